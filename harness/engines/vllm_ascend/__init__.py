"""The vllm-ascend adapter: drive an installed vllm-ascend's merged EAGLE draft ACL graph on a CPU.

`harness engine-check --engine vllm-ascend==X` points our invariants at the NPU speculative
path the release runs on its paired vLLM: the v1 model runner's AscendEagleProposer, whose K
draft steps are one FULL ACL graph (_run_merged_draft under ACLGraphWrapper), replayed with
its attention tasks rewritten by the host before each replay (update_graph_params).

  install.py   the sdist's Python tree (its build needs CANN), the vLLM its matrix pairs it with
  loader.py    import once per process over stand-ins; three runner methods compiled from source
  npu.py       torch_npu / torch.npu: ACL graphs, attention tasks and their updates, KV writes
  standins.py  the configuration, the draft model (the release's attention backend inside), the target
  runner.py    NPUModelRunner's state and its steps around the proposer (capture loop, decode batch)
  config.py    the serving flags and the worlds driven (graph mode, DP size, MoE draft)
  drive.py     one world: every rank's proposer built, captured, replayed over the schedule, as records
  checks.py    capture sizes, capture = replay, DP, the NPU task updates, lanes, padded tail; the n/a list
  report.py    lines, the JSON document, the text report
  command.py   `harness engine-check --engine vllm-ascend...` (exit 0 / 1 / 2 / 3)
"""

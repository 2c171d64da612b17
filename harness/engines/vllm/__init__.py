"""The vLLM adapter: drive an installed vLLM's EAGLE proposer CUDA-graph path on a CPU.

`harness engine-check --engine vllm==X` points our invariants at vLLM's own model runner v2
code (vllm/v1/worker/gpu/): the speculator's graph managers and their capture tables, the
DP agreement every rank pads through, the proposer's multi-step decode drive and its
input-prep and slot-mapping Triton kernels. harness/engines/vllm/checks.py sees our records
(harness.run.records.CaptureRecord / ReplayRecord) plus the input lanes, and names the
invariants that do not apply to vLLM's design instead of passing them.

  stubs.py     third-party imports never exercised; what is installed for real (pydantic)
  install.py   pip --no-deps installs beside the SGLang ones, cached, locked
  loader.py    import once per process; the module globals swapped, each with its reason
  api.py       the release's capture API (token- or request-keyed; the target's query length): its flags and capture-size rules
  standins.py  the config, the CUDA graph, the DP world (threads, a summing all-reduce)
  config.py    the serving flags the proposer runs under
  drive.py     one DP world: capture, then every rank's replays, as records
  checks.py    capture sizes, capture = replay, DP padding, padded tail; the n/a list
  report.py    lines, the JSON document, the text report
  command.py   `harness engine-check --engine vllm...` (exit 0 / 1 / 2)
"""

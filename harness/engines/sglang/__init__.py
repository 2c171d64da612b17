"""The SGLang adapter: drive an installed SGLang's EAGLE draft-extend graph runners on a CPU.

`harness engine-check` points our invariants at the engine's own code. SGLang's runner
modules are plain Python; what they compute on the host -- the forward batch that
`get_forward_batch(bs)` / the capture path bakes per bucket, what replay / prepare fills in,
the bucket it picks -- is exactly where the seed bug lived. This package is the only place
that knows SGLang; harness/engines/check.py sees only our own records
(harness.run.records.CaptureRecord / ReplayRecord) and runs harness.props on them.

What is real: the runner classes and their __init__; the multi-step composite that owns the
shared buffers (its _init_and_capture, reset_buffers / prepare, replay);
get_batch_sizes_to_capture; require_*_gather; ServerArgs and, where the release has one, the
runtime context it is published into; ForwardBatch; the capture path (capture_one_batch_size
/ capture_one_shape, get_forward_batch, attention planning, the step body up to the model
call, including its set_dp_buffer_len); replay / execute / prepare up to the graph launch,
including prepare()'s fused Triton fill kernel (run by Triton's interpreter on the CPU, the
code a GPU runs) and, as a second path, its native twin (the code an NPU runs); and the
logits processor's own row selection (LogitsMetadata.from_forward_batch +
LogitsProcessor._get_pruned_states), which says how many rows a captured batch feeds lm_head.

What is not, each with its reason, in the module that stands in for it:
  stubs.py      third-party imports the runner modules never exercise
  standins.py   the worker, model runner and process groups (strict: a moved attribute is named)
  graph.py      the model (never run: at capture it stops the body; where a replay drives the
                body past it, it answers with harness/engines/after_model.py's deterministic
                stand-in), the attention backend (plans nothing), the CUDA graph (its replay
                runs the captured body again where driven)
  loader.py     module globals swapped process-wide (one engine per process); API generations
  process.py    ServerArgs and the parallel globals for one rank of a layout
  handle.py     one runner: capture, replay snapshot, conversion into our records
  build.py      all runners of one rank: construction and the replay drive
  one_graph.py  the one-graph multi-layer composite (0.5.16 on), beside build.py's per-step one
  draft_decode.py  the graphed draft decode (EAGLEDraftCudaGraphRunner), with build.py's stand-ins
  target_verify.py the target's verify graphs (DecodeCudaGraphRunner in TARGET_VERIFY mode), likewise
  other_runners.py the speculative graph runners beyond EAGLE's, run where --runner names them:
                   frozen_kv_mtp.py (Frozen-KV MTP's draft loop), uno.py (UNO's LoRA / no-LoRA graphs),
                   ragged_verify.py (DSpark's token-tier verify graphs), dflash_verify.py (DFlash's verify graphs)
Errors (errors.py): EngineAdapterError / MissingEngineAttribute mean "cannot drive this
release" (engine-check exit 2), never a verdict.
"""

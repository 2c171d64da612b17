#!/usr/bin/env bash
# The GPU entry point, run on a CUDA machine in one call from the repo root:
#   OUT=/some/dir benchmarks/gpu_run.sh            (the device tool sets OUT itself)
# 1. installs flashinfer from carried wheels (.whl/, see docs/gpu.md) unless it is importable;
# 2. pytest -m gpu (real CUDA graphs, torch/triton/flashinfer, fp32 and bf16) -> $OUT/gpu_tests.log,
#    the measured max differences -> $OUT/gpu_report.json;
# 3. harness bench --json: fp32 and bf16 (default model; flashinfer on the head_dim-64 one), fp32 with the head_dim-64
#    model for every backend -> $OUT/bench.json, bench_bf16.json, bench_hd64.json; the tables in $OUT/bench.txt
#    (each run also times every runner and the iteration: harness/bench/runners.py).
# Every stage has its own time limit so one slow stage cannot hide the others' output.
# GPU_PROFILE=1 also writes $OUT/profile.txt after the bench (benchmarks/profile_iter.py: host vs device time of a
# graphed iteration per backend, torch.profiler's ops by self CPU and CUDA time) and $OUT/sections.txt (the host time by
# runner and plan step, no profiler); GPU_PROFILE_BACKENDS picks the backends.
# GPU_SKIP_BENCH=1 stops after the tests. Exit status: non-zero if any stage failed.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
TESTS=${GPU_TESTS:-tests}            # what pytest -m gpu collects
PYTEST_ARGS=${GPU_PYTEST_ARGS:-}     # e.g. -k "not case_files"
T_TESTS=${GPU_TEST_TIMEOUT:-360}
T_BENCH=${GPU_BENCH_TIMEOUT:-120}  # each bench run: draft-extend table + every runner (harness.bench.runners)
BENCH_ARGS=${GPU_BENCH_ARGS:-}     # e.g. --bs 1,2,4,8 (the goal's batch sizes: a shorter run)
status=0

if ! $PY -c "import flashinfer" >/dev/null 2>&1; then
  wheels=$(ls .whl/flashinfer_python-0.6.8-*.whl .whl/apache_tvm_ffi-0.1.15.post2-*.whl .whl/nvidia_cudnn_frontend-1.32.0-*.whl 2>/dev/null)
  if [ -n "$wheels" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
      && export PYTHONPATH="/tmp/site:$PYTHONPATH" || echo "flashinfer wheels did not install: its tests will skip"
  else
    echo "no flashinfer wheels in .whl/: flashinfer tests will skip"
  fi
fi
# flashinfer's JIT cache: reuse one carried as .fi_ws.tgz (ignored by git), and hand this run's back
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_ws}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
[ -f .fi_ws.tgz ] && tar -xzf .fi_ws.tgz -C "$FLASHINFER_WORKSPACE_BASE" 2>/dev/null

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
} | tee "$OUT/gpu_tests.log"

export SPECHARNESS_GPU_REPORT="$OUT/gpu_report.json"
start=$(date +%s)
timeout "$T_TESTS" $PY -m pytest -m gpu -p no:xdist -p no:cacheprovider --durations=25 -rs $PYTEST_ARGS $TESTS 2>&1 | tee -a "$OUT/gpu_tests.log" || status=1
echo "pytest -m gpu: $(( $(date +%s) - start )) s, status $status" | tee -a "$OUT/gpu_tests.log"

if [ -n "${GPU_SKIP_BENCH:-}" ]; then
  echo "bench skipped (GPU_SKIP_BENCH is set)" | tee "$OUT/bench.txt"
  exit $status
fi
start=$(date +%s)
timeout "$T_BENCH" $PY -m harness.bench $BENCH_ARGS --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" || status=1
timeout "$T_BENCH" $PY -m harness.bench $BENCH_ARGS --dtype bfloat16 --json "$OUT/bench_bf16.json" 2>&1 | tee -a "$OUT/bench.txt" || status=1
# the same model (head_dim 64) for every backend, so flashinfer's row compares with the others'
timeout "$T_BENCH" $PY -m harness.bench $BENCH_ARGS --model hd64 --json "$OUT/bench_hd64.json" 2>&1 | tee -a "$OUT/bench.txt" || status=1
echo "bench: $(( $(date +%s) - start )) s" | tee -a "$OUT/bench.txt"
if [ -n "${GPU_PROFILE:-}" ]; then
  timeout "$T_BENCH" $PY benchmarks/profile_iter.py --backends "${GPU_PROFILE_BACKENDS:-torch,triton,flashinfer}" > "$OUT/profile.txt" 2>&1 || status=1
  timeout "$T_BENCH" $PY benchmarks/profile_iter.py --sections --backends "${GPU_PROFILE_BACKENDS:-torch,triton,flashinfer}" > "$OUT/sections.txt" 2>&1 || status=1
fi

if [ -d "$FLASHINFER_WORKSPACE_BASE/.cache" ]; then
  tar -czf "$OUT/fi_ws.tgz" -C "$FLASHINFER_WORKSPACE_BASE" .cache 2>/dev/null
  [ "$(stat -c %s "$OUT/fi_ws.tgz" 2>/dev/null || echo 0)" -gt 15000000 ] && rm -f "$OUT/fi_ws.tgz"
fi
exit $status

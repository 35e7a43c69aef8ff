#!/usr/bin/env bash
# GPU check of mapflow's Triton mix-and-apply kernel (src/ctxrelay/transports/mapflow/triton_apply.py):
# its exactness tests against the torch operator, then its timing against the torch path on CUDA.
# Writes mapflow-gpu.json (+ the tests' junit xml and a log) to $OUT (default benchmarks/results).
# Without CUDA or triton it writes a "skipped" row and exits 0. Bounded to under 5 minutes.
#
#   OUT=/tmp/gpu PYTHON=.venv/bin/python scripts/gpu_check.sh
#
# Needs torch with CUDA, triton, transformers and safetensors (pip install -e '.[dev,cuda]'); pytest
# for the test step (without it only the timing runs, which checks exactness itself).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="src:benchmarks${PYTHONPATH:+:$PYTHONPATH}" CTXRELAY_RESULTS_DIR="$OUT" CTXRELAY_SKIP_REAL=1
LOG="$OUT/mapflow-gpu.log"
: >"$LOG"

if ! "$PY" -c "import torch, transformers, safetensors" >>"$LOG" 2>&1; then
  echo "gpu_check: $PY lacks torch, transformers or safetensors (pip install -e '.[dev,cuda]'); see $LOG" | tee -a "$LOG"
  exit 2
fi

status=0
if "$PY" -c "import pytest" 2>/dev/null; then
  timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/transports/mapflow/test_mapflow_triton.py \
    --junitxml="$OUT/mapflow-gpu-tests.xml" 2>&1 | tee -a "$LOG"
  status=${PIPESTATUS[0]}
  echo "gpu_check: kernel tests exit $status" | tee -a "$LOG"
else
  echo "gpu_check: pytest not installed: test step skipped (the timing still checks exactness)" | tee -a "$LOG"
fi

# lengths 2048,4096,8192, 10 timed repeats each after warm-up (the first call compiles the kernel)
timeout 120 "$PY" -m ctxrelay_bench.mapflow_gpu.bench 2048,4096,8192 10 2>&1 | tee -a "$LOG"
timing=${PIPESTATUS[0]}
echo "gpu_check: timing exit $timing (1: the kernel is not exact at some length)" | tee -a "$LOG"
[ "$status" -ne 0 ] && exit "$status"
exit "$timing"

#!/usr/bin/env bash
# One device call for the kernel sweep: CUDA kernel tests, then benchmarks/sweep_decode.py.
# Usage (repo root, on the GPU machine): bash benchmarks/gpu_sweep.sh [sweep budget seconds]
# Same copy-to-/tmp/oscar_w trick as gpu_run.sh; outputs go to $OUT (or reports/kernels without it).
set -o pipefail
source "$(dirname "$0")/_gpu_copy.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout "${TEST_TIMEOUT:-110}" python3 -m pytest tests/test_kernels_quantize.py tests/test_kernels_decode.py \
  tests/test_paged.py -q -p no:cacheprovider -k "cuda or test_pool or twin_equals" 2>&1 \
  | tee "$OUTDIR/pytest_cuda_h200.log" | tail -8
timeout "${SWEEP_TIMEOUT:-260}" python3 benchmarks/sweep_decode.py "$OUTDIR" "${1:-170}" 2>&1 \
  | tee "$OUTDIR/sweep_decode.log" | grep -v "^  d=" | tail -60

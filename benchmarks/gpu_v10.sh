#!/usr/bin/env bash
# One device call for the v10 decode kernel: the CUDA tests of the mma layout and of rope-centered keys against
# the torch twin, then bench_decode_v10.py (INT2 mma, INT2 mma + rope-centered keys, vs cuDNN/flash in one process).
# Usage (repo root on the GPU machine): bash benchmarks/gpu_v10.sh [bench_decode_v10.py key=value ...]
# PROFILE="batch=8 context=32768" adds an Nsight Compute summary of the mma kernel (ROPE=1: rope-centered keys).
set -o pipefail
source "$(dirname "$0")/_gpu_copy.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
[ -n "${SKIP_TESTS:-}" ] || timeout "${TEST_TIMEOUT:-180}" python3 -m pytest tests/test_kernels_decode_mma.py \
  tests/test_kernels_decode_rope.py -q -p no:cacheprovider -k "cuda" ${PYTEST_EXTRA:-} 2>&1 \
  | tee "$OUTDIR/pytest_v10.log" | tail -25
timeout "${BENCH_TIMEOUT:-220}" python3 benchmarks/bench_decode_v10.py "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/bench_v10.log" | tail -45
if [ -n "${PROFILE:-}" ]; then
  timeout "${PROFILE_TIMEOUT:-60}" ncu --clock-control none -k regex:oscar_decode_mma -s 2 -c 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 benchmarks/profile_decode.py $PROFILE 2>&1 | tee "$OUTDIR/ncu_v10.txt" | grep -vE "^==PROF==|^\s*$" | tail -40
fi

#!/usr/bin/env bash
# One device call for the mma-layout decode kernel: its CUDA tests, then bench_decode_mma.py.
# Usage (repo root on the GPU machine): bash benchmarks/gpu_mma.sh [bench_decode_mma.py key=value ...]
set -o pipefail
source "$(dirname "$0")/_gpu_copy.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
[ -n "${SKIP_TESTS:-}" ] || timeout "${TEST_TIMEOUT:-150}" python3 -m pytest tests/test_kernels_decode_mma.py -q -p no:cacheprovider \
  ${PYTEST_EXTRA:-} 2>&1 | tee "$OUTDIR/pytest_mma.log" | tail -25
timeout "${BENCH_TIMEOUT:-400}" python3 benchmarks/bench_decode_mma.py "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/bench_mma.log" | tail -60
if [ -n "${PROFILE:-}" ]; then
  timeout "${PROFILE_TIMEOUT:-120}" ncu --clock-control none -k regex:${NCU_KERNEL:-oscar_decode_mma} -s 2 -c 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 benchmarks/profile_decode.py $PROFILE 2>&1 | tee "$OUTDIR/ncu_mma.txt" | grep -vE "^==PROF==|^\s*$" | tail -60
fi

#!/usr/bin/env bash
# One device call: kernel tests on CUDA, then the benchmark. Usage (repo root, on the GPU machine):
#   bash benchmarks/gpu_run.sh [bench-kernels key=value ...]
# Copies the checkout to /tmp/oscar_w with kernels/ placed at oscar/kernels (what the editable
# install maps), so nothing needs installing. Outputs go to $OUT (or reports/kernels without it).
# SKIP_TESTS=1 skips the CUDA tests; `parts=quantize` with the attention table already in the output folder
# times only the quantization kernels and reports their share against that table.
set -o pipefail
source "$(dirname "$0")/_gpu_copy.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
[ -n "${SKIP_TESTS:-}" ] || timeout "${TEST_TIMEOUT:-240}" python3 -m pytest tests/test_kernels_quantize.py tests/test_kernels_decode.py \
  tests/test_kernels_decode_mma.py tests/test_paged.py -q -p no:cacheprovider -k "cuda or test_pool or twin_equals" ${PYTEST_EXTRA:-} 2>&1 | tee "$OUTDIR/pytest_cuda.log" | tail -25
timeout "${BENCH_TIMEOUT:-420}" python3 -m oscar bench-kernels output="$OUTDIR/decode_attention.csv" "$@" 2>&1 \
  | tee "$OUTDIR/bench.log" | grep -v "^tune" | tail -80
if [ -n "${PROFILE:-}" ]; then
  timeout "${PROFILE_TIMEOUT:-120}" ncu --clock-control none -k regex:${NCU_KERNEL:-_planes_kernel} -s 2 -c 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 benchmarks/profile_decode.py $PROFILE 2>&1 | tee "$OUTDIR/ncu.txt" | grep -vE "^==PROF==|^\s*$" | tail -90
fi

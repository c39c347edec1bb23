#!/usr/bin/env bash
# One device call (helper s6f, 2026-12-02): the mma kernel's launch sweep and correctness at the served shapes
# (benchmarks/sweep_served_mma.py), then the served decode step with the windows read in place and the fastest
# correct launch (OSCAR_MMA from the sweep) through benchmarks/gpu_serving.sh, then BF16 flashinfer in the same call.
#   run(command="cd .dev/s6f && BUNDLE=$PWD/../sglang-gpu bash benchmarks/gpu_s6f.sh", carry=[".dev/s6f", ".dev/sglang-gpu"])
#   with this tree (and its ./_site from benchmarks/gpu_site.sh) copied to .dev/s6f; ~480 s of device time
# Env: OUT (default reports/serving), LIMIT_S (seconds the whole script may take: the last row's timeout shrinks to fit)
set -o pipefail
ROOT=$PWD
# the served rows import oscar.models (omegaconf): ./_site (benchmarks/gpu_site.sh) must travel in this tree
[ -d _site ] || python3 -c "import omegaconf" 2>/dev/null || {
  echo "no ./_site here and omegaconf is not importable: build it (bash benchmarks/gpu_site.sh) in the tree you send" >&2
  exit 2; }
OUTDIR=${OUT:-$ROOT/reports/serving}
LIMIT_S=${LIMIT_S:-480}
T0=$(date +%s)
mkdir -p "$OUTDIR/sweep"
(source benchmarks/_gpu_copy.sh && timeout 90 python3 benchmarks/sweep_served_mma.py "$OUTDIR/sweep" batches=32,1 reps=10 \
  2>&1 | grep -v Warning | tail -40)
BEST=$(cat "$OUTDIR/sweep/best_mma.txt" 2>/dev/null || echo "warps=8,stages=4,min_blocks=2")
echo "OSCAR_MMA=$BEST after $(( $(date +%s) - T0 )) s"
cat > "$ROOT/.plan_s6f" <<PLAN
oscar_v11 130 oscar 1x2048 OSCAR_SINK=64 OSCAR_RECENT=256 OSCAR_MMA=$BEST --oscar-warmup=1x2048 --oscar-synthetic=1x100000,32x100000,51x100000 --oscar-profile=32x100000
PLAN
OUT=$OUTDIR PLAN=.plan_s6f bash benchmarks/gpu_serving.sh
LEFT=$(( LIMIT_S - ($(date +%s) - T0) ))
echo "flashinfer gets ${LEFT} s"
# flashinfer: ~85 s of nvcc JIT inside its first graph capture (measured), then its rows
if [ "$LEFT" -gt 220 ]; then
  echo "bf16_flashinfer $LEFT flashinfer 1x2048 --oscar-warmup=1x2048 --oscar-synthetic=1x100000,7x100000" > "$ROOT/.plan_s6f"
  OUT=$OUTDIR PLAN=.plan_s6f SKIP_CHECKS=1 bash benchmarks/gpu_serving.sh
fi
rm -f "$OUTDIR/logs/contract.log"
echo "s6f done after $(( $(date +%s) - T0 )) s"

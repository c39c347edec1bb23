#!/usr/bin/env bash
# One device call: `python -m oscar profile` on the GPU machine, nothing installed there.
#   bash benchmarks/gpu_profile.sh [profile overrides/flags ...]      (repo root, on the GPU machine)
# Copies the checkout to /tmp/oscar_w with kernels/ at oscar/kernels (what the editable install maps);
# pure-Python packages the image lacks (hydra-core, omegaconf, antlr4) travel in ./_site (benchmarks/gpu_site.sh).
# Outputs go to $OUT/throughput (or reports/throughput without $OUT). `layout=auto|rows|mma` picks the page layout
# of the INT2 cache (auto: mma pages and the v9 CUDA kernel on CUDA); several calls may write slices of the grid
# into one folder (a call replaces only the points it measures).
set -o pipefail
OUTDIR=${OUT:+$OUT/throughput}
OUTDIR=${OUTDIR:-$PWD/reports/throughput}
mkdir -p "$OUTDIR"
W=/tmp/oscar_w
rm -rf "$W" && mkdir -p "$W"
cp -r oscar conf tests benchmarks pyproject.toml "$W"/ && cp -r kernels "$W"/oscar/kernels
[ -d _site ] && cp -r _site "$W"/_site
cd "$W" || exit 1
export PYTHONPATH="$W:$W/_site" PYTHONUNBUFFERED=1
source benchmarks/_need_site.sh   # omegaconf/hydra: ./_site from benchmarks/gpu_site.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv
python3 -m oscar profile output_dir="$OUTDIR" tracking.enabled=false "$@" 2>&1 | grep -v -E "FutureWarning|return forward_call"

# Sourced by gpu_run.sh and gpu_sweep.sh (repo root, on the GPU machine): OUTDIR (= $OUT, or reports/kernels
# without it), then a copy of the checkout at /tmp/oscar_w with kernels/ at oscar/kernels (what the
# editable install maps), entered, on PYTHONPATH; nothing has to be installed there.
OUTDIR=${OUT:-$PWD/reports/kernels}
mkdir -p "$OUTDIR"
W=/tmp/oscar_w
rm -rf "$W" && mkdir -p "$W"
cp -r oscar tests benchmarks pyproject.toml "$W"/ && cp -r kernels "$W"/oscar/kernels
cd "$W" || exit 1
export PYTHONPATH="$W" PYTHONUNBUFFERED=1

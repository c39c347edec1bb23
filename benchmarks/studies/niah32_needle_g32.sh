#!/bin/bash
# The 8k needles 1, 12, 22 (the served auto's one-digit misses) with auto's values in groups of 32 channels: the
# section "The 8k misses and value groups" of reports/accuracy/niah32/README.md.
#
#   bash benchmarks/studies/niah32_needle_g32.sh      (any working directory; paths below are under the repo root)
#
# Calibrates auto (per-channel keys by distortion, code calibration, method.group_size=32) into $ART, marks the other
# 29 needles of the 8k length as skipped in the cell's partial records, then runs the eval cell (embedded engine, CPU)
# into $OUT: only the three needles are decoded.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root (this file is benchmarks/studies/<name>.sh)
ART=${ART:-results/s12/cal/cb32-code-g32}
OUT=${OUT:-results/s12/scratch/g32}
PY=${PYTHON:-python}
OMP_NUM_THREADS=1 $PY -m oscar calibrate model=qwen2.5-coder-0.5b method=auto method.channel_block=32 \
  method.select_by=distortion method.group_size=32 calibration=code results_dir=results/h5 artifacts_dir="$ART" \
  tracking.enabled=false
O="model=qwen2.5-coder-0.5b method=auto method.channel_block=32 method.select_by=distortion calibration=code method.sink=0 method.recent=64 method.group_size=32 benchmark=niah benchmark.context_lengths=[8192] benchmark.extra.samples_per_length=32 benchmark.max_new_tokens=12 seed=0 artifacts_dir=$ART results_dir=results/s12/scratch device=cpu tracking.enabled=false"
mkdir -p "$OUT"
# shellcheck disable=SC2086
$PY - "$OUT" $O <<'PY'
import json
import sys
from pathlib import Path

from oscar.config import compose
from oscar.eval.cells import cell_config_hash

out, overrides = Path(sys.argv[1]), sys.argv[2:]
h = cell_config_hash(compose(overrides))
keep = {1, 12, 22}
with open(out / "items.partial.jsonl", "w") as f:
    for i in range(32):
        if i not in keep:
            f.write(json.dumps({"id": f"niah/8192/{i}", "_config_hash": h, "correct": None, "skipped": True}) + "\n")
print("hash", h)
PY
# shellcheck disable=SC2086
exec nice -n 5 $PY -m oscar eval threads=1 $O progress=false output="$OUT"

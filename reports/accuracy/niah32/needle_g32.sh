#!/bin/bash
# 8k needles 1, 12, 22 (the served auto's one-digit misses) with auto's values in groups of 32 channels
cd /work/main
OMP_NUM_THREADS=1 python -m oscar calibrate model=qwen2.5-coder-0.5b method=auto method.channel_block=32 method.select_by=distortion method.group_size=32 calibration=code results_dir=results/h5 artifacts_dir=results/s12/cal/cb32-code-g32 tracking.enabled=false || exit 1
O="model=qwen2.5-coder-0.5b method=auto method.channel_block=32 method.select_by=distortion calibration=code method.sink=0 method.recent=64 method.group_size=32 benchmark=niah benchmark.context_lengths=[8192] benchmark.extra.samples_per_length=32 benchmark.max_new_tokens=12 seed=0 artifacts_dir=results/s12/cal/cb32-code-g32 results_dir=results/s12/scratch device=cpu tracking.enabled=false"
OUT=results/s12/scratch/g32
mkdir -p $OUT
python - $O <<'PY'
import sys, json
from oscar.config import compose
from oscar.eval.cells import cell_config_hash
cfg = compose(sys.argv[1:])
h = cell_config_hash(cfg)
keep = {1, 12, 22}
with open("results/s12/scratch/g32/items.partial.jsonl", "w") as f:
    for i in range(32):
        if i not in keep:
            f.write(json.dumps({"id": f"niah/8192/{i}", "_config_hash": h, "correct": None, "skipped": True}) + "\n")
print("hash", h)
PY
exec nice -n 5 python -m oscar eval threads=1 $O progress=false output=$OUT

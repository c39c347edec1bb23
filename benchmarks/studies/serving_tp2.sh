#!/usr/bin/env bash
# The TP=2 serving measurements of reports/serving/tp2.md, for a two-GPU H200 machine (nvidia-h200-x2), not yet run:
# no two-GPU machine was lent in the session that wrote it.
#
#   here:            bash benchmarks/gpu.sh pack                 (.dev/gpu: the sglang 0.5.17 bundle + wheels)
#   on the machine:  bash benchmarks/studies/serving_tp2.sh bench   (repo root; carry [".dev/gpu"]; ~8 min)
#                    bash benchmarks/studies/serving_tp2.sh check   (~3 min)
#
# bench: dummy-weight Qwen3-32B architecture (the bundle's Qwen3-8B config with the 32B sizes: 64 layers, 64 query
#   heads, 8 KV heads, head_dim 128, hidden 5120, MLP 25600) at --tp-size 2, one python -m oscar.bench.serving.one_batch
#   process per backend (one process per TP rank inside it): OSCAR (INT2, sink 64, recent 256, pages of 16, seeded
#   random rotations with means) and SGLang's flashinfer BF16 (its best backend on the H200, reports/serving/decode.md);
#   decode ms per step on the synthetic state at batch 1 / 8 / 32 x 32k / 100k, the largest batches at 100k, the
#   token capacity per replica (max_total_num_tokens), and job tokens/s at each backend's largest batch at 100k.
# check: the teacher-forced check of TP=2 against TP=1 on a model that fits one GPU (tests/serve/test_engine_tp.py
#   on two GPUs: a saved random-weight Llama, so both runs load the same weights; a dummy-weight model would not).
# Rows: $OUT/tp2_rows.jsonl (default reports/serving/tp2/), logs in $OUT/logs/.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)  # the repository root (this file is benchmarks/studies/<name>.sh)
cd "$ROOT"
OUT=${OUT:-$ROOT/reports/serving/tp2}
mkdir -p "$OUT/logs"
bash benchmarks/gpu.sh setup || exit 2
export OSCAR_SGLANG_PYTHONPATH=${SITE:-/root/sg} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
       NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$OSCAR_SGLANG_PYTHONPATH  # the bundle's transformers for SGLang's processes
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm --format=csv,noheader

if [ "${1:-bench}" = check ]; then
  python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .dev/gpu/wheels/*.whl
  OSCAR_TP_DEVICE=cuda timeout 560 python3 -m pytest -q -s -m slow tests/serve/test_engine_tp.py 2>&1 \
    | tee "$OUT/logs/check.log" | tail -20
  exit 0
fi

M=/tmp/qwen3-32b
mkdir -p "$M" && cp .dev/gpu/qwen3-8b/tokenizer* "$M"/
python3 - "$M" <<'EOF'
import json, sys
cfg = json.load(open(".dev/gpu/qwen3-8b/config.json"))
cfg.update(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, max_window_layers=64,
           num_attention_heads=64, num_key_value_heads=8, head_dim=128)
json.dump(cfg, open(sys.argv[1] + "/config.json", "w"))
EOF
python3 -m oscar.bench.serving.timing_artifact "$M" /tmp/art_qwen3_32b --rotation random --mu --sink 64 --recent 256
COMMON=(--model-path "$M" --load-format dummy --tp-size 2 --output-len 16 --sampling-backend pytorch
        --grammar-backend none --mem-fraction-static 0.85 --context-length 131072 --disable-radix-cache
        --max-running-requests 64 --disable-prefill-cuda-graph --oscar-warmup 1x2048 --oscar-out "$OUT/tp2_rows.jsonl")
GRID=1x32768,8x32768,32x32768,1x100000,8x100000,32x100000
run() {  # NAME LIMIT BACKEND REAL SYNTHETIC [more flags]
  local name=$1 limit=$2 backend=$3 real=$4 synth=$5; shift 5
  local shapes="$real,$synth,1x2048"
  echo "== $name (t=$SECONDS s)"
  # shellcheck disable=SC2046
  OSCAR_ARTIFACT=/tmp/art_qwen3_32b OSCAR_SINK=64 OSCAR_RECENT=256 timeout "$limit" python3 -m oscar.bench.serving.one_batch \
    "${COMMON[@]}" --attention-backend "$backend" --oscar-tag "$name" --oscar-shapes "$real" --oscar-synthetic "$synth" \
    --batch-size $(echo "$shapes" | tr , '\n' | cut -dx -f1 | sort -un) \
    --input-len $(echo "$shapes" | tr , '\n' | cut -dx -f2 | sort -un) "$@" > "$OUT/logs/$name.log" 2>&1
  echo "   exit $? after $SECONDS s"
  grep -E "OSCAR_ROW|Traceback|Error|refuses" "$OUT/logs/$name.log" | cut -c1-300 | tail -30
}
run oscar_tp2 280 oscar 1x32768 "$GRID,40x100000,48x100000,56x100000" --page-size 16
run flashinfer_tp2 300 flashinfer 1x32768 "$GRID,6x100000,7x100000"
python3 - "$OUT/tp2_rows.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for backend in sorted({r["backend"] for r in rows}):
    mine = [r for r in rows if r["backend"] == backend]
    print(f"{backend}: token capacity per replica {mine[0]['max_total_num_tokens']}")
    for r in mine:
        print(f"  {r['mode']:9s} {r['batch']:3d} x {r['context']:6d}: {r['status']:8s} "
              + (f"{r['decode_ms']:.2f} ms/step, {1e3 * r['batch'] / r['decode_ms']:.0f} tokens/s" if r.get("decode_ms") else ""))
    ok = [r for r in mine if r["context"] == 100000 and r["status"] == "ok" and r.get("decode_ms")]
    if ok:
        top = max(ok, key=lambda r: r["batch"])
        print(f"  largest batch at 100k: {top['batch']}, job {1e3 * top['batch'] / top['decode_ms']:.0f} tokens/s")
EOF

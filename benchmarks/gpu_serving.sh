#!/usr/bin/env bash
# SGLang serving on the GPU: SGLang's own one-batch benchmark (dummy Qwen3-8B weights, CUDA graphs) with the
# BF16 backends and with the oscar plugin (python -m oscar.bench.sglang_one_batch), one process per backend and setting.
#   bash benchmarks/gpu_serving.sh            (repo root, on the GPU machine; the bundle at $BUNDLE)
#   e.g. run(command="cd .dev/s6a && BUNDLE=$PWD/../sglang-gpu SKIP_CHECKS=1 bash benchmarks/gpu_serving.sh",
#            carry=[".dev/s6a", ".dev/sglang-gpu"]) with this tree copied to .dev/s6a (+ _site)
# Env: BUNDLE (default .dev/sglang-gpu: the sglang 0.5.17 bundle, README there), SITE (/root/sg), OUT,
#      PLAN (a file of plan lines, default: the PLAN variable): each line
#        NAME TIMEOUT_S BACKEND SHAPES [KEY=VALUE | --flag=value ...]
#      SHAPES: BATCHxINPUT,... (the first is also the warm-up); KEY=VALUE: OSCAR_* settings of an oscar row;
#      --flag=value: more SGLang flags
#      SKIP_CHECKS=1: skip the contract print and benchmarks/serve_gpu_check.py (device time)
#      --oscar-synthetic=BxN,... rows timed on a synthetic state (SGLang's own slot allocation, random valid pool
#      contents, no prefill forward: oscar/bench/sglang_synthetic.py); --oscar-profile=BxN,... the decode step under
#      torch.profiler (graph replays and eager steps) into $OUT/profile_rows.jsonl
# Rows go to $OUT/serving_rows.jsonl (python -m oscar.bench.sglang_one_batch), logs to $OUT/logs/NAME.log;
# benchmarks/serving_report.py turns the rows into reports/serving/decode.{csv,md,png} and profile.{csv,md}.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ROOT=$PWD
BUNDLE=$(cd "${BUNDLE:-.dev/sglang-gpu}" && pwd)
SITE=${SITE:-/root/sg}
OUTDIR=${OUT:-$ROOT/reports/serving}
mkdir -p "$OUTDIR/logs"
T0=$(date +%s)
if [ ! -d "$SITE/sglang" ]; then
  mkdir -p "$SITE" && python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
    "$BUNDLE/sglang-0.5.17-h200-site.tar.xz" "$SITE"
fi
echo "unpacked after $(( $(date +%s) - T0 )) s"
W=/tmp/oscar_w
rm -rf "$W" && mkdir -p "$W"
cp -r oscar benchmarks pyproject.toml "$W"/ && cp -r kernels "$W"/oscar/kernels
cd "$W" || exit 1
[ -d "$ROOT/_site" ] && cp -r "$ROOT/_site" "$W"/_site   # pure-Python packages the machine lacks (omegaconf)
export PYTHONPATH="$SITE:$W:$W/_site"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
if [ "${SKIP_CHECKS:-0}" != 1 ]; then
  python3 -c "
import sglang, torch
from oscar.serve.contract import check_contract
print('sglang', sglang.__version__, 'torch', torch.__version__, 'contract problems:', check_contract() or 'none')
" 2>&1 | grep -v Warning | tee "$OUTDIR/logs/contract.log"
  # the CUDA decode path (Triton writer, captured metadata, v9 kernel) against the twin on the pool's own pages
  timeout 120 python3 benchmarks/serve_gpu_check.py --out "$OUTDIR/gpu_check.json" 2>&1 | grep -v Warning | tail -3
fi
MODEL="$BUNDLE/qwen3-8b"
python3 benchmarks/serve_artifact.py "$MODEL" /tmp/art_random --rotation random --mu 2>&1 | tail -1
COMMON=(--model-path "$MODEL" --load-format dummy --output-len 16 --sampling-backend pytorch --grammar-backend none
        --mem-fraction-static 0.85 --context-length 131072 --disable-radix-cache --max-running-requests 64
        --disable-prefill-cuda-graph)
run() { # NAME TIMEOUT BACKEND SHAPES [OSCAR_X=V | --flag=v ...]
  local name=$1 limit=$2 backend=$3 shapes=$4; shift 4
  local extra=() envs=(OSCAR_ARTIFACT=/tmp/art_random)
  [ "$backend" = oscar ] && extra=(--page-size 16)
  for kv in "$@"; do
    case "$kv" in --*) extra+=("$kv") ;; *) envs+=("$kv") ;; esac
  done
  local batches inputs
  batches=$(echo "$shapes" | tr ',' '\n' | cut -dx -f1 | sort -un | tr '\n' ' ')
  inputs=$(echo "$shapes" | tr ',' '\n' | cut -dx -f2 | sort -un | tr '\n' ' ')
  echo "== $name: backend=$backend shapes=$shapes $* (t=$(( $(date +%s) - T0 )) s)"
  # shellcheck disable=SC2086
  env "${envs[@]}" timeout "$limit" python3 -m oscar.bench.sglang_one_batch "${COMMON[@]}" --attention-backend "$backend" \
    --batch-size $batches --input-len $inputs --oscar-shapes "$shapes" "${extra[@]}" \
    --oscar-out "$OUTDIR/serving_rows.jsonl" --oscar-profile-out "$OUTDIR/profile_rows.jsonl" --oscar-tag "$name" \
    > "$OUTDIR/logs/$name.log" 2>&1
  local rc=$?
  grep -E "OSCAR_ROW|OSCAR_PROFILE|synthetic state|Error|error:|refuses|Traceback" "$OUTDIR/logs/$name.log" \
    | grep -v "FutureWarning" | cut -c1-330 | tail -40
  [ $rc -ne 0 ] && { echo "   rc=$rc"; tail -30 "$OUTDIR/logs/$name.log" | cut -c1-400; }
  return 0
}
# the plan of reports/serving (2026-12-02): real prefill-then-decode at batch 1 (prefill_s, and the cross-check of
# the synthetic rows), the synthetic-state grid (OOM points marked "capacity" from the pool's own token capacity;
# 51x100000 / 7x100000: the largest batch at 100k of OSCAR / BF16 at this memory fraction), the decode profile.
# flashinfer compiles its kernels with nvcc at first use (~2 min, inside its timeout).
REAL=1x30000,1x60000,1x100000,1x128000
GRID=$(for b in 1 8 32 64; do for n in 30000 60000 100000 128000; do printf '%sx%s,' "$b" "$n"; done; done)
PLAN_TEXT=${PLAN_TEXT:-"oscar 200 oscar $REAL OSCAR_SINK=64 OSCAR_RECENT=256 --oscar-warmup=1x2048 --oscar-synthetic=${GRID}51x100000 --oscar-profile=1x100000,32x100000
bf16_flashinfer 240 flashinfer $REAL --oscar-warmup=1x2048 --oscar-synthetic=${GRID}7x100000 --oscar-profile=1x100000
bf16_triton 140 triton $REAL --oscar-warmup=1x2048 --oscar-synthetic=${GRID}7x100000"}
[ -n "${PLAN:-}" ] && PLAN_TEXT=$(cat "$ROOT/$PLAN")
while read -r name limit backend shapes rest; do
  [ -z "$name" ] && continue
  # shellcheck disable=SC2086
  run "$name" "$limit" "$backend" "$shapes" $rest
done <<< "$PLAN_TEXT"
echo "done after $(( $(date +%s) - T0 )) s"

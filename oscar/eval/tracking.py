"""MLflow mirror of the workflow's result files: one experiment per table, one run per job.

Output files are the source of truth; this module copies them into MLflow (local SQLite store by
default, any tracking URI by configuration) so runs can be browsed with `mlflow ui`. Mirroring is
idempotent: a cell whose result and configuration did not change keeps its run; a changed cell
gets a new run and its stale one is deleted. A parent run per table links its children with the
`mlflow.parentRunId` tag. Nothing in the workflow reads MLflow back.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

from oscar.config import flatten
from oscar.core.files import atomic_write_text
from oscar.eval.reporting import TablePlan, aggregate, numeric_metrics, pick_metric, summarize

ROLE_TAG = "oscar.role"
CELL_TAG = "oscar.cell"
DIGEST_TAG = "oscar.digest"
PARENT_TAG = "mlflow.parentRunId"
# MLflow 3 opens an experiment without this tag on its GenAI (traces) page; these are model runs.
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"
_BAD_NAME = re.compile(r"[^\w.\- /]")
MAX_PARAM_CHARS = 6000
BATCH = 100


def experiment_name(experiment: str, table: str, prefix: str | None = None) -> str:
    """MLflow experiment of one table: `oscar/<experiment>/<table>` (or `<prefix>/<table>`)."""
    return f"{prefix}/{table}" if prefix else f"oscar/{experiment}/{table}"


def metric_names(kind: str, item: str, metrics: dict[str, Any]) -> dict[str, float]:
    """MLflow metric names of one cell: `acc.<benchmark>`, `ppl.<corpus>`, `kl.*`, `perf.*`, `mem.*`.

    The main accuracy of an eval cell becomes `acc.<benchmark>`, perplexity of a fidelity cell
    `ppl.<corpus>`; names already in a family (`kl.attn`, `perf.decode_ms`,
    `mem.kv_bits_per_element`) are kept; anything else is prefixed by the benchmark or corpus.
    """
    flat = numeric_metrics(metrics)
    named: dict[str, float] = {}
    primary = {"eval": ("acc", "acc"), "fidelity": ("ppl", "ppl")}.get(kind)
    chosen = pick_metric(flat, primary[0]) if primary else None
    for name, value in flat.items():
        if name == chosen:
            key = f"{primary[1]}.{item}"
        elif chosen and name.startswith(chosen + ".ci_"):  # its interval: acc.<benchmark>.ci_lo
            key = f"{primary[1]}.{item}{name[len(chosen):]}"
        elif name.split(".")[0] in ("acc", "kl", "ppl", "perf", "mem"):
            key = name
        else:
            key = f"{item}.{name}"
        named[_BAD_NAME.sub("_", key)] = value
    return named


def git_commit(root: str | Path = ".") -> str:
    """HEAD commit of the checkout at `root`, or "unknown"."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


@contextlib.contextmanager
def store_lock(uri: str, fallback_dir: str | Path) -> Iterator[None]:
    """Serialise writers of one tracking store (parallel jobs share a SQLite file); one lock file per URI."""
    name = hashlib.sha256(uri.encode()).hexdigest()[:12]
    lock_path = Path(fallback_dir) / f".mlflow-{name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _digest(paths: list[Path]) -> str:
    hasher = hashlib.sha256()
    for path in paths:
        hasher.update(path.name.encode())
        hasher.update(path.read_bytes() if path.is_file() else b"<missing>")
    return hasher.hexdigest()[:16]


def _flat_params(config_path: Path) -> dict[str, str]:
    from omegaconf import OmegaConf

    if not config_path.is_file():
        return {}
    data = OmegaConf.to_container(OmegaConf.load(str(config_path)), resolve=True)
    params = {}
    for key, value in flatten(data).items():
        text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
        params[_BAD_NAME.sub("_", key)] = text[:MAX_PARAM_CHARS]
    return params


def _log_batch(client: Any, run_id: str, params: dict[str, str], metrics: dict[str, float], tags: dict[str, str]) -> None:
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    items_p = [Param(k, v) for k, v in sorted(params.items())]
    items_m = [Metric(k, v, now, 0) for k, v in sorted(metrics.items())]
    items_t = [RunTag(k, v) for k, v in sorted(tags.items())]
    for start in range(0, max(len(items_p), len(items_m), len(items_t)), BATCH):
        client.log_batch(run_id, metrics=items_m[start:start + BATCH], params=items_p[start:start + BATCH],
                         tags=items_t[start:start + BATCH])


def mirror_table(
    plan: TablePlan,
    uri: str,
    root: str | Path = ".",
    report_files: list[str | Path] | None = None,
    rule_of: dict[str, str] | None = None,
    prefix: str | None = None,
) -> dict[str, Any]:
    """Mirror one table's cells and report files into MLflow; returns experiment, parent and child run ids."""
    import mlflow
    from mlflow.tracking import MlflowClient

    root = Path(root)
    rule_of = rule_of or {"eval": "eval_cell", "fidelity": "fidelity_cell"}
    commit = git_commit(root)
    with store_lock(uri, root / "results" / "tracking"):
        mlflow.set_tracking_uri(uri)
        client = MlflowClient(tracking_uri=uri)
        name = experiment_name(plan.experiment, plan.table, prefix)
        found = client.get_experiment_by_name(name)
        experiment_id = found.experiment_id if found else client.create_experiment(name, artifact_location=_artifact_root(uri, root, name))
        client.set_experiment_tag(experiment_id, KIND_TAG, KIND)
        long = aggregate(plan, root=root)  # every cell's metrics, with those measured against the reference
        parent = _parent_run(client, experiment_id, plan, commit, long)
        existing = {
            run.data.tags.get(CELL_TAG): run
            for run in client.search_runs([experiment_id], filter_string=f"tags.`{ROLE_TAG}` = 'cell'", max_results=5000)
        }
        several_models = len({c["model"] for c in plan.cells}) > 1
        children: dict[str, str] = {}
        for cell in plan.cells:
            rows = long[long["result"] == str(Path(cell["result_dir"]) / "result.json")]
            metrics = dict(zip(rows["metric"], rows["value"].astype(float)))
            children[cell["result_dir"]] = _mirror_cell(client, experiment_id, parent, cell, existing, root, commit,
                                                        rule_of, metrics, several_models)
        for cell_id, run in existing.items():
            if cell_id not in children:
                client.delete_run(run.info.run_id)
        for path in report_files or []:
            if Path(path).is_file():
                client.log_artifact(parent, str(path), artifact_path="reports")
        client.set_terminated(parent, status="FINISHED")
    return {"tracking_uri": uri, "experiment": name, "experiment_id": experiment_id, "parent_run_id": parent,
            "children": children}


def _artifact_root(uri: str, root: Path, name: str) -> str | None:
    """Artifacts of a local SQLite store go to `mlruns/` beside it; remote stores choose their own."""
    if not uri.startswith("sqlite:///"):
        return None
    base = Path(uri[len("sqlite:///"):]).resolve().parent
    return (base / "mlruns" / name.replace("/", "-")).as_uri()


def summary_metrics(plan: TablePlan, long: Any) -> dict[str, float]:
    """The table's numbers as parent-run metrics: `<metric>.<benchmark or corpus>.<row>` (mean over
    seeds) with `.ci_lo`/`.ci_hi` where the cell has a one-seed interval, e.g. `agree.mmlu.int2`."""
    import math

    summary = summarize(plan, long)
    rows = [k for k in plan.spec.get("rows", ["method"]) if k != "metric"]
    out: dict[str, float] = {}
    for _, rec in summary.iterrows():
        item = str(rec.get("benchmark") or rec.get("corpus") or "")
        who = ".".join(str(rec[k]) for k in rows if str(rec.get(k, "")) != "")
        variant = str(rec.get("variant") or "")
        base = ".".join(x for x in (str(rec["metric"]), item, variant if "variant" not in rows else "", who) if x)
        base = _BAD_NAME.sub("_", base)
        out[base] = float(rec["mean"])
        for bound in ("ci_lo", "ci_hi"):
            value = float(rec.get(bound, math.nan))
            if not math.isnan(value):
                out[f"{base}.{bound}"] = value
    return out


def _parent_run(client: Any, experiment_id: str, plan: TablePlan, commit: str, long: Any) -> str:
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{ROLE_TAG}` = 'table'", max_results=1)
    if runs:
        run_id = runs[0].info.run_id
    else:
        run_id = client.create_run(experiment_id, run_name=f"{plan.table} (summary)", tags={ROLE_TAG: "table"}).info.run_id
    params = {f"table.{k}": (json.dumps(v) if isinstance(v, (list, dict)) else str(v))[:MAX_PARAM_CHARS]
              for k, v in plan.spec.items()}
    existing = set(client.get_run(run_id).data.params)
    tags = {"oscar.experiment": plan.experiment, "oscar.table": plan.table, "oscar.rule": "track_table",
            "mlflow.source.git.commit": commit, "git_commit": commit, "oscar.cells": str(len(plan.cells))}
    _log_batch(client, run_id, {k: v for k, v in params.items() if k not in existing}, summary_metrics(plan, long), tags)
    return run_id


def run_name(cell: dict[str, Any], with_model: bool = False) -> str:
    """Short run name, `method/benchmark/s<seed>` for an eval cell and `method/kl:<corpus>` for a
    fidelity cell (the model in front when the table has several)."""
    item = cell.get("benchmark") or cell.get("corpus") or ""
    parts = [cell["model"]] if with_model else []
    if cell["kind"] == "eval":
        parts += [cell["method_label"], item, f"s{cell['seed']}"]
    else:
        parts += [cell["method_label"], f"kl:{item}"]
    return "/".join(p for p in parts if p)


def _mirror_cell(client: Any, experiment_id: str, parent: str, cell: dict[str, Any], existing: dict[str, Any],
                 root: Path, commit: str, rule_of: dict[str, str], metrics: dict[str, float],
                 with_model: bool = False) -> str:
    result_dir = root / cell["result_dir"]
    config_path = root / cell["config_path"]
    extra = "items.jsonl" if cell["kind"] == "eval" else "per_layer.csv"
    files = [result_dir / "result.json", config_path, result_dir / extra]
    name = run_name(cell, with_model)
    digest = hashlib.sha256((_digest(files) + name + json.dumps(metrics, sort_keys=True)).encode()).hexdigest()[:16]
    old = existing.get(cell["result_dir"])
    if old is not None and old.data.tags.get(DIGEST_TAG) == digest and old.data.tags.get(PARENT_TAG) == parent:
        return old.info.run_id
    if old is not None:
        client.delete_run(old.info.run_id)
    result = json.loads((result_dir / "result.json").read_text())
    item = cell.get("benchmark") or cell.get("corpus") or ""
    wildcards = {"model": cell["model"], "method": cell["method_label"], "seed": str(cell["seed"])}
    wildcards["benchmark" if cell["kind"] == "eval" else "corpus"] = item
    tags = {
        ROLE_TAG: "cell", CELL_TAG: cell["result_dir"], DIGEST_TAG: digest, PARENT_TAG: parent,
        "oscar.rule": rule_of.get(cell["kind"], cell["kind"]), "oscar.table": cell["table"],
        "oscar.variant": cell.get("variant") or "",
        "mlflow.source.git.commit": str(result.get("git_commit") or commit), "git_commit": str(result.get("git_commit") or commit),
        **{f"wildcard.{k}": v for k, v in wildcards.items()},
    }
    start_ms = int(time.time() * 1000)
    run = client.create_run(experiment_id, run_name=name, start_time=start_ms)
    run_id = run.info.run_id
    _log_batch(client, run_id, _flat_params(config_path), metric_names(cell["kind"], item, metrics), tags)
    for path, folder in zip(files, (None, "config", None)):
        if path.is_file():
            client.log_artifact(run_id, str(path), artifact_path=folder)
    wall_ms = int(float(result.get("wall_s") or 0) * 1000)
    client.set_terminated(run_id, status="FINISHED", end_time=start_ms + wall_ms)
    return run_id


def write_receipt(data: dict[str, Any], path: str | Path) -> None:
    """Record the run ids of a mirrored table (the workflow's output for the tracking job)."""
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True) + "\n")

"""MLflow mirror of a GPU table (the project's conventions, ``oscar.eval.tracking``): one experiment per table
(``oscar/gpu/<table>``), one parent run per measurement with the report files, the hardware and the command,
one child run per job (a shape, a backend, a cell) linked by ``mlflow.parentRunId``. The report files are the
source of truth; a new mirror of the same table replaces the previous runs. Needs mlflow (``ImportError``
otherwise: the caller says tracking was skipped). Light to import (``Cell``): the table modules import it at top.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from oscar.bench.host import ROOT


@dataclass
class Cell:
    """One job of a table: its run name, parameters (the wildcards) and metrics (``perf.*``, ``mem.*``, ...)."""

    name: str
    params: dict[str, Any]
    metrics: dict[str, Any]
    tags: dict[str, str] = field(default_factory=dict)


def _number(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) or math.isinf(x) else x


def mirror(table: str, cells: Sequence[Cell], files: Sequence[Path], env: dict[str, Any], uri: str,
           summary: dict[str, Any] | None = None) -> str:
    """Mirror ``cells`` and the report ``files`` into experiment ``oscar/gpu/<table>``; returns the parent run id."""
    import mlflow  # noqa: F401  (ImportError: the caller skips tracking)
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    from oscar.eval import tracking  # local: keeps omegaconf and pandas out of the table modules' import (`gpu --help`)

    commit = str(env.get("git_commit") or tracking.git_commit(ROOT))
    name = tracking.experiment_name("gpu", table)
    with tracking.store_lock(uri, ROOT / "results" / "tracking"):
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(name)
        exp_id = found.experiment_id if found else client.create_experiment(
            name, artifact_location=tracking._artifact_root(uri, ROOT, name))
        client.set_experiment_tag(exp_id, tracking.KIND_TAG, tracking.KIND)
        for run in client.search_runs([exp_id], max_results=5000):
            client.delete_run(run.info.run_id)
        now = int(time.time() * 1000)
        base = {"oscar.rule": f"gpu_{table}", "oscar.table": table, "mlflow.source.git.commit": commit,
                "git_commit": commit}
        parent = client.create_run(exp_id, run_name=f"{table} ({env.get('date', '')})".strip(),
                                   tags={tracking.ROLE_TAG: "table", **base}).info.run_id
        params = {f"hw.{k}": str(v)[:500] for k, v in env.items()
                  if k in ("gpu", "driver", "torch", "triton", "cuda", "sglang", "sms", "date", "command", "wall_s")}
        metrics = {k: _number(v) for k, v in (summary or {}).items()}
        client.log_batch(parent, params=[Param(k, v) for k, v in params.items()],
                         metrics=[Metric(k, v, now, 0) for k, v in metrics.items() if v is not None])
        for path in files:
            if Path(path).is_file():
                client.log_artifact(parent, str(path), artifact_path="reports")
        for cell in cells:
            tags = {tracking.ROLE_TAG: "cell", tracking.PARENT_TAG: parent, **base,
                    **{f"wildcard.{k}": str(v) for k, v in cell.params.items()}, **cell.tags}
            run = client.create_run(exp_id, run_name=cell.name, tags=tags).info.run_id
            ms = [Metric(k, x, now, 0) for k, v in cell.metrics.items() if (x := _number(v)) is not None]
            client.log_batch(run, metrics=ms[:1000], params=[Param(k, str(v)) for k, v in cell.params.items()],
                             tags=[RunTag("oscar.cell", cell.name)])
            client.set_terminated(run)
        client.set_terminated(parent)
    return parent

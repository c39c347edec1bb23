"""A cell's files (DESIGN "Result files"): their names and folder, the configuration hash that marks them, the
records a cell already holds (to resume), and writing a finished cell. Both ways of running cells use these: one
engine per cell (`oscar.eval.runner`) and one prefill shared by several methods (`oscar.eval.shared_prefill`).
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

from omegaconf import OmegaConf

from oscar import __version__
from oscar.config import config_hash
from oscar.core.files import atomic_write_text
from oscar.eval.items import EvalItem
from oscar.eval.stats import bootstrap_mean_ci

RESULT_FILE = "result.json"
ITEMS_FILE = "items.jsonl"
PARTIAL_FILE = "items.partial.jsonl"
# A finished cell's records with their configuration hash, outside the workflow's declared outputs: Snakemake
# deletes a job's outputs before it runs the job again (a shared-prefill job rerun for one missing cell deletes
# the finished cells' items.jsonl / result.json), and the cell then resumes from these instead of recomputing.
KEPT_FILE = "items.kept.jsonl"


def cell_dir(cfg: Any) -> Path:
    """`cfg.output` when given (the workflow always gives its cell folder), else the ad-hoc folder
    `results/adhoc/eval/<model>/<method>/<benchmark>/seed<k>/`, which no workflow table reads."""
    if cfg.get("output"):
        return Path(cfg.output)
    return Path(cfg.results_dir) / "adhoc" / "eval" / cfg.model.name / cfg.method.name / cfg.benchmark.name / f"seed{cfg.seed}"


def shares_outputs(benchmark: Any) -> bool:
    """Whether a shared prefill gives the outputs of the cell's own run, up to float rounding (so it is not part
    of the cell's configuration hash): true for the continuous-batching stream, whose requests are prefilled as
    a whole; false for needles, whose question is decoded token by token after the shared haystack."""
    return str(benchmark.get("family")) != "niah"


def cell_config_hash(cfg: Any) -> str:
    """Hash of everything that changes a cell's outputs (model, method, benchmark, calibration, seed)."""
    bench = OmegaConf.to_container(cfg.benchmark, resolve=True)
    bench.pop("batch_size", None)  # batching does not change the outputs
    if shares_outputs(cfg.benchmark):  # nor does one prefill per prompt shared by the methods of a stream
        (bench.get("extra") or {}).pop("shared_prefill", None)
    part = {"model": OmegaConf.to_container(cfg.model, resolve=True),
            "method": OmegaConf.to_container(cfg.method, resolve=True), "benchmark": bench,
            "calibration": OmegaConf.to_container(cfg.calibration, resolve=True), "seed": int(cfg.seed)}
    if engine_name(cfg) != "embedded":  # another engine is another cell (embedded hashes stay as they were)
        part["engine"] = engine_name(cfg)
    return config_hash(part)


def engine_name(cfg: Any) -> str:
    """`cfg.engine.name` (embedded when the configuration has no engine group)."""
    engine = cfg.get("engine") if hasattr(cfg, "get") else None
    return str(engine.name) if engine is not None else "embedded"


def sampling(cfg: Any) -> dict:
    """The cell's sampling settings (`benchmark.max_new_tokens`, `temperature`, `top_p`, `top_k`) and its seed."""
    b = cfg.benchmark
    return {"max_new_tokens": int(b.max_new_tokens), "temperature": float(b.temperature), "top_p": float(b.top_p),
            "top_k": int(b.top_k), "seed": int(cfg.seed)}


def git_commit() -> str | None:
    """HEAD commit of the source tree, or None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def hardware(device: str) -> dict:
    """Short description of where the cell ran."""
    import torch

    info = {"device": str(device), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or None}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def read_partial(path: Path, chash: str) -> dict[str, dict]:
    """The records of this configuration (`chash`) a cell already holds: those kept by a finished run of it
    (`KEPT_FILE`, beside `path`), then the partial file `path` of a run that was interrupted."""
    done: dict[str, dict] = {}
    for source in (path.parent / KEPT_FILE, path):
        if not source.is_file():
            continue
        for line in source.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by an interruption
            if rec.get("_config_hash") == chash:
                done[rec["id"]] = rec
    return done


def _with_ci(metrics: dict[str, float], name: str, values: list[float]) -> None:
    """`name` = mean of per-item values, with its 95% percentile-bootstrap interval over items
    (`name.ci_lo`, `name.ci_hi`; items are the resampling unit, seed 0, so the interval is reproducible)."""
    metrics[name] = sum(values) / len(values)
    metrics[f"{name}.ci_lo"], metrics[f"{name}.ci_hi"] = bootstrap_mean_ci(values)


def summarize(family: str, records: list[dict]) -> dict[str, float]:
    """Cell metrics with 95% bootstrap intervals over items: accuracy (pass@1 for code; for NIAH the
    share of needles retrieved, `score`, also per context length as `score@<length>` with `n@<length>`)."""
    if not records:
        return {}
    metrics: dict[str, float] = {}
    if family == "niah":
        _with_ci(metrics, "score", [float(r["score"]) for r in records])
        metrics["accuracy"] = sum(bool(r["correct"]) for r in records) / len(records)
        for length in sorted({r.get("length") for r in records if r.get("length")}):
            sub = [r for r in records if r.get("length") == length]
            _with_ci(metrics, f"score@{length}", [float(r["score"]) for r in sub])
            metrics[f"n@{length}"] = len(sub)
        return metrics
    _with_ci(metrics, "pass@1" if family == "code" else "accuracy", [float(bool(r["correct"])) for r in records])
    if family == "math":
        metrics["extracted_rate"] = sum(r.get("extraction") != "none" for r in records) / len(records)
    return metrics


def write_cell(cfg: Any, out_dir: Path, items: list[EvalItem], done: dict[str, dict], notes: list[str], chash: str,
               start: float, device: str, perf: dict[str, float]) -> dict:
    """Write a finished cell: `items.jsonl` (records in item order), `result.json` (metrics with intervals, the
    generation's `perf` metrics, notes, provenance), both atomically, and `KEPT_FILE` (the records with their
    configuration hash, for a rerun whose outputs were deleted); the partial file is removed."""
    records = []
    for it in items:
        rec = dict(done[it.id])
        rec.pop("_config_hash", None)
        records.append(rec)
    atomic_write_text(out_dir / ITEMS_FILE, "".join(json.dumps(r, default=str) + "\n" for r in records))
    metrics = summarize(cfg.benchmark.family, records)
    unisolated = sum(r.get("isolation") == "hooks" for r in records)
    if unisolated:  # the user opted in (oscar.eval.sandbox.OPT_IN_ENV); the result must say so
        notes.append(f"UNISOLATED: {unisolated} of {len(records)} items ran generated code without isolation "
                     "(audit hooks only, OSCAR_UNISOLATED_CODE=1)")
    per_process = sum(r.get("memory_scope") == "process" for r in records)
    if per_process:  # no writable cgroup: memory capped per process, the process count bounding the total
        notes.append(f"PER-PROCESS MEMORY CAP: {per_process} of {len(records)} items ran generated code without a "
                     "cgroup (no writable cgroup with memory and pids controllers): memory was capped per process and "
                     "the process count kept processes x cap within the item's limit (sandbox process_plan); each "
                     "item's memory_scope says so")
    metrics.update(perf)  # wall time of this run's generation (a resumed cell: the rest)
    result = {
        "model": cfg.model.name, "method": cfg.method.name, "benchmark": cfg.benchmark.name, "seed": int(cfg.seed),
        "stand_in_for": cfg.benchmark.stand_in_for, "n": len(records),
        "metrics": metrics, "config_hash": chash, "oscar_version": __version__,
        "git_commit": git_commit(), "hardware": hardware(device),
        "wall_s": round(time.monotonic() - start, 3),
        "sampling": sampling(cfg), "source": cfg.benchmark.source, "notes": notes, "engine": engine_name(cfg),
    }
    atomic_write_text(out_dir / KEPT_FILE, "".join(json.dumps({**done[it.id], "_config_hash": chash}, default=str) + "\n"
                                                   for it in items))
    atomic_write_text(out_dir / RESULT_FILE, json.dumps(result, indent=2, sort_keys=True) + "\n")
    (out_dir / PARTIAL_FILE).unlink(missing_ok=True)
    return result


def load_cell(path: Path) -> tuple[dict, list[dict]]:
    """result.json and the item records of a finished cell directory."""
    path = Path(path)
    result = json.loads((path / RESULT_FILE).read_text())
    records = [json.loads(line) for line in (path / ITEMS_FILE).read_text().splitlines() if line.strip()]
    return result, records


def iter_cells(root: Path) -> Iterable[Path]:
    """Finished cell directories under a results root."""
    return sorted(p.parent for p in Path(root).rglob(RESULT_FILE))

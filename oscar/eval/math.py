"""Math benchmarks with final answers: CHAMP (offline stand-in), AIME25 and MATH500 (Hugging Face id or file)."""

from __future__ import annotations

import json
from typing import Any

from oscar.eval.items import DataNotAvailable, EvalItem, first_field, package_dir, read_records
from oscar.eval.prompts import MATH_INSTRUCTION

LOADERS = ("champ", "aime25", "math500")


def load_champ(path: str | None = None) -> list[EvalItem]:
    """CHAMP competition-math problems (270) with reference final answers, from `champ-dataset`."""
    from pathlib import Path

    file = Path(path) if path else package_dir("champ_dataset") / "dataset_files" / "v0.json"
    if not file.exists():
        raise DataNotAvailable(f"CHAMP file {str(file)!r} does not exist")
    problems = json.loads(file.read_text(encoding="utf-8"))["problems"]
    items = []
    for key in sorted(problems):
        rec = problems[key]
        items.append(EvalItem(id=rec["identifier"], prompt=MATH_INSTRUCTION.format(problem=rec["_text"]),
                              target=rec["_answer"], meta={"category": rec.get("category")}))
    return items


def items_from_records(records: list[dict[str, Any]], name: str) -> list[EvalItem]:
    """Items from records in the AIME25 (`problem|question`, `answer`, `id`) or MATH500 schema."""
    items = []
    for index, rec in enumerate(records):
        problem = first_field(rec, ("problem", "question", "Problem"), "a problem statement")
        answer = first_field(rec, ("answer", "Answer"), "a final answer")
        rid = rec.get("unique_id", rec.get("id", rec.get("ID", index)))
        meta = {k: rec[k] for k in ("subject", "level") if k in rec}
        items.append(EvalItem(id=f"{name}/{rid}", prompt=MATH_INSTRUCTION.format(problem=problem),
                              target=str(answer), meta=meta))
    return items


def load(bcfg: Any, tokenizer: Any = None) -> list[EvalItem]:  # noqa: ARG001
    """Items of a math benchmark (`champ` offline or from a file; `aime25`, `math500` from hf or file)."""
    if bcfg.name == "champ":
        if bcfg.source not in ("offline", "file"):
            raise DataNotAvailable(f"champ: source={bcfg.source!r}; valid: offline, file")
        return load_champ(bcfg.path if bcfg.source == "file" else None)
    if bcfg.name in ("aime25", "math500"):
        return items_from_records(read_records(bcfg), bcfg.name)
    raise DataNotAvailable(f"math benchmark {bcfg.name!r} is unknown; valid: {', '.join(LOADERS)}")

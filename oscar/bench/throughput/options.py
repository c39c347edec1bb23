"""The throughput run's settings beyond the experiment configuration (``FLAGS``) and the checks of the table's keys.

Light (no torch, no omegaconf): the spec refuses a bad part, layout or point before any work; ``run.Settings``
resolves the same flags against ``experiment=throughput``.
"""

from __future__ import annotations

from typing import Any

# what a run measures beside the experiment's `extra.profile` section (empty: the experiment's own lists)
FLAGS: dict[str, Any] = {
    "parts": "check,grid,fit,job",
    "models": "",
    "caches": "",
    "batches": "",
    "contexts": "",
    "reps": 0,
    "budget_gb": "0",  # memory budget of fit and job in GiB (0: the device's memory)
    "tiny": False,  # a tiny architecture on the CPU (eager timing, no kernel split): the tests' path
    "layout": "auto",
    "hf_caches": "bf16",
    "points": "",  # BATCHxCONTEXT,... instead of the experiment's batches x contexts
    "compile": True,
}
PARTS = ("check", "grid", "fit", "job")
LAYOUTS = ("auto", "rows", "mma")


def ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


def names(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def point(text: str) -> tuple[int, int]:
    """``"8x32000"`` -> (batch 8, context 32000)."""
    try:
        b, t = text.lower().split("x")
        return int(b), int(t)
    except ValueError:
        raise ValueError(f"point {text!r} is not valid; write batch x context, e.g. 8x32000") from None


def check(opts: dict[str, Any]) -> None:
    """Refuse a bad ``parts=``, ``layout=``, ``points=`` or ``budget_gb=`` (names the value and what is valid)."""
    bad = [p for p in names(opts["parts"]) if p not in PARTS]
    if bad or not names(opts["parts"]):
        raise ValueError(f"parts={opts['parts']!r}: {', '.join(bad) or 'nothing'} not valid; choose from "
                         f"{', '.join(PARTS)} (comma-separated)")
    if str(opts["layout"]) not in LAYOUTS:
        raise ValueError(f"layout={opts['layout']!r} is not valid; choose {', '.join(LAYOUTS)}")
    for p in names(opts["points"]):
        point(p)
    if float(opts.get("budget_gb", 0)) < 0:
        raise ValueError(f"budget_gb={opts['budget_gb']}: a memory budget in GiB, 0 for the device's memory")

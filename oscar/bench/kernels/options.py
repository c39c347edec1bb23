"""The kernel table's variants (a bit width, a page layout, rope-centered keys, launch options) and its option checks.

Light (no torch): the spec refuses a bad key before any device work, and the timing and the report name the
variants the same way.
"""

from __future__ import annotations

import json
from typing import Any

from oscar.kernels.launch import MmaLaunch, RowsLaunch

# variant name -> (bits, page layout, rope-centered keys, launch options of the decode call)
VARIANTS: dict[str, dict[str, Any]] = {
    "int2": {"bits": 2, "layout": "mma"},
    "int2_rope": {"bits": 2, "layout": "mma", "rope": True},
    "int4": {"bits": 4, "layout": "mma"},
    "int4_rows": {"bits": 4, "layout": "rows"},
    "int2_rows": {"bits": 2, "layout": "rows"},
}
LABELS = {"int2": "INT2", "int2_rope": "INT2 + rope", "int4": "INT4", "int4_rows": "INT4 rows (v8)",
          "int2_rows": "INT2 rows (v8)"}


def ints(s: Any) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


def variants(opts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The variants of this run: the named ``VARIANTS`` of ``variants=`` and the ``launch=`` ones."""
    out = {}
    for name in (x.strip() for x in str(opts["variants"]).split(",") if x.strip()):
        if name not in VARIANTS:
            raise ValueError(f"variants: unknown variant {name!r}; valid: {', '.join(VARIANTS)} (or launch=NAME:JSON)")
        out[name] = dict(VARIANTS[name])
    for item in (x.strip() for x in str(opts["launch"]).split(";") if x.strip()):
        name, sep, spec = item.partition(":")
        try:
            v = json.loads(spec) if sep else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"launch={item!r}: {exc}; write NAME:{{\"bits\": 2, \"layout\": \"mma\", ...}}") from None
        if not isinstance(v, dict) or v.get("layout", "mma") not in ("mma", "rows") or v.get("bits", 2) not in (2, 4):
            raise ValueError(f"launch={item!r}: expected NAME:JSON object with bits 2|4 and layout mma|rows")
        out[name.strip()] = {"bits": 2, "layout": "mma", **v}
        launch_of(out[name.strip()])  # refuse unknown or bad launch fields now
    if not out:
        raise ValueError("variants: nothing to time (variants= and launch= are empty)")
    return out


def launch_of(variant: dict[str, Any]) -> Any:
    """The launch value of a variant: its keys other than bits/layout/rope as ``MmaLaunch`` (mma pages) or
    ``RowsLaunch`` (row pages) fields; None (the launcher's measured defaults) when it has none."""
    fields = {k: v for k, v in variant.items() if k not in ("bits", "layout", "rope")}
    cls = MmaLaunch if variant["layout"] == "mma" else RowsLaunch
    try:
        return cls(**fields) if fields else None
    except TypeError as exc:
        valid = ", ".join(cls.__dataclass_fields__)
        raise ValueError(f"launch {fields}: {exc}; {cls.__name__} takes {valid}") from None


def check_options(opts: dict[str, Any]) -> None:
    """Refuse bad keys before any device work (names the bad value and what is valid)."""
    variants(opts)
    parts = {p.strip() for p in str(opts["parts"]).split(",") if p.strip()}
    if not parts or parts - {"attention", "quantize"}:
        raise ValueError(f"parts={opts['parts']!r}; valid: attention, quantize (comma-separated)")
    for key in ("head_dims", "batches", "contexts"):
        try:
            vals = ints(opts[key])
        except ValueError:
            raise ValueError(f"{key}={opts[key]!r}: expected comma-separated integers") from None
        if not vals or min(vals) < 1:
            raise ValueError(f"{key}={opts[key]!r}: expected positive integers")
    if set(ints(opts["head_dims"])) - {64, 128}:
        raise ValueError(f"head_dims={opts['head_dims']!r}; the kernels take head_dim 64 or 128")

"""HumanEval cells of one method served with and without radix prefix reuse, set side by side: pass@1 with its
bootstrap interval, the paired difference of each cell to the first (the reference), wins and losses, and how many
completions are equal to the reference's. Writes ``<out>.md`` and ``<out>.csv``.

    python -m oscar.studies.prefix_reuse --out reports/accuracy/prefix_reuse \\
        --cell "embedded=reports/accuracy/partial/humaneval_kivi2.items.jsonl" \\
        --cell "radix off=<cell dir>" --cell "radix on, quantized reuse=<cell dir>" [--notes notes.md]

A cell is an eval output directory (``items.jsonl``, else ``items.partial.jsonl``) or an items file; ``label=path``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from oscar.core.files import atomic_write_text
from oscar.eval.stats import bootstrap_mean_ci, paired_bootstrap


def read_items(path: Path) -> dict[str, dict[str, Any]]:
    """Records by item id of a cell directory or an items file; refuses a path with none, naming it."""
    if path.is_dir():
        files = [path / "items.jsonl", path / "items.partial.jsonl"]
        path = next((f for f in files if f.is_file()), files[0])
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no items.jsonl (an eval cell directory or an items file)")
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[str(rec["id"])] = rec
    if not out:
        raise ValueError(f"{path}: no records")
    return out


def compare(cells: list[tuple[str, dict[str, dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One row per cell: pass@1 over the items every cell holds, its 95% bootstrap interval, the paired difference
    to the first cell, wins / losses against it, equal completions, and the radix switches its records carry."""
    common = sorted(set.intersection(*(set(c) for _, c in cells)))
    if not common:
        raise ValueError("the cells share no items")
    ref_label, ref = cells[0]
    rows = []
    for label, cell in cells:
        ok = [float(bool(cell[i].get("correct"))) for i in common]
        lo, hi = bootstrap_mean_ci(ok)
        row: dict[str, Any] = {"cell": label, "n": len(common), "pass_at_1": sum(ok) / len(ok), "ci_lo": lo, "ci_hi": hi,
                               "radix": _switch(cell, "radix"), "prefix_reuse": _switch(cell, "prefix_reuse"),
                               "cuda_graph": _switch(cell, "cuda_graph")}
        bf16 = all(float(r.get("kv_bits_per_element") or 0) >= 16 for r in cell.values())  # SGLang's own BF16 cache
        if row["radix"] == "true" and row["prefix_reuse"] == "not recorded":
            # the only reuse of a quantized cache before OSCAR_PREFIX_REUSE; BF16 hits read BF16
            row["prefix_reuse"] = "-" if bf16 else "quantized (before the setting)"
        if label != ref_label:
            d = paired_bootstrap({(i, 0): float(bool(cell[i].get("correct"))) for i in common},
                                 {(i, 0): float(bool(ref[i].get("correct"))) for i in common})
            row.update(diff=d["diff"], diff_lo=d["lo"], diff_hi=d["hi"],
                       wins=sum(1 for i in common if cell[i].get("correct") and not ref[i].get("correct")),
                       losses=sum(1 for i in common if ref[i].get("correct") and not cell[i].get("correct")),
                       completions_equal=sum(cell[i].get("prediction") == ref[i].get("prediction") for i in common))
        rows.append(row)
    return rows


def _switch(cell: dict[str, dict[str, Any]], key: str) -> str:
    vals = {str(r.get(key)).lower() for r in cell.values()}
    return "not recorded" if vals == {"none"} else "mixed" if len(vals) > 1 else vals.pop()


COLUMNS = ["cell", "n", "pass_at_1", "ci_lo", "ci_hi", "diff", "diff_lo", "diff_hi", "wins", "losses",
           "completions_equal", "radix", "prefix_reuse", "cuda_graph"]


def write(rows: list[dict[str, Any]], out: Path, command: str, notes: str = "") -> list[Path]:
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    pts = lambda x: f"{100 * x:+.1f}"  # noqa: E731
    md = ["# HumanEval served with and without radix prefix reuse", "", f"Command: `{command}`", ""]
    md += [notes.rstrip(), ""] if notes else []
    md += [f"| cell | n | pass@1 (%) [95% CI] | vs `{rows[0]['cell']}` (pts) [95% CI] | wins / losses | completions "
           "equal | radix / prefix reuse |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        diff = (f"{pts(r['diff'])} [{pts(r['diff_lo'])}, {pts(r['diff_hi'])}]" if "diff" in r else "(reference)")
        md.append(f"| {r['cell']} | {r['n']} | {pct(r['pass_at_1'])} [{pct(r['ci_lo'])}, {pct(r['ci_hi'])}] | {diff} | "
                  + (f"{r['wins']} / {r['losses']} | {r['completions_equal']}/{r['n']}" if "diff" in r else "- | -")
                  + f" | {r['radix']} / {r['prefix_reuse']} |")
    md += ["", "pass@1 intervals: 95% bootstrap over problems; differences: paired bootstrap over the problems every "
           "cell holds; completions equal: the generated text identical to the reference's."]
    csv = [",".join(COLUMNS)] + [",".join(_cell(r.get(c)) for c in COLUMNS) for r in rows]
    atomic_write_text(out.with_suffix(".md"), "\n".join(md) + "\n")
    atomic_write_text(out.with_suffix(".csv"), "\n".join(csv) + "\n")
    return [out.with_suffix(".md"), out.with_suffix(".csv")]


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    s = str(v)
    return f'"{s}"' if "," in s else s


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m oscar.studies.prefix_reuse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cell", action="append", required=True, help="label=path (the first is the reference)")
    ap.add_argument("--out", type=Path, required=True, help="writes <out>.md and <out>.csv")
    ap.add_argument("--notes", type=Path, default=None, help="Markdown put before the table (the reading)")
    a = ap.parse_args(argv)
    cells = []
    for item in a.cell:
        label, sep, path = item.partition("=")
        if not sep or not label.strip() or not path.strip():
            ap.error(f"--cell {item!r} is not label=path")
        cells.append((label.strip(), read_items(Path(path.strip()))))
    rows = compare(cells)
    command = "python -m oscar.studies.prefix_reuse " + " ".join(
        f"--{k} {v!r}" if " " in str(v) else f"--{k} {v}" for k, v in
        ([("out", a.out)] + [("cell", c) for c in a.cell] + ([("notes", a.notes)] if a.notes else [])))
    for f in write(rows, a.out, command, a.notes.read_text() if a.notes else ""):
        print(f"wrote {f}")
    for r in rows:
        print(r["cell"], f"{100 * r['pass_at_1']:.1f}", "" if "diff" not in r else f"{100 * r['diff']:+.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

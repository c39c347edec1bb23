"""Task accuracy by KV-cache method from finished eval cells: HumanEval pass@1 and needle retrieval, with 95%
item-bootstrap intervals, the paired difference to BF16 and the measured bits per element of each row.

    python -m oscar.studies.accuracy --results results --model qwen2.5-coder-0.5b --out-dir reports/accuracy

Reads `results/eval/<model>/<method>/{humaneval,niah}/seed0/` (`result.json` + `items.jsonl`, or the
`items.partial.jsonl` of a cell still running, marked as partial) and writes `humaneval.{csv,md,png}` and
`niah.{csv,md,png}`. Fractions in the CSV (0-1), percent in the Markdown. `bits_per_element` is the mean over
items of the bits per cached K/V element measured from each request's cache rows when it finished (prompt
and completion), so it covers the BF16 windows, the INT pages in use (whole pages) and their scales.
The paired difference to BF16 resamples problems (the same problems for both methods).

HumanEval options: `--versus METHOD` (repeatable) adds the paired difference of every row to that row's method
(columns `diff_vs_<METHOD>`, `_lo`, `_hi`), e.g. a window variant against KIVI-2; `--agree-with ROOT` compares each
cell with the cell of the same name under another results root (another engine or device) on the problems both
hold: `agree_pass` problems with the same verdict, `agree_prediction` with the same completion, `n_common`.

Served cells: `--served-results ROOT` adds the cells served through SGLang (`oscar eval engine=sglang`, written to
`ROOT/eval/<model>/<variant>/{humaneval,niah}_sglang/seed0`) as rows `<variant>@sglang` with `served` true, their
paired difference taken to the served `bf16` cell. Every row has the boolean `served`. `--keep-rows` keeps the rows
of the tables already in `--out-dir` whose cells are not under the roots read (e.g. the embedded cells of another
machine), as written; `--keep-header` keeps the text above their Markdown tables. The served rows of the committed
table, from the served cells alone:

    python -m oscar.studies.accuracy --only humaneval --served-results results --keep-rows --keep-header
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
from pathlib import Path
from typing import Any, Optional, Sequence

from oscar.core.files import atomic_write_text
from oscar.eval.cells import ITEMS_FILE, PARTIAL_FILE, RESULT_FILE
from oscar.eval.stats import bootstrap_mean_ci, paired_bootstrap

METHOD_ORDER = ["bf16", "int2", "auto", "kivi2", "quarot", "oscar", "turboquant", "saw_int4"]
HUMANEVAL_COLUMNS = ["method", "pass_at_1", "ci_lo", "ci_hi", "bits_per_element", "n", "diff_vs_bf16", "diff_ci_lo",
                     "diff_ci_hi", "complete", "wall_s", "hardware", "served"]
NIAH_COLUMNS = ["method", "length", "score", "ci_lo", "ci_hi", "bits_per_element", "n", "diff_vs_bf16", "diff_ci_lo",
                "diff_ci_hi", "complete", "served"]
SERVED_ENGINE = "sglang"  # a served cell: <results>/eval/<model>/<variant>/<benchmark>_sglang/seed0


def cell_benchmark(benchmark: str, engine: Optional[str] = None) -> str:
    """The directory of a cell of `benchmark`: the benchmark's name, `<benchmark>_<engine>` for a served cell."""
    return benchmark if engine is None else f"{benchmark}_{engine}"


def served_cells(results: Path, model: str, benchmark: str, engine: str = SERVED_ENGINE) -> list[str]:
    """The variants with a served cell of `benchmark` under `results` holding records (table order; a server that
    failed to start leaves a cell directory with its log only, which is not a cell)."""
    root, bench = results / "eval" / model, cell_benchmark(benchmark, engine)
    return [m for m in _methods(root, bench) if read_cell(root / m / bench / "seed0")]


def read_cell(cell: Path) -> Optional[tuple[Optional[dict], list[dict]]]:
    """(result or None while running, item records) of a cell directory, or None when it has no records."""
    if (cell / RESULT_FILE).is_file() and (cell / ITEMS_FILE).is_file():
        result = json.loads((cell / RESULT_FILE).read_text())
        return result, [json.loads(x) for x in (cell / ITEMS_FILE).read_text().splitlines() if x.strip()]
    partial = cell / PARTIAL_FILE
    if not partial.is_file():
        return None
    lines = []
    for line in partial.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue  # a line cut by an interruption
    if not lines:
        return None
    current = lines[-1].get("_config_hash")  # records of an earlier configuration are not resumed, nor shown
    records = {rec["id"]: rec for rec in lines if rec.get("_config_hash") == current}
    return None, list(records.values())


def _methods(root: Path, benchmark: str) -> list[str]:
    found = sorted(p.parent.parent.name for p in root.glob(f"*/{benchmark}/seed0"))
    return [m for m in METHOD_ORDER if m in found] + [m for m in found if m not in METHOD_ORDER]


def _bits(records: list[dict]) -> float:
    vals = [float(r["kv_bits_per_element"]) for r in records if r.get("kv_bits_per_element") is not None]
    return sum(vals) / len(vals) if vals else math.nan


def _row(method: str, values: dict[str, float], ref: Optional[dict[str, float]], records: list[dict],
         complete: bool, engine: Optional[str] = None) -> dict[str, Any]:
    """A row of cell `method` (named `<method>@<engine>` when served); `ref`: BF16's values of the same engine."""
    mean = sum(values.values()) / len(values)
    lo, hi = bootstrap_mean_ci(list(values.values()))
    row: dict[str, Any] = {"method": method if engine is None else f"{method}@{engine}", "variant": method,
                           "ci_lo": lo, "ci_hi": hi, "bits_per_element": _bits(records), "n": len(values),
                           "complete": complete, "served": engine is not None, "_mean": mean}
    if ref is not None and method != "bf16":
        d = paired_bootstrap({(k, 0): v for k, v in values.items()}, {(k, 0): v for k, v in ref.items()})
        row.update(diff_vs_bf16=d["diff"], diff_ci_lo=d["lo"], diff_ci_hi=d["hi"])
    return row


def _versus(row: dict[str, Any], values: dict[str, float], theirs: dict[str, float], other: str) -> None:
    """`row` gains its paired difference to cell `other` (`diff_vs_<other>`, `_lo`, `_hi`) on the items both hold."""
    common = {k: v for k, v in theirs.items() if k in values}
    if row["variant"] == other or not common:
        return
    d = paired_bootstrap({(k, 0): values[k] for k in common}, {(k, 0): v for k, v in common.items()})
    row.update({f"diff_vs_{other}": d["diff"], f"diff_vs_{other}_lo": d["lo"], f"diff_vs_{other}_hi": d["hi"]})


def _cells(results: Path, model: str, benchmark: str, engine: Optional[str],
           versus: Sequence[str]) -> dict[str, tuple[Optional[dict], list[dict]]]:
    root = results / "eval" / model
    bench = cell_benchmark(benchmark, engine)
    cells = {m: read_cell(root / m / bench / "seed0") for m in _methods(root, bench)}
    cells = {m: c for m, c in cells.items() if c}
    missing = [v for v in versus if v not in cells]
    if missing:
        raise ValueError(f"--versus {', '.join(missing)}: no {bench} cell of that name under {root}; "
                         f"cells there: {', '.join(cells) or 'none'}")
    return cells


def _hardware(result: Optional[dict], engine: Optional[str]) -> Optional[str]:
    """The CPU a cell ran on; a served cell: its GPU (where the server ran), else its CPU."""
    if result is None:
        return None
    hw = result.get("hardware") or {}
    return (hw.get("gpu") or hw.get("cpu")) if engine is not None else hw.get("cpu")


def humaneval_rows(results: Path, model: str, versus: Sequence[str] = (), agree_with: Optional[Path] = None,
                   engine: Optional[str] = None) -> list[dict[str, Any]]:
    """One row per method with a HumanEval cell (finished or partial); `versus` and `agree_with` as the module says.
    `engine`: the cells served through that engine (`humaneval_<engine>`), each compared with the served BF16."""
    cells = _cells(results, model, "humaneval", engine, versus)
    ref = None
    if "bf16" in cells:
        ref = {r["id"]: float(bool(r.get("correct"))) for r in cells["bf16"][1]}
    rows = []
    for method, (result, records) in cells.items():
        values = {r["id"]: float(bool(r.get("correct"))) for r in records}
        common_ref = None if ref is None else {k: v for k, v in ref.items() if k in values}
        row = _row(method, values, common_ref if common_ref else None, records, result is not None, engine)
        row["pass_at_1"] = row.pop("_mean")
        row["wall_s"] = None if result is None else result.get("wall_s")
        row["hardware"] = _hardware(result, engine)
        for other in versus:
            _versus(row, values, {r["id"]: float(bool(r.get("correct"))) for r in cells[other][1]}, other)
        if agree_with is not None:
            row.update(_agreement(records, read_cell(agree_with / "eval" / model / method /
                                                     cell_benchmark("humaneval", engine) / "seed0")))
        rows.append(row)
    return rows


def _agreement(records: list[dict], other: Optional[tuple[Optional[dict], list[dict]]]) -> dict[str, Any]:
    """Problems where another run of the same cell gave the same verdict / the same completion."""
    if not other:
        return {}
    theirs = {r["id"]: r for r in other[1]}
    common = [r for r in records if r["id"] in theirs]
    return {"n_common": len(common),
            "agree_pass": sum(bool(r.get("correct")) == bool(theirs[r["id"]].get("correct")) for r in common),
            "agree_prediction": sum(r.get("prediction") == theirs[r["id"]].get("prediction") for r in common)}


def niah_rows(results: Path, model: str, versus: Sequence[str] = (),
              engine: Optional[str] = None, benchmark: str = "niah") -> list[dict[str, Any]]:
    """One row per (method, context length) with a NIAH cell (finished or partial); `engine` and `versus` as for
    HumanEval (the paired differences per context length); `benchmark`: the needle table's cells (e.g.
    ``niah_multikey``)."""
    cells = _cells(results, model, benchmark, engine, versus)
    rows = []
    lengths = sorted({int(r["length"]) for _, recs in cells.values() for r in recs if r.get("length")})
    for length in lengths:
        ref = None
        if "bf16" in cells:
            ref = {r["id"]: float(r["score"]) for r in cells["bf16"][1] if r.get("length") == length}
        for method, (result, records) in cells.items():
            sub = [r for r in records if r.get("length") == length]
            if not sub:
                continue
            values = {r["id"]: float(r["score"]) for r in sub}
            common_ref = None if not ref else {k: v for k, v in ref.items() if k in values}
            row = _row(method, values, common_ref or None, sub, result is not None, engine)
            row["score"] = row.pop("_mean")
            row["length"] = length
            for other in versus:
                _versus(row, values, {r["id"]: float(r["score"]) for r in cells[other][1] if r.get("length") == length},
                        other)
            rows.append(row)
    return rows


def _value(text: str) -> Any:
    """A cell of a table written by `_csv`, back to the value it was written from (so that it writes the same)."""
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def read_table(path: Path) -> list[dict[str, Any]]:
    """The rows of a table this module wrote (none when the file does not exist); a row without `served` was not."""
    if not path.is_file():
        return []
    with open(path, newline="") as fh:
        rows = [{k: _value(v) for k, v in r.items()} for r in csv.DictReader(fh)]
    for r in rows:
        r["served"] = bool(r.get("served"))
        r["variant"] = r["method"].rsplit(f"@{SERVED_ENGINE}", 1)[0] if r["served"] else r["method"]
    return rows


def merge_rows(kept: list[dict[str, Any]], rows: list[dict[str, Any]], key: Sequence[str]) -> list[dict[str, Any]]:
    """`kept` (an earlier table) with each row replaced by the row of `rows` of the same `key`, then the rest of
    `rows`; the cells' rows before the served ones and (NIAH) grouped by context length, each group in that order."""
    new = {tuple(r.get(k) for k in key): r for r in rows}
    out = [new.pop(tuple(r.get(k) for k in key), r) for r in kept] + list(new.values())
    order = (lambda r: (r.get("length") or 0, bool(r.get("served")))) if "length" in key else \
        (lambda r: bool(r.get("served")))
    return sorted(out, key=order)


def header_of(markdown: Path) -> str:
    """The text above the first table of a Markdown report (empty when there is no such file)."""
    if not markdown.is_file():
        return ""
    lines = markdown.read_text().splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    return "\n".join(lines[:first]).rstrip()


def _csv(rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        if isinstance(v, float):
            return f"{v:.6g}"
        text = str(v)
        return f'"{text}"' if "," in text else text

    return "\n".join([",".join(columns)] + [",".join(cell(r.get(c)) for c in columns) for r in rows]) + "\n"


def _pct(x: Any, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:+.1f}" if signed else f"{100 * x:.1f}"


def _diff(r: dict[str, Any], other: str = "bf16") -> str:
    """`r`'s paired difference to `other` as Markdown (the BF16 columns keep their `diff_ci_*` names)."""
    if r.get("variant", r["method"]) == other:
        return "(reference)"
    key = f"diff_vs_{other}"
    lo, hi = ("diff_ci_lo", "diff_ci_hi") if other == "bf16" else (f"{key}_lo", f"{key}_hi")
    if r.get(key) is None:
        return "-"
    return f"{_pct(r[key], True)} [{_pct(r[lo], True)}, {_pct(r[hi], True)}]"


SERVED_NOTE = ("Served rows (`<variant>@sglang`, served = yes): the cell served through SGLang (`oscar eval "
               "engine=sglang`: the oscar plugin's pool for a quantized cache, SGLang's own attention for bf16) with "
               "the BF16 model on the GPU, graded by the same sandbox; their paired difference to BF16 is to the "
               "served `bf16@sglang` cell, on the problems both hold; their bits / element are the served format's "
               "accounting at each request's length (the embedded rows' are measured from the cache rows).")


def _served(r: dict[str, Any]) -> str:
    return "yes" if r.get("served") else "no"


def humaneval_markdown(rows: list[dict[str, Any]], header: str, versus: Sequence[str] = ()) -> str:
    agree = any("n_common" in r for r in rows)
    head = ["method", "served", "pass@1 (%) [95% CI]", "bits / element", "n", "paired diff to BF16 (pts) [95% CI]"]
    head += [f"paired diff to {v} (pts) [95% CI]" for v in versus]
    head += ["same verdict / same completion as the other run"] if agree else []
    lines = [header, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        n = f"{r['n']}" + ("" if r["complete"] else " (running)")
        cells = [r["method"], _served(r), f"{_pct(r['pass_at_1'])} [{_pct(r['ci_lo'])}, {_pct(r['ci_hi'])}]",
                 f"{r['bits_per_element']:.2f}", n, _diff(r)] + [_diff(r, v) for v in versus]
        if agree:
            cells.append(f"{r['agree_pass']} / {r['agree_prediction']} of {r['n_common']}" if "n_common" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", SERVED_NOTE] if any(r.get("served") for r in rows) else []
    return "\n".join(lines) + "\n"


def niah_markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| method | served | context (tokens) | needles retrieved (%) [95% CI] | bits / element | n | "
             "paired diff to BF16 (pts) [95% CI] |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        n = f"{r['n']}" + ("" if r["complete"] else " (running)")
        lines.append(f"| {r['method']} | {_served(r)} | {r['length']} | {_pct(r['score'])} [{_pct(r['ci_lo'])}, "
                     f"{_pct(r['ci_hi'])}] | {r['bits_per_element']:.2f} | {n} | {_diff(r)} |")
    lines += ["", SERVED_NOTE.replace("problems", "needles")] if any(r.get("served") for r in rows) else []
    return "\n".join(lines) + "\n"


def humaneval_figure(rows: list[dict[str, Any]], path: Path) -> None:
    """Bars of pass@1 with their intervals, labelled with the measured bits per element."""
    labels = [f"{r['method']}\n{r['bits_per_element']:.2f} b\nn={r['n']}" for r in rows]
    partial = "" if all(r["complete"] for r in rows) else " (partial cells: n problems each)"
    _bar_figure(rows, "pass_at_1", labels, "HumanEval pass@1 (%)",
                f"Qwen2.5-Coder-0.5B-Instruct, greedy; 95% item-bootstrap CI{partial}", path)


def niah_figure(rows: list[dict[str, Any]], path: Path) -> None:
    """Bars of the needles retrieved per method and context length, with intervals and measured bits per element."""
    labels = [f"{r['method']}\n{r['length'] // 1024}k, {r['bits_per_element']:.2f} b\nn={r['n']}" for r in rows]
    partial = "" if all(r["complete"] for r in rows) else " (partial cells: n needles each)"
    _bar_figure(rows, "score", labels, "needles retrieved (%)",
                f"Qwen2.5-Coder-0.5B-Instruct, single needle; 95% item-bootstrap CI{partial}", path)


def _bar_figure(rows: list[dict[str, Any]], key: str, labels: list[str], ylabel: str, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(rows)), 3.2))
    xs = range(len(rows))
    means = [100 * r[key] for r in rows]
    err = [[100 * (r[key] - r["ci_lo"]) for r in rows], [100 * (r["ci_hi"] - r[key]) for r in rows]]
    colors = {(False, True): "#555555", (False, False): "#3b75af", (True, True): "#8c6d31", (True, False): "#d08a2c"}
    ax.bar(xs, means, yerr=err, capsize=3,  # served rows in ochre
           color=[colors[bool(r.get("served")), r.get("variant", r["method"]) == "bf16"] for r in rows])
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=130)
    plt.close(fig)
    tmp.replace(path)


def write_reports(results: Path, model: str, out_dir: Path, header: str = "", only: Optional[str] = None,
                  versus: Sequence[str] = (), agree_with: Optional[Path] = None, served_results: Optional[Path] = None,
                  keep_rows: bool = False, keep_header: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Write humaneval.{csv,md,png} and niah.{csv,md,png} under `out_dir` (`only`: one of the two); returns the rows.
    `served_results`, `keep_rows`, `keep_header`: the served rows, the earlier tables' rows and text (module doc)."""
    he = humaneval_rows(results, model, versus, agree_with) if only in (None, "humaneval") else []
    nh = niah_rows(results, model) if only in (None, "niah") else []
    if served_results is not None:
        for bench, fn, part in (("humaneval", humaneval_rows, he), ("niah", niah_rows, nh)):
            if only in (None, bench):
                present = served_cells(served_results, model, bench)
                part += fn(served_results, model, [v for v in versus if v in present], engine=SERVED_ENGINE)
    if keep_rows:
        he = merge_rows(read_table(out_dir / "humaneval.csv"), he, ["method"]) if only in (None, "humaneval") else he
        nh = merge_rows(read_table(out_dir / "niah.csv"), nh, ["method", "length"]) if only in (None, "niah") else nh
    if he:
        columns = HUMANEVAL_COLUMNS + [f"diff_vs_{v}{s}" for v in versus for s in ("", "_lo", "_hi")]
        columns += ["n_common", "agree_pass", "agree_prediction"] if agree_with is not None else []
        text = (keep_header and header_of(out_dir / "humaneval.md")) or header
        atomic_write_text(out_dir / "humaneval.csv", _csv(he, columns))
        atomic_write_text(out_dir / "humaneval.md", humaneval_markdown(he, text, versus))
        humaneval_figure(he, out_dir / "humaneval.png")
    if nh:
        text = (keep_header and header_of(out_dir / "niah.md")) or header
        atomic_write_text(out_dir / "niah.csv", _csv(nh, NIAH_COLUMNS))
        atomic_write_text(out_dir / "niah.md", niah_markdown(nh, text))
        niah_figure(nh, out_dir / "niah.png")
    return {"humaneval": he, "niah": nh}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="results", help="results root (default: results)")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--out-dir", default="reports/accuracy")
    parser.add_argument("--header", default="", help="Markdown text above the tables (hardware, command)")
    parser.add_argument("--only", choices=["humaneval", "niah"], default=None,
                        help="write one of the two reports (each has its own header)")
    parser.add_argument("--versus", action="append", default=[], metavar="METHOD",
                        help="HumanEval: also the paired difference of every row to this cell (repeatable)")
    parser.add_argument("--agree-with", default=None, metavar="ROOT",
                        help="HumanEval: compare each cell with the cell of the same name under this results root")
    parser.add_argument("--served-results", default=None, metavar="ROOT",
                        help="also the cells served through SGLang under this root (rows <variant>@sglang, served)")
    parser.add_argument("--keep-rows", action="store_true",
                        help="keep the rows of the tables in --out-dir whose cells are not read (as written)")
    parser.add_argument("--keep-header", action="store_true",
                        help="keep the text above the tables of the Markdown reports in --out-dir (else --header)")
    args = parser.parse_args(argv)
    try:
        rows = write_reports(Path(args.results), args.model, Path(args.out_dir), args.header, args.only, args.versus,
                             Path(args.agree_with) if args.agree_with else None,
                             Path(args.served_results) if args.served_results else None, args.keep_rows,
                             args.keep_header)
    except ValueError as exc:
        print(f"oscar.studies.accuracy: {exc}")
        return 2
    if not rows["humaneval"] and not rows["niah"]:
        print(f"no humaneval or niah cells under {args.results}/eval/{args.model}/")
        return 1
    for name, part in rows.items():
        if part:
            print(humaneval_markdown(part, f"## {name}", args.versus) if name == "humaneval"
                  else niah_markdown(part, f"## {name}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m oscar docs [--check] [--root DIR] [FILE ...]`: render the report tables of README.md and docs/RESULTS.md.

Every table of those documents that repeats report numbers sits between `<!-- render: NAME -->` and
`<!-- /render -->`; this command rebuilds each block from the report CSVs named in `BLOCKS` (the report linked
under the table), so that a number lives in one report file and the documents cannot drift from it. Text outside
the blocks is left as it is. `--check` writes nothing: it prints a unified diff of every document whose committed
text differs from the render and exits 1 (`tests/test_docs_render.py` runs it on the committed files).
Rendering is deterministic: fixed float formats, rows in the CSV's order, no dates but those the reports hold.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import math
import posixpath
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

DOCUMENTS = ("README.md", "docs/RESULTS.md")
BLOCK = re.compile(r"(<!-- render: (?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /render -->)", re.S)


class DocsError(Exception):
    """A block that cannot be rendered (unknown name, missing report file or column)."""


# ------------------------------------------------------------------------------------------- reading and formats


@dataclass(frozen=True)
class Ctx:
    """Where the reports are (`root`) and which document a block is rendered into (`doc`, relative to root: the
    links under the tables are relative to it)."""

    root: Path
    doc: str

    def rows(self, rel: str) -> list[dict[str, str]]:
        path = self.root / rel
        if not path.is_file():
            raise DocsError(f"{rel}: report file not found")
        with path.open(newline="") as f:
            return list(csv.DictReader(f))

    def json(self, rel: str) -> Optional[dict]:
        path = self.root / rel
        return json.loads(path.read_text()) if path.is_file() else None

    def link(self, rel: str) -> str:
        target = posixpath.relpath(rel, posixpath.dirname(self.doc) or ".")
        return f"[`{rel}`]({target})"


def num(row: dict[str, str], key: str) -> Optional[float]:
    """The row's value as a float; None where the cell is empty, `nan` or the column is missing."""
    v = (row.get(key) or "").strip()
    if v == "" or v.lower() in ("nan", "none"):
        return None
    x = float(v)
    return None if math.isnan(x) else x


def need(row: dict[str, str], key: str) -> float:
    v = num(row, key)
    if v is None:
        raise DocsError(f"column {key!r} is empty in row {dict(list(row.items())[:3])}")
    return v


def _zero(x: float, decimals: int) -> float:
    """-0.0 and values that round to zero print as 0 (`+0.0`, not `-0.0`)."""
    return 0.0 if round(x, decimals) == 0 else x


def pct(x: float) -> str:
    return f"{_zero(x * 100, 1):.1f}"


def pct_ci(v: float, lo: Optional[float], hi: Optional[float]) -> str:
    if lo is None or hi is None:
        return pct(v)
    return f"{pct(v)} [{pct(lo)}, {pct(hi)}]"


def pts(x: float) -> str:
    return f"{_zero(x * 100, 1):+.1f}"


def pts_ci(v: Optional[float], lo: Optional[float], hi: Optional[float]) -> str:
    if v is None:
        return "(reference)"
    return f"{pts(v)} [{pts(lo)}, {pts(hi)}]" if lo is not None and hi is not None else pts(v)


def sig_decimals(x: float, digits: int = 3, most: int = 4) -> int:
    if x == 0:
        return 0
    return max(0, min(most, digits - 1 - math.floor(math.log10(abs(x)))))


def sig(x: float) -> str:
    """Three significant digits (at most four decimals); 0 as `0`."""
    d = sig_decimals(x)
    return "0" if x == 0 else f"{x:.{d}f}"


def sig_ci(v: float, lo: Optional[float], hi: Optional[float]) -> str:
    if v == 0 or lo is None or hi is None:
        return sig(v)
    d = sig_decimals(v)
    return f"{v:.{d}f} [{lo:.{d}f}, {hi:.{d}f}]"


def ms(x: float) -> str:
    return f"{x:.2f}"


def ratio(x: float) -> str:
    return f"{x:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def kilo(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else (f"{tokens // 1000}k" if tokens % 1000 == 0 else str(tokens))


def on_off(value: str) -> str:
    return {"true": "on", "false": "off", "1": "on", "0": "off"}.get(str(value).strip().lower(), str(value))


# ------------------------------------------------------------------------------------------------------ labels

# Labels of the served variants (the cells' names in the served reports) and of the methods; a name not listed
# prints as itself. The served labels describe the committed cells (CSVs without `cuda_graph`/`radix` columns; their
# windows from the commands in reports/accuracy/*_served.md and niah32/README.md): a CSV with those columns is a new
# measurement, whose variants print by name (`served_label`), so that a re-measured `auto` is never labelled with
# the old cell's keys and windows.
SERVED_LABELS = {
    "bf16": "BF16 (SGLang's own attention)",
    "kivi2": "KIVI-2 (its paged twin), 0/64",
    "auto": "`auto` per-token keys (`method.channel_block=0`), 16/64",
    "auto+cb32-code@0x64": "`auto` per-channel key candidates, calibrated on code (`calibration=code`), 0/64",
    "auto@64x256": "`auto` per-channel key candidates by KL, calibrated on code, 64/256 (the default's windows; "
                   "the default calibrates on essays)",
}
METHOD_LABELS = {
    "bf16": "BF16", "kivi2": "KIVI-2", "auto": "`auto`", "saw_int4": "Saw-INT4 (4-bit)",
    "turboquant": "TurboQuant", "oscar": "OSCAR", "int2": "INT2", "quarot": "QuaRot", "oscar_raw": "`oscar_raw`",
}
MODEL_LABELS = {
    "smollm2-135m": "SmolLM2-135M", "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B", "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B",
    "gemma3-270m": "Gemma 3 270M",
}


PER_TOKEN_NOTE = "is `auto` with per-token keys"


def method_label(method: str, per_token_auto: bool) -> str:
    """A method's label; `auto` is called per-token only where its report says so (`PER_TOKEN_NOTE` in the .md
    beside the CSV), so that a re-measured default `auto` is never labelled with the old cells' keys."""
    return "`auto` per-token keys" if method == "auto" and per_token_auto else METHOD_LABELS.get(method, method)


def says_per_token(ctx: Ctx, *csv_rels: str) -> bool:
    texts = [(ctx.root / rel.replace(".csv", ".md")) for rel in csv_rels]
    return all(t.is_file() and PER_TOKEN_NOTE in t.read_text() for t in texts)


def served_label(row: dict[str, str], flagged: bool) -> str:
    """A served variant's label: the old cells' description (`SERVED_LABELS`), or for a CSV with the serving
    switches its name with the windows and calibration it ran with (columns ``windows``, ``calibration``)."""
    variant = row["variant"]
    if not flagged:
        return SERVED_LABELS.get(variant, variant)
    windows, calib = row.get("windows", "?"), row.get("calibration", "?")
    said = [w for w in ((f"{windows}" if windows not in ("-", "", "?") else ""),
                        (f"{calib} calibration" if calib not in ("-", "", "?") else "")) if w]
    return f"`{variant}`" + (f", {', '.join(said)}" if said else "")


def _switches(r: dict[str, str]) -> str:
    """``graphs / radix`` of a served row, with what a radix hit reused where the row says (``prefix_reuse``)."""
    out = f"{on_off(r['cuda_graph'])} / {on_off(r['radix'])}"
    reuse = r.get("prefix_reuse", "")
    return out + (f" ({reuse} reuse)" if reuse not in ("", "-", "not recorded") and on_off(r["radix"]) == "on" else "")


def served_flags(rows: list[dict[str, str]]) -> tuple[bool, str]:
    """(whether the CSV records `cuda_graph`/`radix` per row, the caption's words on the serving configuration)."""
    if rows and "cuda_graph" in rows[0] and "radix" in rows[0]:
        return True, ("CUDA graphs and the radix cache as in the column `graphs / radix` (with what a radix hit reuses: "
                      "`quantized`, the cached INT2 pages, or `exact`, the BF16 sink only, `OSCAR_PREFIX_REUSE`); each "
                      "variant's method, calibration and windows in the report")
    return False, ("CUDA graphs off, radix cache off, the BF16 row through SGLang's `torch_native` attention (these "
                   "cells predate the production configuration, and the CSV has no `cuda_graph`/`radix` columns)")


# ------------------------------------------------------------------------------------------------------ blocks


def humaneval_served(ctx: Ctx) -> str:
    """Served HumanEval pass@1 by variant: `reports/accuracy/humaneval_served.csv`."""
    rel = "reports/accuracy/humaneval_served.csv"
    rows = ctx.rows(rel)
    flagged, config = served_flags(rows)
    header = ["served cache, windows sink / recent", "pass@1 % [95% CI]", "vs served BF16, paired (pts)",
              "bits / element", "served / embedded pass@1 % (same verdict %)"]
    if flagged:
        header.append("graphs / radix")
    out = []
    for r in rows:
        emb = num(r, "pass_embedded")
        agree = num(r, "verdict_agreement")
        both = f"{pct(need(r, 'pass_served'))} / {pct(emb)} ({pct(agree)})" if emb is not None and agree is not None else "-"
        cells = [served_label(r, flagged),
                 pct_ci(need(r, "pass_at_1"), num(r, "ci_lo"), num(r, "ci_hi")),
                 pts_ci(num(r, "diff_vs_bf16"), num(r, "diff_ci_lo"), num(r, "diff_ci_hi")),
                 f"{need(r, 'bits_per_element'):.2f}", both]
        if flagged:
            cells.append(_switches(r))
        out.append(cells)
    hw = sorted({r.get("hardware", "") for r in rows} - {""})
    n = sorted({int(need(r, "n")) for r in rows})
    caption = (f"HumanEval, {'/'.join(map(str, n))} problems, greedy, the sandboxed grader; served on "
               f"{', '.join(hw) or 'a GPU'}, one SGLang server per cell, every quantized row through the oscar "
               f"plugin's pool; {config}. Paired differences and intervals: 95% bootstrap over problems. "
               f"Report: {ctx.link(rel.replace('.csv', '.md'))} ({ctx.link(rel)}).")
    return table(header, out) + "\n\n" + caption + "\n"


def niah_served(ctx: Ctx) -> str:
    """Served needle retrieval by variant and length: `reports/accuracy/niah_served.csv`."""
    rel = "reports/accuracy/niah_served.csv"
    rows = ctx.rows(rel)
    flagged, config = served_flags(rows)
    lengths = sorted({int(need(r, "length")) for r in rows})
    by: dict[str, dict[int, dict[str, str]]] = {}
    for r in rows:
        by.setdefault(r["variant"], {})[int(need(r, "length"))] = r
    header = ["served cache, windows sink / recent", *[f"needles at {kilo(L)}" for L in lengths],
              f"bits / element ({' / '.join(kilo(L) for L in lengths)})",
              f"same score as the embedded engine % ({' / '.join(kilo(L) for L in lengths)})"]
    if flagged:
        header.append("graphs / radix")
    out = []
    for variant, per in by.items():
        cells = [served_label(per[min(per)], flagged)]
        for L in lengths:
            r = per.get(L)
            cells.append(f"{round(need(r, 'score') * need(r, 'n'))}/{int(need(r, 'n'))}" if r else "not run")
        cells.append(" / ".join(f"{need(per[L], 'bits_per_element'):.2f}" if L in per else "-" for L in lengths))
        agree = [num(per[L], "verdict_agreement") if L in per else None for L in lengths]
        cells.append(" / ".join(pct(a) for a in agree) if all(a is not None for a in agree) else "-")
        if flagged:
            cells.append(_switches(per[min(per)]))
        out.append(cells)
    caption = (f"Needles retrieved of the needles asked per length (Paul Graham haystacks, one 7-digit value, "
               f"greedy); {config}. Report: {ctx.link(rel.replace('.csv', '.md'))} ({ctx.link(rel)}).")
    return table(header, out) + "\n\n" + caption + "\n"


def methods_embedded(ctx: Ctx) -> str:
    """Every method on the embedded engine: HumanEval (`reports/accuracy/humaneval.csv`), needles
    (`reports/accuracy/niah.csv`) and next-token KL (`reports/methods/kl_ppl.csv`)."""
    he_rel, nh_rel, kl_rel = "reports/accuracy/humaneval.csv", "reports/accuracy/niah.csv", "reports/methods/kl_ppl.csv"
    he = [r for r in ctx.rows(he_rel) if str(r.get("served", "False")).lower() != "true"]
    nh = [r for r in ctx.rows(nh_rel) if str(r.get("served", "False")).lower() != "true"]
    kl = ctx.rows(kl_rel)
    lengths = sorted({int(need(r, "length")) for r in nh})
    needles = {(r["method"], int(need(r, "length"))): r for r in nh}
    n_needles = sorted({int(need(r, "n")) for r in nh})
    kls = {(r["model"], r["method"]): r for r in kl if r.get("status", "ok") == "ok"}
    models = ("qwen2.5-coder-0.5b", "smollm2-135m")
    per_token = says_per_token(ctx, he_rel, nh_rel, kl_rel)
    n_he = sorted({int(need(r, "n")) for r in he})
    header = ["method", f"HumanEval pass@1 % ({'/'.join(map(str, n_he))} problems)", "vs BF16, paired (pts)",
              f"needles retrieved % at {' / '.join(kilo(L) for L in lengths)} ({'/'.join(map(str, n_needles))} each)",
              *[f"next-token KL (nats), {MODEL_LABELS.get(m, m)}" for m in models]]
    out = []
    for r in he:
        m = r["method"]
        nd = [needles.get((m, L)) for L in lengths]
        needle_cell = (" / ".join(pct_ci(need(x, "score"), num(x, "ci_lo"), num(x, "ci_hi")) for x in nd)
                       if all(nd) else "not run")
        kl_cells = []
        for model in models:
            k = kls.get((model, m))
            kl_cells.append(sig_ci(need(k, "kl_past_window"), num(k, "kl_past_lo"), num(k, "kl_past_hi")) if k else "not run")
        out.append([method_label(m, per_token), pct_ci(need(r, "pass_at_1"), num(r, "ci_lo"), num(r, "ci_hi")),
                    pts_ci(num(r, "diff_vs_bf16"), num(r, "diff_ci_lo"), num(r, "diff_ci_hi")), needle_cell, *kl_cells])
    bits = [need(r, "bits_per_element") for r in he if r["method"] != "bf16"]
    caption = (f"95% bootstrap intervals. HumanEval: {ctx.link(he_rel)} (greedy, sandboxed grader, BF16 windows 16/64 "
               f"so that completions read INT2 rows: {min(bits):.2f}-{max(bits):.2f} bits per element for the "
               f"quantized methods on these short sequences); needles: {ctx.link(nh_rel)} (64/256 windows); KL: "
               f"{ctx.link(kl_rel)} (held-out essay windows, positions that read quantized history, 64/256 windows).")
    return table(header, out) + "\n\n" + caption + "\n"


def humaneval_embedded(ctx: Ctx) -> str:
    """HumanEval pass@1 of every method on the embedded engine, with bits: `reports/accuracy/humaneval.csv`."""
    rel = "reports/accuracy/humaneval.csv"
    rows = [r for r in ctx.rows(rel) if str(r.get("served", "False")).lower() != "true"]
    per_token = says_per_token(ctx, rel)
    out = [[method_label(r["method"], per_token), pct_ci(need(r, "pass_at_1"), num(r, "ci_lo"), num(r, "ci_hi")),
            f"{need(r, 'bits_per_element'):.2f}", pts_ci(num(r, "diff_vs_bf16"), num(r, "diff_ci_lo"), num(r, "diff_ci_hi")),
            r.get("hardware", "")] for r in rows]
    return (table(["method", "pass@1 % [95% CI]", "bits / element", "vs BF16, paired (pts)", "hardware"], out)
            + f"\n\nReport: {ctx.link(rel.replace('.csv', '.md'))} ({ctx.link(rel)}; the served rows of that file are "
            "the served table's).\n")


def niah_embedded(ctx: Ctx) -> str:
    """Needle retrieval of every method on the embedded engine: `reports/accuracy/niah.csv`."""
    rel = "reports/accuracy/niah.csv"
    rows = [r for r in ctx.rows(rel) if str(r.get("served", "False")).lower() != "true"]
    lengths = sorted({int(need(r, "length")) for r in rows})
    by: dict[str, dict[int, dict[str, str]]] = {}
    for r in rows:
        by.setdefault(r["method"], {})[int(need(r, "length"))] = r
    header = ["method"] + [f"{kilo(L)}: retrieved (% [95% CI])" for L in lengths] + \
             [f"bits / element ({' / '.join(kilo(L) for L in lengths)})"] + \
             [f"vs BF16, paired (pts) ({' / '.join(kilo(L) for L in lengths)})"]
    out = []
    per_token = says_per_token(ctx, rel)
    for m, per in by.items():
        cells = [method_label(m, per_token)]
        for L in lengths:
            r = per.get(L)
            cells.append(f"{round(need(r, 'score') * need(r, 'n'))}/{int(need(r, 'n'))} "
                         f"({pct_ci(need(r, 'score'), num(r, 'ci_lo'), num(r, 'ci_hi'))})" if r else "not run")
        cells.append(" / ".join(f"{need(per[L], 'bits_per_element'):.2f}" if L in per else "-" for L in lengths))
        cells.append(" / ".join(pts_ci(num(per[L], "diff_vs_bf16"), num(per[L], "diff_ci_lo"), num(per[L], "diff_ci_hi"))
                                if L in per else "-" for L in lengths))
        out.append(cells)
    return table(header, out) + f"\n\nReport: {ctx.link(rel.replace('.csv', '.md'))} ({ctx.link(rel)}).\n"


KL_COLUMNS = (("auto", "auto (64/256)"), ("auto@64/128", "auto@64/128"), ("kivi2", "kivi2 (0/128)"),
              ("quarot", "quarot (fit)"), ("oscar", "oscar (fit)"), ("turboquant",) * 2, ("int2", "int2 (fit)"))


def kl_models(ctx: Ctx) -> str:
    """Next-token KL to the BF16 cache and bits per element, by model and method: `reports/methods/kl_ppl.csv`."""
    rel = "reports/methods/kl_ppl.csv"
    rows = [r for r in ctx.rows(rel) if r.get("status", "ok") == "ok"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    at = {(r["model"], r["method"]): r for r in rows}
    out = []
    for model in models:
        first = next(r for r in rows if r["model"] == model)
        windows, tokens = int(need(first, "windows")), int(need(first, "tokens"))
        cells = [f"{MODEL_LABELS.get(model, model)} ({windows} x {tokens // max(windows, 1)})"]
        for method, _ in KL_COLUMNS:
            r = at.get((model, method))
            cells.append(f"{sig_ci(need(r, 'kl_past_window'), num(r, 'kl_past_lo'), num(r, 'kl_past_hi'))}, "
                         f"{need(r, 'bits_per_element'):.2f} b" if r else "not run")
        out.append(cells)
    note = " `auto` is `auto` with per-token keys (the report says so)." if says_per_token(ctx, rel) else ""
    return (table(["model (windows x tokens)", *[h for _, h in KL_COLUMNS]], out)
            + f"\n\nEach cell: KL in nats [95% block-bootstrap interval], bits per element.{note} Report: "
            f"{ctx.link(rel.replace('.csv', '.md'))} ({ctx.link(rel)}).\n")


def kl_gemma_channel(ctx: Ctx) -> str:
    """Gemma 3 270M: `auto` with per-channel key candidates over 32-token blocks against KIVI-2:
    `reports/methods/kl_ppl.csv`."""
    rel = "reports/methods/kl_ppl.csv"
    rows = [r for r in ctx.rows(rel) if r["model"] == "gemma3-270m" and r.get("status", "ok") == "ok"
            and (r["method"] == "kivi2" or r["method"].startswith("auto+ch"))]
    out = []
    for r in rows:
        diff = num(r, "diff_past") if r.get("diff_ref") == "kivi2" else None
        lo, hi = num(r, "diff_past_lo"), num(r, "diff_past_hi")
        out.append([r["method"], f"{int(need(r, 'sink'))}/{int(need(r, 'recent'))}",
                    sig_ci(need(r, "kl_past_window"), num(r, "kl_past_lo"), num(r, "kl_past_hi")),
                    f"{need(r, 'bits_per_element'):.2f}",
                    "(reference)" if r["method"] == "kivi2" else
                    (f"{diff:+.4f} [{lo:+.4f}, {hi:+.4f}]" if diff is not None and lo is not None and hi is not None else "-")])
    return (table(["Gemma 3 270M", "windows sink / recent", "next-token KL (nats) [95% CI]", "bits / element",
                   "minus KIVI-2, paired (nats)"], out)
            + f"\n\nReport: {ctx.link(rel.replace('.csv', '.md'))} ({ctx.link(rel)}).\n")


# Table 2's `auto` cells are per-token `auto` (conf/experiment/table2.yaml pins method.channel_block=0).
TABLE2_LABELS = {"auto": "auto (per-token keys)"}
TABLE2_COLUMNS = (("mmlu", "agree", "mmlu agree %"), ("mmlu", "acc", "mmlu acc %"),
                  ("humaneval", "prefix", "humaneval prefix %"), ("niah", "score@512", "niah@512 %"),
                  ("niah", "score@1024", "niah@1024 %"), ("", "kl", "KL (nats)"))


def table2(ctx: Ctx) -> str:
    """Table 2 on the CPU default: `reports/default/table2.csv` (long format: method x metric)."""
    rel = "reports/default/table2.csv"
    rows = ctx.rows(rel)
    at = {(r["method"], r["benchmark"], r["metric"]): r for r in rows}
    out = []
    for method in dict.fromkeys(r["method"] for r in rows):
        cells = [TABLE2_LABELS.get(method, method)]
        for bench, metric, _ in TABLE2_COLUMNS:
            r = at.get((method, bench, metric))
            if r is None:
                cells.append("-")
            elif metric == "kl":
                cells.append(sig_ci(need(r, "mean"), num(r, "ci_lo"), num(r, "ci_hi")))
            else:
                cells.append(pct_ci(need(r, "mean"), num(r, "ci_lo"), num(r, "ci_hi")))
        out.append(cells)
    return (table(["method", *[h for _, _, h in TABLE2_COLUMNS]], out)
            + f"\n\nReport: {ctx.link(rel.replace('.csv', '.md'))} ({ctx.link(rel)}).\n")


DECODE_CSV = "reports/serving/decode.csv"
PREFILL_CSV = "reports/serving/prefill_defaults.csv"
# the served caches, one column each: the `format` of decode.csv (the registry's kind, or SGLang's own cache),
# the tag of prefill_defaults.csv, the header
DECODE_COLUMNS = (("rotated_channel", "oscar_channel", "default `auto` (per-channel keys)"),
                  ("rotated", "oscar_token", "`auto` per-token keys"),
                  ("bf16", "flashinfer", "BF16 (flashinfer)"),
                  ("fp8_e4m3", "flashinfer_fp8", "FP8 KV (flashinfer)"))
BF16_COLUMN = 2  # the reference of every ratio
DECODE_SHAPES = ((1, 30000), (1, 100000), (3, 100000))


def _decode_ms(rows: list[dict[str, str]], key: str, batch: int, context: int, graph: bool) -> Optional[float]:
    """Decode ms of one cache format at one shape (synthetic state), the fastest backend of that format."""
    hits = [need(r, "decode_ms") for r in rows if r["format"] == key and r["mode"] == "synthetic"
            and r.get("status") == "ok" and int(need(r, "batch")) == batch and int(need(r, "context")) == context
            and on_off(r.get("cuda_graph", "")) == ("on" if graph else "off")]
    return min(hits) if hits else None


def serving_decode(ctx: Ctx) -> str:
    """Served decode and prefill through SGLang, each served format beside SGLang's BF16 and FP8 caches:
    `reports/serving/decode.csv` (decode steps, capacity) and `reports/serving/prefill_defaults.csv` (a 128k prompt
    at SGLang's defaults)."""
    rows = ctx.rows(DECODE_CSV)
    bf16 = DECODE_COLUMNS[BF16_COLUMN][0]
    out = []
    for graph in (True, False):
        for batch, context in DECODE_SHAPES:
            ref = _decode_ms(rows, bf16, batch, context, graph)
            cells = []
            for key, _, _ in DECODE_COLUMNS:
                v = _decode_ms(rows, key, batch, context, graph)
                cells.append("" if v is None else ms(v) + ("" if key == bf16 or ref is None else f" ({ratio(ref / v)})"))
            if any(cells):
                out.append([f"decode ms, {batch} x {kilo(context)}" + ("" if graph else ", CUDA graphs off"), *cells])
    caps, jobs = [], []
    for key, _, _ in DECODE_COLUMNS:
        mine = [r for r in rows if r["format"] == key and on_off(r.get("cuda_graph", "")) == "on"]
        cap = max((need(r, "max_total_num_tokens") for r in mine if num(r, "max_total_num_tokens")), default=None)
        caps.append(cap)
        ok = [r for r in mine if r["mode"] == "synthetic" and r.get("status") == "ok" and int(need(r, "context")) == 100000]
        best = max(ok, key=lambda r: int(need(r, "batch")), default=None)
        jobs.append(None if best is None else (int(need(best, "batch")), need(best, "tokens_per_s")))
    ref_cap, ref_job = caps[BF16_COLUMN], jobs[BF16_COLUMN]
    out.append(["token capacity (SGLang's default memory fraction)",
                *["" if c is None else f"{c:,.0f}" + ("" if i == BF16_COLUMN or not ref_cap else f" ({c / ref_cap:.1f}x)")
                  for i, c in enumerate(caps)]])
    out.append(["job tokens/s at 100k, at the largest batch measured",
                *["" if j is None else f"{j[1]:,.0f} at {j[0]} x 100k" + ("" if i == BF16_COLUMN or not ref_job else
                                                                         f" ({j[1] / ref_job[1]:.1f}x)")
                  for i, j in enumerate(jobs)]])
    prefill = {r["tag"]: r for r in ctx.rows(PREFILL_CSV)} if (ctx.root / PREFILL_CSV).is_file() else {}
    if prefill:
        cells = []
        for _, tag, _ in DECODE_COLUMNS:
            r = prefill.get(tag)
            cells.append("" if r is None else (f"{need(r, 'cold_ttft_s'):.1f} s" if r.get("status") == "ok"
                                                else r.get("status", "")))
        n = next((int(need(r, "input_len")) for r in prefill.values() if num(r, "input_len")), 0)
        out.append([f"{n:,}-token prompt at SGLang's defaults, time to first token", *cells])
    header = ["served through SGLang (>1x: faster than BF16)", *[h for _, _, h in DECODE_COLUMNS]]
    devices = sorted({r.get("device", "") for r in rows} - {""})
    caption = (f"{', '.join(devices)}; dummy Qwen3-8B weights; decode and capacity: SGLang's one-batch harness "
               "(`bench_one_batch`, radix cache off), median step on the synthetic state, CUDA graphs on unless marked, "
               "the ratio is BF16's time over the cache's; which call and machine gave each row: decode.md's notes; the "
               "prompt row through SGLang's own Engine at "
               "its defaults (chunked prefill, radix cache and CUDA graphs on). Reports: "
               f"{ctx.link(DECODE_CSV.replace('.csv', '.md'))}"
               + (f", {ctx.link(PREFILL_CSV.replace('.csv', '.md'))}" if prefill else "") + ".")
    return table(header, out) + "\n\n" + caption + "\n"


BLOCKS: dict[str, Callable[[Ctx], str]] = {
    "humaneval_served": humaneval_served,
    "niah_served": niah_served,
    "methods_embedded": methods_embedded,
    "humaneval_embedded": humaneval_embedded,
    "niah_embedded": niah_embedded,
    "kl_models": kl_models,
    "kl_gemma_channel": kl_gemma_channel,
    "table2": table2,
    "serving_decode": serving_decode,
}


# ----------------------------------------------------------------------------------------------------- rendering


def render_text(text: str, ctx: Ctx, blocks: Optional[dict[str, Callable[[Ctx], str]]] = None) -> str:
    """`text` with every `<!-- render: NAME -->` ... `<!-- /render -->` block rebuilt by `blocks[NAME]`."""
    blocks = BLOCKS if blocks is None else blocks

    def one(m: re.Match) -> str:
        name = m.group("name")
        if name not in blocks:
            raise DocsError(f"{ctx.doc}: unknown block {name!r}; known: {', '.join(sorted(blocks))}")
        return m.group(1) + blocks[name](ctx) + m.group(4)

    opened = len(re.findall(r"<!-- render: [a-z0-9_]+ -->", text))
    if opened != text.count("<!-- /render -->"):
        raise DocsError(f"{ctx.doc}: {opened} `<!-- render: ... -->` markers against "
                        f"{text.count('<!-- /render -->')} `<!-- /render -->`")
    return BLOCK.sub(one, text)


def render_file(root: Path, doc: str) -> tuple[str, str]:
    """(the committed text, the rendered text) of one document."""
    path = root / doc
    if not path.is_file():
        raise DocsError(f"{doc}: not found under {root}")
    text = path.read_text()
    return text, render_text(text, Ctx(root, doc))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oscar docs", description=__doc__.splitlines()[0],
                                     epilog="example: python -m oscar docs --check   (python -m oscar docs: write)")
    parser.add_argument("files", nargs="*", default=list(DOCUMENTS),
                        help=f"documents relative to --root (default: {' '.join(DOCUMENTS)})")
    parser.add_argument("--check", action="store_true", help="write nothing; print a diff and exit 1 on drift")
    parser.add_argument("--root", default=".", help="the repository root (reports/ and the documents)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    drift = 0
    try:
        for doc in args.files:
            old, new = render_file(root, doc)
            if old == new:
                continue
            if args.check:
                drift += 1
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                           f"{doc} (committed)", f"{doc} (rendered)"))
            else:
                (root / doc).write_text(new)
                print(f"oscar docs: rendered {doc}")
    except (DocsError, KeyError, ValueError) as exc:
        print(f"oscar docs: {exc}", file=sys.stderr)
        return 1
    if drift:
        print(f"oscar docs: {drift} document(s) differ from the reports' render; run `python -m oscar docs`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

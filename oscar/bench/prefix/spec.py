"""The prefix table (``python -m oscar gpu prefix``): the prefix-hit sweep (paper Fig. 6) through SGLang's Engine.

One job of ``requests`` prompts of ``input_len`` tokens sharing 0..~100% of their tokens (``ratios``), radix
cache on (``oscar.bench.prefix.sweep``), SGLang BF16 with flashinfer (its best backend) against OSCAR (the plugin,
CUDA graphs, pages of 16), dummy weights of ``model=`` (default: the bundle's Qwen3-8B). Two engines in one run:
the flashinfer engine starts first (its nvcc JIT takes ~2 minutes at first use) and waits after its warm-up while
the OSCAR engine starts and measures; then it measures (the GPU runs one engine's work at a time). Rows:
``prefix_rows.jsonl``; logs: ``logs/prefix_*.log``; report: ``prefix_sweep.{csv,md,png}``.

``profile=true``: where a prefix hit's time goes, no sweep: the OSCAR engine alone (labels on,
``OSCAR_PROFILE_LABELS=1``) times one prompt of ``input_len`` tokens cold and then hitting its cached prefix, unprofiled
and under SGLang's ``torch.profiler`` in the scheduler process (``oscar.bench.prefix.sweep --profile``); writes
``prefix_profile.{md,json}`` (``oscar.bench.prefix.profile``), the traces packed as ``prefix_traces.tar.gz``; then,
without an engine, one layer's extend attention of that hit by route (in place, dequantize + SDPA, the torch twin:
``oscar.bench.prefix.extend_bench``, ``prefix_extend_bench.json``, a section of the .md).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from oscar.bench import host, mirror
from oscar.bench.prefix import profile as prefix_profile
from oscar.bench.prefix import report as prefix_report
from oscar.bench.serving.formats import FORMATS
from oscar.bench.serving.spec import model_dir, oscar_engine_needs
from oscar.serve.reuse import PREFIX_REUSE

AREA = "serving"
SUMMARY = "prefix-hit sweep (radix cache on): job tokens/s and TTFT, OSCAR vs SGLang flashinfer BF16"
DEFAULTS: dict[str, Any] = {
    "requests": 8,
    "input_len": 30000,
    "ratios": "0,0.25,0.5,0.75,0.99",
    "model": "",
    "limit_s": 360,  # the whole run
    "oscar_limit_s": 190,  # the OSCAR engine from its start (its sweep stops starting ratios 30 s before)
    "sink": 64,
    "recent": 256,
    # OSCAR_PREFIX_REUSE of the sweep and the profile (they time hits that take cached INT2 pages); defaults=true
    # serves the plugin's own default (exact: a hit reuses the BF16 sink only)
    "reuse": "quantized",
    "notes": "",
    "profile": False,  # where a hit's time goes: no sweep; the OSCAR engine alone, cold + hits profiled
    "defaults": False,  # one long prompt per backend at SGLang's defaults (no sweep): prefill_defaults.{md,csv}
    "backends": "oscar_channel,oscar_token,flashinfer,flashinfer_fp8",  # defaults=true: one engine each, in turn
}
# defaults=true: what a user's `sglang.Engine(...)` gets: SGLang's own memory fraction, chunked prefill, context
# length (the model's), CUDA graphs and radix cache on; only what dummy weights need is set
ENGINE_DEFAULTS = ["load_format=dummy", "skip_tokenizer_init=true", "sampling_backend=pytorch", "grammar_backend=none",
                   "log_level=info"]
DEFAULTS_ROWS = "prefill_defaults_rows.jsonl"  # defaults=true's raw rows (the sweep's are prefix_rows.jsonl)
ENGINE = ["load_format=dummy", "skip_tokenizer_init=true", "sampling_backend=pytorch", "grammar_backend=none",
          "log_level=info", "context_length=65536", "max_running_requests=16", "cuda_graph_max_bs_decode=16",
          "chunked_prefill_size=32768", "max_prefill_tokens=32768", "disable_prefill_cuda_graph=true"]


def stem(opts: dict[str, Any]) -> str:
    return "prefill_defaults" if opts["defaults"] else "prefix_profile" if opts["profile"] else "prefix_sweep"


def _default_runs(opts: dict[str, Any]) -> list[dict[str, Any]]:
    """``defaults=true``: one engine per entry of ``backends`` (``oscar_<format>``, ``flashinfer``, ``triton``,
    ``<bf16 backend>_fp8``)."""
    runs = []
    for name in (b.strip() for b in str(opts["backends"]).split(",") if b.strip()):
        fmt = name.removeprefix("oscar_") if name.startswith("oscar_") else None
        if fmt is not None and fmt not in FORMATS:
            raise ValueError(f"backends: {name!r} names no served format; valid: "
                             f"{', '.join('oscar_' + f for f in FORMATS)}, flashinfer, triton, flashinfer_fp8")
        if fmt is not None:  # no page size, request slots or graph flags: the plugin's serving defaults choose
            runs.append(dict(name=name, backend="oscar", format=fmt, engine=[]))
        else:
            fp8 = name.endswith("_fp8")
            runs.append(dict(name=name, backend=name.removesuffix("_fp8"), format=None,
                             engine=["kv_cache_dtype=fp8_e4m3"] if fp8 else []))
    if not runs:
        raise ValueError("backends= is empty; e.g. backends=oscar_channel,flashinfer")
    return runs


def _ratios(opts: dict[str, Any]) -> list[float]:
    try:
        vals = [float(x) for x in str(opts["ratios"]).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"ratios={opts['ratios']!r}: expected comma-separated fractions in [0, 1)") from None
    if not vals or any(not 0 <= v < 1 for v in vals):
        raise ValueError(f"ratios={opts['ratios']!r}: expected comma-separated fractions in [0, 1)")
    return vals


def needs(opts: dict[str, Any]) -> list[host.Need]:
    _ratios(opts)
    if opts["reuse"] not in PREFIX_REUSE:
        raise ValueError(f"reuse={opts['reuse']!r}: one of {', '.join(PREFIX_REUSE)} (OSCAR_PREFIX_REUSE of the sweep "
                         "and profile)")
    if opts["defaults"]:
        _default_runs(opts)
    return oscar_engine_needs(opts)


def measure(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
    from oscar.bench.serving.timing_artifact import write_timing_artifact  # local: keeps torch out of `gpu --help`

    (out / "logs").mkdir(parents=True, exist_ok=True)
    rows = out / "prefix_rows.jsonl"
    rows.unlink(missing_ok=True)
    t0 = time.time()
    art = Path(tempfile.gettempdir()) / "oscar_timing_artifact"
    print(write_timing_artifact(model_dir(opts), art, mu=True, sink=int(opts["sink"]), recent=int(opts["recent"])),
          flush=True)
    go, ready = Path(tempfile.gettempdir()) / "oscar_prefix_go", Path(tempfile.gettempdir()) / "oscar_prefix_fi_ready"
    go.unlink(missing_ok=True)
    ready.unlink(missing_ok=True)
    sweep = [sys.executable, "-m", "oscar.bench.prefix.sweep", "--model-path", str(model_dir(opts)), "--out", str(rows),
             "--requests", str(opts["requests"]), "--input-len", str(opts["input_len"]), "--ratios",
             ",".join(f"{r:g}" for r in _ratios(opts)), "--check-hit"]
    extra = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "PYTHONUNBUFFERED": "1", "MAX_JOBS": "10"}  # flashinfer's JIT leaves cores to the engine that measures
    if opts["profile"]:
        _measure_profile(opts, out, env, sweep, extra, art)
        return
    if opts["defaults"]:
        _measure_defaults(opts, out, env, sweep, extra)
        return
    limit = int(opts["limit_s"])
    fi_log = open(out / "logs" / "prefix_bf16_flashinfer.log", "w")  # noqa: SIM115 - closed below
    fi = subprocess.Popen(sweep + ["--attention-backend", "flashinfer", "--tag", "bf16_flashinfer", "--wait-for",
                                   str(go), "--ready", str(ready), "--time-limit", str(limit - 45), "--engine", *ENGINE,
                                   "mem_fraction_static=0.45"], stdout=fi_log, stderr=subprocess.STDOUT,
                          env=host.sglang_env(extra))
    fi_log_path = out / "logs" / "prefix_bf16_flashinfer.log"
    for _ in range(120):  # the flashinfer engine's pool first: then the OSCAR engine sizes its own from what is left
        if fi.poll() is not None or "Memory pool end" in fi_log_path.read_text(errors="replace"):
            break
        time.sleep(1)
    print(f"flashinfer pool allocated at t={time.time() - t0:.0f} s; OSCAR starts", flush=True)
    oscar_limit = int(opts["oscar_limit_s"])
    with open(out / "logs" / "prefix_oscar.log", "w") as log:
        try:
            oscar_env = host.sglang_env(dict(extra, OSCAR_ARTIFACT=str(art), OSCAR_SINK=str(opts["sink"]),
                                             OSCAR_RECENT=str(opts["recent"]), OSCAR_PREFIX_REUSE=str(opts["reuse"])))
            rc: Any = subprocess.run(sweep + ["--attention-backend", "oscar", "--tag", "oscar", "--time-limit",
                                              str(oscar_limit - 30), "--engine", *ENGINE, "mem_fraction_static=0.80",
                                              "page_size=16"], stdout=log, stderr=subprocess.STDOUT,
                                     timeout=oscar_limit, env=oscar_env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"oscar exit {rc} at t={time.time() - t0:.0f} s; flashinfer ready: {ready.exists()}", flush=True)
    go.touch()
    try:
        fi_rc: Any = fi.wait(timeout=max(1, limit - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        fi.kill()
        fi_rc = "timeout"
    fi_log.close()
    print(f"flashinfer exit {fi_rc} at t={time.time() - t0:.0f} s", flush=True)
    env["runs"] = [{"name": "oscar", "rc": rc}, {"name": "bf16_flashinfer", "rc": fi_rc}]
    for name in ("oscar", "bf16_flashinfer"):
        for line in (out / "logs" / f"prefix_{name}.log").read_text(errors="replace").splitlines():
            if line.startswith("PREFIX_ROW") or "Traceback" in line or "Error" in line[:80]:
                print("   " + line[:300], flush=True)


def _measure_defaults(opts: dict[str, Any], out: Path, env: dict[str, Any], sweep: list[str],
                      extra: dict[str, str]) -> None:
    """``defaults=true``: each backend's engine alone at SGLang's defaults: its warm-up, then one prompt of
    ``input_len`` tokens cold and again hitting its cached prefix (the check row: TTFT of each, greedy tokens),
    the pool's capacity and the GPU memory in use after the long prompt."""
    from oscar.bench.serving.timing_artifact import write_timing_artifact  # local: keeps torch out of `gpu --help`

    i = sweep.index("--out")
    rows = out / DEFAULTS_ROWS  # this run's rows only
    rows.unlink(missing_ok=True)
    cmd = sweep[:i] + sweep[i + 2:]  # --out goes last, beside this run's own flags
    cmd[cmd.index("--ratios") + 1] = ""
    arts = Path(tempfile.gettempdir()) / "oscar_timing_artifacts"
    env["runs"] = []
    t0 = time.time()
    for run in _default_runs(opts):
        penv = dict(extra)
        if run["format"]:
            art = arts / run["format"]
            print(write_timing_artifact(model_dir(opts), art, mu=True, sink=int(opts["sink"]),
                                        recent=int(opts["recent"]), fmt=run["format"]), flush=True)
            penv.update(OSCAR_ARTIFACT=str(art), OSCAR_SINK=str(opts["sink"]), OSCAR_RECENT=str(opts["recent"]))
        with open(out / "logs" / f"prefill_{run['name']}.log", "w") as log:
            t1 = time.time()
            try:
                rc: Any = subprocess.run(cmd + ["--out", str(rows), "--attention-backend", run["backend"], "--tag",
                                                run["name"], "--gpu-memory", "--engine", *ENGINE_DEFAULTS,
                                                *run["engine"]],
                                         stdout=log, stderr=subprocess.STDOUT, timeout=int(opts["oscar_limit_s"]),
                                         env=host.sglang_env(penv)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        print(f"{run['name']}: exit {rc} after {time.time() - t1:.0f} s (t={time.time() - t0:.0f} s)", flush=True)
        env["runs"].append({"name": run["name"], "rc": rc, "wall_s": round(time.time() - t1, 1)})
        for line in (out / "logs" / f"prefill_{run['name']}.log").read_text(errors="replace").splitlines():
            if line.startswith("PREFIX_ROW") or "Traceback" in line or "Error" in line[:80]:
                print("   " + line[:400], flush=True)


def _measure_profile(opts: dict[str, Any], out: Path, env: dict[str, Any], sweep: list[str], extra: dict[str, str],
                     art: Path) -> None:
    """``profile=true``: the OSCAR engine alone with ``--profile`` (no sweep, no check row, no flashinfer engine);
    the traces packed into ``prefix_traces.tar.gz``."""
    import shutil
    import tarfile

    cmd = [x for x in sweep if x != "--check-hit"]
    cmd[cmd.index("--ratios") + 1] = ""
    oscar_env = host.sglang_env(dict(extra, OSCAR_ARTIFACT=str(art), OSCAR_SINK=str(opts["sink"]),
                                     OSCAR_RECENT=str(opts["recent"]), OSCAR_PROFILE_LABELS="1",
                                     OSCAR_PREFIX_REUSE=str(opts["reuse"])))
    t0 = time.time()
    with open(out / "logs" / "prefix_oscar.log", "w") as log:
        try:
            rc: Any = subprocess.run(cmd + ["--attention-backend", "oscar", "--tag", "oscar", "--profile", str(out),
                                            "--engine", *ENGINE, "mem_fraction_static=0.80", "page_size=16"],
                                     stdout=log, stderr=subprocess.STDOUT, timeout=int(opts["limit_s"]),
                                     env=oscar_env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"oscar exit {rc} at t={time.time() - t0:.0f} s", flush=True)
    env["runs"] = [{"name": "oscar", "rc": rc}]
    page, recent, n_in = 16, int(opts["recent"]), int(opts["input_len"])
    prefix = (n_in - recent) // page * page  # the hit's cached positions (the match capped at input_len - W, pages)
    bench = [sys.executable, "-m", "oscar.bench.prefix.extend_bench", "--bench", str(out / "prefix_extend_bench.json"),
             "--config", str(model_dir(opts) / "config.json"), "--prefix", str(prefix), "--n", str(n_in - prefix),
             "--sink", str(opts["sink"])]
    with open(out / "logs" / "prefix_extend_bench.log", "w") as log:  # one layer's extend by route (no engine)
        try:
            brc: Any = subprocess.run(bench, stdout=log, stderr=subprocess.STDOUT, timeout=120).returncode
        except subprocess.TimeoutExpired:
            brc = "timeout"
    print(f"extend bench exit {brc} at t={time.time() - t0:.0f} s", flush=True)
    env["runs"].append({"name": "extend_bench", "rc": brc})
    if (out / "traces").is_dir():
        with tarfile.open(out / "prefix_traces.tar.gz", "w:gz") as tar:
            tar.add(out / "traces", arcname="traces")
        shutil.rmtree(out / "traces")
    for line in (out / "logs" / "prefix_oscar.log").read_text(errors="replace").splitlines():
        if line.startswith("PREFIX_") or "Traceback" in line or "Error" in line[:80]:
            print("   " + line[:300], flush=True)


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
    if opts["defaults"]:
        return prefix_report.write_defaults(out / DEFAULTS_ROWS, out,
                                            env=host.read_env(out / "prefill_defaults_env.json"),
                                            notes=Path(opts["notes"]) if opts["notes"] else None)
    if opts["profile"]:
        return prefix_profile.rewrite(out, host.read_env(out / "prefix_profile_env.json"))
    rows = out / "prefix_rows.jsonl"
    if not rows.is_file():
        raise FileNotFoundError(f"{rows}: no rows (run `python -m oscar gpu prefix out={out}` on a GPU first)")
    return prefix_report.write_report([rows], out, env=host.read_env(out / "prefix_sweep_env.json"),
                                      notes=Path(opts["notes"]) if opts["notes"] else None)


def track(out: Path, opts: dict[str, Any], uri: str) -> str:
    import csv

    if opts["profile"] or opts["defaults"]:
        return "none (profile=true and defaults=true write their .md/.csv only)"

    with open(out / "prefix_sweep.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    cells = [mirror.Cell(f"{r['tag']}/r{r['ratio']}", {k: r[k] for k in ("cache", "backend", "ratio", "requests",
                                                                         "input_len", "device")},
                         {"perf.job_s": r["job_s"], "perf.job_tokens_per_s": r["job_tokens_per_s"],
                          "perf.ttft_mean_s": r["ttft_mean_s"], "perf.cached_tokens": r["cached_tokens"]},
                         {"oscar.status": str(r["status"])}) for r in rows]
    files = [out / f for f in ("prefix_sweep.md", "prefix_sweep.csv", "prefix_sweep.png", "prefix_rows.jsonl",
                               "prefix_sweep_env.json")]
    return mirror.mirror("prefix", cells, files, host.read_env(out / "prefix_sweep_env.json"), uri)

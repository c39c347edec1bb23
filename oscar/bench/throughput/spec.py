"""The throughput table (``python -m oscar gpu throughput``): end-to-end decode steps of random-weight models.

The fused, compiled decode step (``oscar.models.fused_step``) with the BF16 static cache and the paged OSCAR
formats, and the transformers forward (HF eager + graph) as the second baseline, at the committed table's points
(Qwen3-8B: batch 1 at 4k and 100k, batch 8 at 32k, batch 32 at 100k; fit searched up to batch 32). The one command
of this measurement. The measuring is ``oscar.bench.throughput.run`` (Hydra-composed, ``experiment=throughput``;
``points=`` empty: the experiment's batches x contexts); ``overrides=`` passes more Hydra overrides, ``budget_gb=``
the memory budget of fit and job. If the compiled step fails (a torch.compile problem on the host), the
grid reruns uncompiled (``compile=false``, labelled ``fused``). Files: ``grid.csv``, ``check.csv``, ``fit.csv``,
``job.csv``, ``kernels.csv``, ``env.json``, ``throughput.{md,png}`` under ``out`` (default reports/throughput).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oscar.bench import host
from oscar.bench.throughput import options
from oscar.bench.throughput import report as throughput_report

AREA = "throughput"
SUMMARY = "end-to-end decode step (fused, compiled) and tokens/s: OSCAR formats vs the BF16 static cache"
DEFAULTS: dict[str, Any] = {
    "models": "qwen3-8b",
    "caches": "bf16,oscar",
    "hf_caches": "bf16",
    "points": "1x4096,1x100000,8x32000,32x100000",
    "parts": "check,grid,fit,job",
    "reps": 8,
    "layout": "auto",
    "budget_gb": 0.0,  # memory budget of fit and job in GiB (0: the device's memory)
    "overrides": "experiment.extra.profile.speedup_contexts=[] experiment.extra.profile.job_batches=[32] "
                 "experiment.extra.profile.fit_max_batch=32",
}


def stem(opts: dict[str, Any]) -> str:
    return "throughput"


def needs(opts: dict[str, Any]) -> list[host.Need]:
    options.check(opts)
    return [host.cuda_device(), host.python_modules(["omegaconf", "hydra"], "configuration",
                                                    f"offline: the wheels of {host.ROUTES}"),
            host.python_modules(["transformers"], "model architectures", "install transformers"),
            host.free_gpu_memory(60.0)]


def _run(opts: dict[str, Any], out: Path, compile_step: bool, command: str | None = None) -> None:
    """One ``oscar.bench.throughput.run.run`` over the table's points (``command``: the line ``env.json`` records)."""
    from oscar.bench.throughput.run import Settings, run  # local: keeps torch and omegaconf out of `gpu --help`
    from oscar.config import compose  # local: keeps omegaconf out of `gpu --help`

    parts = str(opts["parts"])
    if not compile_step:  # the uncompiled rerun leaves the check (it checks the compiled step) out
        parts = ",".join(p for p in parts.split(",") if p != "check")
    flags = dict(options.FLAGS, models=opts["models"], caches=opts["caches"], hf_caches=opts["hf_caches"],
                 points=opts["points"], parts=parts, reps=int(opts["reps"]), layout=opts["layout"],
                 budget_gb=str(opts["budget_gb"]), compile=compile_step)
    cfg = compose(["experiment=throughput", "tracking.enabled=false", *str(opts["overrides"]).split()])
    run(cfg, Settings(cfg, flags), out, command)


def measure(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
    try:
        _run(opts, out, compile_step=True, command=env.get("command"))
    except Exception as exc:  # noqa: BLE001 - torch.compile fails in many ways; the uncompiled step still measures
        print(f"compiled run failed ({type(exc).__name__}: {str(exc)[:300]}): rerunning the grid with compile=false",
              flush=True)
        env["compile_failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        _run(opts, out, compile_step=False, command=env.get("command"))


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
    if not (out / "grid.csv").is_file():
        raise FileNotFoundError(f"{out / 'grid.csv'}: no rows (run `python -m oscar gpu throughput out={out}` on a GPU "
                                "first)")
    return list(throughput_report.write_report(out))


def track(out: Path, opts: dict[str, Any], uri: str) -> str:
    return str(throughput_report.track(out, uri, experiment="throughput")["parent_run_id"])

"""`python -m oscar profile [experiment=throughput] [overrides] [flags]`: end-to-end decode throughput on a GPU.

Random-weight models of real architectures (the `models` of the experiment, sizes from
`experiment.extra.profile.architectures`) decode end to end on CUDA (embeddings, every layer, LM
head, sampling), each step captured in one CUDA graph, with the static BF16 cache (torch SDPA; cuDNN
or flash and the GQA layout, whichever is fastest in the same run) and the paged OSCAR formats of the
experiment's `methods` through the project's kernels (`oscar.cache.device_cache`). Every cache runs the
fused, compiled decode step (`oscar.models.fused_step`); the caches of `hf_caches=` (default `bf16`) also run
the transformers forward ("HF eager + graph"), a second, labelled baseline. `layout=` `auto` (default:
INT2 with one group per row in the fragment-order pages read by the v9 CUDA kernel, other formats in row
pages read by the Triton kernel), `rows` or `mma`; each row records its layout, kernel and step path.

Parts (`parts=`): `check` (tiny model: greedy tokens on CUDA against the CPU host-cache path, KL to
the uncached forward against the CPU interval), `grid` (step time, the byte floor and its GEMM /
attention / quantize+demote / other split at every batch x context, or at the `points=` given as
`BxT,...`; OOM points kept), `fit` (largest batch at the job context per cache), `job` (tokens/s at
the job context under one memory budget). The warm prefix is random codes / values of the right shapes
(exact for timing; no 100k-token prefill).

Writes under `output_dir` (default reports/throughput): `grid.csv`, `check.csv`, `fit.csv`,
`job.csv`, `kernels.csv`, `env.json`, then `throughput.md` and `throughput.png`, and mirrors the
rows into MLflow when tracking is enabled and mlflow is installed. `report_only=true` rebuilds the
Markdown, the figure and the MLflow runs from the CSVs; `tiny=true` runs every part on a tiny
architecture (on the CPU: eager timing, no kernel split, the fused step uncompiled), which is what the
tests do. The measuring lives in `oscar.bench.throughput.run`, the report in `oscar.bench.throughput.report`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from oscar.bench.throughput import report
from oscar.bench.throughput.run import FLAGS, Settings, run
from oscar.commands._stage import pop_flags
from oscar.config import compose


def main(argv: list[str]) -> int:
    """Compose the configuration, measure (unless ``report_only``), write the report, mirror to MLflow."""
    try:
        flags, overrides = pop_flags(argv, FLAGS)
        if not any(o.split("=")[0].lstrip("+") == "experiment" for o in overrides):
            overrides = ["experiment=throughput", *overrides]
        cfg = compose(overrides)
        s = Settings(cfg, flags)
    except ValueError as exc:
        print(f"profile: {exc}", file=sys.stderr)
        return 2
    out = Path(flags["output_dir"])
    if not flags["report_only"]:
        try:
            run(cfg, s, out)
        except RuntimeError as exc:
            print(f"profile: {exc}", file=sys.stderr)
            return 2
    paths = report.write_report(out)
    print("wrote " + ", ".join(str(p) for p in paths))
    if bool(cfg.tracking.enabled):
        try:
            receipt = report.track(out, str(cfg.tracking.uri), experiment=str(cfg.experiment.name))
            print(f"MLflow: experiment {receipt['experiment']}, {len(receipt['children'])} runs")
        except ImportError:
            print("MLflow is not installed here: tracking skipped (rerun with report_only=true where it is)")
    return 0

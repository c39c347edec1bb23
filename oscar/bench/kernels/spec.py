"""The kernel table (``python -m oscar gpu kernels``): paged decode attention against BF16 SDPA, one process.

Times, in one run on the same GPU: a large device-to-device copy (the bandwidth ceiling), torch SDPA BF16
decode attention with the cuDNN and flash backends (the baseline: the best of the two per shape), and the
paged quantized decode attention over its three segments (BF16 sink + quantized pages + BF16 recent) through
``oscar.cache.paged.decode_attention`` for each variant (``VARIANTS``: INT2 and INT4 in the fragment-order
pages read by the CUDA kernel, INT2 with rope-centered keys, INT4 in row pages read by the Triton kernel),
then the demotion of one token per sequence and the prefill quantization. Every column of a row is timed on
the same random codes (valid in both page layouts); each timing replays a CUDA graph that holds one call per
input set, the sets together several times the L2, and reports the median per call (``time_calls``). Before
timing, each variant is checked against the float32 dequantize-then-attend twin (relative error per head).

Files under ``out`` (``stem`` = ``name=``, default ``decode_attention``): ``<stem>_rows.csv`` (one row per shape
and variant, rewritten after every shape), ``<stem>_quantize.csv``, ``<stem>_env.json`` (hardware, command,
accuracy); ``report`` turns them into ``<stem>.csv`` (one row per shape), ``<stem>.md`` and ``<stem>.png``.

This module is the table's light spec (options, requirements, the steps ``oscar.bench.tables`` runs); the measuring
is ``oscar.bench.kernels.timing`` (torch, imported when the table measures), the report
``oscar.bench.kernels.report``, the variants and option checks ``oscar.bench.kernels.options``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oscar.bench import host
from oscar.bench.kernels import report as kernel_report
from oscar.bench.kernels.options import check_options, variants

AREA = "kernels"
SUMMARY = "paged INT2/INT4 decode attention vs cuDNN/flash BF16 SDPA, demotion and prefill quantization"
DEFAULTS: dict[str, Any] = {
    "name": "decode_attention",
    "head_dims": "128,64",
    "batches": "1,8,32,128",
    "contexts": "4096,32768,131072",
    "variants": "int2,int2_rope,int4,int4_rows",
    "launch": "",  # more variants: NAME:{"bits": 2, "layout": "mma", <MmaLaunch or RowsLaunch fields>};NAME:{...}
    "parts": "attention,quantize",
    "check": True,
    "budget_s": 0,  # stop before the next shape once this many seconds have passed (0: no limit)
    "reps": 20,
    "q_heads": 32,
    "kv_heads": 8,
    "sink": 64,
    "recent": 256,
    "page_size": 64,
    "mem_gb": 120,
    "l2_factor": 4,
    "layer_weight_mb": 385.9,  # one Qwen3-8B layer's BF16 weights (the demotion's share of a layer step)
    "notes": "",  # Markdown appended to the report (the reading of the run)
}


def stem(opts: dict[str, Any]) -> str:
    return str(opts["name"])


def needs(opts: dict[str, Any]) -> list[host.Need]:
    check_options(opts)
    return [host.cuda_device(), host.python_modules(["triton"], "the kernels", "install triton (the GPU image has it)"),
            host.free_gpu_memory(min(float(opts["mem_gb"]), 20.0))]


def measure(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
    """Time every shape x variant (and the quantization kernels); raw rows to ``<stem>_rows.csv``."""
    from oscar.bench.kernels import timing  # local: keeps torch out of `gpu --help`

    check_options(opts)
    timing.measure(opts, out, env, variants(opts), stem(opts))


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
    return kernel_report.write_report(out, opts)


def track(out: Path, opts: dict[str, Any], uri: str) -> str:
    return kernel_report.track(out, opts, uri)

"""The decode-step profile of the serving table, from a ``torch.profiler`` chrome trace: GPU time per part of the step.

Kernels launched inside the ranges ``oscar.bench.serving.synthetic.label_ranges`` wraps around the plugin's calls
(``oscar.write``, ``oscar.windows``: the gather of the batch's sink/ring rows, ``oscar.attention``, ``oscar.fold``,
``oscar.metadata``) are attributed to them through the trace's launch/kernel correlation ids; the others by kernel
name (``kernel_category``). Plain Python (no torch): the report and the prefix profile read traces with it anywhere.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Optional

LABELS = ("oscar.metadata", "oscar.write", "oscar.windows", "oscar.attention", "oscar.fold")
# by kernel name, first match wins (lower case)
CATEGORIES = (
    ("norm", r"norm"),
    ("rope", r"rotary|rope|pos_enc"),
    ("activation", r"silu|gelu|act_and_mul"),
    ("attention", r"flashinfer|batchdecode|batchprefill|decode_attn|_fwd_kernel|fwd_grouped|attention|mma_decode|"
                  r"decode_mma|split_kv|merge_state"),
    ("kv_write", r"store_kv|set_kv|kv_buffer|quantize|pack"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|splitk|sm90_|wgmma"),
    ("sampling", r"argmax|sampl|softmax|topk|top_k|logit"),
    ("copy_index", r"copy|index|gather|scatter|fill|arange|cat_|where|elementwise|vectorized|reduce|memcpy|memset"),
)


def kernel_category(name: str) -> str:
    """The part of a decode step a GPU kernel belongs to, by its name (``other`` when nothing matches)."""
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def attribute_kernels(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """GPU kernels (and memcpy/memset) of a chrome trace with their part of the step: the innermost
    ``LABELS`` range around the CPU launch of the kernel (same correlation id), else ``kernel_category``.
    Each item: ``name``, ``dur_us``, ``part``."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") in LABELS]
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = e
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        part: Optional[str] = None
        launch = launches.get((e.get("args") or {}).get("correlation"))
        if launch is not None:
            t, tid = float(launch["ts"]), launch.get("tid")
            inside = [r for r in ranges if (r.get("pid"), r.get("tid")) == (launch.get("pid"), tid)
                      and float(r["ts"]) <= t <= float(r["ts"]) + float(r["dur"])]
            if inside:
                part = min(inside, key=lambda r: float(r["dur"]))["name"]
        out.append(dict(name=str(e["name"]), dur_us=float(e.get("dur", 0.0)), part=part or kernel_category(str(e["name"]))))
    return out


def summarize(kernels: list[dict[str, Any]], steps: int) -> dict[str, dict[str, float]]:
    """GPU ms per step and kernel launches per step of each part."""
    acc: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "kernels": 0.0})
    for k in kernels:
        acc[k["part"]]["ms"] += k["dur_us"] / 1e3 / steps
        acc[k["part"]]["kernels"] += 1.0 / steps
    return dict(acc)


def top_kernels(kernels: list[dict[str, Any]], steps: int, n: int = 25) -> list[dict[str, Any]]:
    """The ``n`` kernel names with the most GPU time per step, with their part."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for k in kernels:
        a = acc[(k["name"], k["part"])]
        a[0] += k["dur_us"] / 1e3 / steps
        a[1] += 1.0 / steps
    rows = [dict(name=name[:160], part=part, ms=ms, calls=calls) for (name, part), (ms, calls) in acc.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:n]


__all__ = ["CATEGORIES", "LABELS", "attribute_kernels", "kernel_category", "summarize", "top_kernels"]

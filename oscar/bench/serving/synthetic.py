"""Synthetic-state decode timing and the decode-step profile of ``python -m oscar.bench.serving.one_batch``.

Real prefill of 32 x 100k tokens of an 8B model takes minutes, so the decode grid of the serving table is
timed on a *synthetic state*, the same for every row and every backend:

- the batch's requests get their request slots and token slots from SGLang's own allocator and
  ``req_to_token`` (``ScheduleBatch.prepare_for_extend``, exactly what a real prefill allocates), but the
  model's forward is not run;
- the KV pool holds random valid data in every slot, written once per process (``fill_pool``): BF16
  ``randn`` in SGLang's K/V buffers; for the OSCAR pool random codes (every byte is a valid packed code),
  scales in ``[0.02, 0.1)`` with ``zero = -1.5 * scale`` and ``randn`` BF16 sink/recent windows;
- the decode steps then run as ``bench_one_batch``'s do (``prepare_for_decode``, ``ModelRunner.forward``:
  the CUDA-graph replay, sampling), timed the same way.

A decode step's time does not depend on the values it reads (dummy weights anyway), so this gives the
decode ms at every (batch, context) that fits in the pool; the real prefill-then-decode rows at batch 1
cross-check it in the same process.

The profile helpers turn a ``torch.profiler`` chrome trace into GPU time per part of the step: kernels
launched inside the ranges ``label_ranges`` wraps around the plugin's calls (``oscar.write``,
``oscar.windows``: the gather of the batch's sink/ring rows, ``oscar.attention``, ``oscar.fold``,
``oscar.metadata``) are attributed to them through the trace's
launch/kernel correlation ids; the others by kernel name (``kernel_category``).
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from typing import Any, Iterator, Optional

import torch

SCALE_RANGE = (0.02, 0.1)


def fill_pool(pool: Any, seed: int = 0) -> str:
    """Random valid contents in every token slot of an SGLang KV pool (see the module docstring); returns
    which kind of pool it filled (``oscar`` or ``bf16``)."""
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    if hasattr(pool, "k_pages"):  # OscarTokenToKVPool
        lo, hi = SCALE_RANGE
        for pages in (*pool.k_pages, *pool.v_pages):
            pages.codes.random_(0, 256, generator=gen)
            pages.scale.uniform_(lo, hi, generator=gen)
            torch.mul(pages.scale, -1.5, out=pages.zero)
        for w in (*pool.win_k, *pool.win_v):
            w.normal_(generator=gen)
        return "oscar"
    if getattr(pool, "k_buffer", None) is None:
        raise TypeError(f"fill_pool: {type(pool).__name__} has neither OSCAR pages nor SGLang's k_buffer/v_buffer")
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.normal_(generator=gen)
    return "bf16"


def fits(capacity: int, batch: int, context: int, output_len: int) -> bool:
    """Whether ``batch`` requests of ``context + output_len`` tokens fit a pool of ``capacity`` tokens (the
    rule of ``bench_one_batch``'s ``max_batch_size``)."""
    return batch <= capacity // (context + output_len)


# -- profile ---------------------------------------------------------------------------------------

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


@contextlib.contextmanager
def label_ranges(backend: Any) -> Iterator[None]:
    """Wrap the plugin's decode calls of ``backend`` (an ``OscarAttnBackend``; anything else: no labels) in
    ``torch.profiler.record_function`` ranges named as ``LABELS`` while the block runs (eager profile only:
    CUDA-graph replays record no CPU ranges)."""
    from torch.profiler import record_function

    if not hasattr(backend, "pool") or not hasattr(backend.pool, "write_decode"):
        yield
        return
    def wrap(fn: Any, label: str) -> Any:
        def inner(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)
        return inner

    pool = backend.pool
    methods = dict(init_forward_metadata="oscar.metadata", _window_segments="oscar.windows", _to_folded="oscar.fold")
    saved = {name: getattr(backend, name) for name in methods}
    fmt_cls = type(pool.format)  # the served format's read path (frozen values: wrapped on the class)
    saved_write, saved_attn = pool.write_decode, fmt_cls.attend
    for name, label in methods.items():
        setattr(backend, name, wrap(saved[name], label))
    pool.write_decode = wrap(saved_write, "oscar.write")
    fmt_cls.attend = wrap(saved_attn, "oscar.attention")
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(backend, name, fn)
        pool.write_decode, fmt_cls.attend = saved_write, saved_attn


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


__all__ = ["CATEGORIES", "LABELS", "attribute_kernels", "fill_pool", "fits", "kernel_category", "label_ranges",
           "summarize", "top_kernels"]

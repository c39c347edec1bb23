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

For the step profile, ``label_ranges`` wraps the plugin's calls in ``torch.profiler`` ranges; reading the trace
back into GPU time per part of the step is ``oscar.bench.serving.trace``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

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
        if buf.element_size() == 1:  # an FP8 cache (SGLang stores it as uint8): normal values cast to its dtype
            dtype = getattr(pool, "dtype", torch.float8_e4m3fn)
            for part in buf.split(1 << 16):
                part.copy_(torch.randn(part.shape, generator=gen, device=part.device).to(dtype).view(buf.dtype))
        else:
            buf.normal_(generator=gen)
    return "bf16"


def fits(capacity: int, batch: int, context: int, output_len: int) -> bool:
    """Whether ``batch`` requests of ``context + output_len`` tokens fit a pool of ``capacity`` tokens (the
    rule of ``bench_one_batch``'s ``max_batch_size``)."""
    return batch <= capacity // (context + output_len)


# -- profile ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def label_ranges(backend: Any) -> Iterator[None]:
    """Wrap the plugin's decode calls of ``backend`` (an ``OscarAttnBackend``; anything else: no labels) in
    ``torch.profiler.record_function`` ranges named as ``oscar.bench.serving.trace.LABELS`` while the block runs
    (eager profile only: CUDA-graph replays record no CPU ranges)."""
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


__all__ = ["fill_pool", "fits", "label_ranges"]

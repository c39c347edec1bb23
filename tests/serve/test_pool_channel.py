"""Per-channel key pages in the SGLang pool (CPU, torch twins): the ring of W to W + T - 1 rows, write-through by
blocks, CUDA-graph metadata, chunked prefill, the radix rule, and per-channel artifacts served end to end.

Without an engine (the pool and backend on SGLang pages, rotations with ``k_block = T``):

- The pool against the embedded engine's torch cache layer of the same rotations (``OscarLayer`` with
  ``k_block``): after a prefill and decode steps across several block boundaries, every step's decode attention
  agrees within bf16 rounding of the output (both quantize the same BF16 rows per channel over the same blocks;
  float reduction orders differ), and the pool's cached rows are exactly the BF16 sink, the ``W .. W + T - 1``
  newest BF16 rows, and quantized blocks up to ``S0 + T * floor((n - W) / T)``.
- The CUDA-graph metadata (fixed buffers, padded entries) equals the eager metadata, and the fixed-shape decode
  write (every entry writes a block; the others into the padding page) leaves the same pages and windows as the
  eager one.
- Chunked prefill (chunks that end inside blocks) leaves the pool as one extend does (exact: the same rows through
  the same quantizer).
- A mixed artifact (per-token and per-channel layers) keeps per-layer lengths.
- Radix: a hit on a page-aligned prefix (whole blocks) reads the donor's blocks as they were written.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oscar.cache.attention import take_pending
from oscar.cache.formats import ChannelKeyFormat, RotatedFormat
from oscar.cache.torch_cache import LayerRotations, OscarCache
from oscar.kernels.segments import Segments
from oscar.serve.settings import OscarServeError, ServeSettings

HKV, H, D = 2, 4, 64


def _rotations(gen: torch.Generator, block: int) -> LayerRotations:
    orth = lambda: torch.linalg.qr(torch.randn(HKV, D, D, generator=gen))[0]  # noqa: E731
    return LayerRotations(orth(), orth(), 0.1 * torch.randn(HKV, D, generator=gen), None, k_block=block)


def _state(sink: int, recent: int, blocks: list[int], prefix_cache: bool = False) -> dict:
    gen = torch.Generator().manual_seed(0)
    return dict(settings=ServeSettings(artifact=Path("unused"), sink=sink, recent=recent, kernels="torch"),
                rotations=[_rotations(gen, t) for t in blocks], prefix_cache=prefix_cache, format=_format(sink, recent, blocks),
                fold=True)


def _format(sink: int, recent: int, blocks: list[int]):
    sizes = sorted(set(blocks) - {0})
    if not sizes:
        return RotatedFormat(name="oscar", bits=2, group_size=D, sink=sink, recent=recent)
    return ChannelKeyFormat(name="auto", bits=2, group_size=D, sink=sink, recent=recent, page_size=sizes[0],
                            key_block=sizes[0], layer_blocks=tuple(blocks))


def _pool(sink: int, recent: int, blocks: list[int], page: int, size: int = 1024, prefix_cache: bool = False):
    from oscar.serve.pool import OscarTokenToKVPool

    pool = OscarTokenToKVPool(size, page, torch.bfloat16, HKV, D, len(blocks), "cpu", False,
                              oscar_state=_state(sink, recent, blocks, prefix_cache), oscar_layout="rows")
    pool.bind_requests(4)
    return pool


def _req_to_token(lengths: dict[int, int], page: int, size: int = 1024, ctx: int = 512, seed: int = 0):
    """SGLang-style token slots: whole pages per request (scattered page ids, page 0 reserved for padding)."""
    gen = torch.Generator().manual_seed(seed)
    r2t = torch.zeros(4, ctx, dtype=torch.int32)
    pages = (torch.randperm(size // page - 1, generator=gen) + 1).tolist()
    for r, n in lengths.items():
        for j in range(math.ceil(n / page)):
            p = pages.pop()
            r2t[r, j * page : (j + 1) * page] = torch.arange(p * page, (p + 1) * page, dtype=torch.int32)
    return r2t


def _rows(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16),
            torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16))


def _decode_step(pool, r2t, r: int, L: int, k: torch.Tensor, v: torch.Tensor, layers=(0,)):
    """One decode step of request slot ``r`` reaching length ``L`` (rows ``k``/``v`` ``[1, Hkv, d]``), as the backend
    writes it; returns the metadata."""
    from oscar.serve.backend import decode_metadata

    loc = r2t[r, L - 1 : L].long()
    meta = decode_metadata(pool, r2t, torch.tensor([r]), torch.tensor([L]), loc)
    for i in layers:
        pool.write_decode(i, k, v, loc, meta.req, meta.col, meta.pos, blocks=meta.blocks)
    return meta


def _attend(pool, meta, q: torch.Tensor, i: int = 0) -> torch.Tensor:
    from test_pool_paged import _backend

    be = _backend(pool, None)
    int_len, _ = pool.lengths(i, meta.int_len, meta.recent_len, meta.blocks)
    segments = Segments(meta.page_table, int_len, **be._window_segments(meta, i))
    return pool.format.attend(q, (pool.k_pages[i], pool.v_pages[i]), segments, pool.transforms[i], sm_scale=D**-0.5,
                              output_frame="original", backend="torch").float()


def _torch_step(layer, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Decode attention ``[H, d]`` of ``q`` through the torch cache layer, which then stores ``k``/``v``."""
    module = SimpleNamespace(num_key_value_groups=H // HKV, training=False, is_causal=True)
    key, value = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, 1, d]
    layer.update(key, value)
    assert take_pending(key) is layer
    return layer.attend_and_write(module, q[None, :, None, :], key, value, None, D**-0.5)[0, :, 0].float()


def _prefill(pool, r2t, r: int, k: torch.Tensor, v: torch.Tensor, start: int, end: int, layers=(0,)) -> None:
    """An extend of positions ``[start, end)`` of request slot ``r`` written as the backend writes it."""
    n = end - start
    for i in layers:
        pool.write(i, k[start:end], v[start:end], r2t[r, start:end].long(), torch.full((n,), r),
                   torch.arange(start, end), torch.full((n,), end))


@pytest.mark.parametrize("sink,recent,blocks,page,prompt", [
    (16, 32, [16], 16, 90),  # m = 2 block slots, pages of one block
    (0, 64, [32], 32, 70),  # KIVI-2's geometry: no sink, residual 64, blocks of 32
    (32, 32, [32], 32, 45),  # m = 1: every completed block releases the previous one
    (32, 32, [0, 16], 32, 61),  # mixed: a per-token layer beside a per-channel one, two blocks per page
])
def test_decode_steps_across_blocks_agree_with_the_torch_cache(sink, recent, blocks, page, prompt):
    gen = torch.Generator().manual_seed(1)
    block = max(blocks)
    steps = 3 * block + 5  # three blocks released during decode
    layers = tuple(range(len(blocks)))
    pool = _pool(sink, recent, blocks, page)
    assert [pool.ring_size(i) for i in layers] == [recent + max(t - 1, 0) for t in blocks]
    L_end = prompt + steps
    r2t = _req_to_token({1: L_end}, page)
    k, v = _rows(L_end, gen)
    _prefill(pool, r2t, 1, k, v, 0, prompt, layers)
    cache = OscarCache(pool.format.cache_spec(pool.rotations), len(blocks))
    for i in layers:
        cache.layers[i].write_rows(k[:prompt].transpose(0, 1)[None], v[:prompt].transpose(0, 1)[None])
    worst = 0.0
    for s in range(steps):
        L = prompt + s + 1
        meta = _decode_step(pool, r2t, 1, L, k[L - 1 : L], v[L - 1 : L], layers)
        n = L - sink
        for i, t in enumerate(blocks):
            q = torch.randn(1, H, D, generator=gen).to(torch.bfloat16)
            out = _attend(pool, meta, q, i)[0]
            ref = _torch_step(cache.layers[i], k[L - 1 : L], v[L - 1 : L], q[0])
            worst = max(worst, ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item())
            int_len, recent_len = pool.lengths(i, meta.int_len, meta.recent_len, meta.blocks)
            expect = max(0, (n - recent) // t * t) if t else max(0, n - recent)
            assert (int(int_len), int(recent_len)) == (expect, n - expect), (i, L)
            if t and n >= recent:
                assert recent <= n - expect <= recent + t - 1
    assert worst < 2e-2, worst  # both outputs rounded to bf16 (2^-8 relative per element)
    # what the pool holds: BF16 sink and ring rows exactly, the blocks quantized (INT2: not exact, not garbage)
    for i, t in enumerate(blocks):
        ck, cv = pool.cached_rows(i, r2t, 1, L_end)
        q_end = sink + (max(0, (L_end - sink - recent) // t * t) if t else L_end - sink - recent)
        assert pool.quantized_end(i, L_end) == q_end
        assert torch.equal(ck[:, :sink], k[:sink].transpose(0, 1).float())
        assert torch.equal(ck[:, q_end:], k[q_end:].transpose(0, 1).float())
        assert torch.equal(cv[:, q_end:], v[q_end:].transpose(0, 1).float())
        for got, ref in ((ck, k), (cv, v)):
            mid, exact = got[:, sink:q_end], ref[sink:q_end].transpose(0, 1).float()
            rel = ((mid - exact).norm(dim=-1) / exact.norm(dim=-1)).mean().item()
            assert 0.05 < rel < 0.6, rel

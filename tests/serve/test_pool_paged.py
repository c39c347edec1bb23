"""The plugin's pool and backend on SGLang pages of 16 tokens, without an engine (CPU, torch twins).

- Decode metadata built for CUDA graphs (fixed buffers, padded entries) equals the eager metadata, and the
  page table is every 16th column of ``req_to_token`` from the sink on (exact: integer ops).
- Write-through: after a prefill and decode steps the BF16 windows hold exactly the rows of the sink and
  the recent window, and the pages hold every quantized row (dequantized within the INT2 error).
- A decode step through the backend equals attention over the rows the cache holds (exact-ish: the
  same dequantized values in float32 on both sides; tolerance 2e-3 relative for bf16 outputs).
- Chunked prefill: a prompt extended in three chunks gives the outputs of one extend while the windows
  cover the prompt (the same BF16 rows; SDPA over a longer masked key set: float reduction order only).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oscar.cache.formats import RotatedFormat

from oscar.cache import paged
from oscar.cache.torch_cache import LayerRotations
from oscar.serve.settings import ServeSettings

HKV, H, D, PAGE = 2, 4, 64, 16


def _orth(gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(HKV, D, D, generator=gen))[0]


def _state(sink: int, recent: int, layers: int = 1) -> dict:
    gen = torch.Generator().manual_seed(0)
    rots = [LayerRotations(_orth(gen), _orth(gen), 0.1 * torch.randn(HKV, D, generator=gen), None) for _ in range(layers)]
    return dict(settings=ServeSettings(artifact=Path("unused"), sink=sink, recent=recent, kernels="torch"),
                rotations=rots, format=RotatedFormat(name="oscar", bits=2, group_size=D, sink=sink, recent=recent), fold=True)


def _pool(sink: int, recent: int, size: int = 512, layout: str = "mma"):
    from oscar.serve.pool import OscarTokenToKVPool

    pool = OscarTokenToKVPool(size, PAGE, torch.bfloat16, HKV, D, 1, "cpu", False,
                              oscar_state=_state(sink, recent), oscar_layout=layout)
    pool.bind_requests(4)
    return pool


def _req_to_token(lengths: dict[int, int], ctx: int = 256, seed: int = 0) -> torch.Tensor:
    """SGLang-style token slots: whole pages per request (scattered page ids, page 0 reserved for padding)."""
    gen = torch.Generator().manual_seed(seed)
    r2t = torch.zeros(4, ctx, dtype=torch.int32)
    pages = (torch.randperm(512 // PAGE - 1, generator=gen) + 1).tolist()
    for r, n in lengths.items():
        for j in range(math.ceil(n / PAGE)):
            page = pages.pop()
            r2t[r, j * PAGE : (j + 1) * PAGE] = torch.arange(page * PAGE, (page + 1) * PAGE, dtype=torch.int32)
    return r2t


def test_graph_metadata_equals_eager_with_padding():
    from oscar.serve.backend import DecodeMeta, decode_metadata

    pool = _pool(sink=16, recent=32)
    r2t = _req_to_token({0: 200, 2: 40, 3: 17})
    req = torch.tensor([2, 0, 3, 0, 0])
    seq = torch.tensor([40, 200, 17, 1, 1])
    loc = torch.tensor([int(r2t[2, 39]), int(r2t[0, 199]), int(r2t[3, 16]), 0, 0])  # two padded entries
    eager = decode_metadata(pool, r2t, req[:3], seq[:3], loc[:3])
    cols = pool.page_columns(r2t).shape[1]
    bufs = DecodeMeta(req=torch.zeros(8, dtype=torch.int64), win_row=torch.zeros(8, dtype=torch.int32),
                      col=torch.zeros(8, dtype=torch.int64),
                      sink_len=torch.zeros(8, dtype=torch.int32), recent_len=torch.zeros(8, dtype=torch.int32),
                      int_len=torch.zeros(8, dtype=torch.int32), page_table=torch.zeros(8, cols, dtype=torch.int32))
    graph = decode_metadata(pool, r2t, req, seq, loc, out=bufs)
    for name in ("req", "win_row", "col", "sink_len", "recent_len", "int_len", "page_table"):
        assert torch.equal(getattr(graph, name)[:3], getattr(eager, name)), name
    assert graph.req[3:].tolist() == [pool.pad_slot] * 2 and graph.int_len[3:].tolist() == [0, 0]
    assert graph.win_row.dtype == torch.int32 and torch.equal(graph.win_row[:5].long(), graph.req[:5])
    assert eager.int_len.tolist() == [0, 200 - 16 - 32, 0]
    assert eager.sink_len.tolist() == [16, 16, 16] and eager.recent_len.tolist() == [24, 32, 1]
    assert eager.col.tolist() == [16 + (39 - 16) % 32, 16 + (199 - 16) % 32, 16 + 0]
    # quantized token t of request 0 is token t % 16 of page req_to_token[0, 16 + t] // 16
    t = torch.arange(200 - 48)
    assert torch.equal(eager.page_table[1, t // PAGE].long() * PAGE + t % PAGE, r2t[0, 16 + t].long())


def _history(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16),
            torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16))


def _prefill_and_decode(pool, r2t, r: int, prompt: int, steps: int, gen: torch.Generator):
    k, v = _history(prompt + steps, gen)
    return k, v, write_history(pool, r2t, r, prompt, steps, k, v)


def write_history(pool, r2t, r: int, prompt: int, steps: int, k: torch.Tensor, v: torch.Tensor):
    """Rows ``k``/``v`` of request slot ``r``: ``prompt`` through ``write`` (a prefill), then ``steps`` decode rows
    through ``decode_metadata`` + ``write_decode`` at the metadata's positions, as the backend does; returns the last
    decode metadata."""
    from oscar.serve.backend import decode_metadata

    pool.write(0, k[:prompt], v[:prompt], r2t[r, :prompt].long(), torch.full((prompt,), r), torch.arange(prompt),
               torch.full((prompt,), prompt))
    meta = None
    for s in range(steps):
        L = prompt + s + 1
        loc = r2t[r, L - 1 : L].long()
        meta = decode_metadata(pool, r2t, torch.tensor([r]), torch.tensor([L]), loc)
        assert meta.pos.tolist() == [L - 1]
        pool.write_decode(0, k[L - 1 : L], v[L - 1 : L], loc, meta.req, meta.col, meta.pos, blocks=meta.blocks)
    return meta


@pytest.mark.parametrize("layout", ["mma", "rows"])
def test_write_through_windows_exact_pages_within_int2_error(layout):
    gen = torch.Generator().manual_seed(1)
    S0, W, prompt, steps = 16, 32, 90, 21
    pool = _pool(S0, W, layout=layout)
    r2t = _req_to_token({1: prompt + steps})
    k, v, _ = _prefill_and_decode(pool, r2t, 1, prompt, steps, gen)
    L = prompt + steps
    ck, cv = pool.cached_rows(0, r2t, 1, L)
    assert torch.equal(ck[:, :S0], k[:S0].transpose(0, 1).float())
    assert torch.equal(ck[:, L - W :], k[L - W :].transpose(0, 1).float())
    assert torch.equal(cv[:, L - W :], v[L - W :].transpose(0, 1).float())
    for got, ref in ((ck, k), (cv, v)):
        mid, exact = got[:, S0 : L - W], ref[S0 : L - W].transpose(0, 1).float()
        rel = ((mid - exact).norm(dim=-1) / exact.norm(dim=-1)).mean().item()
        assert 0.05 < rel < 0.6, rel  # INT2 with one group per row: quantized, and not garbage


def test_decode_over_pool_equals_attention_over_cached_rows():
    from oscar.serve.backend import decode_metadata

    gen = torch.Generator().manual_seed(2)
    S0, W = 16, 32
    pool = _pool(S0, W)
    lengths = {0: 150, 3: 70}
    r2t = _req_to_token(lengths)
    for r, n in lengths.items():
        _prefill_and_decode(pool, r2t, r, n - 3, 3, gen)
    req = torch.tensor([3, 0])
    seq = torch.tensor([lengths[3], lengths[0]])
    meta = decode_metadata(pool, r2t, req, seq, torch.tensor([int(r2t[3, 69]), int(r2t[0, 149])]))
    q = torch.randn(2, H, D, generator=gen).to(torch.bfloat16)
    kt, vt = pool.transforms[0]
    segs = _backend(pool, r2t)._window_segments(meta, 0)  # the pool's window buffers, read in place by slot
    assert segs["recent_k"].data_ptr() == pool.win_k[0].data_ptr() + pool.sink * D * 2  # a view, no copy
    assert segs["window_rows"] is meta.win_row
    out = paged.decode_attention(q, pool.k_pages[0], pool.v_pages[0], paged.Segments(meta.page_table, meta.int_len, **segs),
                                 kt, vt, sm_scale=D**-0.5, output_frame="original", backend="torch").float()
    for b, (r, n) in enumerate(((3, 70), (0, 150))):
        ck, cv = pool.cached_rows(0, r2t, r, n)  # [HKV, n, D]
        qb = q[b].float().reshape(HKV, H // HKV, D)
        p = torch.softmax(torch.einsum("hrd,htd->hrt", qb, ck) * D**-0.5, dim=-1)
        ref = torch.einsum("hrt,htd->hrd", p, cv).reshape(H, D)
        rel = ((out[b] - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert rel < 2e-2, (b, rel)  # the output is rounded to bf16 (2^-8 relative per element)


class _Mode:
    def __init__(self, decode: bool) -> None:
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode

    def is_idle(self) -> bool:
        return False


def _backend(pool, r2t):
    from oscar.serve.backend import OscarAttnBackend

    be = OscarAttnBackend.__new__(OscarAttnBackend)
    be.pool, be.device, be.folded, be.graph, be.num_splits, be.meta = pool, "cpu", False, None, {}, None
    be.req_to_token_pool = SimpleNamespace(req_to_token=r2t)
    return be


def _extend(be, layer, q, k, v, r: int, prefix: int, n: int, r2t):
    fb = SimpleNamespace(forward_mode=_Mode(False), req_pool_indices=torch.tensor([r]),
                         seq_lens=torch.tensor([prefix + n]), seq_lens_cpu=torch.tensor([prefix + n]),
                         extend_seq_lens_cpu=[n], extend_prefix_lens_cpu=[prefix],
                         out_cache_loc=r2t[r, prefix : prefix + n].long())
    be.init_forward_metadata(fb)
    return be.forward_extend(q, k, v, layer, fb)


def test_chunked_prefill_equals_one_extend_while_windows_cover():
    gen = torch.Generator().manual_seed(3)
    n = 60
    q = torch.randn(n, H * D, generator=gen).to(torch.bfloat16)
    k, v = (t.reshape(n, HKV * D) for t in _history(n, gen))
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=H, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                            scaling=D**-0.5, sliding_window_size=-1, logit_cap=0)
    outs = []
    for chunks in ((60,), (16, 32, 12)):
        pool = _pool(16, 64)  # sink + recent cover the 60 rows
        r2t = _req_to_token({2: n})
        be = _backend(pool, r2t)
        parts, start = [], 0
        for c in chunks:
            sl = slice(start, start + c)
            parts.append(_extend(be, layer, q[sl], k[sl], v[sl], 2, start, c, r2t))
            start += c
        outs.append(torch.cat(parts).float())
    rel = ((outs[1] - outs[0]).norm(dim=-1) / outs[0].norm(dim=-1)).max().item()
    assert rel < 1e-2, rel


def test_chunked_prefill_reads_the_quantized_prefix():
    """With a short window the second chunk attends over the dequantized pages of the first."""
    gen = torch.Generator().manual_seed(4)
    n, first = 80, 48
    q = torch.randn(n, H * D, generator=gen).to(torch.bfloat16)
    k, v = (t.reshape(n, HKV * D) for t in _history(n, gen))
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=H, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                            scaling=D**-0.5, sliding_window_size=-1, logit_cap=0)
    pool = _pool(16, 16)
    r2t = _req_to_token({1: n})
    be = _backend(pool, r2t)
    _extend(be, layer, q[:first], k[:first], v[:first], 1, 0, first, r2t)
    ck, cv = pool.cached_rows(0, r2t, 1, first)  # what the cache holds after the first chunk
    out = _extend(be, layer, q[first:], k[first:], v[first:], 1, first, n - first, r2t).float()
    keys = torch.cat([ck, k[first:].reshape(-1, HKV, D).transpose(0, 1).float()], dim=1)
    vals = torch.cat([cv, v[first:].reshape(-1, HKV, D).transpose(0, 1).float()], dim=1)
    qs = q[first:].float().reshape(-1, HKV, H // HKV, D)
    mask = torch.ones(n - first, n, dtype=torch.bool).tril(first)
    s = torch.einsum("nhrd,htd->nhrt", qs, keys) * D**-0.5
    p = torch.softmax(s.masked_fill(~mask[:, None, None, :], float("-inf")), dim=-1)
    ref = torch.einsum("nhrt,htd->nhrd", p, vals).reshape(n - first, H * D)
    rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 2e-2, rel


def _staged_backend(pool, r2t, max_tokens: int):
    be = _backend(pool, r2t)
    be.stage, be.stage_max_tokens = {}, max_tokens
    return be


class _MixedMode(_Mode):
    def is_mixed(self) -> bool:
        return True


@pytest.mark.parametrize("chunks", [(16, 32, 32), (5, 40, 35)])
def test_staged_chunks_read_the_prompt_as_one_extend(chunks):
    """With the prefill stage (OSCAR_PREFILL_STAGE_MIB) a prompt in chunks gives one extend's outputs even where
    the windows (sink 16, recent 16) leave most of the prefix to the INT2 pages: every chunk reads its earlier chunks
    as BF16 rows. Past the stage's cap, or in a mixed batch, the chunks read the pages (as with the stage off)."""
    gen = torch.Generator().manual_seed(5)
    n = sum(chunks)
    q = torch.randn(n, H * D, generator=gen).to(torch.bfloat16)
    k, v = (t.reshape(n, HKV * D) for t in _history(n, gen))
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=H, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                            scaling=D**-0.5, sliding_window_size=-1, logit_cap=0)

    def run(parts, max_tokens, mode=None):
        pool = _pool(16, 16)
        r2t = _req_to_token({1: n})
        be = _staged_backend(pool, r2t, max_tokens)
        outs, start = [], 0
        for c in parts:
            sl = slice(start, start + c)
            if mode is None:
                outs.append(_extend(be, layer, q[sl], k[sl], v[sl], 1, start, c, r2t))
            else:
                fb = SimpleNamespace(forward_mode=mode, req_pool_indices=torch.tensor([1]),
                                     seq_lens=torch.tensor([start + c]), seq_lens_cpu=torch.tensor([start + c]),
                                     extend_seq_lens_cpu=[c], extend_prefix_lens_cpu=[start],
                                     out_cache_loc=r2t[1, start : start + c].long())
                be.init_forward_metadata(fb)
                outs.append(be.forward_extend(q[sl], k[sl], v[sl], layer, fb))
            start += c
        return torch.cat(outs).float(), be

    one, _ = run((n,), 0)
    staged, be = run(chunks, 10_000)
    off, _ = run(chunks, 0)
    capped, _ = run(chunks, chunks[0] + chunks[1] - 1)  # the second chunk does not fit: the third reads the pages
    mixed, _ = run(chunks, 10_000, _MixedMode(False))
    def rel(a, rows=slice(None)):
        return ((a[rows] - one[rows]).norm(dim=-1) / one[rows].norm(dim=-1)).max().item()

    first2, last = slice(0, chunks[0] + chunks[1]), slice(chunks[0] + chunks[1], n)
    assert rel(staged) < 1e-2 and set(be.stage) == {1} and be.stage[1].length == n
    assert rel(off, last) > 5e-2 and rel(mixed, last) > 5e-2  # the pages' INT2 error
    assert rel(capped, first2) < 1e-2 and rel(capped, last) > 5e-2
    be.init_forward_metadata(SimpleNamespace(forward_mode=_Mode(True), req_pool_indices=torch.tensor([1]),
                                             seq_lens=torch.tensor([n + 1]), seq_lens_cpu=torch.tensor([n + 1]),
                                             out_cache_loc=_r2t_slot(be, 1, n)))
    assert be.stage == {}  # a decode-only step: no prefill is between its chunks


def _r2t_slot(be, r: int, pos: int) -> torch.Tensor:
    return be.req_to_token_pool.req_to_token[r, pos : pos + 1].long()


def test_only_a_cut_first_chunk_is_staged():
    """Knowing SGLang's chunk (64 tokens, pages of 16), a first extend is staged only when it may have been cut: the
    batch's last request, the batch within a page of its budget; a continuing chunk always is (its prompt goes on)."""
    pool = _pool(16, 16)
    be = _staged_backend(pool, _req_to_token({1: 100, 2: 100}), 10_000)
    be.stage_chunk = 64
    _, _, keep = be._stage_plan([1, 2], [0, 0], [10, 30])  # 40 of 64, more than a page short: neither was cut
    assert keep == [False, False] and be.stage == {}
    _, _, keep = be._stage_plan([1, 2], [0, 0], [20, 44])  # the budget used: the last one was cut
    assert keep == [False, True] and set(be.stage) == {2}
    _, read, keep = be._stage_plan([2, 1], [44, 0], [30, 10])  # request 2 goes on; 1 is new and small
    assert (read, keep) == ([True, False], [True, False]) and be.stage[2].length == 74

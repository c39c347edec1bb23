"""The extend over a cached quantized prefix (radix hits, later chunks of a chunked prefill) reads the pages in place.

- The Triton kernel ``oscar.kernels.extend_paged`` (interpreted on CPU) equals its torch twin
  ``oscar.cache.extend.extend_paged_attention_torch`` (float32 on both sides: reduction order only) for row and
  fragment-order pages, INT2/INT4, GQA ratios 1/3/4, head_dim 64/128, prefixes of 0 rows, one row, page
  boundaries and prime lengths, shuffled page tables, split-K 1/3.
- ``extend_attention`` (both backends, both output frames, rope-centered keys on the twin) equals attention over
  the rows the cache holds, dequantized and rotated back (the old extend: ``cached_rows`` + dense softmax).
- Through the backend, a hit and a later chunk give that attention, and on the Triton path no prefix row is
  dequantized into memory (``gather_dequantize`` is not called); the twin dequantizes each prefix row once
  per layer (what is computed, not timed). An extend longer than ``extend_in_place_max`` takes the old route
  (the prefix dequantized once, SDPA) with the same result; the route is chosen by length, key kind and kernels.
- Through SGLang's Engine (tiny random Llama, float32, INT2 quarot, S0 = W = 16): the same prompt cold, then
  hitting its own cached prefix. A cold prefill attends over BF16 rows only; the hit reads the prefix quantized
  past the sink (by design: the cache holds nothing else). The first token's log-probabilities differ by the
  measured amount, inside the INT2 serving tolerance; with windows covering the prompt the two agree.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from oscar.cache import extend, paged
from oscar.core import quant
from oscar.kernels.segments import HeadTransform
from serve_helpers import INT2_LOGPROB_TOL, run_driver, save_in_code_artifact
from test_pool_paged import D, H, HKV, PAGE, _backend, _extend, _history, _req_to_token, _state


def _pages(npages: int, hkv: int, page: int, d: int, bits: int, group: int, layout: str):
    kl, vl = ("rows", "rows") if layout == "rows" else ("mma_k", "mma_v")
    return (paged.QuantPages.empty(npages, hkv, page, d, bits, group, "cpu", kl),
            paged.QuantPages.empty(npages, hkv, page, d, bits, group, "cpu", vl))


def _filled(gen, int_len: int, hkv: int, page: int, d: int, bits: int, group: int, layout: str):
    """Pages holding ``int_len`` random rows through a shuffled page table (page 0 left for padding)."""
    npages = max(1, math.ceil(int_len / page)) + 3
    kp, vp = _pages(npages + 1, hkv, page, d, bits, group, layout)
    table = (torch.randperm(npages, generator=gen) + 1).to(torch.int32)
    pos = torch.arange(int_len)
    slots = table[pos // page].long() * page + pos % page
    if int_len:
        paged.rotate_quantize_pack(torch.randn(int_len, hkv, d, generator=gen), slots, kp, HeadTransform())
        paged.rotate_quantize_pack(torch.randn(int_len, hkv, d, generator=gen), slots, vp, HeadTransform())
    return kp, vp, table


CASES = [  # layout, bits, group, d, hkv, rep, page, int_len, n, n_fixed, splits
    ("rows", 2, 64, 64, 2, 2, 16, 77, 19, 7, 1),
    ("rows", 2, 32, 64, 2, 4, 16, 64, 17, 0, 3),  # page boundary, two groups per row
    ("mma", 2, 64, 64, 2, 4, 16, 79, 18, 5, 3),
    ("mma", 2, 128, 128, 1, 1, 32, 96, 16, 3, 1),
    ("rows", 4, 32, 64, 1, 3, 8, 41, 13, 2, 3),  # GQA 3 (SmolLM2), prime lengths
    ("mma", 4, 64, 64, 2, 2, 16, 1, 5, 1, 1),  # one quantized row
    ("rows", 2, 64, 64, 2, 2, 16, 0, 9, 4, 1),  # no quantized row: the BF16 segment alone
]


@pytest.mark.parametrize("layout,bits,group,d,hkv,rep,page,int_len,n,n_fixed,splits", CASES)
def test_kernel_equals_twin(layout, bits, group, d, hkv, rep, page, int_len, n, n_fixed, splits):
    from oscar.kernels.extend_paged import extend_paged_attention

    gen = torch.Generator().manual_seed(int_len + 7 * n)
    kp, vp, table = _filled(gen, int_len, hkv, page, d, bits, group, layout)
    q = torch.randn(n, hkv * rep, d, generator=gen)
    bk, bv = torch.randn(2, hkv, n_fixed + n, d, generator=gen)
    maps = tuple(None if p.layout == "rows" else quant.mma_token_map(d, p.layout, bits) for p in (kp, vp))
    ref = extend.extend_paged_attention_torch(q, kp, vp, table, int_len, bk, bv, n_fixed, sm_scale=d**-0.5)
    out = extend_paged_attention(q, kp, vp, table, int_len, bk, bv, n_fixed, sm_scale=d**-0.5,
                                 token_maps=maps, num_splits=splits, block_m=16, block_n=16)
    assert out.shape == ref.shape == (n, hkv * rep, d)
    err = (out - ref).abs().max().item()
    assert err < 2e-5 * ref.abs().max().item() + 1e-6, err  # float32 both sides: reduction order only
    if int_len == 77:  # FP16 operands (the CUDA default): 11-bit significands, float32 accumulation
        f16 = extend_paged_attention(q, kp, vp, table, int_len, bk, bv, n_fixed, sm_scale=d**-0.5, token_maps=maps,
                                     num_splits=splits, block_m=16, block_n=16, dot_f16=True)
        rel = ((f16 - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert rel < 2e-3, rel


def test_kernel_refuses_bad_arguments():
    from oscar.kernels.extend_paged import extend_paged_attention

    gen = torch.Generator().manual_seed(0)
    kp, vp, table = _filled(gen, 20, 2, 16, 64, 2, 64, "rows")
    q = torch.randn(4, 4, 64)
    bk = torch.zeros(2, 6, 64)
    with pytest.raises(ValueError, match="n_fixed=3 plus the 4 queries"):
        extend_paged_attention(q, kp, vp, table, 20, bk, bk, 3, sm_scale=0.1)
    with pytest.raises(ValueError, match="page_table must be int32"):
        extend_paged_attention(q, kp, vp, table.long(), 20, bk, bk, 2, sm_scale=0.1)
    with pytest.raises(ValueError, match="token_maps"):
        extend_paged_attention(q, kp, vp, table, 20, bk, bk, 2, sm_scale=0.1,
                               token_maps=(quant.mma_token_map(64, "mma_k"), None))


def _transforms(gen, hkv: int, d: int, rope: bool = False):
    orth = lambda: torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0]  # noqa: E731
    extra = {}
    if rope:
        freq = 1e4 ** -(torch.arange(d // 2) / (d // 2)).double()
        extra = dict(rope_mu=torch.randn(hkv, d, generator=gen), rope_freq=freq)
    kt = HeadTransform(orth(), 0.3 * torch.randn(hkv, d, generator=gen), **extra)
    vt = HeadTransform(orth(), 0.3 * torch.randn(hkv, d, generator=gen))
    return kt, vt


def _dense_reference(q, kt, vt, kp, vp, table, int_len, bk, bv, n_fixed, pos0, scale):
    """Attention over the rows the cache holds in the original frame: the pages dequantized and rotated back
    (rope-centered offsets added back), the BF16 rows as given; float32."""
    keys, vals = [], []
    for pages, t, out in ((kp, kt, keys), (vp, vt, vals)):
        x = paged.gather_dequantize(pages, table.reshape(1, -1), 0, int_len)
        x = torch.einsum("hte,hde->htd", x, t.R)
        if t.mu is not None:
            x = x + t.mu[:, None, :]
        if t.rope_centered and int_len:
            x = x + paged.rope_offsets(t, pos0 + torch.arange(int_len)).transpose(0, 1)
        out.append(x)
    K, V = torch.cat([keys[0], bk.float()], 1), torch.cat([vals[0], bv.float()], 1)
    n, Hq, d = q.shape
    hkv = K.shape[0]
    lg = torch.einsum("nhrd,htd->nhrt", q.float().reshape(n, hkv, Hq // hkv, d), K) * scale
    j = torch.arange(bk.shape[1])
    vis = torch.cat([torch.ones(n, int_len, dtype=torch.bool), j[None] <= n_fixed + torch.arange(n)[:, None]], 1)
    p = torch.softmax(lg.masked_fill(~vis[:, None, None], float("-inf")), -1)
    return torch.einsum("nhrt,htd->nhrd", p, V).reshape(n, Hq, d)


@pytest.mark.parametrize("backend,layout,frame,rope", [("torch", "rows", "original", False),
                                                       ("triton", "mma", "rotated", False),
                                                       ("triton", "rows", "original", False),
                                                       ("torch", "mma", "original", True)])
def test_extend_attention_equals_attention_over_the_cached_rows(backend, layout, frame, rope):
    gen = torch.Generator().manual_seed(11)
    hkv, rep, d, page, int_len, n, n_fixed = 2, 2, 64, 16, 70, 12, 9
    kp, vp, table = _pages(8, hkv, page, d, 2, d, layout) + (torch.tensor([5, 2, 7, 1, 3], dtype=torch.int32),)
    kt, vt = _transforms(gen, hkv, d, rope)
    pos = torch.arange(int_len)
    slots = table[pos // page].long() * page + pos % page
    pos0 = 32
    paged.rotate_quantize_pack(torch.randn(int_len, hkv, d, generator=gen), slots, kp, kt, positions=pos0 + pos)
    paged.rotate_quantize_pack(torch.randn(int_len, hkv, d, generator=gen), slots, vp, vt)
    q = torch.randn(n, hkv * rep, d, generator=gen)
    bk, bv = torch.randn(2, hkv, n_fixed + n, d, generator=gen).to(torch.bfloat16)
    out = extend.extend_attention(q, kp, vp, table, int_len, bk, bv, n_fixed, kt, vt, sm_scale=d**-0.5,
                                  output_frame=frame, int_pos0=pos0, backend=backend)
    ref = _dense_reference(q, kt, vt, kp, vp, table, int_len, bk, bv, n_fixed, pos0, d**-0.5)
    if frame == "rotated":
        ref = torch.einsum("nhrd,hde->nhre", ref.reshape(n, hkv, rep, d) - vt.mu[None, :, None], vt.R).reshape(n, -1, d)
    rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 1e-5, rel  # float32: the rotation moved from the rows to the queries and back (reduction order)


def _prefix_pool(sink: int, recent: int, kernels: str):
    from oscar.serve.pool import OscarTokenToKVPool

    state = {**_state(sink, recent), "prefix_cache": True}
    pool = OscarTokenToKVPool(512, PAGE, torch.bfloat16, HKV, D, 1, "cpu", False, oscar_state=state, oscar_layout="mma")
    pool.bind_requests(4)
    pool.kernels = kernels  # "triton": the kernels interpreted on CPU tensors
    return pool


def _layer():
    return SimpleNamespace(layer_id=0, tp_q_head_num=H, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                           scaling=D**-0.5, sliding_window_size=-1, logit_cap=0)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_hit_and_later_chunk_read_the_pages_in_place(kernels, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    S0, W, shared, n_donor, n_new = 32, 16, 96, 112, 21
    pool = _prefix_pool(S0, W, kernels)
    r2t = _req_to_token({1: n_donor, 2: shared + n_new})
    r2t[2, :shared] = r2t[1, :shared]  # the hit's row points at the donor's cached pages
    be = _backend(pool, r2t)
    be.extend_route = "pages"  # the in-place kernel (the default "dequant" route: tests/serve/test_prefix_profile.py)
    be.req_to_token_pool.req_generation = torch.tensor([0, 1, 1, 0])
    layer = _layer()
    q = torch.randn(n_donor + n_new, H * D, generator=gen).to(torch.bfloat16)
    k, v = (t.reshape(-1, HKV * D) for t in _history(n_donor + n_new, gen))
    _extend(be, layer, q[:n_donor], k[:n_donor], v[:n_donor], 1, 0, n_donor, r2t)
    pool.store_sink(r2t, 1, n_donor)
    donor_k, donor_v = pool.cached_rows(0, r2t, 1, shared, ring=False)  # what a hit's queries should see
    pool.slot_generation[2] = 0
    calls = []
    real = paged.gather_dequantize
    monkeypatch.setattr(paged, "gather_dequantize", lambda *a: calls.append(a[3]) or real(*a))
    before = extend.DEQUANTIZED_ROWS[0]
    out = _extend(be, layer, q[n_donor:], k[n_donor:], v[n_donor:], 2, shared, n_new, r2t).float()
    assert be.meta.hit == [True]
    if kernels == "triton":  # the kernel reads the codes in place: no prefix row dequantized into memory
        assert calls == [] and extend.DEQUANTIZED_ROWS[0] == before
    else:  # the twin (the specification) dequantizes each prefix row past the sink once, K and V
        assert calls == [shared - S0] * 2 and extend.DEQUANTIZED_ROWS[0] == before + shared - S0
    own_k = k[n_donor:].reshape(-1, HKV, D).transpose(0, 1).float()
    own_v = v[n_donor:].reshape(-1, HKV, D).transpose(0, 1).float()
    keys, vals = torch.cat([donor_k, own_k], 1), torch.cat([donor_v, own_v], 1)
    qs = q[n_donor:].float().reshape(-1, HKV, H // HKV, D)
    mask = torch.ones(n_new, shared + n_new, dtype=torch.bool).tril(shared)
    s = torch.einsum("nhrd,htd->nhrt", qs, keys) * D**-0.5
    ref = torch.einsum("nhrt,htd->nhrd", torch.softmax(s.masked_fill(~mask[:, None, None], float("-inf")), -1),
                       vals).reshape(n_new, H * D)
    rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 1e-2, rel  # bf16 outputs (2^-8 relative per element)
    # a later chunk of the donor (same slot and generation): pages [S0, p - W), its own ring, its own rows
    p = n_donor
    ck, cv = pool.cached_rows(0, r2t, 1, p)
    calls.clear()
    k2, v2 = _history(8, gen)
    q2 = torch.randn(8, H * D, generator=gen).to(torch.bfloat16)
    r2t[1, p : p + 8] = r2t[2, shared : shared + 8] + 0  # any free slots of the pool
    windows = pool.win_k[0].clone(), pool.win_v[0].clone()
    be.extend_in_place_max = 4  # an extend longer than this dequantizes the prefix once (cached_rows) + SDPA
    long_route = _extend(be, layer, q2, k2.reshape(8, -1), v2.reshape(8, -1), 1, p, 8, r2t).float()
    assert calls == [p - W - S0] * 2
    calls.clear()
    pool.win_k[0].copy_(windows[0])  # the ring as it was before this chunk's rows arrived
    pool.win_v[0].copy_(windows[1])
    be.extend_in_place_max = 4096
    out2 = _extend(be, layer, q2, k2.reshape(8, -1), v2.reshape(8, -1), 1, p, 8, r2t).float()
    assert be.meta.hit == [False]
    assert calls == ([] if kernels == "triton" else [p - W - S0] * 2)
    assert ((out2 - long_route).norm(dim=-1) / long_route.norm(dim=-1)).max().item() < 1e-2
    keys = torch.cat([ck, k2.transpose(0, 1).float()], 1)
    vals = torch.cat([cv, v2.transpose(0, 1).float()], 1)
    mask = torch.ones(8, p + 8, dtype=torch.bool).tril(p)
    s = torch.einsum("nhrd,htd->nhrt", q2.float().reshape(8, HKV, -1, D), keys) * D**-0.5
    ref = torch.einsum("nhrt,htd->nhrd", torch.softmax(s.masked_fill(~mask[:, None, None], float("-inf")), -1),
                       vals).reshape(8, H * D)
    rel = ((out2 - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 1e-2, rel


# -- through SGLang's Engine: a prompt cold, then hitting its own cached prefix -------------------------------------


@pytest.fixture(scope="module")
def cold_and_hit(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cold_and_hit")
    quarot = save_in_code_artifact(tiny_llama, "quarot", tmp / "quarot")
    rng = random.Random(3)
    prompt = [rng.randrange(1, 300) for _ in range(100)]
    sampling = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    radix = {"model_path": str(tiny_llama), "attention_backend": "oscar", "page_size": 16,
             "disable_radix_cache": False, "dtype": "float32"}
    logprobs = {"return_logprob": True, "top_logprobs_num": 2}
    runs = [
        {"name": "int2", "engine_args": radix, "env": {"OSCAR_ARTIFACT": str(quarot), "OSCAR_SINK": 16,
                                                       "OSCAR_RECENT": 16, "OSCAR_PREFIX_REUSE": "quantized"},
         "rounds": [[prompt], [prompt]], "sampling": sampling, "generate_args": logprobs},
        {"name": "covered", "engine_args": radix, "env": {"OSCAR_ARTIFACT": str(quarot), "OSCAR_SINK": 96,
                                                          "OSCAR_RECENT": 32, "OSCAR_PREFIX_REUSE": "quantized"},
         "rounds": [[prompt], [prompt]], "sampling": sampling, "generate_args": logprobs},
    ]
    return run_driver(runs, tmp)


def _first_step_gap(run: dict) -> float:
    """Largest difference of the first generated token's top-2 log-probabilities, cold run against hit."""
    cold, hit = ({tok: lp for lp, tok, _ in r["output_top_logprobs"][0]} for r in run["logprobs"])
    common = set(cold) & set(hit)
    assert common, (cold, hit)
    return max(abs(cold[t] - hit[t]) for t in common)


def test_hit_differs_from_cold_by_reading_the_prefix_quantized(cold_and_hit):
    results, log = cold_and_hit
    assert "#cached-token: 80" in log  # 100 tokens, W = 16: the match is capped at 84 -> 80 (whole pages)
    gap = _first_step_gap(results["int2"])
    # measured 2026-12-03 on this CPU: see docs/SERVING.md "Prefix hits read the prefix quantized"
    assert 0 < gap < INT2_LOGPROB_TOL, gap
    # sink + recent cover the 100 tokens: the hit reads only BF16 rows, as the cold prefill did
    assert "#cached-token: 64" in log, log[-2000:]  # capped at 100 - 32 = 68 -> 64 (whole pages)
    covered = _first_step_gap(results["covered"])
    print(f"first token, cold vs hit: largest top-2 log-probability difference {gap:.4f} (INT2 prefix read), "
          f"{covered:.2e} (windows cover the prompt)")
    assert covered < 1e-4
    assert results["covered"]["output_ids"][0] == results["covered"]["output_ids"][1]


def test_route_choice():
    """Which extends read the pages in place: a prefix with quantized rows, at most ``extend_in_place_max`` tokens,
    per-token keys; rope-centered keys only where the twin serves (the Triton kernel adds no RoPE offsets)."""
    S0, W = 32, 16
    pool = _prefix_pool(S0, W, "triton")
    be = _backend(pool, _req_to_token({1: 64}))
    assert be._pages_in_place(0, 100, 4097, hit=True)  # the default "dequant" route: any length
    be.extend_route = "pages"  # the in-place kernel: up to extend_in_place_max
    assert be._pages_in_place(0, 100, 21, hit=True) and be._pages_in_place(0, 100, 4096, hit=False)
    assert not be._pages_in_place(0, 100, 4097, hit=True)  # a long extend: the prefix dequantized once
    assert not be._pages_in_place(0, S0 + W, 8, hit=False)  # a later chunk whose prefix is all sink and ring
    assert be._pages_in_place(0, S0 + 1, 8, hit=True)  # a hit reads its prefix past the sink from the pages
    kt, vt = pool.transforms[0]
    rope = HeadTransform(kt.R, kt.mu, rope_mu=torch.ones(HKV, D), rope_freq=torch.ones(D // 2, dtype=torch.float64))
    pool.transforms[0] = (rope, vt)
    assert not be._pages_in_place(0, 100, 21, hit=True)
    pool.kernels = "torch"
    assert be._pages_in_place(0, 100, 21, hit=True)

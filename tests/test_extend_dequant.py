"""The extend's ``dequant`` route: the prefix pages dequantized once (Triton), then one dense SDPA.

- ``oscar.kernels.extend_paged.dequantize_pages`` (interpreted on CPU) equals its twin
  ``oscar.cache.paged.gather_dequantize`` for row and fragment-order pages, INT2/INT4, head_dim 64/128, shuffled page
  tables, lengths of 0, 1, a page boundary and primes: ``code * scale + zero`` in float32 on both sides (Triton may
  fuse it into one FMA: at most one float32 rounding apart).
- ``extend_attention(route="dequant")`` equals ``route="pages"`` (the kernel that reads the codes in place) and the
  torch twin, both output frames, GQA 1/2/4: float32 on CPU, reduction order only.
"""

from __future__ import annotations

import math

import pytest
import torch

from oscar.cache import extend, paged
from oscar.core import quant
from oscar.kernels.extend_paged import dequantize_pages
from oscar.kernels.segments import HeadTransform


def _filled(gen, int_len, hkv, page, d, bits, group, layout, t=HeadTransform()):
    kl, vl = ("rows", "rows") if layout == "rows" else ("mma_k", "mma_v")
    npages = max(1, math.ceil(int_len / page)) + 2
    kp = paged.QuantPages.empty(npages + 1, hkv, page, d, bits, group, "cpu", kl)
    vp = paged.QuantPages.empty(npages + 1, hkv, page, d, bits, group, "cpu", vl)
    table = (torch.randperm(npages, generator=gen) + 1).to(torch.int32)
    pos = torch.arange(int_len)
    slots = table[pos // page].long() * page + pos % page
    if int_len:
        paged.rotate_quantize_pack(torch.randn(int_len, hkv, d, generator=gen), slots, kp, t)
        paged.rotate_quantize_pack(torch.randn(int_len, hkv, d, generator=gen), slots, vp, t)
    return kp, vp, table


@pytest.mark.parametrize("layout,bits,group,d,hkv,page,int_len", [
    ("rows", 2, 64, 64, 2, 16, 77), ("rows", 4, 32, 64, 1, 8, 41), ("mma", 2, 128, 128, 2, 16, 33),
    ("mma", 4, 64, 64, 2, 16, 16), ("mma", 2, 64, 64, 1, 32, 1), ("rows", 2, 64, 64, 2, 16, 0)])
def test_dequantize_pages_equals_the_twin(layout, bits, group, d, hkv, page, int_len):
    gen = torch.Generator().manual_seed(int_len + d)
    kp, vp, table = _filled(gen, int_len, hkv, page, d, bits, group, layout)
    for p in (kp, vp):
        tmap = None if p.layout == "rows" else quant.mma_token_map(d, p.layout, bits)
        out = dequantize_pages(p, table, int_len, token_map=tmap, block_t=16)
        ref = paged.gather_dequantize(p, table.reshape(1, -1), 0, int_len)
        assert out.shape == ref.shape == (hkv, int_len, d) and out.dtype == torch.float32
        if int_len:
            assert (out - ref).abs().max().item() <= 2 * torch.finfo(torch.float32).eps * ref.abs().max().item()
    with pytest.raises(ValueError, match="token_map"):
        dequantize_pages(kp, table, int_len, token_map=None if layout != "rows" else quant.mma_token_map(64, "mma_k"))


@pytest.mark.parametrize("layout,rep,frame", [("mma", 4, "rotated"), ("rows", 1, "original"), ("mma", 2, "original")])
def test_dequant_route_equals_the_pages_route(layout, rep, frame):
    gen = torch.Generator().manual_seed(3 + rep)
    hkv, d, page, int_len, n, n_fixed = 2, 64, 16, 70, 12, 9
    orth = lambda: torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0]  # noqa: E731
    kt = HeadTransform(orth(), 0.3 * torch.randn(hkv, d, generator=gen))
    vt = HeadTransform(orth(), 0.3 * torch.randn(hkv, d, generator=gen))
    kp, vp, table = _filled(gen, int_len, hkv, page, d, 2, d, layout, kt)
    q = torch.randn(n, hkv * rep, d, generator=gen)
    bk, bv = torch.randn(2, hkv, n_fixed + n, d, generator=gen).to(torch.bfloat16)
    args = (q, kp, vp, table, int_len, bk, bv, n_fixed, kt, vt)
    kw = dict(sm_scale=d**-0.5, output_frame=frame)
    dq = extend.extend_attention(*args, backend="triton", route="dequant", **kw)
    pages = extend.extend_attention(*args, backend="triton", route="pages", **kw)
    twin = extend.extend_attention(*args, backend="torch", **kw)
    for ref in (pages, twin):
        rel = ((dq - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        assert rel < 1e-5, rel  # float32 on both sides: reduction order only
    with pytest.raises(ValueError, match="route"):
        extend.extend_attention(*args, backend="triton", route="dense", **kw)


def test_gqa_attention_one_kv_head_at_a_time_equals_sdpa_with_gqa():
    """`gqa_attention` (the extend's attention without H/Hkv copies of the prefix) equals SDPA's own GQA, with a
    boolean mask and with a bottom-right causal bias."""
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention

    from oscar.cache.extend import gqa_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=gen) for s in ((5, 8, 16), (2, 12, 16), (2, 12, 16)))
    ref = lambda m: scaled_dot_product_attention(q.movedim(0, 1)[None], k[None], v[None], attn_mask=m,  # noqa: E731
                                                  enable_gqa=True, scale=0.25)[0].movedim(1, 0)
    mask = torch.ones(5, 12, dtype=torch.bool).tril(7)
    torch.testing.assert_close(gqa_attention(q, k, v, mask, 0.25), ref(mask), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gqa_attention(q, k, v, causal_lower_right(5, 12), 0.25), ref(mask), rtol=1e-6, atol=1e-6)

"""Torch paged pool: allocation, writes through rotate-clip-quantize-pack, demotion, reads, decode attention."""

from __future__ import annotations

import math

import pytest
import torch

from oscar.core import quant
from oscar.cache.paged import PagedKVPool, QuantPages, decode_attention_torch, rotate_quantize_pack_torch
from oscar.kernels.segments import HeadTransform, Segments


def _orth(h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].to(torch.float32)


def _transform(h: int, d: int, gen: torch.Generator, rho: float = 0.95) -> HeadTransform:
    return HeadTransform(R=_orth(h, d, gen), mu=0.1 * torch.randn(h, d, generator=gen),
                         rho=torch.full((h,), rho))


def test_pool_write_read_matches_quant_spec():
    gen = torch.Generator().manual_seed(0)
    hkv, d, ps = 2, 64, 8
    pool = PagedKVPool(num_layers=2, num_kv_heads=hkv, head_dim=d, num_pages=12, max_batch=3,
                       max_pages_per_seq=5, bits=2, group_size=32, page_size=ps)
    kt, vt = _transform(hkv, d, gen), _transform(hkv, d, gen, 0.9)
    lens = [13, 1, 16]
    rows = {b: (torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)) for b, n in enumerate(lens)}
    slots = pool.reserve([0, 1, 2], lens)
    assert slots.shape == (sum(lens),)
    assert len(set(slots.tolist())) == sum(lens)
    k_all = torch.cat([rows[b][0] for b in range(3)])
    v_all = torch.cat([rows[b][1] for b in range(3)])
    pool.write(1, k_all, v_all, slots, kt, vt)
    assert pool.int_len.tolist() == lens
    for b, n in enumerate(lens):
        k_rot, v_rot = pool.read(1, b)
        k, v = rows[b]
        ref_k = quant.dequantize(quant.rotate_clip_quantize(k.unsqueeze(-2), kt.R, kt.mu.unsqueeze(-2), kt.rho[:, None],
                                                            bits=2, group_size=32)).squeeze(-2)
        ref_v = quant.dequantize(quant.rotate_clip_quantize(v.unsqueeze(-2), vt.R, vt.mu.unsqueeze(-2), vt.rho[:, None],
                                                            bits=2, group_size=32)).squeeze(-2)
        torch.testing.assert_close(k_rot, ref_k.transpose(0, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v_rot, ref_v.transpose(0, 1), rtol=1e-5, atol=1e-5)
    # layer 0 untouched
    assert int(pool.k[0].codes.count_nonzero()) == 0


def test_pool_demotion_appends_oldest_recent_row():
    gen = torch.Generator().manual_seed(1)
    hkv, d, W = 2, 64, 4
    pool = PagedKVPool(num_layers=1, num_kv_heads=hkv, head_dim=d, num_pages=8, max_batch=2,
                       max_pages_per_seq=4, bits=4, group_size=64, page_size=4)
    kt, vt = HeadTransform(), HeadTransform(rho=torch.full((hkv,), 0.8))
    pool.reserve([0, 1], [3, 4])
    recent_k = torch.randn(2, hkv, W, d, generator=gen)
    recent_v = torch.randn(2, hkv, W, d, generator=gen)
    oldest = torch.tensor([2, 0])
    slots = pool.reserve([0, 1], 1)
    pool.demote(0, recent_k, recent_v, oldest, slots, kt, vt)
    assert pool.length(0) == 4 and pool.length(1) == 5
    k0, v0 = pool.read(0, 0)
    k1, _ = pool.read(0, 1)
    torch.testing.assert_close(k0[:, 3], quant.fake_quantize(recent_k[0, :, 2], 4, 64))
    torch.testing.assert_close(v0[:, 3], quant.fake_quantize(recent_v[0, :, 2], 4, 64, clip_ratio=0.8))
    torch.testing.assert_close(k1[:, 4], quant.fake_quantize(recent_k[1, :, 0], 4, 64))
    assert pool.page_table[1, 1].item() != pool.page_table[0, 0].item()


def test_pool_release_and_exhaustion():
    pool = PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=64, num_pages=3, max_batch=2, max_pages_per_seq=3,
                       page_size=4, group_size=64)
    pool.reserve([0], [9])
    assert pool.num_free_pages == 0
    with pytest.raises(RuntimeError, match="out of pages"):
        pool.reserve([1], [1])
    pool.release(0)
    assert pool.num_free_pages == 3 and pool.length(0) == 0 and int(pool.int_len[0]) == 0
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        pool.reserve([1], [13])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="page_size=48"):
        PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=64, num_pages=3, max_batch=1, max_pages_per_seq=3,
                    page_size=48, group_size=64)
    with pytest.raises(ValueError, match="group_size=48"):
        QuantPages.empty(2, 1, 4, 64, 2, 48)
    pool = PagedKVPool(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=3, max_batch=1, max_pages_per_seq=3,
                       page_size=4, group_size=64)
    with pytest.raises(ValueError, match="backend='cuda'"):
        pool.write(0, torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), pool.reserve([0], 1), HeadTransform(),
                   HeadTransform(), backend="cuda")


def _dense_attention(q, k, v, scale):
    """Reference attention in float64 over dense K/V [Hkv, T, d] with GQA."""
    H, d = q.shape
    hkv = k.shape[0]
    kk = k.repeat_interleave(H // hkv, 0).double()
    vv = v.repeat_interleave(H // hkv, 0).double()
    p = torch.softmax(torch.einsum("hd,htd->ht", q.double(), kk) * scale, dim=-1)
    return torch.einsum("ht,htd->hd", p, vv)


@pytest.mark.parametrize("output_frame", ["original", "rotated"])
def test_decode_attention_twin_equals_dense_on_dequantized_cache(output_frame):
    """Three segments merged by LSE equal one softmax over [sink, dequantized-and-unrotated, recent]."""
    gen = torch.Generator().manual_seed(2)
    B, H, hkv, d, G, ps = 2, 8, 2, 64, 32, 4
    kt, vt = _transform(hkv, d, gen), _transform(hkv, d, gen, 0.9)
    pool = PagedKVPool(num_layers=1, num_kv_heads=hkv, head_dim=d, num_pages=16, max_batch=B, max_pages_per_seq=6,
                       page_size=ps, group_size=G)
    lens = [9, 0]
    k = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    v = [torch.randn(n, hkv, d, generator=gen) for n in lens]
    slots = pool.reserve([0, 1], lens)
    pool.write(0, torch.cat(k), torch.cat(v), slots, kt, vt)
    sink_k, sink_v = torch.randn(B, hkv, 3, d, generator=gen), torch.randn(B, hkv, 3, d, generator=gen)
    rec_k, rec_v = torch.randn(B, hkv, 5, d, generator=gen), torch.randn(B, hkv, 5, d, generator=gen)
    sink_len, rec_len = torch.tensor([3, 2]), torch.tensor([5, 1])
    q = torch.randn(B, H, d, generator=gen)
    segments = Segments(pool.page_table, pool.int_len, sink_k=sink_k, sink_v=sink_v, sink_len=sink_len,
                        recent_k=rec_k, recent_v=rec_v, recent_len=rec_len)
    out = decode_attention_torch(q, pool.k[0], pool.v[0], segments, kt, vt, output_frame=output_frame)
    for b in range(B):
        kr, vr = pool.read(0, b)
        k_orig = kr @ kt.R.transpose(1, 2) + kt.mu[:, None]  # back to the original frame
        v_orig = vr @ vt.R.transpose(1, 2) + vt.mu[:, None]
        n0, n1 = int(sink_len[b]), int(rec_len[b])
        kk = torch.cat([sink_k[b, :, :n0], k_orig, rec_k[b, :, :n1]], dim=1)
        vv = torch.cat([sink_v[b, :, :n0], v_orig, rec_v[b, :, :n1]], dim=1)
        ref = _dense_attention(q[b], kk, vv, 1 / math.sqrt(d))
        if output_frame == "rotated":
            rv = vt.R.double().repeat_interleave(H // hkv, 0)
            ref = torch.einsum("hd,hde->he", ref - vt.mu.double().repeat_interleave(H // hkv, 0), rv)
        torch.testing.assert_close(out[b].double(), ref, rtol=1e-4, atol=1e-5)


def test_rotate_quantize_pack_torch_rejects_mismatched_rows():
    pages = QuantPages.empty(2, 2, 4, 64, 2, 64)
    with pytest.raises(ValueError, match="do not match"):
        rotate_quantize_pack_torch(torch.zeros(1, 3, 64), torch.zeros(1, dtype=torch.long), pages, HeadTransform())


@pytest.mark.parametrize("rep,padded", [(3, 4), (5, 8), (4, None)])
def test_query_heads_padded_to_an_mma_gqa_ratio_keep_the_real_heads(rep, padded):
    """SmolLM2's 9 query / 3 KV heads go to the mma kernel as 12 (zero queries appended per KV head); the real
    heads' outputs are those of the unpadded call (each query head attends on its own: the same float ops)."""
    from oscar.cache.paged import pad_query_heads

    gen = torch.Generator().manual_seed(5)
    B, hkv, d, ps = 2, 3, 64, 4
    kt, vt = _transform(hkv, d, gen), _transform(hkv, d, gen, 0.9)
    pool = PagedKVPool(num_layers=1, num_kv_heads=hkv, head_dim=d, num_pages=16, max_batch=B, max_pages_per_seq=6,
                       page_size=ps, group_size=d)
    lens = [9, 5]
    slots = pool.reserve([0, 1], lens)
    pool.write(0, torch.randn(sum(lens), hkv, d, generator=gen), torch.randn(sum(lens), hkv, d, generator=gen), slots,
               kt, vt)
    q = torch.randn(B, hkv * rep, d, generator=gen)
    qp, unpad = pad_query_heads(q, hkv)
    if padded is None:
        assert qp is q and unpad is None
        return
    assert qp.shape == (B, hkv * padded, d)
    assert torch.equal(qp.view(B, hkv, padded, d)[:, :, rep:], torch.zeros(B, hkv, padded - rep, d))
    segments = Segments(pool.page_table, pool.int_len)
    ref = decode_attention_torch(q, pool.k[0], pool.v[0], segments, kt, vt)
    got = unpad(decode_attention_torch(qp, pool.k[0], pool.v[0], segments, kt, vt))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)  # the same per-head computation (batched einsums)

"""Rope-centered keys on the paged path: keys stored as ``(k - mu - RoPE_p(m)) R_K``, logits plus ``q . RoPE_p(m)``.

CPU: the torch twin against a dense float64 reference that adds ``RoPE_p(m)`` back to the dequantized keys
(awkward positions, page and block boundaries, partial rotary, RoPE scaling); the Triton writers (interpreter)
against the torch writer; the CUDA kernel's rope term emulated lane by lane from its fragments (the table of
``oscar.kernels.decode_mma.rope_table`` and the turned B fragments of ``rope_frags``) against the exact term.
CUDA: the kernel against the twin on rope-centered pages (tests/test_kernels_decode_mma.py's tolerance).
"""

from __future__ import annotations

import math

import pytest
import torch

from oscar.cache.paged import PagedKVPool, decode_attention, decode_attention_torch, gather_dequantize, rope_offsets
from oscar.kernels.launch import MmaLaunch
from oscar.kernels.segments import HeadTransform, Segments
from oscar.core.rope import RopeSpec

REL_TOL = 1.5e-2
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def _spec(d: int, rotary: int, scaling: float = 1.0, theta: float = 10000.0) -> RopeSpec:
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    return RopeSpec(inv, scaling, d)


def _transforms(hkv: int, d: int, spec: RopeSpec, gen: torch.Generator, dev: str = "cpu", m_scale: float = 3.0):
    R = torch.linalg.qr(torch.randn(hkv, d, d, generator=gen, dtype=torch.float64))[0].float()
    m = m_scale * torch.randn(hkv, d, generator=gen)
    m[0] = 0.0  # a head that is not centered
    kt = HeadTransform(R=R, mu=0.1 * torch.randn(hkv, d, generator=gen), rho=torch.full((hkv,), 0.97),
                       rope_mu=m, rope_freq=spec.inv_freq, rope_scaling=spec.scaling)
    vt = HeadTransform(R=R.flip(1), mu=0.1 * torch.randn(hkv, d, generator=gen))
    return kt.to(dev), vt.to(dev)


def test_rope_offsets_match_the_rope_spec():
    spec = _spec(64, 48, scaling=1.25)
    gen = torch.Generator().manual_seed(0)
    kt, _ = _transforms(2, 64, spec, gen)
    pos = torch.tensor([0, 1, 77, 4097, 131071])
    ref = spec.offsets(kt.rope_mu, pos[None], dtype=torch.float64)[0].transpose(0, 1)  # [n, Hkv, d]
    assert torch.allclose(rope_offsets(kt, pos).double(), ref, atol=1e-5)


def _dense_reference(q, pool, b, kt, vt, pos0, seg, scale):
    """float64 attention over sink + dequantized keys moved back to the original frame + RoPE_p(m) + recent."""
    n = pool.length(b)
    k_rot, v_rot = (x.double() for x in pool.read(0, b))
    keys = torch.einsum("htd,hed->hte", k_rot, kt.R.double()) + kt.mu.double()[:, None]
    pos = pos0 + torch.arange(n)
    spec = RopeSpec(kt.rope_freq, kt.rope_scaling, q.shape[-1])
    keys = keys + spec.offsets(kt.rope_mu, pos[None], dtype=torch.float64)[0]
    vals = torch.einsum("htd,hed->hte", v_rot, vt.R.double()) + vt.mu.double()[:, None]
    ks, vs = [keys], [vals]
    for name in ("sink", "recent"):
        m = int(seg[f"{name}_len"][b])
        ks.append(seg[f"{name}_k"][b, :, :m].double())
        vs.append(seg[f"{name}_v"][b, :, :m].double())
    K, V = torch.cat(ks, 1), torch.cat(vs, 1)
    hkv = K.shape[0]
    qb = q[b].double().reshape(hkv, -1, q.shape[-1])
    p = torch.softmax(torch.einsum("hrd,htd->hrt", qb, K) * scale, -1)
    return torch.einsum("hrt,htd->hrd", p, V).reshape(q.shape[1], -1)


def _filled_pools(d, hkv, ps, layouts, kt, vt, steps, pos0, gen, device="cpu", bits=2):
    """Pools (one per layout) holding the same rope-centered keys and values, written by the torch writer."""
    most = max(sum(n[0] for n in steps), sum(n[1] for n in steps))
    per_seq = -(-most // ps) + 1
    pools = [PagedKVPool(num_layers=1, num_kv_heads=hkv, head_dim=d, num_pages=2 * per_seq + 3, max_batch=2,
                         max_pages_per_seq=per_seq, bits=bits, group_size=d, page_size=ps, device=device, layout=lay)
             for lay in layouts]
    for n0, n1 in steps:  # tokens land across block and page boundaries
        first = [pools[0].length(0), pools[0].length(1)]
        k = 2.0 * torch.randn(n0 + n1, hkv, d, generator=gen)
        v = torch.randn(n0 + n1, hkv, d, generator=gen)
        pos = torch.cat([pos0[0] + first[0] + torch.arange(n0), pos0[1] + first[1] + torch.arange(n1)])
        # keys as the model has them: something plus the rotating offset, which the writer must take off
        k = k + rope_offsets(kt, pos).to(k.device)
        for pool in pools:
            slots = pool.reserve([0, 1], [n0, n1])
            pool.write(0, k.to(device), v.to(device), slots, kt, vt, positions=pos.to(device))
    return pools


@pytest.mark.parametrize("d,rotary,scaling,ps,pos0", [(64, 64, 1.0, 16, (5, 64)), (128, 96, 1.3, 32, (64, 1001)),
                                                      (32, 16, 1.0, 64, (0, 131000))])
def test_twin_adds_the_rope_term_back(d, rotary, scaling, ps, pos0):
    gen = torch.Generator().manual_seed(d + rotary)
    hkv, H = 2, 8
    spec = _spec(d, rotary, scaling)
    kt, vt = _transforms(hkv, d, spec, gen)
    pool, = _filled_pools(d, hkv, ps, ["rows"], kt, vt, [(37, 5), (1, 70), (30, 1)], pos0, gen)
    seg = dict(sink_k=torch.randn(2, hkv, 8, d, generator=gen), sink_v=torch.randn(2, hkv, 8, d, generator=gen),
               sink_len=torch.tensor([8, 3], dtype=torch.int32),
               recent_k=torch.randn(2, hkv, 6, d, generator=gen), recent_v=torch.randn(2, hkv, 6, d, generator=gen),
               recent_len=torch.tensor([6, 0], dtype=torch.int32))
    q = torch.randn(2, H, d, generator=gen)
    scale = 1 / math.sqrt(d)
    pos_t = torch.tensor(pos0, dtype=torch.int32)
    out = pool.attend(0, q, kt, vt, int_pos0=pos_t, sm_scale=scale, **seg)
    for b in range(2):
        ref = _dense_reference(q, pool, b, kt, vt, pos0[b], seg, scale)
        assert torch.allclose(out[b].double(), ref, atol=2e-5, rtol=1e-4)
    # the term matters at these magnitudes: without it the result is far off
    plain = HeadTransform(kt.R, kt.mu, kt.rho)
    off = pool.attend(0, q, plain, vt, sm_scale=scale, **seg)
    assert float((off - out).norm() / out.norm()) > 0.05
    with pytest.raises(ValueError, match="int_pos0"):
        pool.attend(0, q, kt, vt, sm_scale=scale, **seg)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout,d", [("rows", 64), ("mma", 64)])
def test_triton_writers_take_the_offsets_off(device, layout, d):
    """The Triton writers (fused K+V, demotion from a window) store what the torch writer stores for rope-centered
    keys: the float32 sums of the rotation differ in order, so at most one code step in < 0.5% of the values."""
    gen = torch.Generator().manual_seed(3)
    hkv, ps = 2, 32
    kt, vt = _transforms(hkv, d, _spec(d, d), gen, device)
    pools = [PagedKVPool(num_layers=1, num_kv_heads=hkv, head_dim=d, num_pages=8, max_batch=2, max_pages_per_seq=4,
                         bits=2, group_size=d, page_size=ps, device=device, layout=layout) for _ in range(2)]
    win = (2.0 * torch.randn(5, hkv, 8, d, generator=gen)).to(torch.bfloat16).to(device)
    src = torch.randint(0, 8, (5,), generator=gen).to(device)
    pos = (300 + torch.arange(5)).to(device)
    for pool, backend in zip(pools, ("torch", "triton")):
        slots = pool.reserve([0, 1], [2, 3])
        pool.demote(0, win, win * 0.5, src, slots, kt, vt, backend=backend, positions=pos)
    for b in (0, 1):
        for a, m in zip(pools[0].read(0, b), pools[1].read(0, b)):
            assert ((a - m).abs() > 1e-6).float().mean() < 5e-3 and bool(a.abs().sum() > 0)
    with pytest.raises(ValueError, match="positions"):
        pools[1].demote(0, win, win, src, pools[1].reserve([0], [5]), kt, vt, backend="triton")


def _mma(a_frags: torch.Tensor, b_frags: torch.Tensor) -> torch.Tensor:
    """m16n8k16 from per-lane fragments: A [32, 4, 2] (a0..a3 halves), B [32, 2, 2]; returns D [16, 8]."""
    A = torch.zeros(16, 16, dtype=torch.float64)
    Bm = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for e in range(2):
            A[g, 2 * t + e], A[g + 8, 2 * t + e] = a_frags[lane, 0, e], a_frags[lane, 1, e]
            A[g, 2 * t + 8 + e], A[g + 8, 2 * t + 8 + e] = a_frags[lane, 2, e], a_frags[lane, 3, e]
            Bm[2 * t + e, g], Bm[2 * t + 8 + e, g] = b_frags[lane, 0, e], b_frags[lane, 1, e]
    return A @ Bm


@pytest.mark.parametrize("d,rotary,rt,start", [(128, 128, 8, 70000), (64, 48, 4, 131008), (128, 64, 16, 17)])
def test_kernel_rope_fragments_give_the_rope_term(d, rotary, rt, start):
    """Emulate rope_frags + the table MMA of decode_mma.cu lane by lane (8 warps: a warp's k-th block of a turn
    starts 16 * 8 * k after its first) and compare with q . RoPE_p(m) in float64."""
    from oscar.kernels.decode_mma import rope_table

    gen = torch.Generator().manual_seed(d + rt)
    rep, W = 4, 8
    spec = _spec(d, rotary, 1.1)
    h = spec.rotary_dim // 2
    q = torch.randn(rep, d, generator=gen, dtype=torch.float64)
    m = 3.0 * torch.randn(d, generator=gen, dtype=torch.float64)
    sc = 0.125
    tab = rope_table(spec.inv_freq, d, W, rt).view(torch.float16).reshape(rt, d // 16, 32, 4, 2).double()
    # s_u of the kernel: A_i, B_i (times sc), zero past the rotary half
    A, B = torch.zeros(rep, d // 2, dtype=torch.float64), torch.zeros(rep, d // 2, dtype=torch.float64)
    A[:, :h] = sc * spec.scaling * (q[:, :h] * m[:h] + q[:, h:2 * h] * m[h:2 * h])
    B[:, :h] = sc * spec.scaling * (q[:, h:2 * h] * m[:h] - q[:, :h] * m[h:2 * h])
    w = torch.zeros(d // 2, dtype=torch.float64)
    w[:h] = spec.inv_freq
    ang = torch.remainder(start * w, 2 * math.pi)
    c, s = ang.cos(), ang.sin()
    ub = torch.zeros(d // 16, 32, 2, 2, dtype=torch.float64)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for kc in range(d // 32):
            for hh in range(2):
                for e in range(2):
                    i = 16 * kc + 8 * hh + 2 * t + e
                    a, bb = (A[g, i], B[g, i]) if g < rep else (0.0, 0.0)
                    ub[kc, lane, hh, e] = c[i] * a + s[i] * bb
                    ub[kc + d // 32, lane, hh, e] = c[i] * bb - s[i] * a
    ub = ub.half().double()
    pos = torch.arange(start, start + 16 * W * rt)
    turned = spec.apply(m[None].expand(pos.numel(), d), pos)  # RoPE_p(m) [n, d]
    exact = sc * (q @ turned.T - (q[:, 2 * h:] @ m[2 * h:])[:, None])  # the pass-through channels go with q . mu_K
    for k in range(rt):
        D = sum(_mma(tab[k, kc], ub[kc]) for kc in range(d // 16))  # [16 tokens, 8 heads]
        got = D[:, :rep].T  # [rep, 16]
        ref = exact[:, 16 * W * k: 16 * W * k + 16]
        err = float((got - ref).abs().max())
        assert err < 2e-3 * float(A.abs().sum(1).max() + B.abs().sum(1).max()), err
        assert float(ref.abs().max()) > 50 * err  # the term is large against the error


# ---------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the mma decode kernel needs a CUDA device")
@pytest.mark.parametrize("d,rotary,rope_blocks,pos0,bits", [(128, 128, 8, (64, 64), 2), (128, 64, 16, (100, 70001), 2),
                                                            (64, 64, 4, (0, 5), 2), (128, 128, 32, (64, 131000), 2),
                                                            (128, 128, 8, (64, 64), 4), (64, 32, 16, (3, 9000), 4)])
def test_cuda_mma_kernel_adds_the_rope_term(d, rotary, rope_blocks, pos0, bits, dev="cuda"):
    gen = torch.Generator().manual_seed(d + rope_blocks)
    hkv, H = 4, 16
    kt, vt = _transforms(hkv, d, _spec(d, rotary, 1.05), gen, dev)
    pool, mma = _filled_pools(d, hkv, 64, ["rows", "mma"], kt, vt, [(700, 300), (1, 2200), (333, 17)], pos0, gen,
                              device=dev, bits=bits)
    kp, vp = mma.k[0], mma.v[0]
    B = 2
    seg = dict(sink_k=torch.randn(B, hkv, 64, d, generator=gen).to(dev, torch.bfloat16),
               sink_v=torch.randn(B, hkv, 64, d, generator=gen).to(dev, torch.bfloat16),
               sink_len=torch.tensor([64, 10], dtype=torch.int32, device=dev),
               recent_k=torch.randn(B, hkv, 256, d, generator=gen).to(dev, torch.bfloat16),
               recent_v=torch.randn(B, hkv, 256, d, generator=gen).to(dev, torch.bfloat16),
               recent_len=torch.tensor([256, 3], dtype=torch.int32, device=dev))
    q = (2.0 * torch.randn(B, H, d, generator=gen)).to(dev, torch.bfloat16)
    pos_t = torch.tensor(pos0, dtype=torch.int32, device=dev)
    pt, il = pool.page_table[:B], pool.int_len[:B]
    for b in range(B):
        assert torch.equal(gather_dequantize(pool.k[0], pt, b, pool.length(b)), gather_dequantize(kp, pt, b, pool.length(b)))
    segs = Segments(pt, il, int_pos0=pos_t, **seg)
    ref = decode_attention_torch(q, pool.k[0], pool.v[0], segs, kt, vt)
    out = decode_attention(q, kp, vp, segs, kt, vt, backend="triton", launch=MmaLaunch(rope_blocks=rope_blocks))
    rel = float(((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max())
    assert rel < REL_TOL, rel
    plain = decode_attention_torch(q, pool.k[0], pool.v[0], segs, kt.without_rope(), vt)
    assert float(((plain.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max()) > 10 * REL_TOL
    if pos0[0] == pos0[1]:  # an int position gives the same as the tensor
        again = decode_attention(q, kp, vp, Segments(pt, il, int_pos0=pos0[0], **seg), kt, vt, backend="triton",
                                 launch=MmaLaunch(rope_blocks=rope_blocks))
        assert torch.equal(again, out)

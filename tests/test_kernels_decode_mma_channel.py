"""Per-channel key pages (``QuantPages.block = T``) read by the CUDA mma decode kernel (decode_mma.cu, ``CT = T``).

CPU: the kernel's per-channel arithmetic emulated lane by lane from its fragments (the query's fp16 B fragments and
bf16 hi/lo fragments as the CTA stores them, the stage's scales turned to fp16 in place and read by ``ldmatrix``, the
``mul.rn.f16x2`` products, the codes' fp16 subnormals in the score MMAs, the zeros' bf16 MMAs) against the logits of
the torch twin on pages written by the twin writer, within the bound the roundings give; the kernel's split of the
quantized blocks into contiguous runs per warp (every block once, balanced to a block, the query turned at each
channel block a run touches). CUDA: the kernel against the float32 twin on per-channel
pages (tests/test_kernels_decode_mma.py's tolerance), with rope-centered keys, launch options, a CUDA graph, and
pages written by the writer.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pytest
import torch

from oscar.cache.paged import QuantPages, decode_attention, decode_attention_torch, gather_dequantize, \
    rotate_quantize_pack_torch
from oscar.core import quant
from oscar.kernels import decode_mma
from oscar.kernels.launch import MmaLaunch
from oscar.kernels.segments import HeadTransform, Segments

REL_TOL = 1.5e-2
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the mma decode kernel needs a CUDA device")


# ------------------------------------------------------------------------------------------- emulation helpers


def _f16_pair(x0: float, x1: float) -> int:
    """cvt.rn.f16x2.f32: two floats as one word of fp16 halves (x0 low)."""
    h = np.array([x0, x1], dtype=np.float32).astype(np.float16).view(np.uint16)
    return int(h[0]) | (int(h[1]) << 16)


def _bf16_pair(x0: float, x1: float) -> int:
    """cvt.rn.bf16x2.f32 (round to nearest even)."""
    out = 0
    for i, x in enumerate((x0, x1)):
        u = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        out |= (u & 0xFFFF) << (16 * i)
    return out


def _halves(word: int, kind: str) -> tuple[float, float]:
    """The two 16-bit halves of a word as floats (fp16 or bf16)."""
    lo, hi = word & 0xFFFF, word >> 16
    if kind == "f16":
        return tuple(float(v) for v in np.array([lo, hi], dtype=np.uint16).view(np.float16))
    return tuple(float(v) for v in np.array([lo << 16, hi << 16], dtype=np.uint32).view(np.float32))


def _bf16f(word16: int) -> float:
    return float(np.array([(word16 & 0xFFFF) << 16], dtype=np.uint32).view(np.float32)[0])


def _hmul2(a: int, b: int) -> int:
    """mul.rn.f16x2: the product of two fp16 values is exact in float64; one rounding to fp16."""
    (a0, a1), (b0, b1) = _halves(a, "f16"), _halves(b, "f16")
    return _f16_pair(a0 * b0, a1 * b1)


def _mma(a: list, b: list, kind: str) -> np.ndarray:
    """m16n8k16 from per-lane fragment words: a[lane] = (a0, a1, a2, a3), b[lane] = (b0, b1); D [16, 8] float64."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = divmod(lane, 4)
        for (row, col), w in zip(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)), a[lane]):
            A[row, col], A[row, col + 1] = _halves(w, kind)
        for k0, w in zip((2 * t, 2 * t + 8), b[lane]):
            B[k0, g], B[k0 + 1, g] = _halves(w, kind)
    return A @ B


def _slot_j(i: int) -> int:
    return i if i < 5 else i - 5


def _slot(w: int, i: int, bits: int) -> int:
    """slot<I> (INT2) / slot4<I> (INT4) of decode_mma.cu: the codes of one slot as two fp16 subnormals."""
    if bits == 2:
        j = _slot_j(i)
        return ((w if i < 5 else w >> 10) & ((3 << (2 * j)) * 0x10001)) & 0xFFFFFFFF
    return ((w if i < 2 else w >> 8) & ((0xF << (4 * (i & 1))) * 0x10001)) & 0xFFFFFFFF


def _slot_factor(bits: int, j: int, h: int) -> float:
    return 4.0 ** -_slot_j(2 * (j % 4) + h) if bits == 2 else (1 / 16 if h else 1.0)


def emulate_block_logits(q_r: torch.Tensor, block_bytes: torch.Tensor, ks: torch.Tensor, kz: torch.Tensor,
                         bits: int, sc: float, qm: torch.Tensor) -> np.ndarray:
    """Base-2 logits ``[16 tokens, rep]`` of one 16-token block of per-channel keys, as decode_mma.cu computes them.

    ``q_r`` float32 ``[rep, D]`` (rotated query), ``block_bytes`` uint8 ``[16 * D * bits / 8]`` (the block in the
    ``mma_k`` layout), ``ks``/``kz`` bf16 ``[D]`` (its channel block's scales and zeros), ``qm`` ``[rep]``:
    sc q . mu_K.
    """
    rep, D = q_r.shape
    q = q_r.numpy().astype(np.float32)

    def qv(g: int, ch: int) -> float:
        return float(q[g, ch]) if g < rep else 0.0

    # the CTA's fragments (kernel: qb, then s_qc = s_qf [D/32][32] uint4, s_qz [D/16][32] uint4)
    qb = {}
    for lane in range(32):
        g, t = divmod(lane, 4)
        for j in range(D // 16):
            for h in range(2):
                ch, f = 16 * j + 2 * t + 8 * h, _slot_factor(bits, j, h)
                x0, x1 = np.float32(qv(g, ch)) * np.float32(f), np.float32(qv(g, ch + 1)) * np.float32(f)
                qb[lane, j, h] = _f16_pair(x0, x1)
    s_qf = {(c, lane): (qb[lane, 2 * c, 0], qb[lane, 2 * c, 1], qb[lane, 2 * c + 1, 0], qb[lane, 2 * c + 1, 1])
            for c in range(D // 32) for lane in range(32)}
    s_qz = {}
    for lane in range(32):
        g, t = divmod(lane, 4)
        for j in range(D // 16):
            hl = [[0, 0], [0, 0]]
            for h in range(2):
                ch = 16 * j + 2 * t + 8 * h
                x0, x1 = np.float32(qv(g, ch)), np.float32(qv(g, ch + 1))
                hl[0][h] = _bf16_pair(x0, x1)
                lo0 = np.float32(x0 - np.float32(_bf16f(hl[0][h])))
                lo1 = np.float32(x1 - np.float32(_bf16f(hl[0][h] >> 16)))
                hl[1][h] = _bf16_pair(lo0, lo1)
            s_qz[j, lane] = (hl[0][0], hl[1][0], hl[0][1], hl[1][1])  # A fragment: hi rows g, lo rows g + 8
    # the stage's K scales / zeros (bf16 words), the scales turned to fp16 in place
    sw = ks.contiguous().view(torch.int16).numpy().astype(np.uint16).astype(np.int64)
    zw = kz.contiguous().view(torch.int16).numpy().astype(np.uint16).astype(np.int64)
    s_words = [int(sw[2 * i]) | (int(sw[2 * i + 1]) << 16) for i in range(D // 2)]
    z_words = [int(zw[2 * i]) | (int(zw[2 * i + 1]) << 16) for i in range(D // 2)]
    s_words = [_f16_pair(_bf16f(w), _bf16f(w >> 16)) for w in s_words]

    def ldsm(words: list, c: int, lane: int) -> list:  # matrix i: 8 channels from 8 (4c + i); lane (g, t): word t
        return [words[4 * (4 * c + i) + lane % 4] for i in range(4)]

    qc = {}
    for lane in range(32):
        for c in range(D // 32):
            s = ldsm(s_words, c, lane)
            f = s_qf[c, lane]
            for i in range(4):
                qc[lane, 2 * c + i // 2, i % 2] = _hmul2(f[i], s[i])
    dz = np.zeros((16, 8))
    for c in range(D // 32):
        for jj in range(2):
            a = [s_qz[2 * c + jj, lane] for lane in range(32)]
            b = [tuple(ldsm(z_words, c, lane)[2 * jj: 2 * jj + 2]) for lane in range(32)]
            dz += _mma(a, b, "bf16")
    assert np.allclose(dz, dz[:, :1])  # every column of B is the zero vector
    qz = (dz[:8, 0] + dz[8:, 0])[None, :]  # head g: rows g (hi) + g + 8 (lo); lanes of heads 2t, 2t+1 by shuffles
    # the score MMAs of int_block: lane L's D*bits/16 bytes, words of token g then token g + 8
    lb, nu = D * bits // 16, D * bits // 128
    raw = block_bytes.numpy().astype(np.uint8)
    words = [np.frombuffer(raw[lane * lb:(lane + 1) * lb].tobytes(), dtype=np.uint32).astype(np.int64).tolist()
             for lane in range(32)]
    acc = np.zeros((16, 8))
    per = 4 if bits == 2 else 2  # k-chunks per word
    for u in range(nu):
        for p in range(per):
            a, b = [], []
            for lane in range(32):
                w0, w1 = words[lane][u], words[lane][nu + u]
                a.append((_slot(w0, 2 * p, bits), _slot(w1, 2 * p, bits), _slot(w0, 2 * p + 1, bits),
                          _slot(w1, 2 * p + 1, bits)))
                b.append((qc[lane, per * u + p, 0], qc[lane, per * u + p, 1]))
            acc += _mma(a, b, "f16")
    ksc = sc * 2.0**24
    lg = acc * ksc + qz * sc + np.pad(qm.numpy().astype(np.float64), (0, 8 - rep))[None, :]
    return lg[:, :rep]


def _written_pages(d: int, hkv: int, ps: int, block: int, bits: int, n: int, gen: torch.Generator,
                   layout: str = "mma_k", R: Optional[torch.Tensor] = None):
    """Key pages of ``n`` tokens (whole blocks, pages in shuffled order) written by the twin writer from rows with
    large per-channel offsets (what per-channel keys are for), and the page table."""
    npages = -(-n // ps) + 2
    pages = QuantPages.empty(npages, hkv, ps, d, bits, d, layout=layout, block=block)
    table = torch.randperm(npages, generator=gen)[: -(-n // ps)].to(torch.int32)[None]
    offs = 4.0 * torch.randn(hkv, d, generator=gen)
    rows = torch.randn(n, hkv, d, generator=gen) * (0.2 + torch.rand(hkv, d, generator=gen)) + offs
    pos = torch.arange(n)
    slots = table[0, pos // ps].long() * ps + pos % ps
    rotate_quantize_pack_torch(rows, slots, pages, HeadTransform(R=R, block=block))
    return pages, table


@pytest.mark.parametrize("d,bits,block,ps,rep", [(128, 2, 64, 64, 4), (64, 2, 16, 32, 8), (128, 4, 32, 64, 1),
                                                 (64, 4, 64, 128, 2)])
def test_emulated_kernel_logits_match_the_twin(d, bits, block, ps, rep):
    """Each 16-token block's logits through the kernel's per-channel fragments equal the twin's
    ``sm_scale (q_r . (code s + z) + q . mu_K)`` within the roundings' bound: the query's fp16 B fragment and the
    fp16 product with the scale (two roundings of 2^-11 each: 2^-10 relative per channel, times the largest code)
    and q_r = bf16 hi + lo against the exact bf16 zeros (2^-16 relative)."""
    gen = torch.Generator().manual_seed(d + block + bits)
    hkv, n = 2, 2 * block + 32 if block < 64 else block
    n = -(-n // block) * block
    pages, table = _written_pages(d, hkv, ps, block, bits, n, gen)
    q_r = (2.0 * torch.randn(hkv, rep, d, generator=gen)).to(torch.bfloat16).float()
    mu = 0.3 * torch.randn(hkv, d, generator=gen)
    sm_scale = 1 / math.sqrt(d)
    sc = sm_scale * decode_mma.LOG2E
    k_hat = gather_dequantize(pages, table, 0, n).double()  # [Hkv, n, d]
    nb = d * bits // 8
    cmax = 2**bits - 1
    worst = 0.0
    for h in range(hkv):
        qm = torch.tensor([sc * float(q_r[h, r].double() @ mu[h].double()) for r in range(rep)])
        ref = sm_scale * (q_r[h].double() @ k_hat[h].T + (q_r[h].double() @ mu[h].double())[:, None])  # [rep, n]
        for blk in range(n // 16):
            tok0 = 16 * blk
            page, off = int(table[0, tok0 // ps]), tok0 % ps
            raw = pages.codes[page, h].reshape(-1)[off * nb: (off + 16) * nb]
            s, z = pages.scale[page, h, off // block], pages.zero[page, h, off // block]
            got = emulate_block_logits(q_r[h], raw, s, z, bits, sc, qm) / decode_mma.LOG2E  # [16, rep]
            err = np.abs(got.T - ref[:, tok0:tok0 + 16].numpy())
            sf, zf = s.double(), z.double()
            bound = sm_scale * (2**-10 * cmax * (q_r[h].double().abs() @ sf.abs())
                                + 2**-14 * (q_r[h].double().abs() @ zf.abs())).numpy() + 1e-5
            assert (err <= bound[:, None]).all(), (blk, float(err.max()), float(bound.min()))
            worst = max(worst, float((err / bound[:, None]).max()))
    # the zeros' term is large here (the offsets), so dropping it or reading the wrong block would not pass
    assert float(k_hat.abs().mean()) > 2.0 and worst > 0.0


def _runs(nblk: int, s_int: int, W: int, R: int) -> list[list[int]]:
    """The kernel's split of ``nblk`` 16-token blocks of per-channel keys: for each (split, warp) its blocks in loop
    order (a contiguous run of ceil(split blocks / W)), and the loop steps where it turns the query (channel_frags:
    the run's first block, each channel block's first)."""
    per = -(-nblk // s_int)
    out = []
    for split in range(s_int):
        lo, hi = split * per, min(nblk, split * per + per)
        c = -(-max(0, hi - lo) // W)
        start = lo + 0
        for warp in range(W):
            first = start + warp * c
            n_w = max(0, min(hi, first + c) - first)
            blocks = [first + k for k in range(n_w)]
            turns = [k for k in range(n_w) if k == 0 or blocks[k] % R == 0]
            out.append((blocks, turns))
    return out


@pytest.mark.parametrize("nblk,s_int,W,R", [(1, 1, 8, 4), (37, 3, 8, 2), (2028, 9, 8, 4), (8172, 33, 8, 2),
                                            (61, 7, 4, 4), (9, 2, 2, 1), (513, 5, 8, 8)])
def test_kernel_runs_cover_every_block_once(nblk, s_int, W, R):
    """Every block is read once, a warp's run is contiguous and at most one block longer than the split's mean over
    its warps (the per-token kernel's balance), and the query is turned once per channel block the run touches (its
    first block's and each later channel block's), so every block sees its own channel block's scales."""
    runs = _runs(nblk, s_int, W, R)
    assert sorted(b for blocks, _ in runs for b in blocks) == list(range(nblk))
    per = -(-nblk // s_int)
    for blocks, turns in runs:
        assert blocks == list(range(blocks[0], blocks[0] + len(blocks))) if blocks else True
        assert len(blocks) <= -(-per // W)
        for k, b in enumerate(blocks):  # the latest turn at or before k is in b's channel block
            last = max(x for x in turns if x <= k)
            assert blocks[last] // R == b // R
        assert len(turns) == len({b // R for b in blocks})


def test_channel_launch_sizes():
    """The per-channel stage holds the V scales/zeros of 16 tokens and a channel block's K scales and zeros."""
    assert decode_mma.stage_bytes(128, 2, 64) == 2 * 512 + 64 + 512
    assert decode_mma.stage_bytes(128, 2) == 2 * 512 + 128
    assert decode_mma.kernel_name(128, 4, 8, 4, 2, 8, 2, 64) == "oscar_decode_mma<128,2,4,8,4,2,8,64>"
    assert decode_mma.shared_bytes(128, 4, 8, 4, block=64) <= decode_mma.shared_limit(2, 2)
    assert decode_mma.CHANNEL_KEYS


# ---------------------------------------------------------------------------------------------- CUDA


def _channel_case(*, B, H, hkv, d, ps, block, int_lens, S0, W, seed, bits=2, rotate=True, dev="cuda"):
    """Random codes in mma_k pages with per-channel scales/zeros (large offsets), per-token V pages, shuffled page
    tables, BF16 windows, transforms."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    max_pages = max(1, max(-(-n // ps) for n in int_lens))
    npages = B * max_pages + 3
    perm = torch.randperm(npages, device=dev, generator=gen)
    page_table = perm[: B * max_pages].to(torch.int32).reshape(B, max_pages)
    nb = d * bits // 8

    def mma_codes(layout):
        codes = torch.randint(0, 2**bits, (npages, hkv, ps, d), device=dev, generator=gen, dtype=torch.uint8)
        tb = (torch.arange(ps, device=dev) % 16).expand(npages, hkv, ps)
        packed = quant.pack_codes_mma(codes, tb, layout, bits)
        blocks = torch.zeros(npages, hkv, ps // 16, 16 * nb, dtype=torch.uint8, device=dev)
        _, byte_index = quant.mma_token_map(d, layout, bits)
        idx = byte_index.to(dev).expand(npages, hkv, ps // 16, 16, nb).reshape(npages, hkv, ps // 16, -1)
        blocks.scatter_(-1, idx, packed.reshape(npages, hkv, ps // 16, -1))
        return blocks.reshape(npages, hkv, ps, nb)

    ks = (0.02 + 0.3 * torch.rand(npages, hkv, ps // block, d, device=dev, generator=gen)).to(torch.bfloat16)
    kz = (3.0 * torch.randn(npages, hkv, 1, d, device=dev, generator=gen)
          + 0.3 * torch.randn(npages, hkv, ps // block, d, device=dev, generator=gen)).to(torch.bfloat16)
    kp = QuantPages(mma_codes("mma_k"), ks, kz, bits, d, "mma_k", block)
    vs = (0.02 + 0.1 * torch.rand(npages, hkv, ps, 1, device=dev, generator=gen)).to(torch.bfloat16)
    vz = (-0.15 * torch.rand(npages, hkv, ps, 1, device=dev, generator=gen)).to(torch.bfloat16)
    vp = QuantPages(mma_codes("mma_v"), vs, vz, bits, d, "mma_v")

    def orth():
        return torch.linalg.qr(torch.randn(hkv, d, d, device=dev, generator=gen, dtype=torch.float64))[0].float()

    kt = HeadTransform(R=orth() if rotate else None, mu=0.3 * torch.randn(hkv, d, device=dev, generator=gen),
                       block=block)
    vt = HeadTransform(R=orth() if rotate else None, mu=0.2 * torch.randn(hkv, d, device=dev, generator=gen))
    seg = {}
    if S0:
        seg.update(sink_k=torch.randn(B, hkv, S0, d, device=dev, generator=gen).to(torch.bfloat16),
                   sink_v=torch.randn(B, hkv, S0, d, device=dev, generator=gen).to(torch.bfloat16),
                   sink_len=torch.full((B,), S0, dtype=torch.int32, device=dev))
    if W:
        seg.update(recent_k=torch.randn(B, hkv, W, d, device=dev, generator=gen).to(torch.bfloat16),
                   recent_v=torch.randn(B, hkv, W, d, device=dev, generator=gen).to(torch.bfloat16),
                   recent_len=torch.tensor([(W * (b + 1)) // B for b in range(B)], dtype=torch.int32, device=dev))
    q = (0.5 * torch.randn(B, H, d, device=dev, generator=gen)).to(torch.bfloat16)
    int_len = torch.tensor(int_lens, dtype=torch.int32, device=dev)
    return q, kp, vp, page_table, int_len, kt, vt, seg


def _rel(out, ref):
    return float(((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max())


CASES = [
    dict(B=3, H=32, hkv=8, d=128, ps=64, block=64, int_lens=[1024, 64, 4096], S0=64, W=256),
    dict(B=2, H=32, hkv=8, d=128, ps=64, block=32, int_lens=[2016, 96], S0=16, W=64),
    dict(B=2, H=16, hkv=2, d=64, ps=16, block=16, int_lens=[512, 2048], S0=64, W=256),
    dict(B=2, H=8, hkv=8, d=128, ps=128, block=128, int_lens=[0, 768], S0=8, W=40),
    dict(B=2, H=8, hkv=2, d=128, ps=64, block=64, int_lens=[1000, 77], S0=0, W=0),  # partial blocks: masked
    dict(B=3, H=32, hkv=8, d=128, ps=64, block=64, int_lens=[1024, 64, 4096], S0=64, W=256, bits=4),
    dict(B=2, H=16, hkv=2, d=64, ps=32, block=32, int_lens=[512, 2048], S0=64, W=256, bits=4),
]


@CUDA
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("frame", ["original", "rotated"])
def test_cuda_channel_keys_match_twin(case, frame):
    q, kp, vp, pt, il, kt, vt, seg = _channel_case(seed=case, **CASES[case])
    segs = Segments(pt, il, **seg)
    ref = decode_attention_torch(q, kp, vp, segs, kt, vt, output_frame=frame)
    out = decode_attention(q, kp, vp, segs, kt, vt, output_frame=frame, backend="triton")
    assert out.dtype == q.dtype and torch.isfinite(out.float()).all()
    assert _rel(out, ref) < REL_TOL
    # the per-channel zeros matter: the same codes read as per-token pages (scale/zero of slot 0's block) are far off
    wrong = QuantPages(kp.codes, kp.scale[:, :, :1, :1].expand(-1, -1, kp.page_size, 1).contiguous(),
                       kp.zero[:, :, :1, :1].expand(-1, -1, kp.page_size, 1).contiguous(), kp.bits, kp.group_size,
                       "mma_k")
    if max(CASES[case]["int_lens"]) > 0:
        assert _rel(decode_attention(q, wrong, vp, segs, HeadTransform(kt.R, kt.mu), vt, output_frame=frame,
                                     backend="triton"), ref) > 5 * REL_TOL
    again = decode_attention(q, kp, vp, segs, kt, vt, output_frame=frame, backend="triton")
    assert torch.equal(out, again)


@CUDA
@pytest.mark.parametrize("launch,d", [(MmaLaunch(num_splits=1), 128),
                                      (MmaLaunch(num_splits=7, warps=4, min_blocks=1, stages=6), 128),
                                      (MmaLaunch(warps=2, stages=2), 64),
                                      (MmaLaunch(stages=3, num_splits=64, min_blocks=1), 128)])
def test_cuda_channel_keys_launch_options(launch, d):
    spec = dict(CASES[0], d=d) if d == 128 else dict(CASES[2])
    q, kp, vp, pt, il, kt, vt, seg = _channel_case(seed=11, rotate=False, **spec)
    segs = Segments(pt, il, **seg)
    ref = decode_attention_torch(q, kp, vp, segs, kt, vt)
    assert _rel(decode_attention(q, kp, vp, segs, kt, vt, backend="triton", launch=launch), ref) < REL_TOL


@CUDA
@pytest.mark.parametrize("block,rope_blocks,d,ps", [(64, 8, 128, 64), (32, 16, 128, 64), (16, 4, 64, 64),
                                                    (128, 4, 128, 128)])
def test_cuda_channel_keys_with_rope_term(block, rope_blocks, d, ps):
    """Rope turns of any length over a warp's contiguous run (the table's block stride is 1 for per-channel keys)."""
    spec = dict(CASES[0], block=block, ps=ps, d=d)
    q, kp, vp, pt, il, kt, vt, seg = _channel_case(seed=block + d, **spec)
    gen = torch.Generator(device="cuda").manual_seed(3)
    m = 3.0 * torch.randn(kt.mu.shape, device="cuda", generator=gen)
    m[0] = 0.0
    inv = 1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64, device="cuda") / d)
    kr = HeadTransform(kt.R, kt.mu, rope_mu=m, rope_freq=inv, rope_scaling=1.05, block=block)
    pos0 = torch.tensor([64, 70001, 5], dtype=torch.int32, device="cuda")
    segs = Segments(pt, il, int_pos0=pos0, **seg)
    ref = decode_attention_torch(q, kp, vp, segs, kr, vt)
    out = decode_attention(q, kp, vp, segs, kr, vt, backend="triton", launch=MmaLaunch(rope_blocks=rope_blocks))
    assert _rel(out, ref) < REL_TOL
    plain = decode_attention_torch(q, kp, vp, segs, kt, vt)
    assert _rel(plain, ref) > 5 * REL_TOL  # the term matters here


@CUDA
def test_cuda_channel_keys_in_a_cuda_graph():
    q, kp, vp, pt, il, kt, vt, seg = _channel_case(seed=5, **CASES[0])
    args = (kp, vp, Segments(pt, il, **seg), kt, vt)
    eager = decode_attention(q, *args, backend="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, *args, backend="triton")
    q.copy_(0.5 * torch.randn_like(q))
    il[0] += 64  # lengths are read on the device at replay (one more whole block)
    graph.replay()
    torch.cuda.synchronize()
    ref = decode_attention_torch(q, kp, vp, Segments(pt, il, **seg), kt, vt)
    assert _rel(out, ref) < REL_TOL and not torch.equal(out, eager)


@CUDA
@pytest.mark.parametrize("d,block,bits", [(128, 64, 2), (64, 32, 2), (128, 32, 4)])
def test_cuda_channel_keys_written_by_the_writer(d, block, bits):
    """Keys written by the twin writer (rotation, per-channel blocks) into mma_k and rows pages: the kernel on the mma
    pages against the twin on the row pages (the same codes)."""
    gen = torch.Generator().manual_seed(d + block)
    hkv, H, ps, n = 2, 8, 64, 40 * block
    R = torch.linalg.qr(torch.randn(hkv, d, d, generator=gen, dtype=torch.float64))[0].float()
    kp, table = _written_pages(d, hkv, ps, block, bits, n, torch.Generator().manual_seed(1), "mma_k", R)
    kr, table_r = _written_pages(d, hkv, ps, block, bits, n, torch.Generator().manual_seed(1), "rows", R)
    assert torch.equal(table, table_r)
    vals = torch.randint(0, 2**bits, (kp.codes.shape[0], hkv, ps, d), generator=gen, dtype=torch.uint8)
    vs = (0.02 + 0.1 * torch.rand(kp.codes.shape[0], hkv, ps, 1, generator=gen)).to(torch.bfloat16)
    vz = (-0.1 * torch.rand(kp.codes.shape[0], hkv, ps, 1, generator=gen)).to(torch.bfloat16)
    v_rows = QuantPages(quant.pack_codes(vals, bits, d), vs, vz, bits, d)
    tb = (torch.arange(ps) % 16).expand(kp.codes.shape[0], hkv, ps)
    packed = quant.pack_codes_mma(vals, tb, "mma_v", bits)
    v_mma = QuantPages.empty(kp.codes.shape[0], hkv, ps, d, bits, d, layout="mma_v")
    page, off = torch.arange(kp.codes.shape[0]).repeat_interleave(ps), torch.arange(ps).repeat(kp.codes.shape[0])
    flat = v_mma.codes.view(kp.codes.shape[0], hkv, -1)
    flat[page[:, None, None], torch.arange(hkv)[None, :, None], v_mma.block_bytes(page, off)[:, None, :]] = \
        packed.permute(0, 2, 1, 3).reshape(-1, hkv, d * bits // 8)
    v_mma = QuantPages(v_mma.codes, vs, vz, bits, d, "mma_v")
    kt = HeadTransform(R=R, mu=0.2 * torch.randn(hkv, d, generator=gen), block=block)
    vt = HeadTransform(R=R.flip(1))
    q = torch.randn(1, H, d, generator=gen).to(torch.bfloat16)
    il = torch.tensor([n], dtype=torch.int32)
    ref = decode_attention_torch(q, kr, v_rows, Segments(table, il), kt, vt)
    assert torch.equal(ref, decode_attention_torch(q, kp, v_mma, Segments(table, il), kt, vt))  # same codes
    dev = "cuda"

    def mv(p):
        return QuantPages(p.codes.to(dev), p.scale.to(dev), p.zero.to(dev), p.bits, p.group_size, p.layout, p.block)

    out = decode_attention(q.to(dev), mv(kp), mv(v_mma), Segments(table.to(dev), il.to(dev)), kt.to(dev), vt.to(dev),
                           backend="triton")
    assert _rel(out.cpu(), ref) < REL_TOL

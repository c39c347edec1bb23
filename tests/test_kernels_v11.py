"""Decode kernel v11 (oscar.kernels.decode_v11): the page record and the kernel's fragment arithmetic.

CPU: the record layout (offsets, alignment, per-channel key blocks), the torch twin writers' round trips (exact,
per-token and per-channel key records), the codes as the kernel's lanes read them out of a record (2-bit slots of
half words, the v9 subnormal trick) equal to the format's codes (exact), and an emulation of the kernel (query
rotated in fp16, 64-token softmax steps per math warp, p * s_V rounded to fp16, split-K and warp merge; rope-centered
keys: the per-page turn of the rope term's fp16 B fragments and the fp16 cos/sin table; per-channel keys: the query
times the block's scales in fp16, q_r . z per block) against the float32 dequantize-then-attend twin (1.5e-2 relative
error per head, the tolerance of the v10 kernel for the same roundings). CUDA: the kernel against the twin on the same
records.
"""

from __future__ import annotations

import math

import pytest
import torch

from oscar.cache.paged import QuantPages, decode_attention_torch
from oscar.core import quant
from oscar.kernels.decode_mma import rope_table
from oscar.kernels.decode_v11 import (RecordLayout, V11Launch, default_num_splits, pack_pages, pack_records,
                                      unpack_records, write_key_blocks, write_tokens)
from oscar.kernels.segments import HeadTransform, Segments

REL_TOL = 1.5e-2
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the v11 kernel needs a CUDA device (sm_90)")


def _pages(npages, hkv, ps, d, gen, dev, name, block=0):
    codes = torch.randint(0, 4, (npages, hkv, ps, d), device=dev, generator=gen, dtype=torch.uint8)
    meta = (npages, hkv, ps // block, d) if block else (npages, hkv, ps, 1)
    scale = (0.02 + 0.1 * torch.rand(meta, device=dev, generator=gen)).to(torch.bfloat16)
    zero = (-0.15 * torch.rand(meta, device=dev, generator=gen)).to(torch.bfloat16)
    tb = (torch.arange(ps, device=dev) % 16).expand(npages, hkv, ps)
    packed = quant.pack_codes_mma(codes, tb, f"mma_{name}", 2)
    nb = d // 4
    blocks = torch.zeros(npages, hkv, ps // 16, 16 * nb, dtype=torch.uint8, device=dev)
    _, byte_index = quant.mma_token_map(d, f"mma_{name}", 2)
    idx = byte_index.to(dev).expand(npages, hkv, ps // 16, 16, nb).reshape(npages, hkv, ps // 16, -1)
    blocks.scatter_(-1, idx, packed.reshape(npages, hkv, ps // 16, -1))
    return codes, QuantPages(blocks.reshape(npages, hkv, ps, nb), scale, zero, 2, d, f"mma_{name}", block)


def _rope(hkv, d, rotary, gen, dev, scaling=1.0, theta=10000.0, m_scale=3.0):
    """The rope-centered fields of a key transform: means [Hkv, d] (head 0 not centered), frequencies, scaling."""
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64, device=dev) / rotary)
    m = m_scale * torch.randn(hkv, d, device=dev, generator=gen)
    m[0] = 0.0
    return dict(rope_mu=m, rope_freq=inv, rope_scaling=scaling)


def _case(*, B, H, hkv, d, ps, int_lens, seed, windows=False, dev="cpu", block=0, rope=None, pos0=None):
    """Random pages, records, windows and transforms. ``block``: per-channel keys over blocks of that many tokens;
    ``rope``: ``(rotary_dim, scaling)`` for rope-centered keys, with ``pos0`` (int, or a list: one per sequence)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    max_pages = max(1, max(-(-n // ps) for n in int_lens))
    npages = B * max_pages + 3
    page_table = torch.randperm(npages, device=dev, generator=gen)[: B * max_pages].to(torch.int32).reshape(B, -1)
    k_codes, kp = _pages(npages, hkv, ps, d, gen, dev, "k", block)
    v_codes, vp = _pages(npages, hkv, ps, d, gen, dev, "v")

    def orth():
        return torch.linalg.qr(torch.randn(hkv, d, d, device=dev, generator=gen, dtype=torch.float64))[0].float()

    extra = _rope(hkv, d, rope[0], gen, dev, scaling=rope[1]) if rope else {}
    kt = HeadTransform(R=orth(), mu=0.3 * torch.randn(hkv, d, device=dev, generator=gen), block=block, **extra)
    vt = HeadTransform(R=orth(), mu=0.2 * torch.randn(hkv, d, device=dev, generator=gen))
    seg = {}
    if windows:
        for name, n in (("sink", 64), ("recent", 256)):
            seg[f"{name}_k"] = torch.randn(B, hkv, n, d, device=dev, generator=gen).to(torch.bfloat16)
            seg[f"{name}_v"] = torch.randn(B, hkv, n, d, device=dev, generator=gen).to(torch.bfloat16)
            seg[f"{name}_len"] = torch.randint(1, n + 1, (B,), device=dev, generator=gen).to(torch.int32)
    q = (2.0 * torch.randn(B, H, d, device=dev, generator=gen)).to(torch.bfloat16)
    if rope:
        seg["int_pos0"] = torch.tensor(pos0, dtype=torch.int32, device=dev) if isinstance(pos0, list) else pos0
    segs = Segments(page_table, torch.tensor(int_lens, dtype=torch.int32, device=dev), **seg)
    rec, layout = pack_pages(kp, vp)
    assert layout == RecordLayout(d, ps, key_block=block)
    return dict(q=q, kp=kp, vp=vp, k_codes=k_codes, v_codes=v_codes, segs=segs, kt=kt, vt=vt, rec=rec, layout=layout)


def _rel(out, ref):
    return float(((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max())


# ------------------------------------------------------------------------------------------------ the record


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ps", [16, 64, 128])
def test_record_sections_are_aligned_and_sized(d, ps):
    lay = RecordLayout(d, ps)
    assert (lay.k_off, lay.v_off, lay.meta_off) == (0, ps * d // 4, ps * d // 2)
    assert lay.bytes == ps * d // 2 + 8 * ps and lay.bytes % 16 == 0  # 72 B per token at d=128, as the pages
    assert all(off % 16 == 0 for off in (lay.v_off, lay.meta_off, lay.chan_off))
    ch = RecordLayout(d, ps, key_block=16)  # per-channel key blocks: room after the meta
    assert ch.chan_bytes == (ps // 16) * 4 * d and ch.bytes == lay.bytes + ch.chan_bytes


@pytest.mark.parametrize("bad", [dict(d=96, page_size=64), dict(d=128, page_size=48), dict(d=128, page_size=64, bits=4),
                                 dict(d=128, page_size=64, key_block=24)])
def test_record_layout_refuses_what_it_does_not_cover(bad):
    with pytest.raises(ValueError, match="RecordLayout"):
        RecordLayout(**bad)


@pytest.mark.parametrize("d,ps", [(128, 64), (64, 16), (128, 128)])
def test_twin_writer_round_trips_and_places_the_meta(d, ps):
    c = _case(B=2, H=8, hkv=2, d=d, ps=ps, int_lens=[3 * ps, ps + 5], seed=d + ps)
    kp, vp, rec, lay = c["kp"], c["vp"], c["rec"], c["layout"]
    back = unpack_records(rec, lay)
    for got, want in zip(back, (kp.codes, kp.scale, kp.zero, vp.codes, vp.scale, vp.zero)):
        assert torch.equal(got, want)
    # entry g of tile j: bf16 ks[16j+g], ks[16j+g+8], kz.., vs.., vz..
    meta = rec[..., lay.meta_off:lay.meta_off + 8 * ps].contiguous().view(torch.bfloat16).reshape(*rec.shape[:2], -1, 8, 8)
    j, g = ps // 16 - 1, 5
    for a, t in enumerate((kp.scale, kp.zero, vp.scale, vp.zero)):
        assert torch.equal(meta[:, :, j, g, 2 * a], t[:, :, 16 * j + g, 0])
        assert torch.equal(meta[:, :, j, g, 2 * a + 1], t[:, :, 16 * j + g + 8, 0])


@pytest.mark.parametrize("d,ps,block", [(128, 64, 64), (64, 32, 16), (128, 128, 32)])
def test_channel_records_round_trip_and_place_the_blocks(d, ps, block):
    c = _case(B=2, H=8, hkv=2, d=d, ps=ps, int_lens=[2 * ps, block], seed=d + block, block=block)
    kp, vp, rec, lay = c["kp"], c["vp"], c["rec"], c["layout"]
    assert lay.bytes == ps * d // 2 + 8 * ps + (ps // block) * 4 * d and lay.bytes % 16 == 0
    for got, want in zip(unpack_records(rec, lay), (kp.codes, kp.scale, kp.zero, vp.codes, vp.scale, vp.zero)):
        assert torch.equal(got, want)
    chan = rec[..., lay.chan_off:lay.chan_off + lay.chan_bytes].contiguous().view(torch.bfloat16)
    chan = chan.reshape(*rec.shape[:2], ps // block, 2, d)  # block j: scale[d], then zero[d]
    j = ps // block - 1
    assert torch.equal(chan[:, :, j, 0], kp.scale[:, :, j]) and torch.equal(chan[:, :, j, 1], kp.zero[:, :, j])
    meta = rec[..., lay.meta_off:lay.meta_off + 8 * ps].contiguous().view(torch.bfloat16).reshape(*rec.shape[:2], -1, 8, 8)
    assert not meta[..., :4].any()  # the K words of the entries stay zero
    assert torch.equal(meta[:, :, 0, 3, 4], vp.scale[:, :, 3, 0])


def test_pack_pages_refuses_what_records_do_not_hold():
    c = _case(B=1, H=4, hkv=2, d=64, ps=32, int_lens=[32], seed=5)
    with pytest.raises(ValueError, match="mma_k"):
        pack_pages(c["vp"], c["vp"])
    with pytest.raises(ValueError, match="k_scale"):
        pack_records(c["kp"].codes, c["kp"].scale, c["kp"].zero, c["vp"].codes, c["vp"].scale, c["vp"].zero,
                     RecordLayout(64, 32, key_block=16))


@pytest.mark.parametrize("d,ps,block", [(128, 64, 0), (64, 32, 0), (128, 64, 32)])
def test_token_writer_fills_records_as_the_page_writer(d, ps, block):
    c = _case(B=1, H=4, hkv=2, d=d, ps=ps, int_lens=[2 * ps], seed=11, block=block)
    kp, vp, lay = c["kp"], c["vp"], c["layout"]
    npages, hkv = kp.codes.shape[:2]
    slots = torch.randperm(npages * ps, generator=torch.Generator().manual_seed(0))  # any order
    page, off = slots // ps, slots % ps
    tb = off % 16

    def token_bytes(codes, name):  # [N, Hkv, d] codes -> each token's packed bytes for its tile position
        return quant.pack_codes_mma(codes[page, :, off], tb[:, None].expand(-1, hkv), f"mma_{name}", 2)

    def meta(pages):
        return torch.stack([pages.scale[page, :, off, 0], pages.zero[page, :, off, 0]], dim=-1)

    rec = torch.zeros_like(c["rec"])
    maps = (quant.mma_token_map(d, "mma_k")[1], quant.mma_token_map(d, "mma_v")[1])
    for chunk in torch.arange(slots.numel()).split(37):  # several calls, as steps of a cache would
        sl = chunk.tolist()
        write_tokens(rec, lay, slots[sl], token_bytes(c["k_codes"], "k")[sl], token_bytes(c["v_codes"], "v")[sl],
                     None if block else meta(kp)[sl], meta(vp)[sl], maps)
    if block:  # the key blocks' per-channel scale/zero, blocks in any order
        first = torch.randperm(npages * ps // block, generator=torch.Generator().manual_seed(1)) * block
        bp, bj = first // ps, (first % ps) // block
        write_key_blocks(rec, lay, first, kp.scale[bp, :, bj], kp.zero[bp, :, bj])
    assert torch.equal(rec, c["rec"])


@pytest.mark.parametrize("bad", [dict(warps=3), dict(warps=4, stages=6), dict(num_splits=0), dict(min_blocks=5)])
def test_launch_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="V11Launch"):
        V11Launch(**bad)


@pytest.mark.parametrize("batch,pages", [(1, 59), (1, 2044), (8, 512), (32, 2044), (128, 3)])
def test_default_splits_give_each_math_warp_two_pages(batch, pages):
    launch = V11Launch()
    s = default_num_splits(batch, 8, pages, launch)
    assert 1 <= s <= max(1, math.ceil(pages / (2 * launch.warps)))
    if batch * 8 >= 64 and pages >= 2 * launch.warps * s:  # two waves of SM slots from 64 pairs, when pages allow
        assert batch * 8 * s >= 2 * 132 * 3


# ------------------------------------------------------------------ the kernel's lanes, emulated on the CPU


def _slot_j(i):
    return i if i < 5 else i - 5


def lane_map(d, which):
    """Where the kernel's lanes find each code of a 16-token tile (decode_v11.cu ``int_step``): int64 ``[16, d]``
    tensors (byte in the tile's section, bit shift in it, power J of the code's subnormal ``c 4^J 2^-24``).

    Lane (g, t) loads its ``d/8`` bytes at ``lane * d/8``: words ``u < d/64`` of token g (keys) or token pair
    (2t, 2t+1) (values), then words of token g + 8 (pair 2t + 8). Slot I of a half word (``slot<I>``) is bits 2I
    (I < 5) or 10 + 2J (I >= 5, J = I - 5) and feeds k-chunk / output rows ``4u + I//2``, half ``I % 2``."""
    nu, lb = d // 64, d // 8
    byte = torch.full((16, d), -1, dtype=torch.int64)
    shift, jpow = torch.zeros_like(byte), torch.zeros_like(byte)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for p in range(2):
            for u in range(nu):
                for h in range(2):
                    for i in range(8):
                        bit = 2 * i if i < 5 else 10 + 2 * (i - 5)
                        chunk = 4 * u + i // 2
                        if which == "k":
                            tok, ch = g + 8 * p, 16 * chunk + 2 * t + 8 * (i % 2) + h
                        else:
                            tok, ch = 2 * t + h + 8 * p, 16 * chunk + g + 8 * (i % 2)
                        assert byte[tok, ch] < 0, "two slots for one code"
                        byte[tok, ch] = lane * lb + 4 * (p * nu + u) + 2 * h + bit // 8
                        shift[tok, ch], jpow[tok, ch] = bit % 8, _slot_j(i)
    assert (byte >= 0).all()
    return byte, shift, jpow


def lane_codes(rec_section, d, which):
    """Codes ``[..., PS, d]`` of a record section (``[..., PS*d/4]`` bytes) read the kernel's way."""
    byte, shift, _ = lane_map(d, which)
    tiles = rec_section.reshape(*rec_section.shape[:-1], -1, 4 * d).long()  # [..., PS/16, 16 * d/4]
    got = torch.gather(tiles.unsqueeze(-2).expand(*tiles.shape[:-1], 16, tiles.shape[-1]), -1,
                       byte.expand(*tiles.shape[:-1], 16, d))
    return ((got >> shift) & 3).reshape(*rec_section.shape[:-1], -1, d).to(torch.uint8)


@pytest.mark.parametrize("d,ps", [(128, 64), (64, 32)])
def test_lanes_read_the_formats_codes_out_of_a_record(d, ps):
    c = _case(B=1, H=4, hkv=2, d=d, ps=ps, int_lens=[2 * ps], seed=7)
    lay, rec = c["layout"], c["rec"]
    cb = lay.code_bytes
    assert torch.equal(lane_codes(rec[..., lay.k_off:lay.k_off + cb], d, "k"), c["k_codes"])
    assert torch.equal(lane_codes(rec[..., lay.v_off:lay.v_off + cb], d, "v"), c["v_codes"])


def _rope_term_emulated(q, kt, h, sc, ps, pos):
    """The rope term of the kernel for one KV head and one page at position ``pos``: ``[PS, rep]`` float32 from the
    turned fp16 B fragments (``rope_turn``: A, B in float32, angles reduced in float64, cos/sin in float32) and the fp16
    table of ``decode_mma.rope_table`` (stride one tile), summed in float32."""
    d = q.shape[-1]
    nf = int(kt.rope_freq.numel())
    m = kt.rope_mu[h].float()
    f = sc * kt.rope_scaling
    q1, q2 = q[:, :nf], q[:, nf:2 * nf]
    A = torch.zeros(q.shape[0], d // 2)
    Bv = torch.zeros(q.shape[0], d // 2)
    A[:, :nf] = f * (q1 * m[:nf] + q2 * m[nf:2 * nf])
    Bv[:, :nf] = f * (q2 * m[:nf] - q1 * m[nf:2 * nf])
    w = torch.zeros(d // 2, dtype=torch.float64)
    w[:nf] = kt.rope_freq.double()
    ang = pos * w
    ang = ang - torch.round(ang / (2 * math.pi)) * (2 * math.pi)
    c, sn = ang.cos().float(), ang.sin().float()
    ub = torch.cat([c * A + sn * Bv, c * Bv - sn * A], dim=-1).half().float()  # [rep, d]
    tab = rope_table(kt.rope_freq, d, 1, ps // 16)  # fragments -> E[x, channel] fp16
    x = torch.arange(ps, dtype=torch.float64)[:, None] * w
    E = torch.cat([x.cos(), x.sin()], dim=-1).half().float()  # the values the table's fragments hold
    assert tab.dtype == torch.int32 and tab.shape == (ps // 16, d // 16, 32, 4)
    return E @ ub.T


def emulate_v11(q, rec, lay, segs, kt, vt, *, sm_scale, launch, output_frame="original"):
    """The kernel's arithmetic on the CPU (quantized pages only): fp16 query fragments times the codes' subnormals
    (float32 sums), logits ``s_K sc 2^24 (q.c) + z_K sum(q) + q.mu_K`` (per-channel keys: the fp16 fragments times the
    block's fp16 scales, ``sc 2^24 (q s . c) + sc q_r . z + q.mu_K``; rope-centered keys: plus the rope term of
    ``_rope_term_emulated`` and ``q . m`` on the channels RoPE leaves alone), 64-token online-softmax steps per math
    warp (base 2), ``p s_V`` rounded to fp16 for the value products, the warps' and splits' partials merged exactly."""
    B, H, d = q.shape
    hkv = rec.shape[1]
    rep, ps, T = H // hkv, lay.page_size, lay.key_block
    sc = sm_scale * math.log2(math.e)
    cb = lay.code_bytes
    _, _, jk = lane_map(d, "k")
    _, _, jv = lane_map(d, "v")
    kcodes = lane_codes(rec[..., lay.k_off:lay.k_off + cb], d, "k").float()  # [P, Hkv, PS, d]
    vcodes = lane_codes(rec[..., lay.v_off:lay.v_off + cb], d, "v").float()
    tok = torch.arange(ps) % 16
    ksub = kcodes * torch.pow(4.0, jk[tok].float()) * 2.0**-24  # the fp16 registers' values (exact subnormals)
    vsub = vcodes * torch.pow(4.0, jv[tok].float()) * 2.0**-24
    fk = torch.pow(4.0, -jk[0].float())  # the factor of each channel (same for every token of a key tile)
    fv = torch.pow(4.0, -jv[0].float())  # rows 16m + g (+8) of the output
    _, ks, kz, _, vs, vz = (t.float() for t in unpack_records(rec, lay))
    steps = min(ps, 64)
    pages_per_seq = segs.page_table.shape[1]
    s_int = launch.num_splits or default_num_splits(B, hkv, pages_per_seq, launch)
    rope = kt.rope_centered
    out = torch.zeros(B, H, d)
    for b in range(B):
        n_tok = int(segs.int_len[b])
        npg = -(-n_tok // ps)
        per = -(-npg // s_int)
        if rope:
            p0 = segs.int_pos0
            pos0 = int(p0[b]) if isinstance(p0, torch.Tensor) else int(p0)
        for h in range(hkv):
            qh = q[b, h * rep:(h + 1) * rep].float()  # bf16 values
            qrot = qh.half().float() @ kt.R[h].half().float()
            qb = (qrot * fk).half().float()  # [rep, d] fp16 B fragments
            qs = (qb / fk).sum(-1) * sc
            mk = kt.mu[h].clone()
            if rope:
                mk[2 * int(kt.rope_freq.numel()):] += kt.rope_mu[h, 2 * int(kt.rope_freq.numel()):]
            qm = (qh @ mk) * sc
            parts = []  # (m, l, o[rep, d]) of each warp
            for split in range(s_int):
                lo, hi = split * per, min(npg, split * per + per)
                for w in range(launch.warps):
                    m = torch.full((rep,), -math.inf)
                    l, zs = torch.zeros(rep), torch.zeros(rep)
                    o = torch.zeros(rep, d)
                    for i in range(lo + w, hi, launch.warps):
                        page = int(segs.page_table[b, i])
                        rterm = _rope_term_emulated(qh, kt, h, sc, ps, pos0 + i * ps) if rope else None
                        for s0 in range(0, ps, steps):
                            t0 = i * ps + s0
                            nv = min(steps, n_tok - t0)
                            if nv <= 0:
                                break
                            sl = slice(s0, s0 + steps)
                            if T:  # per-channel keys: per 16-token tile the block's query fragments
                                lg = torch.empty(steps, rep)
                                for t in range(s0, s0 + steps, 16):
                                    j = t // T
                                    qc = (qb * ks[page, h, j].half().float()).half().float()
                                    acc = ksub[page, h, t:t + 16] @ qc.T
                                    qz = qrot @ kz[page, h, j]
                                    lg[t - s0:t - s0 + 16] = acc * (sc * 2.0**24) + (qz * sc + qm)
                            else:
                                acc = ksub[page, h, sl] @ qb.T  # [steps, rep]
                                lg = acc * (ks[page, h, sl] * sc * 2.0**24) + (kz[page, h, sl] * qs + qm)
                            if rope:
                                lg = lg + rterm[sl]
                            lg[nv:] = -math.inf
                            mn = torch.maximum(m, lg.max(0).values)
                            alpha = torch.exp2(m - mn)
                            p = torch.exp2(lg - mn)
                            svv, zvv = vs[page, h, sl].clone(), vz[page, h, sl].clone()
                            svv[nv:], zvv[nv:] = 0, 0
                            pv = (p * svv).half().float()
                            o = o * alpha[:, None] + pv.T @ vsub[page, h, sl]
                            l = l * alpha + p.sum(0)
                            zs = zs * alpha + (p * zvv).sum(0)
                            m = mn
                    if math.isfinite(float(m.max())) or hi > lo:
                        parts.append((m, l, o * fv * 2.0**24 + zs[:, None]))
            mx = torch.stack([p[0] for p in parts]).max(0).values
            num, den = torch.zeros(rep, d), torch.zeros(rep)
            for m, l, o in parts:
                f = torch.where(torch.isfinite(m), torch.exp2(m - mx), torch.zeros_like(m))
                num += f[:, None] * o
                den += f * l
            o_rot = num / den[:, None]
            res = o_rot @ vt.R[h].T + vt.mu[h] if output_frame == "original" else o_rot
            out[b, h * rep:(h + 1) * rep] = res
    return out


def test_rope_table_holds_the_emulated_values():
    """The fp16 cos/sin the emulation uses are the table's fragments (row x = 16 k + j of tile k)."""
    d, ps = 64, 32
    inv = 1.0 / 10000 ** (torch.arange(0, 48, 2, dtype=torch.float64) / 48)
    tab = rope_table(inv, d, 1, ps // 16).view(torch.float16).reshape(ps // 16, d // 16, 8, 4, 4, 2)
    w = torch.zeros(d // 2, dtype=torch.float64)
    w[:inv.numel()] = inv
    x = torch.arange(ps, dtype=torch.float64)[:, None] * w
    E = torch.cat([x.cos(), x.sin()], dim=-1).half()
    k, kc, g, t, r, e = 1, 2, 5, 3, 3, 1  # entry [k, kc, 4g + t, r] packs E[16k + g + 8(r&1), 16kc + 2t + 8(r>>1) + e]
    assert torch.equal(tab[k, kc, g, t, r, e], E[16 * k + g + 8 * (r & 1), 16 * kc + 2 * t + 8 * (r >> 1) + e])


def _mma_m16n8k16(a, b):
    """``mma.sync.m16n8k16`` (fp16 in, float32 sums) from per-lane fragments: ``a`` ``[32, 4, 2]`` (regs a0-a3, low
    and high halves), ``b`` ``[32, 2, 2]``; returns the per-lane C ``[32, 4]`` (c0-c3)."""
    A, B = torch.zeros(16, 16), torch.zeros(16, 8)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for r in range(4):
            for e in range(2):
                A[g + 8 * (r & 1), 2 * t + 8 * (r >> 1) + e] = a[lane, r, e]
        for r in range(2):
            for e in range(2):
                B[2 * t + 8 * r + e, g] = b[lane, r, e]
    C = A @ B
    return torch.stack([torch.stack([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])
                        for g, t in (divmod(lane, 4) for lane in range(32))])


@pytest.mark.parametrize("d,rep,rotary", [(128, 4, 128), (64, 8, 48)])
def test_rope_lanes_match_the_emulated_term(d, rep, rotary):
    """decode_v11.cu's rope path lane by lane: s_u as the prologue writes it ({A_2p, B_2p, A_2p+1, B_2p+1} per head),
    s_cs as lane p of ``rope_turn`` writes it, each lane's B fragments ``ub[kc][hh]`` from entry ``p = 8 kc + 4 hh + t``,
    the table's A fragments of tile k, one simulated MMA per 16 channels: equal to ``_rope_term_emulated``."""
    gen = torch.Generator().manual_seed(d + rep)
    ps, pos, sc = 64, 4097, 0.127
    inv = 1.0 / 10000.0 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    kt = HeadTransform(rope_mu=torch.randn(1, d, generator=gen), rope_freq=inv, rope_scaling=1.25)
    q = torch.randn(rep, d, generator=gen).to(torch.bfloat16).float()
    hf, m, f = int(kt.rope_freq.numel()), kt.rope_mu[0], sc * kt.rope_scaling
    su = torch.zeros(rep * d)  # the prologue's writes
    for hh in range(rep):
        for c in range(d // 2):
            a = bb = 0.0
            if c < hf:
                q1, q2, m1, m2 = q[hh, c], q[hh, hf + c], m[c], m[hf + c]
                a, bb = f * (q1 * m1 + q2 * m2), f * (q2 * m1 - q1 * m2)
            su[hh * d + 4 * (c >> 1) + 2 * (c & 1)] = a
            su[hh * d + 4 * (c >> 1) + 2 * (c & 1) + 1] = bb
    w = torch.zeros(d // 2, dtype=torch.float64)
    w[:hf] = kt.rope_freq.double()
    scs = torch.zeros(d // 4, 4)  # rope_turn: lane p writes {cos, sin} of frequencies 2p, 2p + 1
    for lane in range(d // 4):
        ang = pos * w[2 * lane:2 * lane + 2]
        ang = ang - torch.round(ang / (2 * math.pi)) * 2 * math.pi
        scs[lane] = torch.stack([ang[0].cos(), ang[0].sin(), ang[1].cos(), ang[1].sin()]).float()
    ub = torch.zeros(32, d // 16, 2, 2)  # [lane, kc, hh, half]
    for lane in range(32):
        g, t = divmod(lane, 4)
        for kc in range(d // 32):
            for hh in range(2):
                p = 8 * kc + 4 * hh + t
                cs = scs[p]
                u = su[g * d + 4 * p:g * d + 4 * p + 4] if g < rep else torch.zeros(4)
                ub[lane, kc, hh] = torch.stack([cs[0] * u[0] + cs[1] * u[1], cs[2] * u[2] + cs[3] * u[3]]).half().float()
                ub[lane, kc + d // 32, hh] = torch.stack([cs[0] * u[1] - cs[1] * u[0],
                                                          cs[2] * u[3] - cs[3] * u[2]]).half().float()
    tab = rope_table(kt.rope_freq, d, 1, ps // 16).view(torch.float16).float().reshape(ps // 16, d // 16, 32, 4, 2)
    want = _rope_term_emulated(q, kt, 0, sc, ps, pos)  # [PS, rep]
    for k in range(ps // 16):
        racc = sum(_mma_m16n8k16(tab[k, kc], ub[:, kc]) for kc in range(d // 16))  # [32, 4]
        for lane in range(32):
            g, t = divmod(lane, 4)
            for n in range(2):
                for kk in range(2):
                    if 2 * t + kk < rep:
                        got, ref = racc[lane, 2 * n + kk], want[16 * k + g + 8 * n, 2 * t + kk]
                        assert abs(float(got - ref)) <= 1e-4 * (1 + abs(float(ref))), (k, lane, n, kk)


@pytest.mark.parametrize("d,rep", [(128, 4), (64, 8)])
def test_channel_lanes_match_the_emulated_query(d, rep):
    """decode_v11.cu's per-channel path lane by lane: warp 0's s_qf (entry ``c*32 + lane``: the fragments of chunks
    2c, 2c + 1) and s_qz (q_r's bf16 hi/lo as A fragments), ``channel_frags`` reading the record's block (scales
    turned to fp16 in place, ``ldmatrix`` of 8 channels per matrix: lane (g, t) gets channels 8(4c + i) + 2t, + 1),
    ``qc = qf * s`` in fp16 and ``q_r . z`` from the simulated bf16 MMAs: equal to the emulation's ``qc`` and ``qz``."""
    gen = torch.Generator().manual_seed(d)
    lay = RecordLayout(d, 64, key_block=32)
    qr = torch.randn(rep, d, generator=gen)  # the rotated query (s_q after rotate_rows)
    scale = (0.02 + 0.1 * torch.rand(d, generator=gen)).to(torch.bfloat16)
    zero = (-0.15 * torch.rand(d, generator=gen)).to(torch.bfloat16)
    _, _, jk = lane_map(d, "k")
    fk = torch.pow(4.0, -jk[0].float())  # slot_factor of each channel
    qf = torch.zeros(32, d // 32, 4, 2)  # s_qf[c * 32 + lane] = {qb[2c][0], qb[2c][1], qb[2c+1][0], qb[2c+1][1]}
    qz_a = torch.zeros(32, d // 16, 4, 2)  # s_qz[j * 32 + lane] = {hi row g, lo row g+8, hi (ch+8), lo (ch+8)}
    for lane in range(32):
        g, t = divmod(lane, 4)
        for c in range(d // 32):
            for r in range(4):
                j, h = 2 * c + (r >> 1), r & 1
                ch = 16 * j + 2 * t + 8 * h
                x = qr[g, ch:ch + 2] if g < rep else torch.zeros(2)
                qf[lane, c, r] = (x * fk[ch:ch + 2]).half().float()
        for j in range(d // 16):
            for h in range(2):
                ch = 16 * j + 2 * t + 8 * h
                x = qr[g, ch:ch + 2] if g < rep else torch.zeros(2)
                hi = x.to(torch.bfloat16).float()
                qz_a[lane, j, 2 * h] = hi
                qz_a[lane, j, 2 * h + 1] = (x - hi).to(torch.bfloat16).float()
    block = torch.cat([scale, zero]).view(torch.uint8)  # the record's channel block: scale[d] then zero[d]
    s16 = block[:2 * d].view(torch.bfloat16).float().half()  # the in-place turn to fp16
    z = block[2 * d:].view(torch.bfloat16).float()
    want_qc = (qr * fk).half().float() * scale.float().half().float()
    want_qz = qr @ z
    for lane in range(32):
        g, t = divmod(lane, 4)
        for c in range(d // 32):
            for i in range(4):  # matrix i of ldmatrix call c, and the s_qf half it multiplies
                ch = 8 * (4 * c + i) + 2 * t
                got = (qf[lane, c, i] * s16[ch:ch + 2].float()).half().float()
                if g < rep:
                    assert torch.equal(got, want_qc[g, ch:ch + 2].half().float()), (lane, c, i)
    za = torch.zeros(32, 4)
    for c in range(d // 32):
        for m, jj in ((0, 2 * c), (1, 2 * c + 1)):  # chunk jj: its A (hi rows g, lo rows g + 8), B = z of chunk jj
            bz = torch.zeros(32, 2, 2)
            for lane in range(32):
                t = lane % 4
                for r in range(2):
                    bz[lane, r] = z[16 * jj + 8 * r + 2 * t:16 * jj + 8 * r + 2 * t + 2]
            za += _mma_m16n8k16(qz_a[:, jj], bz)
    for lane in range(32):
        g, t = divmod(lane, 4)
        v = za[lane, 0] + za[lane, 2]  # head g: rows g (hi) and g + 8 (lo), any column
        if g < rep:
            assert abs(float(v - want_qz[g])) <= 1e-4 * (1 + abs(float(want_qz[g]))), lane
    assert lay.chan_bytes == 2 * 4 * d  # two blocks of 32 tokens per page of 64


@pytest.mark.parametrize("spec", [
    dict(B=2, H=8, hkv=2, d=128, ps=64, int_lens=[700, 129], seed=1, launch=V11Launch()),
    dict(B=1, H=8, hkv=1, d=128, ps=64, int_lens=[1000], seed=2, launch=V11Launch(num_splits=3, warps=2, stages=4)),
    dict(B=2, H=4, hkv=4, d=64, ps=32, int_lens=[16, 333], seed=3, launch=V11Launch(num_splits=2)),
    dict(B=1, H=16, hkv=2, d=128, ps=128, int_lens=[517], seed=4, launch=V11Launch()),
    # rope-centered keys: full and partial rotary, RoPE scaling, one start position or one per sequence
    dict(B=2, H=8, hkv=2, d=128, ps=64, int_lens=[700, 129], seed=5, launch=V11Launch(), rope=(128, 1.0), pos0=64),
    dict(B=2, H=4, hkv=4, d=64, ps=32, int_lens=[16, 333], seed=6, launch=V11Launch(num_splits=2), rope=(48, 1.25),
         pos0=[5, 100003]),
    # per-channel keys (lengths multiples of the block), with and without rope-centering
    dict(B=2, H=8, hkv=2, d=128, ps=64, int_lens=[640, 128], seed=7, launch=V11Launch(), block=64),
    dict(B=1, H=16, hkv=2, d=128, ps=128, int_lens=[544], seed=8, launch=V11Launch(num_splits=2), block=32),
    dict(B=2, H=4, hkv=4, d=64, ps=32, int_lens=[16, 336], seed=9, launch=V11Launch(num_splits=2), block=16,
         rope=(64, 1.0), pos0=[64, 7]),
])
def test_emulated_kernel_matches_the_twin(spec):
    spec = dict(spec)
    launch = spec.pop("launch")
    c = _case(**spec)
    lay = c["layout"]
    kp, vp = c["kp"], c["vp"]
    back = unpack_records(c["rec"], lay)
    for got, want in zip(back, (kp.codes, kp.scale, kp.zero, vp.codes, vp.scale, vp.zero)):
        assert torch.equal(got, want)  # the twin reads the very values the records hold
    sm = 1.0 / math.sqrt(spec["d"])
    ref = decode_attention_torch(c["q"], kp, vp, c["segs"], c["kt"], c["vt"], sm_scale=sm)
    emu = emulate_v11(c["q"], c["rec"], lay, c["segs"], c["kt"], c["vt"], sm_scale=sm, launch=launch)
    err = _rel(emu, ref)
    assert err < REL_TOL, f"emulated v11 vs twin: relative error {err:.2e} >= {REL_TOL}"
    assert err > 0  # the fp16 roundings are there: this is not the twin computed twice
    if c["kt"].rope_centered:  # the rope term matters here: without it the twin's answer is far away
        plain = HeadTransform(R=c["kt"].R, mu=c["kt"].mu, block=c["kt"].block)
        off = decode_attention_torch(c["q"], kp, vp, c["segs"], plain, c["vt"], sm_scale=sm)
        assert _rel(off, ref) > 10 * REL_TOL


# ------------------------------------------------------------------------------------------------------ CUDA


@CUDA
@pytest.mark.parametrize("spec", [
    dict(B=3, H=32, hkv=8, d=128, ps=64, int_lens=[1000, 37, 4101], seed=1, windows=True),
    dict(B=2, H=16, hkv=2, d=128, ps=64, int_lens=[0, 777], seed=2, windows=True),
    dict(B=2, H=8, hkv=8, d=128, ps=128, int_lens=[300, 16], seed=3),
    dict(B=2, H=16, hkv=2, d=64, ps=64, int_lens=[517, 2048], seed=4, windows=True),
    dict(B=3, H=32, hkv=8, d=128, ps=64, int_lens=[1000, 37, 4101], seed=5, windows=True, rope=(128, 1.0), pos0=64),
    dict(B=2, H=16, hkv=2, d=64, ps=32, int_lens=[333, 70000], seed=6, rope=(48, 1.25), pos0=[5, 100003]),
    dict(B=3, H=32, hkv=8, d=128, ps=64, int_lens=[1024, 0, 4096], seed=7, windows=True, block=64),
    dict(B=2, H=16, hkv=2, d=128, ps=128, int_lens=[544, 96], seed=8, block=32, rope=(128, 1.0), pos0=[64, 7]),
    dict(B=2, H=8, hkv=8, d=64, ps=64, int_lens=[160, 3008], seed=9, windows=True, block=16),
])
@pytest.mark.parametrize("frame", ["original", "rotated"])
def test_cuda_v11_matches_twin(spec, frame):
    from oscar.kernels.decode_v11 import paged_decode_attention_v11

    c = _case(dev="cuda", **spec)
    lay = c["layout"]
    kp, vp = c["kp"], c["vp"]
    ref = decode_attention_torch(c["q"], kp, vp, c["segs"], c["kt"], c["vt"], output_frame=frame)
    out = paged_decode_attention_v11(c["q"], c["rec"], lay, c["segs"], c["kt"], c["vt"], output_frame=frame)
    assert torch.isfinite(out.float()).all()
    assert _rel(out, ref) < REL_TOL
    again = paged_decode_attention_v11(c["q"], c["rec"], lay, c["segs"], c["kt"], c["vt"], output_frame=frame)
    assert torch.equal(out, again)

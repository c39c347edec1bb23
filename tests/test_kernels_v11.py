"""Decode kernel v11 (oscar.kernels.decode_v11): the page record and the kernel's fragment arithmetic.

CPU: the record layout (offsets, alignment, room for per-channel key blocks), the torch twin writer's round trip
(exact), the codes as the kernel's lanes read them out of a record (2-bit slots of half words, the v9 subnormal
trick) equal to the format's codes (exact), and an emulation of the kernel (query rotated in fp16, 64-token softmax
steps per math warp, p * s_V rounded to fp16, split-K and warp merge) against the float32 dequantize-then-attend
twin (1.5e-2 relative error per head, the tolerance of the v10 kernel for the same roundings). CUDA: the kernel
against the twin on the same records.
"""

from __future__ import annotations

import math

import pytest
import torch

from oscar.cache.paged import QuantPages, decode_attention_torch
from oscar.core import quant
from oscar.kernels.decode_v11 import (RecordLayout, V11Launch, default_num_splits, pack_records, unpack_records,
                                      write_tokens)
from oscar.kernels.segments import HeadTransform, Segments

REL_TOL = 1.5e-2
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the v11 kernel needs a CUDA device (sm_90)")


def _pages(npages, hkv, ps, d, gen, dev, name):
    codes = torch.randint(0, 4, (npages, hkv, ps, d), device=dev, generator=gen, dtype=torch.uint8)
    scale = (0.02 + 0.1 * torch.rand(npages, hkv, ps, 1, device=dev, generator=gen)).to(torch.bfloat16)
    zero = (-0.15 * torch.rand(npages, hkv, ps, 1, device=dev, generator=gen)).to(torch.bfloat16)
    tb = (torch.arange(ps, device=dev) % 16).expand(npages, hkv, ps)
    packed = quant.pack_codes_mma(codes, tb, f"mma_{name}", 2)
    nb = d // 4
    blocks = torch.zeros(npages, hkv, ps // 16, 16 * nb, dtype=torch.uint8, device=dev)
    _, byte_index = quant.mma_token_map(d, f"mma_{name}", 2)
    idx = byte_index.to(dev).expand(npages, hkv, ps // 16, 16, nb).reshape(npages, hkv, ps // 16, -1)
    blocks.scatter_(-1, idx, packed.reshape(npages, hkv, ps // 16, -1))
    return codes, QuantPages(blocks.reshape(npages, hkv, ps, nb), scale, zero, 2, d, f"mma_{name}")


def _case(*, B, H, hkv, d, ps, int_lens, seed, windows=False, dev="cpu"):
    gen = torch.Generator(device=dev).manual_seed(seed)
    max_pages = max(1, max(-(-n // ps) for n in int_lens))
    npages = B * max_pages + 3
    page_table = torch.randperm(npages, device=dev, generator=gen)[: B * max_pages].to(torch.int32).reshape(B, -1)
    k_codes, kp = _pages(npages, hkv, ps, d, gen, dev, "k")
    v_codes, vp = _pages(npages, hkv, ps, d, gen, dev, "v")

    def orth():
        return torch.linalg.qr(torch.randn(hkv, d, d, device=dev, generator=gen, dtype=torch.float64))[0].float()

    kt = HeadTransform(R=orth(), mu=0.3 * torch.randn(hkv, d, device=dev, generator=gen))
    vt = HeadTransform(R=orth(), mu=0.2 * torch.randn(hkv, d, device=dev, generator=gen))
    seg = {}
    if windows:
        for name, n in (("sink", 64), ("recent", 256)):
            seg[f"{name}_k"] = torch.randn(B, hkv, n, d, device=dev, generator=gen).to(torch.bfloat16)
            seg[f"{name}_v"] = torch.randn(B, hkv, n, d, device=dev, generator=gen).to(torch.bfloat16)
            seg[f"{name}_len"] = torch.randint(1, n + 1, (B,), device=dev, generator=gen).to(torch.int32)
    q = (2.0 * torch.randn(B, H, d, device=dev, generator=gen)).to(torch.bfloat16)
    segs = Segments(page_table, torch.tensor(int_lens, dtype=torch.int32, device=dev), **seg)
    layout = RecordLayout(d, ps)
    rec = pack_records(kp.codes, kp.scale, kp.zero, vp.codes, vp.scale, vp.zero, layout)
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


@pytest.mark.parametrize("d,ps", [(128, 64), (64, 32)])
def test_token_writer_fills_records_as_the_page_writer(d, ps):
    c = _case(B=1, H=4, hkv=2, d=d, ps=ps, int_lens=[2 * ps], seed=11)
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
                     meta(kp)[sl], meta(vp)[sl], maps)
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


def emulate_v11(q, rec, lay, segs, kt, vt, *, sm_scale, launch, output_frame="original"):
    """The kernel's arithmetic on the CPU (quantized pages only): fp16 query fragments times the codes' subnormals
    (float32 sums), logits ``s_K sc 2^24 (q.c) + z_K sum(q) + q.mu_K``, 64-token online-softmax steps per math warp
    (base 2), ``p s_V`` rounded to fp16 for the value products, the warps' and splits' partials merged exactly."""
    B, H, d = q.shape
    hkv = rec.shape[1]
    rep, ps = H // hkv, lay.page_size
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
    out = torch.zeros(B, H, d)
    for b in range(B):
        n_tok = int(segs.int_len[b])
        npg = -(-n_tok // ps)
        per = -(-npg // s_int)
        for h in range(hkv):
            qh = q[b, h * rep:(h + 1) * rep].float()  # bf16 values
            qrot = qh.half().float() @ kt.R[h].half().float()
            qb = (qrot * fk).half().float()  # [rep, d] fp16 B fragments
            qs = (qb / fk).sum(-1) * sc
            qm = (qh @ kt.mu[h]) * sc
            parts = []  # (m, l, o[rep, d]) of each warp
            for split in range(s_int):
                lo, hi = split * per, min(npg, split * per + per)
                for w in range(launch.warps):
                    m = torch.full((rep,), -math.inf)
                    l, zs = torch.zeros(rep), torch.zeros(rep)
                    o = torch.zeros(rep, d)
                    for i in range(lo + w, hi, launch.warps):
                        page = int(segs.page_table[b, i])
                        for s0 in range(0, ps, steps):
                            t0 = i * ps + s0
                            nv = min(steps, n_tok - t0)
                            if nv <= 0:
                                break
                            sl = slice(s0, s0 + steps)
                            acc = ksub[page, h, sl] @ qb.T  # [steps, rep]
                            lg = acc * (ks[page, h, sl] * sc * 2.0**24) + (kz[page, h, sl] * qs + qm)
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


@pytest.mark.parametrize("spec", [
    dict(B=2, H=8, hkv=2, d=128, ps=64, int_lens=[700, 129], seed=1, launch=V11Launch()),
    dict(B=1, H=8, hkv=1, d=128, ps=64, int_lens=[1000], seed=2, launch=V11Launch(num_splits=3, warps=2, stages=4)),
    dict(B=2, H=4, hkv=4, d=64, ps=32, int_lens=[16, 333], seed=3, launch=V11Launch(num_splits=2)),
    dict(B=1, H=16, hkv=2, d=128, ps=128, int_lens=[517], seed=4, launch=V11Launch()),
])
def test_emulated_kernel_matches_the_twin(spec):
    spec = dict(spec)
    launch = spec.pop("launch")
    c = _case(**spec)
    lay = c["layout"]
    kp, vp = (QuantPages(*t, 2, spec["d"], name) for t, name in
              ((unpack_records(c["rec"], lay)[:3], "mma_k"), (unpack_records(c["rec"], lay)[3:], "mma_v")))
    sm = 1.0 / math.sqrt(spec["d"])
    ref = decode_attention_torch(c["q"], kp, vp, c["segs"], c["kt"], c["vt"], sm_scale=sm)
    emu = emulate_v11(c["q"], c["rec"], lay, c["segs"], c["kt"], c["vt"], sm_scale=sm, launch=launch)
    err = _rel(emu, ref)
    assert err < REL_TOL, f"emulated v11 vs twin: relative error {err:.2e} >= {REL_TOL}"
    assert err > 0  # the fp16 roundings are there: this is not the twin computed twice


# ------------------------------------------------------------------------------------------------------ CUDA


@CUDA
@pytest.mark.parametrize("spec", [
    dict(B=3, H=32, hkv=8, d=128, ps=64, int_lens=[1000, 37, 4101], seed=1, windows=True),
    dict(B=2, H=16, hkv=2, d=128, ps=64, int_lens=[0, 777], seed=2, windows=True),
    dict(B=2, H=8, hkv=8, d=128, ps=128, int_lens=[300, 16], seed=3),
    dict(B=2, H=16, hkv=2, d=64, ps=64, int_lens=[517, 2048], seed=4, windows=True),
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

"""Triton paged decode attention against its torch twin and against full-precision attention.

CPU runs go through the Triton interpreter; on a CUDA machine the same cases also run compiled.
Tolerances: the kernel rounds the rotated query and the codes' products to fp16 (the BF16
segments to bf16 on the GPU) and returns the query dtype (bf16 here), so its output is compared
with the float32 dequantize-then-attend twin at 1.5e-2 relative error per head.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: interpret; set before any Triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from oscar.cache.paged import QuantPages, decode_attention, rotate_quantize_pack  # noqa: E402
from oscar.kernels.launch import RowsLaunch  # noqa: E402
from oscar.kernels.segments import HeadTransform, Segments  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
REL_TOL = 1.5e-2


def _orth(h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].to(torch.float32)


def _scenario(*, B, H, hkv, d, bits, g, ps, int_lens, sink_lens, recent_lens, S0, W, seed, clip=True, rotate=True):
    """A cache with shuffled page tables: (q, pages K/V, page_table, int_len, segments, transforms, dense rows)."""
    gen = torch.Generator().manual_seed(seed)
    max_pages = max(1, max(-(-n // ps) for n in int_lens))
    npages = B * max_pages + 3
    perm = torch.randperm(npages, generator=gen).to(torch.int32)
    page_table = perm[: B * max_pages].reshape(B, max_pages).contiguous()
    kt = HeadTransform(R=_orth(hkv, d, gen) if rotate else None, mu=0.2 * torch.randn(hkv, d, generator=gen),
                       rho=torch.full((hkv,), 0.95) if clip else None)
    vt = HeadTransform(R=_orth(hkv, d, gen) if rotate else None, mu=0.1 * torch.randn(hkv, d, generator=gen),
                       rho=torch.full((hkv,), 0.9) if clip else None)
    kp = QuantPages.empty(npages, hkv, ps, d, bits, g)
    vp = QuantPages.empty(npages, hkv, ps, d, bits, g)
    dense_k, dense_v = [], []
    for b, n in enumerate(int_lens):
        k = torch.randn(n, hkv, d, generator=gen) + 0.5
        v = torch.randn(n, hkv, d, generator=gen)
        pos = torch.arange(n)
        slots = page_table[b, pos // ps].long() * ps + pos % ps
        rotate_quantize_pack(k, slots, kp, kt, backend="torch")
        rotate_quantize_pack(v, slots, vp, vt, backend="torch")
        dense_k.append(k)
        dense_v.append(v)
    seg = dict(
        sink_k=torch.randn(B, hkv, S0, d, generator=gen).to(torch.bfloat16),
        sink_v=torch.randn(B, hkv, S0, d, generator=gen).to(torch.bfloat16),
        sink_len=torch.tensor(sink_lens, dtype=torch.int32),
        recent_k=torch.randn(B, hkv, W, d, generator=gen).to(torch.bfloat16),
        recent_v=torch.randn(B, hkv, W, d, generator=gen).to(torch.bfloat16),
        recent_len=torch.tensor(recent_lens, dtype=torch.int32),
    )
    q = (1.5 * torch.randn(B, H, d, generator=gen)).to(torch.bfloat16)
    return q, kp, vp, page_table, torch.tensor(int_lens, dtype=torch.int32), seg, kt, vt, dense_k, dense_v


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, QuantPages):
        return QuantPages(x.codes.to(device), x.scale.to(device), x.zero.to(device), x.bits, x.group_size)
    if isinstance(x, HeadTransform):
        return HeadTransform(*(None if t is None else t.to(device) for t in (x.R, x.mu, x.rho)))
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _segments(pt, il, seg, device="cpu"):
    return Segments(_to(pt, device), _to(il, device), **_to(seg, device))


def _run_both(device, sc, output_frame="original", launch=None):
    q, kp, vp, pt, il, seg, kt, vt, _, _ = sc
    ref = decode_attention(q, kp, vp, _segments(pt, il, seg), kt, vt, output_frame=output_frame, backend="torch")
    out = decode_attention(_to(q, device), _to(kp, device), _to(vp, device), _segments(pt, il, seg, device),
                           _to(kt, device), _to(vt, device), output_frame=output_frame, backend="triton", launch=launch)
    return ref.float(), out.float().cpu()


def _rel(out, ref):
    return ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max().item()


CASES = [
    # (d, H, Hkv, bits, G, page_size, int_lens, sink_lens, recent_lens, S0, W)
    (64, 4, 4, 2, 64, 16, [1, 17, 32], [4, 0, 4], [8, 3, 0], 4, 8),  # GQA 1, length 1, prime, page boundary
    (128, 8, 2, 2, 128, 16, [0, 31, 48], [2, 4, 4], [1, 8, 8], 4, 8),  # GQA 4, empty INT segment, full windows
    (64, 8, 1, 2, 32, 32, [53, 64], [4, 1], [8, 7], 4, 8),  # GQA 8, several groups per row
    (128, 8, 2, 4, 128, 16, [29, 16], [4, 4], [8, 8], 4, 8),  # INT4
    (64, 4, 1, 4, 32, 16, [47, 2], [3, 0], [5, 1], 4, 8),  # INT4, several groups
    (64, 8, 2, 2, 64, 16, [20, 3], [4, 70], [130, 64], 70, 130),  # windows over several 64-token chunks
    (64, 4, 2, 2, 32, 4, [13, 30], [2, 2], [3, 0], 2, 3),  # pages of 4 slots: blocks gather rows over pages
    (16, 4, 1, 2, 16, 8, [11, 5], [1, 1], [2, 2], 2, 4),  # head_dim 16 (one code word per row)
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[f"d{c[0]}-H{c[1]}-kv{c[2]}-b{c[3]}-g{c[4]}" for c in CASES])
def test_decode_matches_dequantize_then_attend(device, case):
    d, H, hkv, bits, g, ps, il, sl, rl, S0, W = case
    sc = _scenario(B=len(il), H=H, hkv=hkv, d=d, bits=bits, g=g, ps=ps, int_lens=il, sink_lens=sl,
                   recent_lens=rl, S0=S0, W=W, seed=sum(il) + d + bits)
    ref, out = _run_both(device, sc)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < REL_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits,g", [(1, 64), (3, 64), (7, 64), (3, 32), (7, 32)])
def test_decode_split_merge_and_rotated_frame(device, num_splits, g):
    """Any number of splits (empty ones included) gives the same answer, in both frames."""
    sc = _scenario(B=2, H=8, hkv=2, d=64, bits=2, g=g, ps=16, int_lens=[45, 80], sink_lens=[4, 2],
                   recent_lens=[8, 5], S0=4, W=8, seed=11)
    for frame in ("original", "rotated"):
        ref, out = _run_both(device, sc, output_frame=frame, launch=RowsLaunch(num_splits=num_splits))
        assert _rel(out, ref) < REL_TOL, frame


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options,g", [({"stages": 3}, 64),
                                       ({"span_pages": True, "block_n": 32}, 64),
                                       ({"span_pages": True, "block_n": 64}, 64),
                                       ({"span_pages": True, "block_n": 32}, 32),
                                       ({"fuse_bf16": True}, 64),
                                       ({"span_pages": True, "block_n": 32, "fuse_bf16": True, "stages": 3}, 64)],
                         ids=["stages3", "span32", "span64", "span32-g32", "fused-bf16", "all"])
def test_decode_block_options(device, options, g):
    """Blocks spanning several pages (page 16), fused BF16 chunks, deeper pipelines: the twin's answer."""
    sc = _scenario(B=2, H=8, hkv=2, d=64, bits=2, g=g, ps=16, int_lens=[45, 100], sink_lens=[4, 2],
                   recent_lens=[8, 5], S0=4, W=8, seed=13)
    ref, out = _run_both(device, sc, launch=RowsLaunch(num_splits=2, **options))
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < REL_TOL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("planes", [False, True])
def test_decode_word_and_plane_paths_on_one_format(device, planes):
    """d=128 INT2 with one group per row: the bit-plane path (default) and the word path (``planes=False``) both
    give the twin's answer, both frames."""
    sc = _scenario(B=2, H=8, hkv=2, d=128, bits=2, g=128, ps=16, int_lens=[37, 70], sink_lens=[4, 1],
                   recent_lens=[3, 8], S0=4, W=8, seed=17)
    for frame in ("original", "rotated"):
        ref, out = _run_both(device, sc, output_frame=frame, launch=RowsLaunch(planes=planes, num_splits=3))
        assert _rel(out, ref) < REL_TOL, frame


@pytest.mark.parametrize("device", DEVICES)
def test_decode_without_bf16_segments_and_identity_transform(device):
    sc = _scenario(B=2, H=4, hkv=2, d=64, bits=2, g=64, ps=16, int_lens=[33, 1], sink_lens=[0, 0],
                   recent_lens=[0, 0], S0=4, W=8, seed=5, clip=False, rotate=False)
    q, kp, vp, pt, il, _, kt, vt, _, _ = sc
    sc = (q, kp, vp, pt, il, {}, HeadTransform(), HeadTransform(), None, None)
    ref, out = _run_both(device, sc)
    assert _rel(out, ref) < REL_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_decode_within_quantization_bound_of_full_precision(device):
    """|o - o_fp| <= (e^{2 eps} - 1) * max ||v_hat - c|| + max ||v_hat - v|| (+ arithmetic slack).

    ``eps`` bounds the logit error of any quantized token: ``sm_scale * ||q_rot||_1 * max|k_hat - k_rot|``;
    the first term bounds the moved softmax mass times the spread of values, the second the value
    error; both in the rotated frame, whose norms equal the original ones (orthogonal rotations).
    """
    d, H, hkv = 64, 8, 2
    sc = _scenario(B=2, H=H, hkv=hkv, d=d, bits=2, g=32, ps=16, int_lens=[40, 23], sink_lens=[4, 4],
                   recent_lens=[8, 8], S0=4, W=8, seed=21, clip=False)
    q, kp, vp, pt, il, seg, kt, vt, dense_k, dense_v = sc
    _, out = _run_both(device, sc)
    sm = 1 / math.sqrt(d)
    from oscar.cache.paged import gather_dequantize

    for b in range(2):
        n = int(il[b])
        kr = torch.einsum("nhd,hde->hne", dense_k[b] - kt.mu, kt.R)
        vr = torch.einsum("nhd,hde->hne", dense_v[b] - vt.mu, vt.R)
        kh, vh = gather_dequantize(kp, pt, b, n), gather_dequantize(vp, pt, b, n)
        k_err = (kh - kr).abs().amax(dim=(1, 2))  # [Hkv]
        v_err = (vh - vr).norm(dim=-1).amax(dim=1)
        ks = torch.cat([seg["sink_k"][b].float(), dense_k[b].transpose(0, 1), seg["recent_k"][b].float()], dim=1)
        vs = torch.cat([seg["sink_v"][b].float(), dense_v[b].transpose(0, 1), seg["recent_v"][b].float()], dim=1)
        rep = H // hkv
        qf = q[b].float()
        p = torch.softmax(torch.einsum("hd,htd->ht", qf, ks.repeat_interleave(rep, 0)) * sm, dim=-1)
        o_fp = torch.einsum("ht,htd->hd", p, vs.repeat_interleave(rep, 0))
        q_rot = torch.einsum("hrd,hde->hre", qf.view(hkv, rep, d), kt.R).reshape(H, d)
        eps = sm * q_rot.abs().sum(-1) * k_err.repeat_interleave(rep)
        v_all = torch.cat([seg["sink_v"][b].float(), vh @ vt.R.transpose(1, 2) + vt.mu[:, None],
                           seg["recent_v"][b].float()], dim=1).repeat_interleave(rep, 0)
        spread = (v_all - v_all.mean(dim=1, keepdim=True)).norm(dim=-1).amax(dim=1)
        bound = (torch.exp(2 * eps) - 1) * spread + v_err.repeat_interleave(rep)
        err = (out[b] - o_fp).norm(dim=-1)
        slack = 2e-2 * o_fp.norm(dim=-1) + 1e-3
        assert (err <= bound + slack).all(), (err, bound)
        assert (err > 0).any()  # the quantized cache is not silently bypassed


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("bits", [2, 4])
def test_decode_sweep(device, d, ratio, bits):
    hkv = 2
    il = [1, 2, 13, 64, 97, 128]
    sc = _scenario(B=len(il), H=hkv * ratio, hkv=hkv, d=d, bits=bits, g=d // 2, ps=32, int_lens=il,
                   sink_lens=[0, 4, 4, 1, 4, 4], recent_lens=[16, 0, 16, 5, 16, 1], S0=4, W=16, seed=d + ratio + bits)
    ref, out = _run_both(device, sc)
    assert _rel(out, ref) < REL_TOL


def test_decode_kernel_rejects_bad_arguments():
    sc = _scenario(B=1, H=6, hkv=4, d=64, bits=2, g=64, ps=16, int_lens=[5], sink_lens=[1], recent_lens=[1],
                   S0=4, W=8, seed=1)
    q, kp, vp, pt, il, seg, kt, vt, _, _ = sc
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention(q, kp, vp, Segments(pt, il, **seg), kt, vt, backend="triton")
    with pytest.raises(ValueError, match="page_table must be int32"):
        decode_attention(q[:, :4], kp, vp, Segments(pt.long(), il, **seg), kt, vt, backend="triton")
    with pytest.raises(ValueError, match="bit-plane path needs one group per row and at least 32 bytes"):
        decode_attention(q[:, :4], kp, vp, Segments(pt, il, **seg), kt, vt, backend="triton",
                         launch=RowsLaunch(planes=True))  # d=64 INT2: 16 bytes per row
    from oscar.kernels.launch import MmaLaunch

    with pytest.raises(ValueError, match="is not a RowsLaunch"):
        decode_attention(q[:, :4], kp, vp, Segments(pt, il, **seg), kt, vt, backend="triton", launch=MmaLaunch())


def _in_slots(seg: dict, rows: list[int], num_rows: int, gen: torch.Generator) -> dict:
    """The windows of ``seg`` moved into per-slot buffers ``[num_rows, Hkv, S, d]`` (sequence ``b`` at row ``rows[b]``,
    random rows elsewhere), with ``window_rows``: the layout of a cache's per-request window buffers."""
    out = dict(seg, window_rows=torch.tensor(rows, dtype=torch.int32))
    for name in ("sink_k", "sink_v", "recent_k", "recent_v"):
        t = seg[name]
        buf = torch.randn(num_rows, *t.shape[1:], generator=gen).to(t.dtype)
        buf[torch.tensor(rows)] = t
        out[name] = buf
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fuse_bf16", [False, True])
def test_decode_reads_windows_in_place_by_row(device, fuse_bf16):
    """``window_rows``: the kernel reads each sequence's windows at its row of per-slot buffers; the twin does so
    exactly as on gathered copies (same float ops), the kernel within the usual tolerance."""
    gen = torch.Generator().manual_seed(5)
    sc = _scenario(B=3, H=8, hkv=2, d=64, bits=2, g=64, ps=16, int_lens=[45, 0, 20], sink_lens=[4, 2, 4],
                   recent_lens=[8, 5, 1], S0=4, W=8, seed=3)
    q, kp, vp, pt, il, seg, kt, vt, _, _ = sc
    slotted = _in_slots(seg, [4, 0, 2], 6, gen)
    for frame in ("original", "rotated"):
        ref = decode_attention(q, kp, vp, _segments(pt, il, seg), kt, vt, output_frame=frame, backend="torch")
        twin = decode_attention(q, kp, vp, _segments(pt, il, slotted), kt, vt, output_frame=frame, backend="torch")
        assert torch.equal(twin, ref), frame
        out = decode_attention(_to(q, device), _to(kp, device), _to(vp, device), _segments(pt, il, slotted, device),
                               _to(kt, device), _to(vt, device), output_frame=frame, backend="triton",
                               launch=RowsLaunch(fuse_bf16=fuse_bf16))
        assert _rel(out.float().cpu(), ref.float()) < REL_TOL, frame


def test_decode_window_rows_refusals():
    q, kp, vp, pt, il, seg, kt, vt, _, _ = _scenario(B=2, H=4, hkv=2, d=64, bits=2, g=64, ps=16, int_lens=[5, 3],
                                                     sink_lens=[1, 1], recent_lens=[2, 2], S0=2, W=4, seed=1)
    for rows, backend, message in (([0, 2], "torch", r"window_rows \[2\] are outside the 2 rows"),
                                   ([0], "torch", "one window row per sequence"),
                                   ([0, 1], "triton", "window_rows must be int32")):
        with pytest.raises(ValueError, match=message):
            decode_attention(q, kp, vp, Segments(pt, il, window_rows=torch.tensor(rows), **seg), kt, vt,
                             backend=backend)

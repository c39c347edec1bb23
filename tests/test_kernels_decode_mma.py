"""Fragment-order page layout (oscar.core.quant "mma_k"/"mma_v") and the CUDA decode kernel that reads it.

CPU: the layout contract (pack/unpack exact, every byte owned by one token, the torch writer and reader
of an mma pool equal to the row pool's bit for bit). CUDA: the kernel against the float32
dequantize-then-attend twin on the same pages (1.5e-2 relative error per head, the tolerance of the
Triton path: the kernel rounds the rotated query, the codes' products and p * s_V to fp16, the BF16
windows' products to bf16, and returns bf16), and the Triton row-layout kernel on the same codes.
"""

from __future__ import annotations

import pytest
import torch

from oscar.core import quant
from oscar.cache.paged import PagedKVPool, QuantPages, decode_attention, decode_attention_torch, gather_dequantize
from oscar.kernels.launch import MmaLaunch
from oscar.kernels.segments import HeadTransform, Segments

REL_TOL = 1.5e-2
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the mma decode kernel needs a CUDA device")


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("layout", ["mma_k", "mma_v"])
def test_token_map_is_a_byte_partition_and_round_trips(d, layout, bits):
    order, byte_index = quant.mma_token_map(d, layout, bits)
    assert torch.equal(torch.sort(byte_index.flatten()).values, torch.arange(16 * d * bits // 8))  # each byte: one token
    assert torch.equal(torch.sort(order, dim=1).values, torch.arange(d).expand(16, d))
    gen = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 2**bits, (3, 16, d), generator=gen, dtype=torch.uint8)
    tb = torch.arange(16).expand(3, 16)
    packed = quant.pack_codes_mma(codes, tb, layout, bits)
    assert packed.shape == (3, 16, d * bits // 8)
    assert torch.equal(quant.unpack_codes_mma(packed, tb, layout, bits), codes)


def test_fragment_positions_match_the_mma_operands():
    """Spot-check the documented positions: lane (r, c), part p, word u, half h, slot i."""
    d = 128
    _, kb = quant.mma_token_map(d, "mma_k")
    korder, _ = quant.mma_token_map(d, "mma_k")
    vorder, vb = quant.mma_token_map(d, "mma_v")
    for lane, p, u, h, i in ((0, 0, 0, 0, 0), (5, 1, 1, 1, 7), (31, 1, 0, 0, 3), (18, 0, 1, 1, 6)):
        r, c = divmod(lane, 4)
        byte = lane * d // 8 + p * d // 16 + 4 * u + 2 * h + i // 4
        tok, ch = 8 * p + r, 16 * (4 * u + i // 2) + 8 * (i % 2) + 2 * c + h  # key: B operand (k=channel, n=token)
        k = int((kb[tok] == byte).nonzero())
        assert int(korder[tok, 4 * k + i % 4]) == ch
        tok, ch = 8 * p + 2 * c + h, 16 * (4 * u + i // 2) + 8 * (i % 2) + r  # value: A operand (m=channel, k=token)
        k = int((vb[tok] == byte).nonzero())
        assert int(vorder[tok, 4 * k + i % 4]) == ch


def test_int4_fragment_positions_match_the_mma_operands():
    """INT4: lane (r, c), part p, word u, half h, slot i (nibble i%2 of byte i//2 of the half)."""
    d = 128
    korder, kb = quant.mma_token_map(d, "mma_k", 4)
    vorder, vb = quant.mma_token_map(d, "mma_v", 4)
    for lane, p, u, h, i in ((0, 0, 0, 0, 0), (5, 1, 3, 1, 3), (31, 1, 0, 0, 2), (18, 0, 2, 1, 1)):
        r, c = divmod(lane, 4)
        byte = lane * d // 4 + p * d // 8 + 4 * u + 2 * h + i // 2
        tok, ch = 8 * p + r, 16 * (2 * u + i // 2) + 8 * (i % 2) + 2 * c + h  # key: A operand rows = tokens
        k = int((kb[tok] == byte).nonzero())
        assert int(korder[tok, 2 * k + i % 2]) == ch
        tok, ch = 8 * p + 2 * c + h, 16 * (2 * u + i // 2) + 8 * (i % 2) + r  # value^T: A operand rows = channels
        k = int((vb[tok] == byte).nonzero())
        assert int(vorder[tok, 2 * k + i % 2]) == ch


@pytest.mark.parametrize("bad", [dict(bits=3, group_size=128, d=128), dict(bits=2, group_size=64, d=128),
                                 dict(bits=2, group_size=32, d=32), dict(bits=2, group_size=128, d=128, page_size=8)])
def test_mma_layout_refuses_formats_it_does_not_cover(bad):
    with pytest.raises(ValueError):
        quant.check_mma_layout(**bad)


@pytest.mark.parametrize("d", [64, 128])
def test_rotation_b_fragments_hold_the_documented_entries(d):
    from oscar.kernels.decode_mma import mma_b_fragments

    M = torch.randn(2, d, d, generator=torch.Generator().manual_seed(d))
    frag = mma_b_fragments(M)
    assert frag.shape == (2, d // 8, d // 16, 32, 2) and frag.dtype == torch.int32
    halves = frag.view(torch.float16).reshape(2, d // 8, d // 16, 32, 2, 2)
    for h, nt, kc, lane, r, e in ((0, 0, 0, 0, 0, 0), (1, d // 8 - 1, d // 16 - 1, 31, 1, 1), (0, 3, 2, 13, 1, 0)):
        g, t = divmod(lane, 4)
        assert halves[h, nt, kc, lane, r, e] == M[h, 16 * kc + 2 * t + 8 * r + e, 8 * nt + g].half()
    # every entry of M appears once
    assert torch.equal(torch.sort(halves.reshape(2, -1), dim=1).values,
                       torch.sort(M.half().reshape(2, -1), dim=1).values)


def _pools(d, hkv, ps, layout, device="cpu", bits=2):
    return PagedKVPool(num_layers=1, num_kv_heads=hkv, head_dim=d, num_pages=12, max_batch=3, max_pages_per_seq=6,
                       bits=bits, group_size=d, page_size=ps, device=device, layout=layout)


@pytest.mark.parametrize("d,ps,bits", [(64, 16, 2), (128, 64, 2), (128, 32, 2), (128, 32, 4), (64, 16, 4)])
def test_mma_pool_stores_the_same_codes_as_the_row_pool(d, ps, bits):
    gen = torch.Generator().manual_seed(7)
    hkv = 2
    rows, mma = _pools(d, hkv, ps, "rows", bits=bits), _pools(d, hkv, ps, "mma", bits=bits)
    R = torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0]
    kt = HeadTransform(R=R, mu=0.1 * torch.randn(hkv, d, generator=gen), rho=torch.full((hkv,), 0.95))
    vt = HeadTransform(R=R.flip(1), rho=torch.full((hkv,), 0.9))
    for n0, n1 in ((37, 5), (1, 70), (30, 1)):  # several steps: tokens land across block and page boundaries
        k = torch.randn(n0 + n1, hkv, d, generator=gen)
        v = torch.randn(n0 + n1, hkv, d, generator=gen)
        for pool in (rows, mma):
            slots = pool.reserve([0, 2], [n0, n1])
            pool.write(0, k, v, slots, kt, vt)
    for b in (0, 2):
        kr, vr = rows.read(0, b)
        km, vm = mma.read(0, b)
        assert torch.equal(kr, km) and torch.equal(vr, vm)
    # the bytes differ (another layout) but hold the same multiset of codes per page
    assert not torch.equal(rows.k[0].codes, mma.k[0].codes)


# the interpreter where there is no GPU, compiled where there is one (as the other kernel tests run there)
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d,rotate,n_rows,bits", [(128, True, 3, 2), (64, False, 40, 2), (128, True, 200, 2),
                                                 (64, True, 3, 4)])
def test_triton_writer_stores_the_mma_layout(device, d, rotate, n_rows, bits):
    """The Triton writer in the fragment-order layout stores what it stores in the row layout (same codes):
    bit for bit on the CPU (the interpreter computes each output channel alone), on the GPU up to the float
    sums of the rotation (3xTF32 tiles): at most one code step in < 0.5% of the values."""
    gen = torch.Generator().manual_seed(d + n_rows)
    hkv, ps = 2, 32
    pools = {lay: _pools(d, hkv, ps, lay, device, bits) for lay in ("rows", "mma")}
    R = torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0] if rotate else None
    kt = HeadTransform(R=R, mu=0.1 * torch.randn(hkv, d, generator=gen), rho=torch.full((hkv,), 0.93))
    vt = HeadTransform(R=None if R is None else R.flip(2), rho=torch.full((hkv,), 0.9))
    kt = HeadTransform(*(None if x is None else x.to(device) for x in (kt.R, kt.mu, kt.rho)))
    vt = HeadTransform(*(None if x is None else x.to(device) for x in (vt.R, vt.mu, vt.rho)))
    win = torch.randn(n_rows, hkv, 8, d, generator=gen).to(device)
    src = torch.randint(0, 8, (n_rows,), generator=gen).to(device)
    for pool in pools.values():
        slots = pool.reserve([0, 1], [n_rows // 2, n_rows - n_rows // 2])
        pool.demote(0, win, win * 0.5, src, slots, kt, vt, backend="triton")  # fused K+V launch
    for b in (0, 1):
        for a, m in zip(pools["rows"].read(0, b), pools["mma"].read(0, b)):
            if device == "cpu":
                assert torch.equal(a, m)
            else:
                assert ((a - m).abs() > 1e-6).float().mean() < 5e-3


def test_mma_pages_on_cpu_need_the_torch_backend():
    pool = _pools(128, 1, 64, "mma")
    q = torch.randn(1, 4, 128)
    pool.reserve([0], [3])
    with pytest.raises(ValueError, match="backend='torch'"):
        pool.attend(0, q, HeadTransform(), HeadTransform(), backend="triton")


# ---------------------------------------------------------------------------------------------- CUDA


def _case(*, B, H, hkv, d, ps, int_lens, sink_lens, recent_lens, S0, W, seed, rotate=True, mu=True, dev="cuda", bits=2):
    """Random codes in pages of both layouts holding the same values, shuffled page tables, windows, transforms."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    max_pages = max(1, max(-(-n // ps) for n in int_lens))
    npages = B * max_pages + 5
    perm = torch.randperm(npages, device=dev, generator=gen)
    page_table = perm[: B * max_pages].to(torch.int32).reshape(B, max_pages)
    pages = {}
    for name in ("k", "v"):
        codes = torch.randint(0, 2**bits, (npages, hkv, ps, d), device=dev, generator=gen, dtype=torch.uint8)
        scale = (0.02 + 0.1 * torch.rand(npages, hkv, ps, 1, device=dev, generator=gen)).to(torch.bfloat16)
        zero = (-0.15 * torch.rand(npages, hkv, ps, 1, device=dev, generator=gen)).to(torch.bfloat16)
        nb = d * bits // 8
        rows = QuantPages(quant.pack_codes(codes, bits, d), scale, zero, bits, d)
        tb = (torch.arange(ps, device=dev) % 16).expand(npages, hkv, ps)
        packed = quant.pack_codes_mma(codes, tb, f"mma_{name}", bits)  # [P, Hkv, ps, nb] bytes of each token
        blocks = torch.zeros(npages, hkv, ps // 16, 16 * nb, dtype=torch.uint8, device=dev)
        _, byte_index = quant.mma_token_map(d, f"mma_{name}", bits)
        idx = byte_index.to(dev).expand(npages, hkv, ps // 16, 16, nb).reshape(npages, hkv, ps // 16, -1)
        blocks.scatter_(-1, idx, packed.reshape(npages, hkv, ps // 16, -1))
        mma = QuantPages(blocks.reshape(npages, hkv, ps, nb), scale, zero, bits, d, f"mma_{name}")
        pages[name] = (rows, mma)

    def orth():
        return torch.linalg.qr(torch.randn(hkv, d, d, device=dev, generator=gen, dtype=torch.float64))[0].float()

    def mean(scale):
        return scale * torch.randn(hkv, d, device=dev, generator=gen) if mu else None

    kt = HeadTransform(R=orth() if rotate else None, mu=mean(0.3))
    vt = HeadTransform(R=orth() if rotate else None, mu=mean(0.2))
    seg = {}
    if S0:
        seg.update(sink_k=torch.randn(B, hkv, S0, d, device=dev, generator=gen).to(torch.bfloat16),
                   sink_v=torch.randn(B, hkv, S0, d, device=dev, generator=gen).to(torch.bfloat16),
                   sink_len=torch.tensor(sink_lens, dtype=torch.int32, device=dev))
    if W:
        seg.update(recent_k=torch.randn(B, hkv, W, d, device=dev, generator=gen).to(torch.bfloat16),
                   recent_v=torch.randn(B, hkv, W, d, device=dev, generator=gen).to(torch.bfloat16),
                   recent_len=torch.tensor(recent_lens, dtype=torch.int32, device=dev))
    q = (2.0 * torch.randn(B, H, d, device=dev, generator=gen)).to(torch.bfloat16)
    int_len = torch.tensor(int_lens, dtype=torch.int32, device=dev)
    return q, pages, page_table, int_len, kt, vt, seg


def _rel(out, ref):
    return float(((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max())


CASES = [
    dict(B=3, H=32, hkv=8, d=128, ps=64, int_lens=[1000, 37, 4101], sink_lens=[64, 10, 0], recent_lens=[256, 100, 3],
         S0=64, W=256),
    dict(B=2, H=16, hkv=2, d=64, ps=16, int_lens=[517, 2048], sink_lens=[4, 64], recent_lens=[31, 256], S0=64, W=256),
    dict(B=2, H=8, hkv=8, d=128, ps=32, int_lens=[300, 16], sink_lens=[1, 2], recent_lens=[5, 0], S0=8, W=40),
    dict(B=2, H=16, hkv=2, d=128, ps=128, int_lens=[0, 777], sink_lens=[3, 0], recent_lens=[0, 9], S0=16, W=16),
    dict(B=1, H=8, hkv=4, d=64, ps=64, int_lens=[3000], sink_lens=[0], recent_lens=[0], S0=0, W=0),
    dict(B=3, H=32, hkv=8, d=128, ps=64, int_lens=[1000, 37, 4101], sink_lens=[64, 10, 0], recent_lens=[256, 100, 3],
         S0=64, W=256, bits=4),
    dict(B=2, H=16, hkv=2, d=64, ps=16, int_lens=[517, 2048], sink_lens=[4, 64], recent_lens=[31, 256], S0=64, W=256,
         bits=4),
    dict(B=2, H=16, hkv=2, d=128, ps=128, int_lens=[0, 777], sink_lens=[3, 0], recent_lens=[0, 9], S0=16, W=16,
         bits=4),
]


@pytest.mark.parametrize("case", [1, 3, 6])
def test_case_builder_puts_equal_values_in_both_layouts(case):
    spec = dict(CASES[case])
    _, pages, pt, _, _, _, _ = _case(seed=case, dev="cpu", **spec)
    for name in ("k", "v"):
        rows, mma = pages[name]
        for b, n in enumerate(spec["int_lens"]):
            assert torch.equal(gather_dequantize(rows, pt, b, n), gather_dequantize(mma, pt, b, n))


@CUDA
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("frame", ["original", "rotated"])
def test_cuda_mma_kernel_matches_twin_and_row_kernel(case, frame):
    spec = dict(CASES[case])
    q, pages, pt, int_len, kt, vt, seg = _case(seed=case, **spec)
    (k_rows, k_mma), (v_rows, v_mma) = pages["k"], pages["v"]
    for b, n in enumerate(spec["int_lens"]):  # same values in both layouts
        assert torch.equal(gather_dequantize(k_rows, pt, b, n), gather_dequantize(k_mma, pt, b, n))
        assert torch.equal(gather_dequantize(v_rows, pt, b, n), gather_dequantize(v_mma, pt, b, n))
    segs = Segments(pt, int_len, **seg)
    ref = decode_attention_torch(q, k_rows, v_rows, segs, kt, vt, output_frame=frame)
    out = decode_attention(q, k_mma, v_mma, segs, kt, vt, output_frame=frame, backend="triton")
    assert out.dtype == q.dtype and torch.isfinite(out.float()).all()
    assert _rel(out, ref) < REL_TOL
    if spec["d"] * spec.get("bits", 2) // 8 >= 16:  # the Triton row-layout kernel on the same codes
        tri = decode_attention(q, k_rows, v_rows, segs, kt, vt, output_frame=frame, backend="triton")
        assert _rel(tri, ref) < REL_TOL
    again = decode_attention(q, k_mma, v_mma, segs, kt, vt, output_frame=frame, backend="triton")
    assert torch.equal(out, again)  # the counters were reset: a second launch gives the same result


@CUDA
@pytest.mark.parametrize("launch", [MmaLaunch(num_splits=1), MmaLaunch(num_splits=7, warps=4, min_blocks=1, stages=6),
                                    MmaLaunch(warps=2, stages=2), MmaLaunch(stages=3, num_splits=64, min_blocks=1)])
def test_cuda_mma_kernel_options_and_no_transform(launch):
    spec = dict(CASES[0])
    if launch.warps == 2:
        spec.update(d=64, H=16, hkv=2)
    q, pages, pt, int_len, kt, vt, seg = _case(seed=11, rotate=False, mu=False, **spec)
    segs = Segments(pt, int_len, **seg)
    ref = decode_attention_torch(q, pages["k"][0], pages["v"][0], segs, kt, vt)
    out = decode_attention(q, pages["k"][1], pages["v"][1], segs, kt, vt, backend="triton", launch=launch)
    assert _rel(out, ref) < REL_TOL


@CUDA
def test_cuda_mma_kernel_in_a_cuda_graph():
    q, pages, pt, int_len, kt, vt, seg = _case(seed=5, **CASES[0])
    args = (pages["k"][1], pages["v"][1], Segments(pt, int_len, **seg), kt, vt)
    eager = decode_attention(q, *args, backend="triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, *args, backend="triton")
    q.copy_(torch.randn_like(q))
    int_len[0] += 5  # lengths are read on the device at replay
    graph.replay()
    torch.cuda.synchronize()
    ref = decode_attention_torch(q, pages["k"][0], pages["v"][0], Segments(pt, int_len, **seg), kt, vt)
    assert _rel(out, ref) < REL_TOL and not torch.equal(out, eager)


@CUDA
@pytest.mark.parametrize("case", [0, 1])
def test_cuda_mma_kernel_reads_windows_in_place_by_row(case):
    """``window_rows``: the windows of sequence b at row rows[b] of per-slot buffers (other rows random), as the
    serving pool holds them; same result as on gathered copies (twin) within the tolerance."""
    spec = dict(CASES[case])
    q, pages, pt, int_len, kt, vt, seg = _case(seed=case + 20, **spec)
    rows = list(range(2 * spec["B"] - 1, -1, -2))  # sequence b at row 2(B - 1 - b) + 1
    slotted = dict(seg, window_rows=torch.tensor(rows, dtype=torch.int32, device="cuda"))
    for name in ("sink_k", "sink_v", "recent_k", "recent_v"):
        buf = torch.randn(2 * spec["B"] + 1, *seg[name].shape[1:], device="cuda").to(torch.bfloat16)
        buf[rows] = seg[name]
        slotted[name] = buf
    for frame in ("original", "rotated"):
        ref = decode_attention_torch(q, pages["k"][0], pages["v"][0], Segments(pt, int_len, **seg), kt, vt,
                                     output_frame=frame)
        out = decode_attention(q, pages["k"][1], pages["v"][1], Segments(pt, int_len, **slotted), kt, vt,
                               output_frame=frame, backend="triton")
        assert _rel(out, ref) < REL_TOL, frame

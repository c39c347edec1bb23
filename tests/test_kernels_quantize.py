"""Triton rotate-clip-quantize-pack against its torch twin (CPU: Triton interpreter; CUDA when present)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: interpret; set before any Triton kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from oscar.core import quant  # noqa: E402
from oscar.cache.paged import QuantPages, rotate_quantize_pack  # noqa: E402
from oscar.kernels.segments import HeadTransform  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True, params=["rows", "blocks"])
def quant_path(request, monkeypatch):
    """Every test runs on both kernel paths: one row per program (demotion-sized launches: FMA rotation,
    rank-selected clip threshold) and blocks of rows (prefill: tensor-core rotation, radix select)."""
    import oscar.kernels.quantize as kq

    monkeypatch.setattr(kq, "ROW_PATH_MAX_ROWS", 10**9 if request.param == "rows" else 0)
    return request.param


def _orth(h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].to(torch.float32)


def _rows(n: int, h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, h, d, generator=gen) * (0.2 + 3 * torch.rand(n, h, 1, generator=gen))
    x[n // 2, 0] = 0.75  # a constant row: scale 0, all codes 0
    x[-1, -1, :3] = 40.0  # outliers that clipping removes
    return x


def _pair(hkv: int, d: int, bits: int, g: int, pages: int, ps: int, device: str):
    """(reference pages on CPU, kernel pages on ``device``)."""
    return (QuantPages.empty(pages, hkv, ps, d, bits, g, "cpu"), QuantPages.empty(pages, hkv, ps, d, bits, g, device))


def _equal_pages(a: QuantPages, b: QuantPages) -> None:
    assert torch.equal(a.codes.cpu(), b.codes.cpu())
    assert torch.equal(a.scale.cpu(), b.scale.cpu())
    assert torch.equal(a.zero.cpu(), b.zero.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,d,g", [(2, 128, 128), (2, 64, 16), (4, 128, 128), (4, 64, 32)])
@pytest.mark.parametrize("clip", [False, True])
def test_quantize_bit_exact_without_rotation(device, bits, d, g, clip):
    gen = torch.Generator().manual_seed(bits * 1000 + d + g + clip)
    hkv, n, ps, npages = 2, 23, 8, 5
    x = _rows(n, hkv, d, gen)
    t = HeadTransform(mu=0.3 * torch.randn(hkv, d, generator=gen), rho=torch.tensor([0.9, 0.97]) if clip else None)
    slots = torch.randperm(npages * ps, generator=gen)[:n]  # scattered over shuffled pages
    ref, out = _pair(hkv, d, bits, g, npages, ps, device)
    rotate_quantize_pack(x, slots, ref, t, backend="torch")
    rotate_quantize_pack(x.to(device), slots.to(device), out, t, backend="triton")
    _equal_pages(ref, out)
    # and the packed bytes are exactly the spec's packing of the spec's codes
    page, off = slots // ps, slots % ps
    codes, scale, zero = quant.quantize_codes(x - t.mu, bits, g, 1.0 if t.rho is None else t.rho)
    assert torch.equal(quant.unpack_codes(out.codes.cpu()[page, :, off], bits, g), codes)
    assert torch.equal(out.scale.cpu()[page, :, off], scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,d,g", [(2, 128, 128), (4, 64, 64)])
def test_quantize_with_rotation_close_to_twin(device, bits, d, g):
    """A rotated row sums in another order than torch: a few codes on a rounding boundary may move by one."""
    gen = torch.Generator().manual_seed(7 + bits + d)
    hkv, n, ps, npages = 2, 40, 16, 4
    x = _rows(n, hkv, d, gen).to(torch.bfloat16)
    t = HeadTransform(R=_orth(hkv, d, gen), mu=0.1 * torch.randn(hkv, d, generator=gen), rho=torch.tensor([0.95, 0.9]))
    slots = torch.randperm(npages * ps, generator=gen)[:n]
    ref, out = _pair(hkv, d, bits, g, npages, ps, device)
    rotate_quantize_pack(x, slots, ref, t, backend="torch")
    rotate_quantize_pack(x.to(device), slots.to(device), out, t, backend="triton")
    page, off = slots // ps, slots % ps
    c_ref = quant.unpack_codes(ref.codes[page, :, off], bits, g).int()
    c_out = quant.unpack_codes(out.codes.cpu()[page, :, off], bits, g).int()
    diff = (c_ref - c_out).abs()
    assert int(diff.max()) <= 1
    assert float((diff > 0).float().mean()) < 5e-3
    torch.testing.assert_close(out.scale.cpu().float(), ref.scale.float(), rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(out.zero.cpu().float(), ref.zero.float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_demotion_reads_ring_slots(device):
    """Demotion: row ``recent[n, :, src_index[n]]`` of a ring window goes to slot ``slots[n]``, bit-exact."""
    gen = torch.Generator().manual_seed(3)
    B, hkv, W, d, ps = 5, 2, 8, 64, 4
    recent = torch.randn(B, hkv, W, d, generator=gen).to(torch.bfloat16)
    src = torch.tensor([0, 7, 3, 3, 5])
    slots = torch.tensor([3, 4, 9, 0, 15])
    t = HeadTransform(rho=torch.tensor([0.93, 1.0]))
    ref, out = _pair(hkv, d, 2, 32, 4, ps, device)
    rotate_quantize_pack(recent, slots, ref, t, src_index=src, backend="torch")
    rotate_quantize_pack(recent.to(device), slots.to(device), out, t, src_index=src.to(device), backend="triton")
    _equal_pages(ref, out)
    rows = recent[torch.arange(B), :, src]
    q = quant.quantize(rows, 2, 32, clip_ratio=t.rho)
    assert torch.equal(out.codes.cpu()[slots // ps, :, slots % ps], q.codes)


def test_quantize_kernel_rejects_bad_shapes():
    pages = QuantPages.empty(2, 2, 4, 64, 2, 64)
    with pytest.raises(ValueError, match="R must be"):
        rotate_quantize_pack(torch.zeros(3, 2, 64), torch.arange(3), pages, HeadTransform(R=torch.eye(32)[None]),
                             backend="triton")
    with pytest.raises(ValueError, match="slots must be"):
        rotate_quantize_pack(torch.zeros(3, 2, 64), torch.arange(2), pages, HeadTransform(), backend="triton")
    bad = QuantPages.empty(2, 2, 4, 96, 2, 32)
    with pytest.raises(ValueError, match="head_dim=96"):
        rotate_quantize_pack(torch.zeros(1, 2, 96), torch.arange(1), bad, HeadTransform(), backend="triton")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_kv_demotion_matches_twin(device):
    """K and V demoted in one launch equal the torch twin (no rotation: bit-exact)."""
    from oscar.cache.paged import rotate_quantize_pack_kv

    gen = torch.Generator().manual_seed(9)
    B, hkv, W, d, ps = 6, 2, 8, 128, 4
    rk = torch.randn(B, hkv, W, d, generator=gen).to(torch.bfloat16)
    rv = torch.randn(B, hkv, W, d, generator=gen).to(torch.bfloat16)
    src = torch.randint(0, W, (B,), generator=gen)
    slots = torch.randperm(4 * ps, generator=gen)[:B]
    kt = HeadTransform(mu=torch.randn(hkv, d, generator=gen), rho=torch.tensor([0.95, 0.9]))
    vt = HeadTransform(mu=torch.randn(hkv, d, generator=gen), rho=torch.tensor([0.85, 1.0]))
    ref_k, out_k = _pair(hkv, d, 2, 128, 4, ps, device)
    ref_v, out_v = _pair(hkv, d, 2, 128, 4, ps, device)
    rotate_quantize_pack_kv(rk, rv, slots, ref_k, ref_v, kt, vt, src_index=src, backend="torch")
    rotate_quantize_pack_kv(rk.to(device), rv.to(device), slots.to(device), out_k, out_v,
                            HeadTransform(mu=kt.mu.to(device), rho=kt.rho.to(device)),
                            HeadTransform(mu=vt.mu.to(device), rho=vt.rho.to(device)),
                            src_index=src.to(device), backend="triton")
    _equal_pages(ref_k, out_k)
    _equal_pages(ref_v, out_v)


@pytest.mark.parametrize("device", DEVICES)
def test_rank_clip_select_equals_radix_select(device):
    """The row path's clip threshold (ranks by extracting extremes) equals the block path's radix select on the
    float bits: ties, zeros, subnormals, few distinct magnitudes."""
    from oscar.kernels.launch import QuantizeLaunch
    from oscar.kernels.quantize import rotate_quantize_pack as kernel

    gen = torch.Generator().manual_seed(21)
    n, hkv, d, ps = 5, 2, 64, 8
    x = torch.randn(n, hkv, d, generator=gen)
    x[0, 0, : d // 2] = 0.5  # many ties
    x[1, 1] = 0.0  # all zero
    x[2, 0, ::3] = 1e-40  # subnormals
    x[3, 1] = torch.randint(-3, 4, (d,), generator=gen).float()  # few distinct magnitudes
    t = HeadTransform(rho=torch.tensor([0.9, 0.37], device=device))
    slots = torch.arange(n, device=device)
    pages = [QuantPages.empty(1, hkv, ps, d, 2, 16, device) for _ in range(2)]
    for p, row_path in zip(pages, (False, True)):
        kernel(x.to(device), slots, p, t, launch=QuantizeLaunch(row_path=row_path))
    _equal_pages(pages[0], pages[1])
    ref = QuantPages.empty(1, hkv, ps, d, 2, 16, "cpu")  # and both are the spec's codes
    rotate_quantize_pack(x, slots.cpu(), ref, HeadTransform(rho=t.rho.cpu()), backend="torch")
    _equal_pages(ref, pages[0])


def test_writer_refuses_a_rope_centered_transform_and_a_missing_token_map():
    from oscar.kernels.quantize import rotate_quantize_pack as kernel

    x, slots = torch.zeros(2, 2, 64), torch.arange(2)
    rope = HeadTransform(rope_mu=torch.zeros(2, 64), rope_freq=torch.ones(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="rope-centered offsets are already subtracted"):
        kernel(x, slots, QuantPages.empty(1, 2, 16, 64, 2, 64), rope)
    with pytest.raises(ValueError, match="'mma_k' layout need its token_map"):
        kernel(x, slots, QuantPages.empty(1, 2, 16, 64, 2, 64, layout="mma_k"), HeadTransform())

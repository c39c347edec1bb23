"""Tests of the quantized storage format (oscar.core.quant): clipping, codes, packing, accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from oscar.core.quant import (
    bits_per_element,
    bits_per_element_of,
    dequantize,
    dequantize_codes,
    fake_quantize,
    pack_codes,
    percentile_clip,
    quantize,
    quantize_codes,
    rotate_clip_quantize,
    unpack_codes,
)


pytestmark = pytest.mark.usefixtures("single_thread")


HEAD_DIMS = (64, 80, 96, 128, 160, 192, 256)
GROUPS = (32, 64, 128)


def _shapes():
    for d in HEAD_DIMS:
        for g in GROUPS:
            if d % g == 0:
                yield d, g


def _bf16(v: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def _reference_quantize(x: np.ndarray, bits: int, g: int, rho: float):
    """Independent float32 numpy reference of the DESIGN.md format, one row at a time."""
    qmax = np.float32(2**bits - 1)
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    codes = np.zeros(rows.shape, dtype=np.uint8)
    scales, zeros = [], []
    for i, row in enumerate(rows):
        s = np.sort(np.abs(row))
        pos = np.float32(rho) * np.float32(len(row) - 1)
        lo, hi = int(np.floor(pos)), int(np.ceil(pos))
        w = np.float32(pos - np.float32(lo))
        a, b = s[lo], s[hi]
        tau = a + w * (b - a) if w < 0.5 else b - (b - a) * (np.float32(1) - w)
        row = np.clip(row, -tau, tau).astype(np.float32)
        rs, rz = [], []
        for j in range(0, len(row), g):
            grp = row[j : j + g]
            mn, mx = grp.min(), grp.max()
            sc = _bf16(np.array([(mx - mn) / qmax]))[0]
            z = _bf16(np.array([mn]))[0]
            if sc == 0:
                c = np.zeros(g)
            else:
                c = np.clip(np.floor((grp - z) / sc + np.float32(0.5)), 0, qmax)
            codes[i, j : j + g] = c.astype(np.uint8)
            rs.append(sc)
            rz.append(z)
        scales.append(rs)
        zeros.append(rz)
    return codes.reshape(x.shape), np.array(scales, dtype=np.float32), np.array(zeros, dtype=np.float32)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("rho", [1.0, 0.99, 0.96, 0.9, 0.5, 0.123])
def test_percentile_clip_matches_torch_quantile_bitwise(d, rho):
    torch.manual_seed(d)
    x = torch.randn(7, d) * torch.linspace(0.1, 5.0, d)
    clipped, tau = percentile_clip(x, rho)
    expected_tau = torch.quantile(x.abs(), rho, dim=-1, interpolation="linear")
    assert torch.equal(tau, expected_tau)
    assert torch.equal(clipped, x.clamp(-expected_tau[:, None], expected_tau[:, None]))


def test_percentile_clip_per_row_ratio_tensor():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 128)
    rho = torch.tensor([0.9, 0.95, 1.0]).view(1, 3, 1)
    _, tau = percentile_clip(x, rho)
    for h, r in enumerate((0.9, 0.95, 1.0)):
        assert torch.equal(tau[:, h], torch.quantile(x[:, h].abs(), r, dim=-1, interpolation="linear"))
    assert torch.equal(tau[:, 2], x[:, 2].abs().amax(-1))


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01, float("nan")])
def test_percentile_clip_refuses_bad_ratio(bad):
    with pytest.raises(ValueError, match="clip ratio"):
        percentile_clip(torch.randn(2, 64), bad)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d,g", [(64, 32), (80, 16), (128, 128), (96, 32), (192, 64)])
@pytest.mark.parametrize("rho", [1.0, 0.95])
def test_quantize_matches_independent_reference(bits, d, g, rho):
    torch.manual_seed(bits * 1000 + d + g)
    x = torch.randn(3, 5, d) * torch.exp(torch.randn(d))
    x[0, 0, 3] = 40.0  # an outlier so clipping matters
    codes, scale, zero = quantize_codes(x, bits, g, rho)
    ref_codes, ref_scale, ref_zero = _reference_quantize(x.numpy(), bits, g, rho)
    assert torch.equal(codes, torch.from_numpy(ref_codes))
    assert np.array_equal(scale.float().reshape(-1, d // g).numpy(), ref_scale)
    assert np.array_equal(zero.float().reshape(-1, d // g).numpy(), ref_zero)
    assert scale.dtype == torch.bfloat16 and zero.dtype == torch.bfloat16
    assert scale.shape == (3, 5, d // g)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d,g", list(_shapes()))
def test_pack_unpack_round_trip_exact(bits, d, g):
    gen = torch.Generator().manual_seed(d * g + bits)
    codes = torch.randint(0, 2**bits, (2, 3, 9, d), generator=gen, dtype=torch.uint8)
    packed = pack_codes(codes, bits, g)
    assert packed.shape == (2, 3, 9, d * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits, g), codes)


def test_pack_layout_is_planar_within_group_int2():
    g, d = 8, 16
    codes = torch.zeros(d, dtype=torch.uint8)
    codes[1] = 1  # group 0, plane 0, byte 1, bits 0-1
    codes[3] = 2  # group 0, plane 1 (channel 1 + G/4... j=1 -> channel 3 = 1 + 2), byte 1, bits 2-3
    codes[6] = 3  # group 0, plane 3, byte 0, bits 6-7
    codes[8 + 5] = 1  # group 1, plane 2, byte 1 of group 1 -> packed byte 3, bits 4-5
    packed = pack_codes(codes, 2, g)
    assert packed.tolist() == [3 << 6, 1 | (2 << 2), 0, 1 << 4]


def test_pack_layout_is_planar_within_group_int4():
    g = 8
    codes = torch.arange(16, dtype=torch.uint8)
    packed = pack_codes(codes, 4, g)
    expected = [codes[j] | (codes[j + 4] << 4) for j in range(4)] + [codes[8 + j] | (codes[12 + j] << 4) for j in range(4)]
    assert packed.tolist() == [int(v) for v in expected]


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_dequantize_round_trip_through_packing(bits):
    torch.manual_seed(1)
    x = torch.randn(4, 2, 11, 128)
    q = quantize(x, bits, 64, clip_ratio=0.97)
    codes, scale, zero = quantize_codes(x, bits, 64, 0.97)
    assert torch.equal(unpack_codes(q.codes, bits, 64), codes)
    assert torch.equal(dequantize(q), dequantize_codes(codes, scale, zero, 64))
    assert torch.equal(dequantize(q), fake_quantize(x, bits, 64, 0.97))
    assert q.shape == x.shape
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d,g", [(64, 64), (160, 32), (256, 128)])
def test_dequantization_error_within_rounding_bound(bits, d, g):
    torch.manual_seed(3)
    x = torch.randn(50, d) * 3
    codes, scale, zero = quantize_codes(x, bits, g)
    x_hat = dequantize_codes(codes, scale, zero, g)
    grp = x.reshape(50, d // g, g)
    mn, mx = grp.amin(-1), grp.amax(-1)
    s_exact = (mx - mn) / (2**bits - 1)
    s, z = scale.float(), zero.float()
    # half a step, plus what the bf16 rounding of zero and of scale (times the top code) moves
    bound = s / 2 + (z - mn).abs() + (2**bits - 1) * (s - s_exact).abs() + 1e-5
    err = (x_hat - x).reshape(50, d // g, g).abs().amax(-1)
    assert bool((err <= bound).all())
    assert float(err.max()) > 0.1 * float(s.min())  # it really quantized


@pytest.mark.parametrize("bits", [2, 4])
def test_constant_groups_dequantize_exactly_to_bf16_value(bits):
    x = torch.randn(3, 128)
    x[0, :32] = 0.3
    x[1] = -7.25
    x[2, 32:64] = 0.0
    q = quantize(x, bits, 32)
    x_hat = dequantize(q)
    assert torch.equal(x_hat[0, :32], torch.full((32,), 0.3).to(torch.bfloat16).float())
    assert torch.equal(x_hat[1], x[1])  # -7.25 is exact in bf16
    assert torch.equal(x_hat[2, 32:64], torch.zeros(32))
    assert float(q.scale[1].float().abs().max()) == 0.0


def test_single_token_and_one_dimensional_rows():
    torch.manual_seed(4)
    x = torch.randn(96)
    q = quantize(x, 2, 32)
    assert q.codes.shape == (24,) and q.scale.shape == (3,)
    assert torch.equal(dequantize(q), fake_quantize(x.view(1, 1, 96), 2, 32).view(96))


def test_empty_batches_quantize_to_empty_codes():
    q = quantize(torch.zeros(0, 4, 128), 2, 64, clip_ratio=0.9)
    assert q.codes.shape == (0, 4, 32) and q.scale.shape == (0, 4, 2) and dequantize(q).shape == (0, 4, 128)


def test_quantize_accepts_half_inputs_as_float32():
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert torch.equal(dequantize(quantize(x, 4, 32)), dequantize(quantize(x.float(), 4, 32)))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_inputs_are_refused(value):
    x = torch.randn(2, 64)
    x[1, 5] = value
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, 2, 32)
    with pytest.raises(ValueError, match="non-finite"):
        percentile_clip(x, 0.9)


def test_bad_formats_are_refused_with_the_value():
    x = torch.randn(2, 96)
    with pytest.raises(ValueError, match="bits=3"):
        quantize(x, 3, 32)
    with pytest.raises(ValueError, match="bits=8"):
        quantize(x, 8, 32)
    with pytest.raises(ValueError, match="group_size=64 does not divide head_dim d=96"):
        quantize(x, 2, 64)
    with pytest.raises(ValueError, match="group_size=6 is not a multiple of 4"):
        quantize(torch.randn(2, 12), 2, 6)
    with pytest.raises(ValueError, match="group_size=0"):
        quantize(x, 2, 0)
    with pytest.raises(ValueError, match="does not fit in 2 bits"):
        pack_codes(torch.full((2, 32), 4, dtype=torch.uint8), 2, 32)
    with pytest.raises(ValueError, match="uint8"):
        pack_codes(torch.zeros(2, 32, dtype=torch.int64), 2, 32)


def test_clipping_reduces_error_on_outlier_rows():
    torch.manual_seed(5)
    x = torch.randn(200, 128)
    x[:, 7] += 30.0  # one outlier channel stretches its group's range
    err_noclip = (fake_quantize(x, 2, 128) - x)[:, torch.arange(128) != 7].pow(2).mean()
    err_clip = (fake_quantize(x, 2, 128, 0.9) - x)[:, torch.arange(128) != 7].pow(2).mean()
    assert float(err_clip) < 0.5 * float(err_noclip)


def test_rotate_clip_quantize_is_quantize_of_centered_rotation():
    torch.manual_seed(6)
    x = torch.randn(2, 4, 7, 64, dtype=torch.bfloat16)
    r, _ = torch.linalg.qr(torch.randn(64, 64))
    mu = torch.randn(4, 1, 64)
    q = rotate_clip_quantize(x, r, mu, 0.95, bits=2, group_size=32)
    expected = quantize((x.float() - mu) @ r, 2, 32, clip_ratio=0.95)
    assert torch.equal(q.codes, expected.codes) and torch.equal(q.scale, expected.scale)
    back = dequantize(q) @ r.T + mu
    assert float((back - x.float()).pow(2).mean()) < float(x.float().pow(2).mean())
    with pytest.raises(ValueError, match="does not match"):
        rotate_clip_quantize(x, torch.eye(32), bits=2, group_size=32)


def test_bits_per_element_int2_at_128k_is_2_28():
    value = bits_per_element(128 * 1024, 128, 2, 128, sink=64, recent=256)
    assert round(value, 2) == 2.28
    n_q = 128 * 1024 - 320
    assert math.isclose(value, (n_q * (2 + 2 * 16 / 128) + 320 * 16) / (128 * 1024))


def test_bits_per_element_limits_and_measured_allocation():
    assert bits_per_element(100, 128, 2, 128, sink=64, recent=256) == 16.0
    assert math.isclose(bits_per_element(10**9, 128, 4, 64, sink=0, recent=0), 4.5)
    n, d, g = 1000, 128, 128
    q = quantize(torch.randn(n - 320, d), 2, g)
    bf16_rows = torch.zeros(320, d, dtype=torch.bfloat16)
    measured = bits_per_element_of(n, d, [q.codes, q.scale, q.zero, bf16_rows])
    assert math.isclose(measured, bits_per_element(n, d, 2, g, sink=64, recent=256))


F32_MAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize("row", [
    [F32_MAX] * 8,  # constant group above the bf16 range: zero = bf16(min) = inf
    [3.397e38] * 8,
    [-F32_MAX] * 4 + [-0.99 * F32_MAX] * 4,  # zero = -inf, scale finite
    [0.0] * 7 + [F32_MAX],  # zero and scale finite, zero + 3 * scale = inf
])
def test_zero_point_overflow_is_refused(row):
    """Finite float32 rows that used to dequantize to inf without an error."""
    with pytest.raises(ValueError, match="zero point") as info:
        quantize_codes(torch.tensor([row]), 2, 8)
    assert "largest |x|" in str(info.value)


def test_large_finite_rows_inside_the_bf16_range_still_quantize():
    x = torch.tensor([[0.0, 1e38, 2e38, 3e38, -3e36, 5.0, 0.5, 3.3e38]])
    codes, scale, zero = quantize_codes(x, 2, 8)
    assert torch.isfinite(dequantize_codes(codes, scale, zero, 8)).all()

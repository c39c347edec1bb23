"""Tests of the KIVI-2 and TurboQuant-style baseline quantizers (real codes)."""

from __future__ import annotations

import math

import pytest
import torch

from oscar.core.baselines import (
    TurboQuantizer,
    gaussian_mse,
    kivi_dequantize,
    kivi_fake_quantize,
    kivi_quantize,
    kivi_split,
    lloyd_max_gaussian,
    turboquant_bits_per_element,
)
from oscar.core.quant import fake_quantize, unpack_codes
from oscar.core.rotation import random_orthogonal


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("t,g,r,expected", [(0, 32, 128, (0, 0)), (100, 32, 128, (0, 0)), (128, 32, 128, (0, 0)),
                                            (160, 32, 128, (32, 32)), (200, 32, 128, (64, 72)), (37, 4, 0, (36, 37))])
def test_kivi_split(t, g, r, expected):
    assert kivi_split(t, g, r) == expected


def test_kivi_keys_per_channel_values_per_token_and_exact_residual():
    gen = torch.Generator().manual_seed(0)
    b, h, t, d, g, r = 2, 3, 200, 64, 32, 128
    k = torch.randn(b, h, t, d, generator=gen) * torch.linspace(0.1, 8.0, d)  # channel-wise key scales
    v = torch.randn(b, h, t, d, generator=gen)
    q = kivi_quantize(k, v, bits=2, group_size=g, residual=r)
    k_hat, v_hat = kivi_dequantize(q)
    n_k, n_v = kivi_split(t, g, r)
    assert torch.equal(k_hat[..., n_k:, :], k[..., n_k:, :]) and torch.equal(v_hat[..., n_v:, :], v[..., n_v:, :])
    # keys: block j, channel c is one group of g tokens
    block = k[..., 32:64, :].transpose(-1, -2)
    assert torch.equal(k_hat[..., 32:64, :], fake_quantize(block, 2, g).transpose(-1, -2))
    assert torch.equal(v_hat[..., :n_v, :], fake_quantize(v[..., :n_v, :], 2, g))
    assert q.keys.codes.shape == (b, h, n_k // g, d, g // 4) and q.values.codes.shape == (b, h, n_v, d // 4)
    assert not torch.equal(k_hat[..., :n_k, :], k[..., :n_k, :])
    kf, vf = kivi_fake_quantize(k.to(torch.bfloat16), v.to(torch.bfloat16), 2, g, r)
    assert kf.dtype == torch.bfloat16 and kf.shape == k.shape


def test_kivi_per_channel_keys_beat_per_token_on_channel_outliers():
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1, 1, 256, 128, generator=gen)
    k[..., :4] *= 20.0  # outlier channels, as KIVI observes for keys
    k_hat, _ = kivi_fake_quantize(k, k.clone(), 2, 32, residual=0)
    per_token = fake_quantize(k, 2, 32)
    assert float((k_hat - k).pow(2).mean()) < float((per_token - k).pow(2).mean())
    # outliers no longer stretch the ranges of the ordinary channels
    normal = (slice(None), slice(None), slice(None), slice(4, None))
    assert float((k_hat - k)[normal].pow(2).mean()) < 0.5 * float((per_token - k)[normal].pow(2).mean())


def test_kivi_argument_errors():
    with pytest.raises(ValueError, match="must share a shape"):
        kivi_quantize(torch.zeros(2, 8, 64), torch.zeros(2, 9, 64))
    with pytest.raises(ValueError, match="group_size=0"):
        kivi_split(10, 0, 4)


def test_lloyd_max_levels_satisfy_the_optimality_conditions():
    x = torch.linspace(-12, 12, 2_000_001, dtype=torch.float64)
    pdf = torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    for bits in (1, 2, 3, 4):
        c = lloyd_max_gaussian(bits)
        assert c.shape == (2**bits,) and bool((c[1:] > c[:-1]).all())
        assert torch.allclose(c, -c.flip(0), atol=1e-12)
        edges = (c[1:] + c[:-1]) / 2
        cell = torch.bucketize(x, edges)
        for i in range(2**bits):  # each level is the centroid of its cell (numerical integration)
            w = pdf * (cell == i)
            assert abs(float((w * x).sum() / w.sum()) - float(c[i])) < 3e-5  # grid step 1.2e-5
        mse_numeric = float((pdf * (x - c[cell]) ** 2).sum() * (x[1] - x[0]))
        assert abs(gaussian_mse(c) - mse_numeric) < 1e-6
    # textbook values (Max, 1960) as an external check
    assert abs(float(lloyd_max_gaussian(1)[1]) - math.sqrt(2 / math.pi)) < 1e-12  # E|X|, exact
    assert torch.allclose(lloyd_max_gaussian(2)[2:], torch.tensor([0.4528, 1.5104], dtype=torch.float64), atol=1e-4)
    assert abs(gaussian_mse(lloyd_max_gaussian(2)) - 0.1175) < 1e-4
    with pytest.raises(ValueError, match="bits=0"):
        lloyd_max_gaussian(0)


@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("bits", [2, 4])
def test_turboquant_round_trip_and_distortion_matches_gaussian_theory(d, bits):
    tq = TurboQuantizer(d, bits=bits, seed=3)
    gen = torch.Generator().manual_seed(d)
    a = random_orthogonal(d, 99).float()
    x = (torch.randn(4000, d, generator=gen) * torch.linspace(0.05, 3.0, d)) @ a  # anisotropic rows
    q = tq.quantize(x)
    assert q.codes.shape == (4000, d * bits // 8) and q.codes.dtype == torch.uint8 and q.norms.dtype == torch.bfloat16
    x_hat = tq.dequantize(q)
    # decoding uses exactly the stored levels, the stored norms and the rotation
    y = tq.levels[unpack_codes(q.codes, bits, d).long()] / math.sqrt(d)
    assert torch.allclose(x_hat, (y @ tq.rotation.T) * q.norms.float()[:, None], atol=0, rtol=0)
    rel = float((x_hat - x).pow(2).sum() / x.pow(2).sum())
    theory = gaussian_mse(lloyd_max_gaussian(bits))
    assert abs(rel - theory) < 0.15 * theory + 0.005
    assert torch.equal(TurboQuantizer(d, bits, seed=3).rotation, tq.rotation)
    assert not torch.equal(TurboQuantizer(d, bits, seed=4).rotation, tq.rotation)


def test_turboquant_zero_rows_errors_and_accounting():
    tq = TurboQuantizer(64, 2, seed=0)
    x = torch.zeros(3, 64)
    assert torch.equal(tq.fake_quantize(x), x)
    with pytest.raises(ValueError, match="head_dim=64"):
        tq.quantize(torch.zeros(2, 32))
    with pytest.raises(ValueError, match="non-finite"):
        tq.quantize(torch.full((1, 64), float("nan")))
    with pytest.raises(ValueError, match="bits=3"):
        TurboQuantizer(64, 3)
    assert turboquant_bits_per_element(128, 2) == 2.125

"""The math core on a CUDA device: the torch twins give the same bits as on the CPU."""

from __future__ import annotations

import pytest
import torch

from oscar.core.baselines import TurboQuantizer, kivi_fake_quantize
from oscar.core.quant import dequantize, percentile_clip, quantize, rotate_clip_quantize
from oscar.core.rotation import build_rotation
from oscar.core.stats import CalibrationStats, attention_output

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d,g", [(64, 64), (96, 32), (128, 128), (128, 32), (256, 128)])
@pytest.mark.parametrize("rho", [1.0, 0.93])
def test_quantize_is_bit_identical_on_cuda(bits, d, g, rho):
    gen = torch.Generator().manual_seed(d * bits + g)
    x = torch.randn(3, 4, 97, d, generator=gen) * torch.exp(torch.randn(d, generator=gen))
    cpu = quantize(x, bits, g, clip_ratio=rho)
    gpu = quantize(x.cuda(), bits, g, clip_ratio=rho)
    assert torch.equal(gpu.codes.cpu(), cpu.codes)
    assert torch.equal(gpu.scale.cpu(), cpu.scale) and torch.equal(gpu.zero.cpu(), cpu.zero)
    assert torch.equal(dequantize(gpu).cpu(), dequantize(cpu))
    assert torch.equal(percentile_clip(x.cuda(), rho)[1].cpu(), percentile_clip(x, rho)[1])


def test_rotate_clip_quantize_on_cuda_matches_within_rotation_rounding():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 50, 128, generator=gen)
    r = build_rotation("hp", 128).float()
    mu = torch.randn(4, 1, 128, generator=gen)
    cpu = dequantize(rotate_clip_quantize(x, r, mu, 0.95, bits=2, group_size=128))
    gpu = dequantize(rotate_clip_quantize(x.cuda(), r.cuda(), mu.cuda(), 0.95, bits=2, group_size=128)).cpu()
    # the float32 matmul may round differently on the device; codes then differ by one step at most
    step = (cpu.amax(-1) - cpu.amin(-1)).max() / 3
    assert float((gpu - cpu).abs().max()) <= float(step) + 1e-4
    assert float((gpu != cpu).float().mean()) < 0.01


def test_statistics_accept_cuda_inputs():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 40, 64, generator=gen)
    k = torch.randn(2, 2, 40, 64, generator=gen)
    v = torch.randn(2, 2, 40, 64, generator=gen)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, :3] = False
    o = attention_output(q, k, v, mask=mask)
    o_gpu = attention_output(q.cuda(), k.cuda(), v.cuda(), mask=mask.cuda())
    assert torch.allclose(o_gpu.cpu(), o, atol=1e-5)
    cpu, gpu = CalibrationStats(1, 8, 2, 64, max_samples=10), CalibrationStats(1, 8, 2, 64, max_samples=10)
    cpu.update(0, q, k, v, o, mask=mask)
    gpu.update(0, q.cuda(), k.cuda(), v.cuda(), o.cuda(), mask=mask.cuda())
    gpu.add_samples(0, k.cuda(), v.cuda(), mask=mask.cuda())
    for name, value in cpu.layers[0].tensors.items():
        assert gpu.layers[0][name].device.type == "cpu"
        assert torch.allclose(gpu.layers[0][name].double(), value.double(), rtol=1e-10, atol=1e-8), name
    assert gpu.samples[0]["K_samples"].device.type == "cpu"


def test_baselines_run_on_cuda():
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(1, 2, 300, 128, generator=gen)
    v = torch.randn(1, 2, 300, 128, generator=gen)
    kc, vc = kivi_fake_quantize(k, v, 2, 32, 128)
    kg, vg = kivi_fake_quantize(k.cuda(), v.cuda(), 2, 32, 128)
    assert torch.equal(kg.cpu(), kc) and torch.equal(vg.cpu(), vc)
    tq = TurboQuantizer(128, 2, seed=0)
    x = torch.randn(500, 128, generator=gen)
    xc, xg = tq.fake_quantize(x), tq.fake_quantize(x.cuda()).cpu()
    assert float((xc - xg).abs().gt(1e-3).float().mean()) < 0.01

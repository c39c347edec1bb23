"""The decode step's fast paths against the general ones, step by step, across continuous-batching changes
(rows leaving and joining): the rotated cache's write-then-read of the stored state (batched demotion, kept
dequantized INT rows) against `_attend_segments`' decode-equivalent view of the same state, and the KIVI /
TurboQuant simulations' kept quantize-dequantize images against recomputing them over the whole history.
Same math, float32 reduction order only: 1e-5 absolute on outputs of size ~1 (measured max 1e-6)."""

from __future__ import annotations

import copy

import pytest
import torch

from oscar.cache.attention import take_pending
from oscar.cache.torch_cache import CacheSpec, LayerRotations, OscarLayer, SimulatedLayer
from oscar.core.rotation import random_orthogonal

H, HKV, D = 4, 2, 32


class _Module:
    num_key_value_groups = H // HKV
    training = False
    is_causal = True


def _rotated(k_rope: bool = False) -> OscarLayer:
    rk = torch.stack([random_orthogonal(D, seed=h) for h in range(HKV)])
    rv = torch.stack([random_orthogonal(D, seed=h + 7) for h in range(HKV)])
    g = torch.Generator().manual_seed(1)
    rot = LayerRotations(rk, rv, 0.1 * torch.randn(HKV, D, generator=g), 0.1 * torch.randn(HKV, D, generator=g),
                         torch.full((HKV,), 0.95), torch.full((HKV,), 0.9))
    spec = CacheSpec(kind="rotated", bits=2, group_size=32, sink=4, recent=8, page_size=4, layers=[rot])
    return OscarLayer(spec, rot, 0)


def _feed(lay, n: int, batch: int, gen: torch.Generator):
    q = torch.randn(batch, H, n, D, generator=gen)
    k = torch.randn(batch, HKV, n, D, generator=gen)
    v = torch.randn(batch, HKV, n, D, generator=gen)
    return q, k, v


def _step(lay, q, k, v):
    lay.update(k, v)
    take_pending(k)
    return lay.attend_and_write(_Module(), q, k, v, None, D**-0.5)


def _prefilled(make, batch: int, n: int, seed: int):
    lay, gen = make(), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _step(lay, *_feed(lay, n, batch, gen))
    return lay


def test_rotated_decode_step_equals_the_segments_view_across_select_and_extend():
    gen = torch.Generator().manual_seed(0)
    lay = _prefilled(_rotated, 3, 11, 5)
    worst = 0.0
    with torch.no_grad():
        for step in range(30):
            if step == 9:
                lay.batch_select_indices([2, 0])  # a request leaves, the others are reordered
            if step == 17:
                lay.batch_extend(_prefilled(_rotated, 2, 23, 6))  # two requests join
            q, k, v = _feed(lay, 1, lay.batch, gen)
            ref_layer = copy.deepcopy(lay)
            kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
            ref = ref_layer._attend_segments(q, kb, vb, None, D**-0.5, True, ref_layer.lengths())
            out = _step(lay, q, k, v)
            worst = max(worst, float((out - ref).abs().max()))
    assert worst < 1e-5
    assert min(lay.int_lengths()) > 0  # the INT segment was read, and its kept copy updated and rebuilt
    assert lay._dequantized is not None


@pytest.mark.parametrize("kind", ["kivi", "turboquant"])
def test_simulated_decode_step_equals_recomputing_the_images(kind):
    def make():
        spec = CacheSpec(kind=kind, bits=2, group_size=8, sink=4 if kind == "turboquant" else 0, recent=8, page_size=8)
        return SimulatedLayer(spec, None, 0)

    gen = torch.Generator().manual_seed(0)
    lay = _prefilled(make, 3, 13, 5)
    worst = 0.0
    with torch.no_grad():
        for step in range(26):  # crosses several KIVI key blocks of 8
            if step == 7:
                lay.batch_select_indices([1, 2])
            if step == 15:
                lay.batch_extend(_prefilled(make, 1, 30, 6))
            q, k, v = _feed(lay, 1, lay.batch, gen)
            ref_layer = copy.deepcopy(lay)
            ref_layer.fake_len = [0] * ref_layer.batch  # forces the whole-history images
            ref = _step(ref_layer, q, k, v)
            out = _step(lay, q, k, v)
            worst = max(worst, float((out - ref).abs().max()))
    assert worst < 1e-5

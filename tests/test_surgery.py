"""o_proj folding of the inverse value rotation: exact equivalence in float64."""

from __future__ import annotations

import torch

from oscar.cache.attention import enable
from oscar.cache.torch_cache import spec_for_model
from oscar.models.engine import new_cache
from oscar.core.rotation import random_orthogonal
from oscar.models.surgery import fold_value_rotations, folded_weight

from test_cache import random_rotations, tiny_llama


def test_folded_weight_absorbs_the_inverse_rotation_per_kv_head() -> None:
    torch.manual_seed(0)
    hidden, heads, hkv, d = 12, 6, 2, 8
    w = torch.randn(hidden, heads * d, dtype=torch.float64)
    r_v = torch.stack([random_orthogonal(d, seed=s) for s in range(hkv)])
    o_rot = torch.randn(5, heads, d, dtype=torch.float64)
    kv_of = torch.arange(heads) // (heads // hkv)
    o = torch.einsum("nhd,hed->nhe", o_rot, r_v[kv_of])  # o = o_rot @ R^T per head
    ref = o.reshape(5, -1) @ w.T
    out = o_rot.reshape(5, -1) @ folded_weight(w, r_v, heads).T
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)


def test_folded_model_with_quantized_history_is_exact_in_float64() -> None:
    model = tiny_llama(dtype=torch.float64)
    enable(model)
    rots = random_rotations(model, seed=4, dtype=torch.float64)
    ids = torch.randint(0, 96, (2, 27), generator=torch.Generator().manual_seed(1))
    kw = dict(kind="rotated", rotations=rots, sink=2, recent=5, group_size=8, store_dtype=torch.float64)
    outs = {}
    original = [layer.self_attn.o_proj.weight.clone() for layer in model.model.layers]
    assert all(layer.self_attn.o_proj.bias is None for layer in model.model.layers)
    for fold in (False, True):
        handle = fold_value_rotations(model, rots) if fold else None
        with torch.no_grad():
            for mode in ("decode_equivalent", "serving"):
                cache = new_cache(model, spec_for_model(model, mode=mode, fold_values=fold, **kw))
                prefix = model(ids[:, :20], cache=cache).logits
                steps = [model(ids[:, t : t + 1], cache=cache).logits for t in range(20, 27)]
                outs[(fold, mode)] = torch.cat([prefix, *steps], dim=1)
        if handle is not None:
            handle.undo()
    for mode in ("decode_equivalent", "serving"):
        torch.testing.assert_close(outs[(True, mode)], outs[(False, mode)], rtol=1e-10, atol=1e-10)
    for layer, w in zip(model.model.layers, original):
        assert torch.equal(layer.self_attn.o_proj.weight, w)  # undo restores the weights exactly
        assert layer.self_attn.o_proj.bias is None

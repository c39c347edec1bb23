"""Activation capture is exact: statistics from the registered attention function equal an
independent float64 recomputation of q/k/v/S.V from each layer's inputs (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from oscar.models.capture import CAPTURE_IMPL, capturing, group_by_kv_head, run_captured
from oscar.models import get_adapter, load_model
from oscar.models.tiny import save_random_model, tiny_model_cfg
from oscar.core.stats import CalibrationStats

FAMILIES = {
    "llama": dict(num_heads=4, num_kv_heads=2, head_dim=64),  # GQA 2
    "qwen2": dict(num_heads=8, num_kv_heads=2, head_dim=64),  # GQA 4, q/k/v biases
    "qwen3": dict(num_heads=4, num_kv_heads=1, head_dim=128),  # q/k norm, GQA 4
    "glm4_moe": dict(num_heads=4, num_kv_heads=2, head_dim=128),  # partial rotary, MoE
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    family = request.param
    path = save_random_model(family, tmp_path_factory.mktemp(family), seed=1, **FAMILIES[family])
    model, tok = load_model(tiny_model_cfg(family, path), device="cpu", dtype="float64")
    return family, model, tok


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rd = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    rot, rest = x[..., :rd], x[..., rd:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)


def _reference(model, ids: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer q/k/v/S.V recomputed from the attention module's inputs, by hand, in float64."""
    adapter = get_adapter(model)
    dims = adapter.dims(model)
    inputs: dict[int, tuple] = {}
    handles = []
    for layer in range(dims.num_layers):
        attn = adapter.attention(model, layer)

        def hook(module, args, kwargs, layer=layer):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            inputs[layer] = (hidden.detach(), tuple(t.detach() for t in kwargs["position_embeddings"]))

        handles.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    out = {}
    d, h_q, h_kv = dims.head_dim, dims.num_heads, dims.num_kv_heads
    for layer, (hidden, (cos, sin)) in inputs.items():
        attn = adapter.attention(model, layer)
        proj = adapter.projections(model, layer)
        b, t, _ = hidden.shape
        q = proj["q"](hidden).view(b, t, h_q, d)
        k = proj["k"](hidden).view(b, t, h_kv, d)
        v = proj["v"](hidden).view(b, t, h_kv, d).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rope(q.transpose(1, 2), cos, sin), _rope(k.transpose(1, 2), cos, sin)
        g = h_q // h_kv
        k_rep, v_rep = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        logits = (q @ k_rep.transpose(-1, -2)) * d**-0.5
        logits = logits.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        s = torch.softmax(logits, dim=-1) @ v_rep
        out[layer] = {"q": q, "k": k, "v": v, "s": s}
    return out


def test_captured_statistics_equal_independent_recomputation(tiny):
    family, model, tok = tiny
    dims = get_adapter(model).dims(model)
    ids = torch.randint(0, len(tok), (1, 37), generator=torch.Generator().manual_seed(0))
    stats = CalibrationStats(dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim)
    run_captured(model, [ids[0]], lambda l, q, k, v, s: stats.update(l, q=q, k=k, v=v, attn_out=s))
    ref = _reference(model, ids)
    g = dims.group_size
    for layer in range(dims.num_layers):
        r = ref[layer]
        for h in range(dims.num_kv_heads):
            heads = range(h * g, (h + 1) * g)  # GQA: query head j reads KV head j // g
            c_q = sum(r["q"][0, j].T @ r["q"][0, j] for j in heads)
            c_s = sum(r["s"][0, j].T @ r["s"][0, j] for j in heads)
            c_k = r["k"][0, h].T @ r["k"][0, h]
            c_v = r["v"][0, h].T @ r["v"][0, h]
            for name, want in (("C_Q", c_q), ("C_S", c_s), ("C_K", c_k), ("C_V", c_v)):
                got = stats.layers[layer][name][h]
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{family} layer {layer} {name}[{h}]")
            assert int(stats.layers[layer]["n_Q"][h]) == g * 37
            assert int(stats.layers[layer]["n_K"][h]) == 37


def test_sdpa_base_matches_eager_base(tiny):
    """The eager base (explicit causal mask) gives the same outputs up to its float32 softmax."""
    _, model, tok = tiny
    ids = torch.randint(0, len(tok), (1, 21), generator=torch.Generator().manual_seed(2))
    got: dict[str, dict[int, torch.Tensor]] = {"sdpa": {}, "eager": {}}
    for base in got:
        run_captured(model, [ids[0]], lambda l, q, k, v, s, base=base: got[base].__setitem__(l, s.clone()), base=base)
    for layer, s in got["sdpa"].items():
        torch.testing.assert_close(s, got["eager"][layer], rtol=1e-5, atol=1e-6)


def test_capture_leaves_logits_unchanged_and_restores_implementation(tiny):
    _, model, tok = tiny
    ids = torch.randint(0, len(tok), (1, 16), generator=torch.Generator().manual_seed(3))
    before = model.config._attn_implementation
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        seen = []
        with capturing(model, lambda l, q, k, v, s: seen.append(l)):
            assert model.config._attn_implementation == CAPTURE_IMPL
            out = model(input_ids=ids, use_cache=False).logits
    assert model.config._attn_implementation == before
    assert seen == list(range(get_adapter(model).dims(model).num_layers))
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_group_by_kv_head_follows_gqa_rule():
    b, h, t, d, hkv = 2, 6, 3, 4, 2
    x = torch.arange(b * h * t * d, dtype=torch.float64).view(b, h, t, d)
    grouped = group_by_kv_head(x, hkv)
    assert grouped.shape == (hkv, b * (h // hkv) * t, d)
    for kv in range(hkv):
        expected = torch.cat([x[bi, j] for bi in range(b) for j in range(kv * 3, kv * 3 + 3)])
        torch.testing.assert_close(grouped[kv], expected)
    with pytest.raises(ValueError, match="not a multiple"):
        group_by_kv_head(x, 4)


def test_capture_refuses_cached_forward(tiny):
    _, model, tok = tiny
    ids = torch.randint(0, len(tok), (1, 8))
    with torch.no_grad(), capturing(model, lambda *a: None):
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :4], cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="use_cache=False"):
            model(input_ids=ids[:, 4:], cache=cache, use_cache=True)


def test_capture_rejects_unknown_base(tiny):
    _, model, _ = tiny
    with pytest.raises(ValueError, match="valid: sdpa, eager"):
        with capturing(model, lambda *a: None, base="flash"):
            pass

"""Rope-centered keys (`oscar.core.rope`): the RoPE twin against transformers, the statistics, `auto`'s candidate,
the artifact round trip and the cache paths that subtract `RoPE_p(m)` on write and add it back on read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from oscar.core import quant
from oscar.cache.attention import enable
from oscar.cache.torch_cache import CacheSpec, LayerRotations, spec_for_model
from oscar.models.engine import new_cache
from oscar.core.rope import RopeSpec
from oscar.core.rotation import random_orthogonal
from oscar.core.stats import CalibrationStats

torch.set_num_threads(2)


def tiny_qwen2(bias_scale: float = 4.0) -> Qwen2ForCausalLM:
    """Qwen2 (k_proj with a bias) whose key bias is large against the key spread, as in Qwen2.5-Coder."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.normal_(0, bias_scale)
    return model


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen2()


def test_rope_twin_equals_transformers_and_inverts(qwen) -> None:
    from oscar.models.adapters import key_rope

    spec, why = key_rope(qwen, 0, positions=64)
    assert spec is not None, why
    assert spec.rotary_dim == 16 and spec.scaling == 1.0
    x = torch.randn(2, 2, 64, 16, dtype=torch.float64)
    pos = torch.arange(64)
    # exact up to float64 rounding: the same rotation, computed in another order
    torch.testing.assert_close(spec.apply(spec.apply(x, pos), pos, inverse=True), x, rtol=0, atol=1e-12)
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    cos, sin = qwen.model.rotary_emb(x.float(), pos[None])
    _, ref = apply_rotary_pos_emb(x.float(), x.float(), cos, sin)
    # float32 reference (cos/sin rounded to float32): agreement to float32 rounding of |x| ~ 4
    torch.testing.assert_close(spec.apply(x, pos).float(), ref, rtol=0, atol=1e-5)


def test_key_rope_follows_the_model_and_names_what_it_lacks() -> None:
    from oscar.models.adapters import key_rope

    model = tiny_qwen2()
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq * 1.5  # a rescaled RoPE is read from the model
    spec, why = key_rope(model, 0, positions=8)
    assert spec is not None and why == ""
    model.model.rotary_emb.attention_scaling = 2.0
    spec, why = key_rope(model, 0, positions=8)
    assert spec is not None and spec.scaling == 2.0  # scaled RoPE is expressed, not refused
    del model.model.rotary_emb.inv_freq
    spec, why = key_rope(model, 0, positions=8)
    assert spec is None and "inv_freq" in why


def test_averaged_second_moment_equals_the_mean_of_rotated_moments() -> None:
    spec = RopeSpec(1.0 / (100.0 ** (torch.arange(0, 3, dtype=torch.float64) / 3)), 1.0, head_dim=8)  # partial: 6 of 8
    a = torch.randn(8, 8, dtype=torch.float64)
    s = a @ a.T
    pos = torch.arange(37)
    eye = torch.eye(8, dtype=torch.float64)
    mats = [spec.apply(eye, torch.full((8,), int(p))).T for p in pos]  # columns: RoPE_p of the basis
    brute = sum(m @ s @ m.T for m in mats) / len(mats)
    torch.testing.assert_close(spec.averaged_second_moment(s, pos, chunk=5), brute, rtol=0, atol=1e-12)


def test_stats_keep_pre_rope_sums_and_positions_through_save_and_load(tmp_path) -> None:
    st = CalibrationStats(1, 2, 1, 4, max_samples=5)
    k = torch.randn(1, 1, 3, 4)
    st.update(0, q=torch.randn(1, 2, 3, 4), k=k, v=k, attn_out=torch.randn(1, 2, 3, 4), k_pre=2 * k)
    assert st.has_pre_rope(0)
    st.add_samples(0, k, k, positions=torch.tensor([[7, 8, 9]]))
    st.add_samples(0, k, k)
    assert st.sample_pos[0].tolist() == [7, 8, 9, 0, 1]
    st.save(tmp_path)
    back = CalibrationStats.load(tmp_path)
    assert back.has_pre_rope(0) and back.sample_pos[0].tolist() == [7, 8, 9, 0, 1]
    torch.testing.assert_close(back.mean(0, "Kpre"), 2 * st.mean(0, "K"))
    older = CalibrationStats(1, 2, 1, 4)
    older.update(0, q=torch.randn(1, 2, 3, 4), k=k, v=k, attn_out=torch.randn(1, 2, 3, 4))
    assert not older.has_pre_rope(0)
    merged = older.merge(back)  # one side without pre-RoPE sums: the merge has none that count
    assert not merged.has_pre_rope(0)


def _rope_rotations(model, spec: RopeSpec, mean_scale: float = 3.0) -> list[LayerRotations]:
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(11)
    out = []
    for layer in range(cfg.num_hidden_layers):
        rk = torch.stack([random_orthogonal(d, seed=200 + 10 * layer + h) for h in range(hkv)])
        rv = torch.stack([random_orthogonal(d, seed=300 + 10 * layer + h) for h in range(hkv)])
        rope_k = mean_scale * torch.randn(hkv, d, generator=g)
        rope_k[1] = 0  # head 1 not rope-centered: the layer mixes both kinds
        mu_k = torch.zeros(hkv, d)
        mu_k[1] = 0.2 * torch.randn(d, generator=g)
        out.append(LayerRotations(rk, rv, mu_k, 0.1 * torch.randn(hkv, d, generator=g), torch.full((hkv,), 0.9),
                                  torch.full((hkv,), 0.95), rope_k, spec))
    return out


def test_decode_equivalent_prefill_equals_step_by_step_decoding_with_rope_centering(qwen) -> None:
    from oscar.models.adapters import key_rope

    enable(qwen)
    spec, _ = key_rope(qwen, 0, positions=64)
    rots = _rope_rotations(qwen, spec)
    ids = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(3))
    kw = dict(kind="rotated", rotations=rots, sink=3, recent=5, bits=2, group_size=8, page_size=4)
    with torch.no_grad():
        c1 = new_cache(qwen, spec_for_model(qwen, mode="decode_equivalent", **kw))
        chunked = qwen(ids, cache=c1).logits
        c2 = new_cache(qwen, spec_for_model(qwen, **kw))
        stepped = torch.cat([qwen(ids[:, t : t + 1], cache=c2).logits for t in range(29)], dim=1)
        c3 = new_cache(qwen, spec_for_model(qwen, **{**kw, "rotations": [LayerRotations(r.r_k, r.r_v, r.mu_k, r.mu_v, r.rho_k, r.rho_v) for r in rots]}))
        plain = torch.cat([qwen(ids[:, t : t + 1], cache=c3).logits for t in range(29)], dim=1)
    # float32 reassociation only (one softmax over dequantized rows vs rotated-frame segments + LSE merge)
    torch.testing.assert_close(chunked, stepped, rtol=1e-4, atol=1e-4)
    assert (stepped - plain).abs().max() > 1e-3  # the offsets are really subtracted and added back
    assert c2.layers[0].int_lengths() == [21, 21]


def test_rope_centering_removes_a_rotating_key_bias_exactly() -> None:
    """Keys `RoPE_p(b) + small noise` quantize to the noise's precision once `RoPE_p(b)` is subtracted; without
    it the bias sets the range (the failure the candidate exists for)."""
    hkv, d, heads, n = 1, 16, 2, 48
    spec = RopeSpec(1.0 / (10000.0 ** (torch.arange(0, 8, dtype=torch.float64) / 8)), 1.0, head_dim=d)
    bias = 20 * torch.randn(hkv, d, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n)
    keys = spec.offsets(bias, pos[None])[0] + 0.05 * torch.randn(hkv, n, d, generator=torch.Generator().manual_seed(2))
    eye = torch.eye(d).expand(hkv, d, d).clone()
    errs = {}
    for name, rot in (("rope", LayerRotations(eye, eye.clone(), rope_k=bias, rope=spec)), ("plain", LayerRotations(eye, eye.clone()))):
        cache_spec = CacheSpec(kind="rotated", bits=2, group_size=8, sink=0, recent=1, page_size=4, layers=[rot])
        from tests.test_cache import _layer_harness, _step

        layer, module = _layer_harness(cache_spec, hkv, d)
        for t in range(n):
            _step(layer, module, torch.randn(1, heads, 1, d), keys[None, :, t : t + 1], keys[None, :, t : t + 1])
        k_rot, valid = layer.k_store.gather_dequantized()
        back = layer._unrotate(k_rot, "k", layer._int_positions(valid))[0, :, : n - 1]
        errs[name] = float((back - keys[:, : n - 1].to(torch.bfloat16).float()).abs().max())
    assert errs["rope"] < 0.1 < 2.0 < errs["plain"], errs


def test_auto_picks_rope_centering_for_a_biased_key_head_and_the_artifact_keeps_it(tmp_path) -> None:
    from oscar.core.artifact import load_artifact, save_artifact
    from oscar.core.calibration import build_artifact
    from oscar.models.engine import layer_rotations

    d, hkv, heads, n = 16, 1, 2, 512
    spec = RopeSpec(1.0 / (10000.0 ** (torch.arange(0, 8, dtype=torch.float64) / 8)), 1.0, head_dim=d)
    g = torch.Generator().manual_seed(4)
    bias = 8 * torch.randn(hkv, d, generator=g, dtype=torch.float64)
    st = CalibrationStats(1, heads, hkv, d, max_samples=256, meta={"rope": [spec.to_json()], "calibration": {"seq_len": n}})
    for _ in range(2):
        pre = bias[None, :, None, :] + torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
        k = spec.apply(pre, torch.arange(n))
        q = torch.randn(1, heads, n, d, generator=g, dtype=torch.float64)
        st.update(0, q=q, k=k, v=pre, attn_out=q, k_pre=pre)
    st.add_samples(0, k.float(), pre.float())
    art = build_artifact({"name": "auto", "key_rotation": "auto", "value_rotation": "auto", "clip": "fit"},
                         num_layers=1, num_kv_heads=hkv, head_dim=d, group_size=8, stats=st,
                         clip_grid_k=[0.8, 0.9, 1.0], clip_grid_v=[0.9, 1.0])
    choice = art.meta["choices"][0]
    assert choice["center_k"] == "rope", choice["key_table"]
    assert art.meta["rope"][0] is not None
    torch.testing.assert_close(art.ropemu_K[0].double(), bias, rtol=0, atol=0.2)
    save_artifact(art, tmp_path)
    back = load_artifact(tmp_path)
    rot = layer_rotations(back)[0]
    assert rot.rope is not None and torch.equal(rot.rope_k, art.ropemu_K[0])
    no_rope = build_artifact({"name": "auto", "key_rotation": "auto", "value_rotation": "auto", "clip": "fit", "rope_center": False},
                             num_layers=1, num_kv_heads=hkv, head_dim=d, group_size=8, stats=st,
                             clip_grid_k=[0.8, 0.9, 1.0], clip_grid_v=[0.9, 1.0])
    assert no_rope.meta["choices"][0]["center_k"] != "rope" and "rope" not in no_rope.meta
    assert no_rope.meta["choices"][0]["key_distortion"] > 4 * choice["key_distortion"]


def test_paged_decode_with_rope_centered_keys_equals_the_segment_path(qwen) -> None:
    """Decode steps through oscar.cache.paged (the kernels' twin: pages, q . RoPE_p(m) added to the logits at
    int_pos0 = sink) give the logits of the host cache's own segment path on the same stored rows."""
    from oscar.models.adapters import key_rope

    enable(qwen)
    spec, _ = key_rope(qwen, 0, positions=64)
    rots = _rope_rotations(qwen, spec)
    ids = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(5))
    kw = dict(kind="rotated", rotations=rots, sink=1, recent=2, group_size=8)
    with torch.no_grad():
        paged = new_cache(qwen, spec_for_model(qwen, paged_decode=True, **kw))
        via_pages = torch.cat([qwen(ids[:, t : t + 1], cache=paged).logits for t in range(14)], dim=1)
        host = new_cache(qwen, spec_for_model(qwen, **kw))
        segments = torch.cat([qwen(ids[:, t : t + 1], cache=host).logits for t in range(14)], dim=1)
    assert paged.layers[0].int_lengths() == [11]
    torch.testing.assert_close(via_pages, segments, rtol=1e-4, atol=1e-4)  # float32 reassociation only


def test_kernel_transforms_carry_rope_centered_keys(qwen) -> None:
    from oscar.models.adapters import key_rope
    from oscar.bench.throughput.decode import head_transforms

    spec, _ = key_rope(qwen, 0, positions=64)
    rots = _rope_rotations(qwen, spec)
    (kt, vt), _ = head_transforms(rots)
    assert kt.rope_centered and not vt.rope_centered and torch.equal(kt.rope_mu, rots[0].rope_k)
    plain = [LayerRotations(r.r_k, r.r_v, r.mu_k, r.mu_v, r.rho_k, r.rho_v) for r in rots]
    assert not head_transforms(plain)[0][0].rope_centered

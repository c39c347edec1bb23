"""The OSCAR cache on tiny random models: exactness against the BF16 cache, demotion, decode-equivalent
prefill against step-by-step decoding, padding, the packed path against dequantize-then-attend, memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from oscar.core import quant
from oscar.cache.attention import enable
from oscar.cache.torch_cache import CacheSpec, LayerRotations, OscarLayer, spec_for_model
from oscar.models.engine import new_cache
from oscar.core.rotation import random_orthogonal

torch.set_num_threads(2)


def tiny_llama(kv_heads: int = 2, heads: int = 4, dtype: torch.dtype = torch.float32, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=16 * heads, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


def random_rotations(model, seed: int = 0, center: bool = True, rho: float = 0.9, dtype: torch.dtype = torch.float32) -> list[LayerRotations]:
    """Random orthogonal R_K/R_V, random means and clip ratios: exercises every term of the math."""
    cfg = model.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(cfg.num_hidden_layers):
        rk = torch.stack([random_orthogonal(d, seed=seed + 100 * layer + h, dtype=dtype) for h in range(hkv)])
        rv = torch.stack([random_orthogonal(d, seed=seed + 100 * layer + h + 50, dtype=dtype) for h in range(hkv)])
        mu_k = 0.1 * torch.randn(hkv, d, generator=g) if center else None
        mu_v = 0.1 * torch.randn(hkv, d, generator=g) if center else None
        out.append(LayerRotations(rk, rv, mu_k, mu_v, torch.full((hkv,), rho), torch.full((hkv,), rho)))
    return out


def run_prefill(model, ids, spec, attention_mask=None):
    with torch.no_grad():
        cache = new_cache(model, spec)
        return model(ids, attention_mask=attention_mask, cache=cache).logits, cache


def run_steps(model, ids, spec):
    with torch.no_grad():
        cache = new_cache(model, spec)
        logits = [model(ids[:, t : t + 1], cache=cache).logits for t in range(ids.shape[1])]
    return torch.cat(logits, dim=1), cache


def _store_rows(store) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked codes `[N, Hkv, d]`, bf16 scale and zero `[N, Hkv, d/G]` of every stored row, sequence by sequence."""
    codes, scales, zeros = [], [], []
    for b, pages in enumerate(store.pages):
        n = store.lengths[b]
        idx = torch.tensor(pages, dtype=torch.long)
        for name, out in (("codes", codes), ("scale", scales), ("zero", zeros)):
            t = getattr(store, name)[idx].permute(0, 2, 1, 3).reshape(-1, store.hkv, getattr(store, name).shape[-1])[:n]
            out.append(t)
    return quant.unpack_codes(torch.cat(codes), store.bits, store.group_size), torch.cat(scales), torch.cat(zeros)


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place between same-signed bf16 values (0 where equal)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs().masked_fill(a == b, 0)


def assert_quantized_alike(a: tuple, b: tuple, group_size: int, max_group_share: float) -> None:
    """Unpacked (codes, scale, zero) of the same rows reached through different float reduction orders.

    Exact: the shapes (which rows, which groups). May differ (machine-dependent: BLAS kernel, ISA,
    batch shape): where reassociation moves a value across a rounding boundary, its code moves by one
    step or its group's bf16 scale/zero by one ulp. Each position moves by at most that; at most
    `max_group_share` of the groups move at all.
    """
    (ca, sa, za), (cb, sb, zb) = a, b
    assert ca.shape == cb.shape and sa.shape == sb.shape and za.shape == zb.shape
    assert int((ca.int() - cb.int()).abs().max()) <= 1
    assert int(_bf16_ulps(sa, sb).max()) <= 1 and int(_bf16_ulps(za, zb).max()) <= 1
    moved = (ca != cb).reshape(*ca.shape[:-1], -1, group_size).any(-1) | (sa != sb) | (za != zb)
    assert float(moved.float().mean()) <= max_group_share, f"{int(moved.sum())} of {moved.numel()} groups moved"


def assert_same_rows_quantized_alike(a, b, max_group_share: float) -> None:
    """Two stores holding the same rows (same lengths, exactly) quantized alike (`assert_quantized_alike`)."""
    assert a.lengths == b.lengths
    assert_quantized_alike(_store_rows(a), _store_rows(b), a.group_size, max_group_share)


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    enable(model)
    return model


def test_windows_covering_the_sequence_are_bit_identical_to_bf16(llama) -> None:
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    bf16 = spec_for_model(llama, kind="bf16")
    wide = spec_for_model(llama, kind="rotated", rotations=random_rotations(llama), sink=5, recent=25, group_size=8)
    a, _ = run_prefill(llama, ids, bf16)
    b, _ = run_prefill(llama, ids, wide)
    assert torch.equal(a, b)
    a, _ = run_steps(llama, ids, bf16)
    b, cache = run_steps(llama, ids, wide)
    assert torch.equal(a, b)
    assert cache.layers[0].int_lengths() == [0, 0]


def test_bf16_cache_equals_transformers_dynamic_cache_on_a_bf16_model() -> None:
    model = tiny_llama(dtype=torch.bfloat16)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref_cache = DynamicCache(config=model.config)
        ref = [model(ids[:, :8], cache=ref_cache).logits]
        for t in range(8, 12):
            ref.append(model(ids[:, t : t + 1], cache=ref_cache).logits)
        enable(model)
        cache = new_cache(model, spec_for_model(model, kind="bf16"))
        out = [model(ids[:, :8], cache=cache).logits]
        for t in range(8, 12):
            out.append(model(ids[:, t : t + 1], cache=cache).logits)
    for r, o in zip(ref, out):
        assert torch.equal(r, o)


@pytest.mark.parametrize(
    "sink,recent,bits,group,kv_heads",
    [(4, 8, 2, 8, 2), (0, 1, 2, 16, 1), (3, 5, 4, 4, 4), (1, 2, 2, 4, 2)],
)
def test_decode_equivalent_prefill_equals_step_by_step_decoding(sink, recent, bits, group, kv_heads) -> None:
    model = tiny_llama(kv_heads=kv_heads)
    enable(model)
    rots = random_rotations(model)
    ids = torch.randint(0, 96, (2, 29), generator=torch.Generator().manual_seed(3))
    kw = dict(kind="rotated", rotations=rots, sink=sink, recent=recent, bits=bits, group_size=group, page_size=4)
    chunked, c1 = run_prefill(model, ids, spec_for_model(model, mode="decode_equivalent", **kw))
    stepped, c2 = run_steps(model, ids, spec_for_model(model, **kw))
    # float32 reassociation only (one softmax over dequantized rows vs rotated-frame segments + LSE merge)
    torch.testing.assert_close(chunked, stepped, rtol=1e-4, atol=1e-4)
    bf16, _ = run_prefill(model, ids, spec_for_model(model, kind="bf16"))
    assert (chunked - bf16).abs().max() > 1e-3  # quantized history is really used
    for la, lb in zip(c1.layers, c2.layers):
        assert la.int_lengths() == lb.int_lengths() == [29 - sink - recent] * 2
        # same rows, but the chunked prefill computes them in other batch shapes than one token at a time:
        # its float32 sums may reassociate (measured on an AVX2 EPYC: one group of 56 moved by one bf16 ulp)
        for store_a, store_b in ((la.k_store, lb.k_store), (la.v_store, lb.v_store)):
            assert_same_rows_quantized_alike(store_a, store_b, max_group_share=0.1)


def test_serving_prefill_attends_in_full_precision_and_then_decodes(llama) -> None:
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(4))
    spec = spec_for_model(llama, kind="rotated", rotations=random_rotations(llama), sink=2, recent=4, group_size=8)
    served, cache = run_prefill(llama, ids, spec)
    bf16, _ = run_prefill(llama, ids, spec_for_model(llama, kind="bf16"))
    torch.testing.assert_close(served, bf16, rtol=1e-5, atol=1e-5)
    assert cache.layers[0].int_lengths() == [24 - 2 - 4]
    with torch.no_grad():
        nxt = llama(ids[:, -1:], cache=cache).logits  # decode over the quantized history works
    assert torch.isfinite(nxt).all()


def _layer_harness(spec: CacheSpec, hkv: int = 2, d: int = 16) -> tuple[OscarLayer, SimpleNamespace]:
    layer = OscarLayer(spec, spec.layers[0] if spec.layers else None, 0)
    return layer, SimpleNamespace(num_key_value_groups=2, layer_idx=0)


def _step(layer: OscarLayer, module, q, k, v, valid=None, scale=0.25):
    from oscar.cache.attention import take_pending

    layer.update(k, v)
    take_pending(k)
    return layer.attend_and_write(module, q, k, v, valid, scale)


def test_packed_decode_equals_dequantize_then_attend() -> None:
    torch.manual_seed(5)
    hkv, d, heads = 2, 16, 4
    fake = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=1, num_key_value_heads=hkv, hidden_size=heads * d, num_attention_heads=heads))
    rots = random_rotations(SimpleNamespace(config=fake.config), seed=7)
    spec = CacheSpec(kind="rotated", bits=2, group_size=8, sink=3, recent=5, page_size=4, layers=rots)
    layer, module = _layer_harness(spec, hkv, d)
    ks = torch.randn(1, hkv, 40, d) * 2 + 0.5
    vs = torch.randn(1, hkv, 40, d)
    for t in range(39):
        _step(layer, module, torch.randn(1, heads, 1, d), ks[:, :, t : t + 1], vs[:, :, t : t + 1])
    q = torch.randn(1, heads, 1, d)
    out = _step(layer, module, q, ks[:, :, 39:40], vs[:, :, 39:40])
    # reference: every token as the cache holds it, in the original frame, one plain softmax
    r = layer.rot
    k_rot, _ = layer.k_store.gather_dequantized()
    v_rot, _ = layer.v_store.gather_dequantized()
    n_int = layer.int_lengths()[0]
    k_int = torch.einsum("bhld,hed->bhle", k_rot[:, :, :n_int], r.r_k) + r.mu_k[None, :, None]
    v_int = torch.einsum("bhld,hed->bhle", v_rot[:, :, :n_int], r.r_v) + r.mu_v[None, :, None]
    bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    keys = torch.cat([bf(ks[:, :, :3]), k_int, bf(ks[:, :, 3 + n_int : 40])], dim=2)
    vals = torch.cat([bf(vs[:, :, :3]), v_int, bf(vs[:, :, 3 + n_int : 40])], dim=2)
    assert keys.shape[2] == 40
    p = torch.softmax(q @ keys.repeat_interleave(2, 1).transpose(-1, -2) * 0.25, dim=-1)
    torch.testing.assert_close(out, p @ vals.repeat_interleave(2, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("total", [2, 3, 8, 9, 12, 13, 21])
def test_demotion_is_exact_at_the_window_boundaries(total: int) -> None:
    torch.manual_seed(6)
    hkv, d, heads, sink, recent = 2, 16, 4, 3, 5
    cfg = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=hkv, hidden_size=heads * d, num_attention_heads=heads)
    rots = random_rotations(SimpleNamespace(config=cfg), seed=3)
    spec = CacheSpec(kind="rotated", bits=2, group_size=8, sink=sink, recent=recent, page_size=4, layers=rots)
    ks, vs = torch.randn(1, hkv, total, d), torch.randn(1, hkv, total, d)
    stepped, module = _layer_harness(spec)
    for t in range(total):
        _step(stepped, module, torch.randn(1, heads, 1, d), ks[:, :, t : t + 1], vs[:, :, t : t + 1])
    chunked, _ = _layer_harness(spec)
    _step(chunked, module, torch.randn(1, heads, total, d), ks, vs)
    n_int = max(0, total - sink - recent)
    for layer in (stepped, chunked):
        assert layer.sink_len == [min(sink, total)]
        assert layer.int_lengths() == [n_int]
        assert layer.recent_len == [min(recent, max(0, total - sink))]
        assert torch.equal(layer.sink_k[0, :, : min(sink, total)], ks[0, :, :sink].to(torch.bfloat16))
        r = layer.recent_len[0]
        assert torch.equal(layer.recent_v[0, :, :r], vs[0, :, total - r :].to(torch.bfloat16))
        if n_int:
            expect = quant.rotate_clip_quantize(
                ks[0, :, sink : sink + n_int].to(torch.bfloat16).float(), rots[0].r_k, rots[0].mu_k[:, None], rots[0].rho_k[:, None].expand(hkv, n_int), bits=2, group_size=8
            )
            want = (quant.unpack_codes(expect.codes, 2, 8).transpose(0, 1), expect.scale.transpose(0, 1), expect.zero.transpose(0, 1))
            # the rotation runs on one row here and on all rows there: its sums may reassociate
            assert_quantized_alike(_store_rows(layer.k_store), want, 8, max_group_share=0.1)


def test_left_padded_row_equals_the_prompt_alone(llama) -> None:
    gen = torch.Generator().manual_seed(8)
    long_ids = torch.randint(0, 96, (1, 26), generator=gen)
    short_ids = torch.randint(0, 96, (1, 19), generator=gen)
    spec_kw = dict(kind="rotated", rotations=random_rotations(llama), sink=2, recent=6, group_size=8)
    batch = torch.cat([long_ids, torch.cat([torch.zeros(1, 7, dtype=torch.long), short_ids], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :7] = 0
    for mode in ("serving", "decode_equivalent"):
        spec = spec_for_model(llama, mode=mode, **spec_kw)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            out = llama(batch, attention_mask=mask, position_ids=pos, cache=new_cache(llama, spec)).logits
        alone, _ = run_prefill(llama, short_ids, spec)
        first, _ = run_prefill(llama, long_ids, spec)
        torch.testing.assert_close(out[1, 7:], alone[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[0], first[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [2, 4])
def test_measured_bits_per_element_match_the_accounting(bits: int) -> None:
    model = tiny_llama(layers=1)
    enable(model)
    sink, recent, page, group = 4, 8, 4, 8
    total = sink + recent + 5 * page
    spec = spec_for_model(model, kind="rotated", sink=sink, recent=recent, page_size=page, bits=bits, group_size=group)
    ids = torch.randint(0, 96, (2, total), generator=torch.Generator().manual_seed(9))
    _, cache = run_prefill(model, ids, spec)
    expected = quant.bits_per_element(total, 16, bits, group, sink, recent)
    assert cache.bits_per_element() == pytest.approx(expected, rel=1e-12)
    d, hkv = 16, 2
    assert cache.nbytes() == 2 * 2 * hkv * (total * d * expected / 8)  # batch 2, K and V


def test_qwen2_with_biases_runs_through_the_cache() -> None:
    torch.manual_seed(10)
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1)
    model = Qwen2ForCausalLM(cfg).eval()
    enable(model)
    ids = torch.randint(0, 64, (1, 20))
    kw = dict(kind="rotated", rotations=random_rotations(model), sink=2, recent=4, group_size=8)
    a, _ = run_prefill(model, ids, spec_for_model(model, mode="decode_equivalent", **kw))
    b, _ = run_steps(model, ids, spec_for_model(model, **kw))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_errors_name_the_bad_value(llama) -> None:
    with pytest.raises(ValueError, match="'paged'"):
        CacheSpec(kind="paged")
    with pytest.raises(ValueError, match="page_size=3"):
        CacheSpec(page_size=3)
    plain = tiny_llama()
    with pytest.raises(ValueError, match="'oscar'"):
        new_cache(plain, spec_for_model(plain, kind="bf16"))


@pytest.mark.parametrize("fold", [False, True])
def test_paged_decode_path_equals_the_segment_path(fold: bool) -> None:
    """Decode steps through oscar.cache.paged.decode_attention (the path of the Triton kernel) against the
    vectorized LSE-merge path, with folding, centering and clipping, after a padded prefill."""
    from oscar.models.surgery import fold_value_rotations

    model = tiny_llama(dtype=torch.float64)
    enable(model)
    rots = random_rotations(model, seed=5, dtype=torch.float64)
    handle = fold_value_rotations(model, rots) if fold else None
    prompts = torch.randint(0, 96, (2, 15), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(prompts)
    mask[1, :4] = 0
    nxt = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(12))
    outs = []
    for paged_decode in (False, True):
        spec = spec_for_model(model, kind="rotated", rotations=rots, sink=2, recent=3, group_size=8, page_size=4, fold_values=fold, paged_decode=paged_decode)
        cache = new_cache(model, spec)
        m = mask.clone()
        with torch.no_grad():
            logits = [model(prompts, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0), cache=cache).logits[:, -1:]]
            for t in range(nxt.shape[1]):
                m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], dim=1)
                pos = m.sum(-1, keepdim=True) - 1
                logits.append(model(nxt[:, t : t + 1], attention_mask=m, position_ids=pos, cache=cache).logits)
        outs.append(torch.cat(logits, dim=1))
        assert cache.layers[0].int_lengths() == [15 + 9 - 5, 11 + 9 - 5]
    if handle is not None:
        handle.undo()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_triton_backend_matches_the_torch_backend() -> None:
    """The cache on `backend="triton"`: demotions (and the prefill's overflow) through the fused quantize
    kernel, decode steps through the paged decode-attention kernel (the interpreter on CPU), against the
    torch backend, with rotations, centering and clipping, ragged prompts and pages of 4 slots."""
    model = tiny_llama(dtype=torch.float32)
    enable(model)
    rots = random_rotations(model, seed=7)
    prompts = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    nxt = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(4))
    outs, caches = [], []
    for backend in ("torch", "triton"):
        spec = spec_for_model(model, kind="rotated", rotations=rots, sink=2, recent=3, group_size=8, page_size=4,
                              backend=backend)
        cache = new_cache(model, spec)
        m = mask.clone()
        with torch.no_grad():
            logits = [model(prompts, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0),
                            cache=cache).logits[:, -1:]]
            for t in range(nxt.shape[1]):
                m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], dim=1)
                logits.append(model(nxt[:, t : t + 1], attention_mask=m, position_ids=m.sum(-1, keepdim=True) - 1,
                                    cache=cache).logits)
        outs.append(torch.cat(logits, dim=1))
        caches.append(cache)
    assert caches[1].layers[0].int_lengths() == caches[0].layers[0].int_lengths() == [13 + 6 - 5, 10 + 6 - 5]
    for a, b in zip(caches[0].layers, caches[1].layers):  # the kernel wrote (nearly) the twin's codes
        ca, cb = a.k_store.codes[: a.k_store.num_pages], b.k_store.codes[: b.k_store.num_pages]
        assert ca.shape == cb.shape
        assert float((ca != cb).float().mean()) < 0.05  # a rotated row sums in another order: rare boundary flips
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-3, atol=2e-3)

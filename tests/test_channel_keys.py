"""Per-channel keys (the "channel" key format, `oscar.core.quant.quantize_channels`): the format, `auto`'s candidate
and its artifact round trip, the torch cache paths against the dequantize-then-attend twin, and the refusal on
the paged/kernel paths."""

from __future__ import annotations

import pytest
import torch

from oscar.core import quant
from oscar.cache.torch_cache import CacheSpec, LayerRotations
from oscar.core.rotation import random_orthogonal
from oscar.core.stats import CalibrationStats

torch.set_num_threads(2)


def _drifting_keys(hkv: int, n: int, d: int, seed: int, drift: float = 3.0) -> torch.Tensor:
    """Keys `[hkv, n, d]` whose per-channel offsets drift slowly over tokens (a random walk) plus small noise:
    a per-token group pays for the spread of the offsets across channels, a block of one channel barely sees it."""
    g = torch.Generator().manual_seed(seed)
    walk = torch.cumsum(drift / 8 * torch.randn(hkv, n, d, generator=g), dim=1) + drift * torch.randn(hkv, 1, d, generator=g)
    return walk + 0.05 * torch.randn(hkv, n, d, generator=g)


def test_channel_codes_pack_and_unpack_exactly_and_match_the_per_channel_definition() -> None:
    x = _drifting_keys(2, 96, 32, seed=1)
    q = quant.quantize_channels(x, 2, 16, 8)
    assert q.codes.shape == (2, 96, 8) and q.scale.shape == q.zero.shape == (2, 6, 32)
    codes = quant.unpack_codes(q.codes, 2, 8)
    assert torch.equal(quant.pack_codes(codes, 2, 8), q.codes)
    # the definition: the per-token steps 2-4 with one channel's block of 16 tokens as the group
    blocks = x.reshape(2, 6, 16, 32).transpose(-1, -2)
    ref_codes, ref_scale, ref_zero = quant.quantize_codes(blocks, 2, 16)
    assert torch.equal(codes, ref_codes.transpose(-1, -2).reshape(2, 96, 32))
    assert torch.equal(q.scale, ref_scale[..., 0]) and torch.equal(q.zero, ref_zero[..., 0])
    assert torch.equal(quant.dequantize_channels(q), quant.dequantize_codes(ref_codes, ref_scale, ref_zero, 16).transpose(-1, -2).reshape(2, 96, 32))


def test_channel_dequantized_keys_stay_within_the_format_bound() -> None:
    x = _drifting_keys(1, 128, 64, seed=2)
    q = quant.quantize_channels(x, 2, 32, 64)
    err = (quant.dequantize_channels(q) - x).abs().reshape(1, 4, 32, 64)
    scale, zero = q.scale.float()[:, :, None], q.zero.float()[:, :, None]
    # half a code step, plus the bf16 rounding of scale and zero (relative 2^-8) carried to the top code
    bound = 0.5 * scale + 2.0**-8 * (zero.abs() + 3 * scale) + 1e-6
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0.1 * float(scale.max())  # really quantized
    with pytest.raises(ValueError, match="whole blocks"):
        quant.quantize_channels(x[:, :100], 2, 32, 64)


def _stats_with_keys(keys: torch.Tensor, heads: int = 2) -> CalibrationStats:
    hkv, n, d = keys.shape
    g = torch.Generator().manual_seed(9)
    st = CalibrationStats(1, heads, hkv, d, max_samples=n, meta={"calibration": {"seq_len": n}})
    k = keys[None].double()
    q = torch.randn(1, heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
    st.update(0, q=q, k=k, v=v, attn_out=q)
    st.add_samples(0, k.float(), v.float())
    return st


def test_auto_picks_per_channel_keys_when_they_distort_less_and_the_artifact_keeps_them(tmp_path) -> None:
    from oscar.core.artifact import load_artifact, save_artifact
    from oscar.core.calibration import build_artifact
    from oscar.models.engine import layer_rotations

    st = _stats_with_keys(_drifting_keys(1, 256, 16, seed=3))
    method = {"name": "auto", "key_rotation": "auto", "value_rotation": "auto", "clip": "fit", "channel_block": 16}
    kw = dict(num_layers=1, num_kv_heads=1, head_dim=16, group_size=8, stats=st, clip_grid_k=[0.9, 1.0], clip_grid_v=[1.0])
    art = build_artifact(method, **kw)
    choice = art.meta["choices"][0]
    assert choice["key_block"] == 16 and art.meta["key_block"] == [16], choice["key_table"]
    token_best = min(e["distortion"] for e in choice["key_table"] if "block" not in e)
    assert choice["key_distortion"] < token_best / 2  # measured 2.3x
    save_artifact(art, tmp_path)
    back = load_artifact(tmp_path, method=method)
    assert back.key_block(0) == 16 and layer_rotations(back)[0].k_block == 16
    plain = build_artifact({**method, "channel_block": 0}, **kw)
    assert "key_block" not in plain.meta and plain.meta["choices"][0]["key_block"] == 0
    assert plain.meta["choices"][0]["key_distortion"] == pytest.approx(token_best)


def test_auto_keeps_per_token_keys_where_they_distort_less() -> None:
    from oscar.core.calibration import build_artifact

    # one large direction that moves from token to token: the U.H.P candidates make it group-constant,
    # per-channel blocks see it in every channel
    g = torch.Generator().manual_seed(4)
    u = torch.nn.functional.normalize(torch.randn(16, generator=g), dim=0)
    keys = (20 * torch.randn(1, 256, 1, generator=g)) * u + 0.3 * torch.randn(1, 256, 16, generator=g)
    art = build_artifact({"name": "auto", "key_rotation": "auto", "value_rotation": "auto", "clip": "fit", "channel_block": 16},
                         num_layers=1, num_kv_heads=1, head_dim=16, group_size=8, stats=_stats_with_keys(keys),
                         clip_grid_k=[1.0], clip_grid_v=[1.0])
    choice = art.meta["choices"][0]
    assert choice["key_block"] == 0 and "key_block" not in art.meta
    assert choice["key_distortion"] < min(e["distortion"] for e in choice["key_table"] if "block" in e)


def _channel_rotations(hkv: int, d: int, block: int, seed: int = 0) -> LayerRotations:
    g = torch.Generator().manual_seed(seed)
    rk = torch.stack([random_orthogonal(d, seed=seed + 50 + h) for h in range(hkv)])
    rv = torch.stack([random_orthogonal(d, seed=seed + 70 + h) for h in range(hkv)])
    return LayerRotations(rk, rv, 0.3 * torch.randn(hkv, d, generator=g), 0.1 * torch.randn(hkv, d, generator=g),
                          torch.full((hkv,), 0.9), torch.full((hkv,), 0.95), k_block=block)


@pytest.mark.parametrize("total", [9, 12, 20, 21, 27, 40])
def test_cache_pages_hold_whole_key_blocks_and_decoding_reads_them_like_the_twin(total: int) -> None:
    from tests.test_cache import _layer_harness, _step

    hkv, d, heads, sink, recent, block = 2, 16, 4, 3, 5, 4
    rot = _channel_rotations(hkv, d, block)
    spec = CacheSpec(kind="rotated", bits=2, group_size=8, sink=sink, recent=recent, page_size=8, layers=[rot])
    ks = _drifting_keys(hkv, total, d, seed=5)[None]
    vs = torch.randn(1, hkv, total, d, generator=torch.Generator().manual_seed(6))
    layer, module = _layer_harness(spec, hkv, d)
    for t in range(total - 1):
        _step(layer, module, torch.randn(1, heads, 1, d), ks[:, :, t : t + 1], vs[:, :, t : t + 1])
    q = torch.randn(1, heads, 1, d, generator=torch.Generator().manual_seed(7))
    out = _step(layer, module, q, ks[:, :, -1:], vs[:, :, -1:])
    rot = layer.rot  # float32 on the cache's device, as the cache uses it
    n_int = max(0, (total - sink - recent) // block * block)
    assert layer.int_lengths() == [n_int] and layer.recent_len == [min(total, total - sink - n_int)]
    bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    k_rot = v_rot = torch.zeros(1, hkv, 0, d)
    if n_int:
        k_rot, _ = layer.k_store.gather_dequantized()
        v_rot, _ = layer.v_store.gather_dequantized()
        # the stored key blocks are the format applied to the same float32 rows (same arithmetic: exact)
        rows = torch.matmul(bf(ks[0, :, sink : sink + n_int]) - rot.mu_k[:, None], rot.r_k)
        want = quant.dequantize_channels(quant.quantize_channels(rows, 2, block, 8, rot.rho_k))
        assert torch.equal(k_rot[0, :, :n_int], want)
    k_int = torch.einsum("bhld,hed->bhle", k_rot[:, :, :n_int], rot.r_k) + rot.mu_k[None, :, None]
    v_int = torch.einsum("bhld,hed->bhle", v_rot[:, :, :n_int], rot.r_v) + rot.mu_v[None, :, None]
    keys = torch.cat([bf(ks[:, :, :sink]), k_int, bf(ks[:, :, sink + n_int :])], dim=2)
    vals = torch.cat([bf(vs[:, :, :sink]), v_int, bf(vs[:, :, sink + n_int :])], dim=2)
    p = torch.softmax(q @ keys.repeat_interleave(2, 1).transpose(-1, -2) * 0.25, dim=-1)
    torch.testing.assert_close(out, p @ vals.repeat_interleave(2, 1), rtol=1e-5, atol=1e-5)


def _llama_with(block: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar.cache.attention import enable

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).eval()
    enable(model)
    rots = [_channel_rotations(2, 16, block if layer == 0 else 0, seed=10 * layer) for layer in range(2)]
    return model, rots


def test_decode_equivalent_prefill_equals_step_by_step_decoding_with_per_channel_keys() -> None:
    from oscar.cache.torch_cache import spec_for_model
    from oscar.models.engine import new_cache

    model, rots = _llama_with(4)
    ids = torch.randint(0, 96, (2, 31), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 31, dtype=torch.long)
    kw = dict(kind="rotated", rotations=rots, sink=3, recent=5, bits=2, group_size=8, page_size=8)
    with torch.no_grad():
        chunked = model(ids, cache=new_cache(model, spec_for_model(model, mode="decode_equivalent", **kw))).logits
        c2 = new_cache(model, spec_for_model(model, **kw))
        stepped = torch.cat([model(ids[:, t : t + 1], cache=c2).logits for t in range(31)], dim=1)
        c3 = new_cache(model, spec_for_model(model, **kw))
        model(ids[:, :17], attention_mask=mask[:, :17], cache=c3)  # serving prefill, then decode
        served = torch.cat([model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=c3).logits for t in range(17, 31)], dim=1)
        plain = [LayerRotations(r.r_k, r.r_v, r.mu_k, r.mu_v, r.rho_k, r.rho_v) for r in rots]
        c4 = new_cache(model, spec_for_model(model, **{**kw, "rotations": plain}))
        per_token = torch.cat([model(ids[:, t : t + 1], cache=c4).logits for t in range(31)], dim=1)
    # float32 reassociation only (one softmax over dequantized rows vs rotated-frame segments + LSE merge)
    torch.testing.assert_close(chunked, stepped, rtol=1e-4, atol=1e-4)
    assert c2.layers[0].int_lengths() == [20, 20] and c2.layers[1].int_lengths() == [23, 23]
    assert c2.layers[0].recent_len == [8, 8]
    assert c3.layers[0].int_lengths() == [20, 20] and bool(torch.isfinite(served).all())
    assert (stepped - per_token).abs().max() > 1e-3  # the layer really reads per-channel blocks


def test_paged_paths_take_per_channel_keys() -> None:
    """Per-channel key layers reach the paged path (issue 33, docs/DESIGN.md "Per-channel key pages on the paged
    path"): their transforms carry the block, and decode steps through `paged.decode_attention` (paged_decode) give
    the torch cache's stepwise logits (tests/test_channel_pages.py pins the pages, kernels and device cache)."""
    from oscar.cache.torch_cache import spec_for_model
    from oscar.models.engine import new_cache
    from oscar.serve.settings import head_transforms as serve_transforms
    from oscar.bench.throughput.decode import head_transforms

    model, rots = _llama_with(4)
    assert [kt.block for kt, _ in head_transforms(rots)] == [4, 0]
    assert serve_transforms(rots[0], torch.device("cpu"))[0].block == 4
    ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(5))
    kw = dict(kind="rotated", rotations=rots, sink=1, recent=4, group_size=8, page_size=8)
    with torch.no_grad():
        outs = []
        for paged_decode in (False, True):
            cache = new_cache(model, spec_for_model(model, paged_decode=paged_decode, **kw))
            outs.append(torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(24)], dim=1))
        assert cache.layers[0].int_lengths() == [16] and cache.layers[1].int_lengths() == [19]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="page_size=4 is not a multiple of the per-channel key block 8"):
        from tests.test_cache import _layer_harness, _step

        layer, module = _layer_harness(CacheSpec(kind="rotated", group_size=8, sink=1, recent=2, page_size=4,
                                                 layers=[_channel_rotations(2, 16, 8)]), 2, 16)
        _step(layer, module, torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))


class _CharTokenizer:
    """Characters as token ids (a tiny model's vocabulary of 96): enough to cut a corpus into windows."""

    def __call__(self, text: str, **_: object) -> dict:
        return {"input_ids": [ord(c) % 96 for c in text]}


@pytest.fixture(scope="module")
def kl_setup(tmp_path_factory):
    """A tiny random Llama (3 layers, head_dim 16), its statistics on a text file, the `auto` method with per-channel
    candidates (blocks of 8) and windows S0/W 4/8, and `build(formats)`: its artifact with those key formats."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar.commands.dump import collect_statistics
    from oscar.config import compose
    from oscar.models.methods import build_rotations

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).eval()
    text = tmp_path_factory.mktemp("corpus") / "notes.txt"
    g = torch.Generator().manual_seed(5)
    text.write_text("".join(chr(32 + int(i)) for i in torch.randint(0, 90, (3000,), generator=g)))
    cfg = compose(["model=smollm2-135m", "method=auto", "calibration=file", f"calibration.path={text}",
                   "calibration.num_tokens=512", "calibration.seq_len=128", "calibration.holdout_tokens=256",
                   "method.channel_block=8", "method.sink=4", "method.recent=8", "method.select_by=kl"])
    tok = _CharTokenizer()
    stats = collect_statistics(model, tok, cfg.calibration, progress=False)

    def build(formats):
        return build_rotations(cfg.method, num_layers=3, num_kv_heads=2, head_dim=16, stats=stats,
                               clip_grid_k=[0.9, 1.0], clip_grid_v=[1.0], key_formats=formats)

    return model, tok, cfg, stats, build


def test_kl_selection_takes_a_layer_per_channel_when_it_buys_its_bits_and_records_what_it_measured(kl_setup, single_thread) -> None:
    from oscar.data.corpora import calibration_splits
    from oscar.models.engine import layer_rotations
    from oscar.models.select import bf16_logits, kl_and_bits, select_key_formats

    model, tok, cfg, _, build = kl_setup
    windows = calibration_splits(tok, cfg.calibration).holdout
    assert [int(w.numel()) for w in windows] == [128, 128]
    passes = []
    free = select_key_formats(model, windows, cfg.method, build, step=lambda: passes.append(1))
    chosen = [m["channel"] for m in free.layers]
    mixed = 0 < sum(chosen) < 3
    assert len(passes) == 3 + 2 + mixed  # base, one per layer, all per-channel, and a mixed chosen set
    assert [m["layer"] for m in free.layers] == [0, 1, 2] and free.positions == 2 * (127 - 12)
    for m in free.layers:  # the rule at price 0: per-channel keys where they lower the KL
        assert m["measured"] and m["channel"] == (m["kl_gain"] > 0) and m["extra_bits"] > 0
    objective = {k: free.kl[k] for k in ("chosen", "all_token", "all_channel")}
    assert free.kl["kept"] == min(objective.values()) and free.kl[free.kept] == free.kl["kept"]
    assert free.formats == (chosen if free.kept == "chosen" else [free.kept == "all_channel"] * 3)
    assert min(free.kl.values()) > 1e-4  # really quantized
    # the recorded KL and bits are the cache's: the kept artifact through an engine scores the same
    art = build(free.formats)
    assert [bool(b) for b in art.meta.get("key_block", [0, 0, 0])] == free.formats
    refs = bf16_logits(model, windows)
    kl, bits = kl_and_bits(model, cfg.method, layer_rotations(art), windows, refs, 12)
    assert kl == pytest.approx(free.kl["kept"], rel=1e-9) and bits == pytest.approx(free.bits["kept"], rel=1e-12)
    # a price above every layer's gain per bit keeps per-token keys everywhere
    top = max(m["kl_gain"] / m["extra_bits"] for m in free.layers)
    priced = select_key_formats(model, windows, {**dict(cfg.method), "select_price": 2 * max(top, 1e-6)}, build)
    assert priced.formats == [False, False, False] and priced.kept in ("chosen", "all_token")
    assert priced.kl["kept"] == pytest.approx(free.kl["all_token"], rel=1e-12)
    # a price between the layers' gains per bit: the layers above it, measured as a set
    ratios = sorted(m["kl_gain"] / m["extra_bits"] for m in free.layers)
    mid = select_key_formats(model, windows, {**dict(cfg.method), "select_price": (ratios[0] + ratios[1]) / 2}, build)
    assert [m["channel"] for m in mid.layers] == [m["kl_gain"] / m["extra_bits"] > ratios[0] for m in free.layers]
    assert mid.kl["chosen"] not in (mid.kl["all_token"], mid.kl["all_channel"])


def test_kl_selection_refuses_windows_without_quantized_history(kl_setup) -> None:
    from oscar.models.select import select_key_formats

    model, _, cfg, _, build = kl_setup
    with pytest.raises(ValueError, match="holdout_tokens"):
        select_key_formats(model, [torch.zeros(12, dtype=torch.long)], cfg.method, build)

"""One cache-format value (oscar.cache.formats.CacheFormat) for the embedded engine, the throughput profile and
the SGLang settings: each consumer's object carries exactly the format's fields, and the byte accounting
the SGLang pool uses is the bytes the profile's device cache allocates per token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oscar.bench import throughput as tp
from oscar.cache.formats import CacheFormat
from oscar.config import compose
from oscar.models.engine import cache_spec
from oscar.serve.settings import ServeSettings, bytes_per_token, window_bytes_per_request

FIELDS = ("bits", "group_size", "sink", "recent")


@pytest.fixture(scope="module")
def model():
    cfg = tp.architecture_config("qwen3", dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=64, hidden_size=128, intermediate_size=256, vocab_size=320,
                                               max_position_embeddings=4096, tie_word_embeddings=False))
    return tp.build_random_model(cfg, device="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("method", ["bf16", "oscar", "quarot", "saw_int4", "kivi2", "turboquant"])
def test_engine_and_profile_take_the_format_of_the_method(model, method):
    mcfg = compose([f"method={method}"]).method
    fmt = CacheFormat.from_method(mcfg, 64)
    spec = cache_spec(mcfg, model, [] if fmt.kind == "rotated" else None)
    assert spec.kind == fmt.kind
    if fmt.quantized:
        assert tuple(getattr(spec, k) for k in FIELDS) == tuple(getattr(fmt, k) for k in FIELDS)
    if fmt.kind == "rotated":
        assert spec.page_size == fmt.page_size
        timed = tp.timed_cache(mcfg, model)
        assert timed.format == fmt and (timed.bits, timed.group_size, timed.sink) == (fmt.bits, fmt.group_size, fmt.sink)
    if method == "bf16":
        assert tp.timed_cache(mcfg, model).format == fmt and not fmt.quantized


def test_serving_format_and_its_bytes_are_the_profile_cache_allocation():
    """The SGLang settings build the same value (bits and group from the artifact), and the pool's bytes per
    token equal what a profile device cache of that format allocates per quantized token (codes, scales and
    zeros of every layer, K and V), its windows what the BF16 sink + ring buffers take."""
    s = ServeSettings(artifact=Path("unused"), sink=4, recent=8)
    fmt = s.cache_format(bits=2, group_size=32)
    assert fmt == CacheFormat(name="oscar", kind="rotated", bits=2, group_size=32, sink=4, recent=8)
    layers, hkv, d = 2, 2, 64
    assert bytes_per_token(layers, hkv, d, 2, 32) == fmt.bytes_per_token(layers, hkv, d)
    assert window_bytes_per_request(layers, hkv, d, 4, 8) == fmt.window_bytes(layers, hkv, d)
    from oscar.cache import device_cache as dc
    from oscar.cache import paged

    ident = paged.HeadTransform(torch.eye(d).expand(hkv, d, d).contiguous(), None, None)
    cache = dc.DeviceOscarCache(num_layers=layers, batch=1, num_kv_heads=hkv, head_dim=d, bits=2, group_size=32,
                                sink=4, recent=8, page_size=4, quant_capacity=16, transforms=[(ident, ident)] * layers,
                                layout="rows")
    pages = sum(t.numel() * t.element_size() for p in cache.k_pages + cache.v_pages for t in (p.codes, p.scale, p.zero))
    tokens = cache.k_pages[0].codes.shape[0] * 4  # pages x page size (the spare page included)
    assert pages == tokens * fmt.bytes_per_token(layers, hkv, d)
    assert sum(t.numel() * t.element_size() for t in cache.bf16) == fmt.window_bytes(layers, hkv, d)
    assert CacheFormat(name="bf16").bytes_per_token(layers, hkv, d) == 2 * layers * hkv * d * 2


def test_bad_formats_are_refused_by_name():
    with pytest.raises(ValueError, match="cache kind 'fp8' is not valid"):
        CacheFormat(name="x", kind="fp8")
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        CacheFormat(name="x", kind="rotated", bits=3, group_size=64)
    with pytest.raises(ValueError, match="sink=-1"):
        CacheFormat(name="x", kind="rotated", bits=2, group_size=64, sink=-1)

"""The cache-format registry (oscar.cache.formats): one class per format, asked by every consumer.

- The kinds exist once (the registry); a method, an artifact and a server all reach the same format value.
- Each consumer builds its caches and layers from the format (`oscar.cache.torch_cache.cache_spec`/`torch_layer`,
  `oscar.cache.device_cache.for_format`); the format methods of the same names forward to those builders.
- Every registered format runs through every consumer: the embedded engine's torch cache, the device cache
  (CPU twin here, the Triton/CUDA kernels under ``-m gpu``) and, in tests/serve/test_pool_formats.py, the
  SGLang pool. A consumer that serves the format gives the torch cache's greedy tokens with logits within one
  bf16 step; one that does not refuses it by name (`FormatNotServed`, naming the consumers that do).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from oscar.bench.throughput import decode as tp
from oscar.cache import device_cache as dc
from oscar.cache import formats, torch_cache
from oscar.cache.formats import (KINDS, REGISTRY, BF16Format, CacheFormat, FormatNotServed, RotatedFormat, format_for,
                                 served_kinds)
from oscar.cache.torch_cache import LayerRotations
from oscar.config import compose
from oscar.core.rotation import random_orthogonal
from oscar.models.engine import cache_spec
from oscar.serve.settings import OscarServeError, ServeSettings

LAYERS, HEADS, HKV, D = 2, 4, 2, 64
LOGIT_TOL = 0.05  # one bf16 step of these models' logits (< 8 in magnitude), as tests/test_device_cache.py
# Kernels against the torch cache, teacher forced. Measured on one H200 (2026-12-03, this test with -s): 0.031 for the
# rotated format (mma pages, v10 kernel, Triton writer) while the format moves BF16's logits by up to 3.4, 0 for BF16;
# the committed throughput check (reports/throughput/check.csv) saw 0.05 on random Qwen3-8B. Tolerance: 0.1.
CUDA_LOGIT_TOL = 0.1
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    cfg = tp.architecture_config("qwen3", dict(
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HKV, head_dim=D, hidden_size=128,
        intermediate_size=256, vocab_size=320, max_position_embeddings=4096, tie_word_embeddings=False))
    return tp.build_random_model(cfg, device="cpu", dtype=torch.bfloat16, std=0.08)


def small(kind: str) -> CacheFormat:
    """A format of ``kind`` whose windows leave the middle of a 24-token prompt quantized."""
    fields = {"bf16": dict(), "rotated": dict(bits=2, group_size=D, sink=4, recent=8, page_size=4),
              "rotated_channel": dict(bits=2, group_size=D, sink=4, recent=8, page_size=4, key_block=4,
                                      layer_blocks=(4, 0)),  # layer 0 per-channel keys, layer 1 per-token
              "kivi": dict(bits=2, group_size=8, recent=8), "turboquant": dict(bits=2, group_size=D, sink=4, recent=8)}
    return format_for(kind, name=kind, **fields[kind])


def rotations(fmt: CacheFormat | None = None) -> list[LayerRotations]:
    """Seeded rotations, means and clip ratios per layer; keys per channel where ``fmt`` says (``layer_key_block``)."""
    blocks = [fmt.layer_key_block(i) if isinstance(fmt, RotatedFormat) else 0 for i in range(LAYERS)]
    return [LayerRotations(torch.stack([random_orthogonal(D, seed=10 * i + h, dtype=torch.float32) for h in range(HKV)]),
                           torch.stack([random_orthogonal(D, seed=10 * i + h + 5, dtype=torch.float32) for h in range(HKV)]),
                           0.1 * torch.randn(HKV, D, generator=torch.Generator().manual_seed(i)), None,
                           torch.full((HKV,), 0.95), torch.full((HKV,), 0.95), k_block=blocks[i]) for i in range(LAYERS)]


def timed(fmt: CacheFormat, layout: str = "rows") -> tp.TimedCache:
    return tp.TimedCache(fmt, transforms=tp.head_transforms(rotations(fmt)) if fmt.rotated else None, layout=layout)


def prompt() -> torch.Tensor:
    return torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))


# -- the registry -----------------------------------------------------------------------------------


def test_kinds_exist_once_in_the_registry():
    """No module outside the registry spells the tuple of kinds (or branches on a kind string)."""
    assert KINDS == tuple(REGISTRY) == ("bf16", "rotated", "rotated_channel", "kivi", "turboquant")
    spelled = re.compile(r"""["'](bf16|rotated|kivi|turboquant)["']\s*,\s*["'](bf16|rotated|kivi|turboquant)["']""")
    branch = re.compile(r"""kind\s*(==|!=|in|not in)\s*\(?["'](bf16|rotated|kivi|turboquant)["']""")
    offenders = []
    for path in sorted((ROOT / "oscar").rglob("*.py")):
        if path.name == "formats.py" and path.parent.name == "cache":
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for rx in (spelled, branch) for m in rx.finditer(text)]
    assert offenders == []


def test_consumers_and_their_formats():
    assert served_kinds("torch") == KINDS
    assert served_kinds("device") == ("bf16", "rotated", "rotated_channel")
    assert served_kinds("pool") == ("rotated", "rotated_channel")
    with pytest.raises(FormatNotServed, match=r"not served by the SGLang KV pool; it is served by: embedded"):
        small("kivi").check_served("pool")
    with pytest.raises(ValueError, match="consumer 'gpu' is not valid"):
        served_kinds("gpu")


def test_bad_formats_are_refused_by_name():
    with pytest.raises(ValueError, match="cache kind 'fp8' is not valid; choose one of bf16, rotated, rotated_channel, kivi, turboquant"):
        format_for("fp8", name="x")
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        RotatedFormat(name="x", bits=3, group_size=64, recent=1)
    with pytest.raises(ValueError, match="sink=-1"):
        RotatedFormat(name="x", bits=2, group_size=64, sink=-1, recent=1)
    with pytest.raises(ValueError, match="recent=0"):
        RotatedFormat(name="x", bits=2, group_size=64, recent=0)
    with pytest.raises(ValueError, match="page_size=24 must be a power of two"):
        RotatedFormat(name="x", bits=2, group_size=64, recent=1, page_size=24)
    with pytest.raises(ValueError, match="group_size 48 does not divide head_dim 64"):
        CacheFormat.from_method({"name": "m", "kind": "rotated", "group_size": 48}, 64)
    with pytest.raises(TypeError, match="abstract"):
        CacheFormat(name="x")
    with pytest.raises(ValueError, match=r"unknown fields \['colour'\]"):
        CacheFormat.from_meta({"kind": "rotated", "bits": 2, "group_size": 64, "recent": 8, "colour": "red"})


@pytest.mark.parametrize("method", ["bf16", "oscar", "quarot", "saw_int4", "kivi2", "turboquant"])
def test_engine_and_profile_take_the_format_of_the_method(model, method):
    mcfg = compose([f"method={method}"]).method
    fmt = CacheFormat.from_method(mcfg, D)
    spec = cache_spec(mcfg, model, [] if fmt.rotated else None)
    assert spec.format == fmt and spec.kind == fmt.kind
    assert CacheFormat.from_meta(fmt.to_meta()) == fmt
    if "device" in fmt.served_by:
        assert tp.timed_cache(mcfg, model).format == fmt
    else:
        with pytest.raises(FormatNotServed, match="device cache"):
            tp.timed_cache(mcfg, model)


def test_the_artifact_records_its_format_and_the_server_serves_it(tmp_path):
    """An artifact names the format it was calibrated for; the server's format is that one, with serve-time
    windows; an artifact written before formats were recorded gets the format of its method."""
    from oscar.core.artifact import read_meta, save_artifact
    from oscar.models.methods import in_code_artifact

    mcfg = compose(["method=quarot", "method.clip=none", "method.sink=16", "method.recent=32"]).method
    art = in_code_artifact(mcfg, num_layers=1, num_kv_heads=HKV, head_dim=D, model_id="m", config_hash="h")
    save_artifact(art, tmp_path / "a")
    meta = read_meta(tmp_path / "a")
    fmt = CacheFormat.of_artifact(meta)
    assert fmt == CacheFormat.from_method(mcfg, D) and (fmt.sink, fmt.recent, fmt.group_size) == (16, 32, D)
    legacy = {k: v for k, v in meta.items() if k != "cache_format"}
    assert CacheFormat.of_artifact(legacy) == fmt
    settings = ServeSettings(artifact=tmp_path / "a", recent=64)
    served = settings.cache_format(fmt)
    assert (served.kind, served.sink, served.recent, served.bits) == ("rotated", 16, 64, 2)
    with pytest.raises(OscarServeError, match="not served by the SGLang KV pool"):
        settings.cache_format(small("turboquant"))


def test_pool_bytes_are_what_the_device_cache_allocates():
    """The pool's bytes per token (the format's) equal what a device cache of that format allocates per quantized
    token (codes, scales and zeros of every layer, K and V); its windows what the BF16 sink + ring take."""
    from oscar.cache import device_cache as dc
    from oscar.cache import paged

    fmt = RotatedFormat(name="oscar", bits=2, group_size=32, sink=4, recent=8, page_size=4)
    ident = paged.HeadTransform(torch.eye(D).expand(HKV, D, D).contiguous(), None, None)
    cache = dc.DeviceOscarCache(fmt, num_layers=LAYERS, batch=1, num_kv_heads=HKV, head_dim=D, quant_capacity=16,
                                transforms=[(ident, ident)] * LAYERS, layout="rows")
    pages = sum(t.numel() * t.element_size() for p in cache.k_pages + cache.v_pages for t in (p.codes, p.scale, p.zero))
    tokens = cache.k_pages[0].codes.shape[0] * 4  # pages x page size (the spare page included)
    assert pages == tokens * fmt.bytes_per_token(LAYERS, HKV, D)
    assert sum(t.numel() * t.element_size() for t in cache.bf16) == fmt.window_bytes(LAYERS, HKV, D)
    assert BF16Format(name="bf16").bytes_per_token(LAYERS, HKV, D) == 2 * LAYERS * HKV * D * 2


@pytest.mark.parametrize("kind", KINDS)
def test_the_consumers_build_what_the_format_methods_return(kind, monkeypatch):
    """The torch cache picks the layer class from the format (simulated formats: `SimulatedLayer`, no rotations), the
    device cache its cache (paged: `DeviceOscarCache`, BF16: `StaticBF16Cache`); the format methods forward there,
    refuse an unserved format by name before anything is built, and name the module to import when its builders are
    not loaded."""
    fmt, rots = small(kind), rotations(small(kind))
    spec = torch_cache.cache_spec(fmt, rots, mode="decode_equivalent", backend="triton")
    assert spec.format == fmt and spec.mode == "decode_equivalent"
    assert spec.backend == ("triton" if "backend" in fmt.runtime_fields else "torch")  # a field the format lacks is dropped
    assert [id(r) for r in spec.layers] == ([id(r) for r in rots] if fmt.rotated else [])  # rotated formats only
    forwarded = fmt.cache_spec(rots, mode="decode_equivalent", backend="triton")
    assert (forwarded.format, forwarded.mode, forwarded.backend) == (spec.format, spec.mode, spec.backend)
    assert all(a is b for a, b in zip(forwarded.layers, spec.layers, strict=True))
    layer = torch_cache.torch_layer(spec, spec.layers[0] if fmt.rotated else None, 0)
    assert type(layer) is (torch_cache.SimulatedLayer if fmt.simulated else torch_cache.OscarLayer)
    assert type(fmt.torch_layer(spec, spec.layers[0] if fmt.rotated else None, 0)) is type(layer)
    geometry = dict(num_layers=LAYERS, batch=1, num_kv_heads=HKV, head_dim=D, context=8)
    if fmt.paged:
        geometry.update(transforms=tp.head_transforms(rotations(fmt)), layout="rows")
    if "device" in fmt.served_by:
        want = dc.DeviceOscarCache if fmt.paged else dc.StaticBF16Cache
        assert type(dc.for_format(fmt, **geometry)) is want and type(fmt.device_cache(**geometry)) is want
    monkeypatch.setattr(formats, "BUILDERS", {})
    if "device" not in fmt.served_by:
        with pytest.raises(FormatNotServed, match="not served by the device cache"):
            fmt.device_cache(**geometry)
    else:
        with pytest.raises(RuntimeError, match="built by oscar.cache.device_cache, which has not been imported"):
            fmt.device_cache(**geometry)
    with pytest.raises(RuntimeError, match="built by oscar.cache.torch_cache"):
        fmt.cache_spec(rots)


# -- every format through every consumer ------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_through_the_torch_cache(model, kind):
    """The torch cache holds every format: greedy decode past the windows stays finite, quantized formats move
    the first decode step's logits off BF16's (the prompt's middle is quantized) and BF16 does not, and the cache's
    measured bits per element are the format's accounting."""
    from oscar.cache import attention
    from oscar.models.engine import new_cache

    fmt = small(kind)
    ids, steps = prompt(), 6
    tok, lg = tp.reference_decode(model, ids, timed(fmt), steps, rotations(fmt))
    _, ref = tp.reference_decode(model, ids, tp.TimedCache(BF16Format(name="bf16")), steps, [])
    assert torch.isfinite(lg).all()
    assert torch.equal(lg[:, 0], ref[:, 0])  # a serving prefill attends in BF16 for every format
    gap = (lg[:, 1] - ref[:, 1]).abs().max().item()  # the first decode step reads the quantized middle, same input
    assert (gap > 0) == fmt.quantized, gap
    attention.enable(model)
    cache = new_cache(model, torch_cache.cache_spec(fmt, rotations(fmt)))
    with torch.no_grad():
        model(ids, use_cache=True, past_key_values=cache)
    bits = cache.bits_per_element()
    expect = fmt.expected_bits(ids.shape[1], D)
    assert bits == pytest.approx(expect, rel=0.15 if fmt.paged else 1e-6), (bits, expect)  # pages round up


def _device_matches_torch(model, fmt: CacheFormat, device: str, backend: str, steps: int = 6) -> None:
    """The device cache of ``fmt`` against the torch cache of ``fmt``. With the torch twins (same arithmetic as the
    torch cache, CPU): the same greedy tokens and logits within one bf16 step. With the kernels (Triton writer,
    CUDA/Triton decode: other reduction orders, so a code may move one step): teacher forced on the torch cache's
    tokens, logits within `CUDA_LOGIT_TOL` (measured on the H200; greedy tokens may part at near-ties)."""
    ids = prompt().to(device)
    if device == "cuda" and fmt.paged:  # the mma pages hold blocks of 16 tokens
        fmt = fmt.replace(page_size=16)
    t = timed(fmt, "auto" if device == "cuda" else "rows")
    ref_tok, ref_lg = tp.reference_decode(model, ids, t, steps, rotations(fmt))
    cache = tp.new_device_cache(t, model, 2, ids.shape[1], extra_steps=steps, device=device, backend=backend,
                                shuffle_pages=fmt.paged)
    assert cache.format == fmt
    if backend == "torch":
        tok, lg = tp.device_decode(model, ids, cache, steps)
        assert torch.equal(tok, ref_tok)
        assert (lg - ref_lg).abs().max().item() <= LOGIT_TOL
        return
    _, lg = tp.device_decode(model, ids, cache, steps, forced=ref_tok[:, :-1])
    _, bf16 = tp.reference_decode(model, ids, tp.TimedCache(BF16Format(name="bf16")), steps, [])
    diff, moved = (lg - ref_lg).abs().max().item(), (ref_lg - bf16).abs().max().item()
    print(f"{fmt.kind} on {device}: teacher-forced max |logit - torch cache| {diff:.4f}; the format moves BF16's "
          f"logits by up to {moved:.4f}; argmax agreement {(lg.argmax(-1) == ref_lg.argmax(-1)).float().mean():.3f}")
    assert diff <= CUDA_LOGIT_TOL, (diff, moved)


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_through_the_device_cache(model, kind):
    fmt = small(kind)
    if "device" not in fmt.served_by:
        with pytest.raises(FormatNotServed, match=f"the {kind} cache format .* not served by the device cache"):
            dc.for_format(fmt, num_layers=LAYERS, batch=1, num_kv_heads=HKV, head_dim=D, context=8)
        return
    _device_matches_torch(model, fmt, "cpu", "torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", served_kinds("device"))
def test_every_device_format_through_the_cuda_kernels(model, kind):
    """On CUDA the device cache runs the format's kernels (Triton writer, v10 mma or row kernel). The mma kernel
    reads per-channel key blocks of >= 16 tokens: blocks of 16, a 16-token ring, and steps enough to demote two."""
    fmt, steps = small(kind), 6
    if kind == "rotated_channel":
        fmt, steps = fmt.replace(page_size=16, key_block=16, layer_blocks=(16, 0), recent=16), 30
    _device_matches_torch(model.to("cuda"), fmt, "cuda", "triton", steps)

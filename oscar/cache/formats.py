"""Cache formats: one class per storage format, in one registry that every consumer asks.

A format is what a method stores per token and how: its segments (BF16 sink, quantized history, BF16
recent window), bits and group, page size, what it needs from the calibration artifact, how its rows
are written and read (which kernel), and which consumers serve it:

- ``torch``: the embedded engine's transformers cache (`oscar.cache.torch_cache.OscarCache`),
- ``device``: the CUDA-graph device caches of the profile and the fused step (`oscar.cache.device_cache`),
- ``pool``: the SGLang KV pool (`oscar.serve.pool.OscarTokenToKVPool`).

Those consumers hold a format object and ask it (``paged``, ``simulated``, ``new_pages``, ``write``,
``attend``, ``bytes_per_token``, ...); the kinds exist here only (`KINDS`). Each consumer builds its own caches
and layers from the format's fields and flags (`oscar.cache.torch_cache.cache_spec` and ``torch_layer``,
`oscar.cache.device_cache.for_format`): the consumers import this module and it imports none of them; the
format methods ``cache_spec``, ``torch_layer`` and ``device_cache`` forward to those builders (`BUILDERS`). A method
(``conf/method/*.yaml``) becomes a format in one place (`CacheFormat.from_method`); a calibration artifact
records the format it was made for (``meta.json`` ``cache_format``, `record_format`) and servers read it
back with `CacheFormat.of_artifact`. Adding a format is one class here (registered with `register`),
its kernel path, and a case in ``tests/test_formats.py`` that runs it through every consumer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch

from oscar.cache import paged
from oscar.cache.rotations import LayerRotations
from oscar.core import quant
from oscar.core.baselines import TurboQuantizer, kivi_fake_quantize, kivi_split, turboquant_bits_per_element

CONSUMERS = ("torch", "device", "pool")
LAYOUTS = ("auto", "rows", "mma")  # page layouts of a paged format (`resolve_layout`)


class FormatNotServed(NotImplementedError):
    """A consumer was asked to hold a format that it does not serve."""


@dataclass(frozen=True)
class CacheFormat:
    """A cache's storage format. ``group_size`` is the effective group (it divides head_dim); ``bits`` 16
    and empty windows for the BF16 cache. Subclasses fix the kind and the behaviour."""

    kind: ClassVar[str] = ""
    served_by: ClassVar[tuple[str, ...]] = ()
    quantized: ClassVar[bool] = True  # stores INT codes (accounting below 16 bits per element)
    paged: ClassVar[bool] = False  # real packed pages (`oscar.cache.paged`), written and read by kernels
    simulated: ClassVar[bool] = False  # accuracy-only: BF16 rows attended as their quantize-dequantize image
    rotated: ClassVar[bool] = False  # needs per-(layer, KV head) rotations, means and clip ratios
    windowed: ClassVar[bool] = False  # BF16 sink and recent windows (S0/W) around the quantized history

    name: str = ""
    bits: int = 16
    group_size: int = 0
    sink: int = 0
    recent: int = 0
    page_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if type(self) is CacheFormat:
            raise TypeError("CacheFormat is abstract: use format_for(kind, ...) or a registered format class")
        if self.quantized and self.bits not in quant.SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits} is not supported for a {self.kind} cache; valid values are "
                             f"{quant.SUPPORTED_BITS}")
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink={self.sink} and recent={self.recent} must be non-negative")
        if self.quantized and (self.page_size < 1 or self.page_size & (self.page_size - 1)):
            raise ValueError(f"page_size={self.page_size} must be a power of two")

    # -- construction ------------------------------------------------------------------------------

    @staticmethod
    def from_method(method_cfg: Any, head_dim: int) -> "CacheFormat":
        """The format of a method configuration (``conf/method/*.yaml``) on a model of ``head_dim``."""
        cls = format_class(str(_get(method_cfg, "kind", "rotated")), f"method {_get(method_cfg, 'name', '?')!r}")
        return cls._of_method(method_cfg, int(head_dim))

    @classmethod
    def _of_method(cls, method_cfg: Any, head_dim: int) -> "CacheFormat":
        return cls(name=str(_get(method_cfg, "name", cls.kind)), bits=int(_get(method_cfg, "bits", 2)),
                   group_size=group_of(method_cfg, head_dim), sink=int(_get(method_cfg, "sink", 0)),
                   recent=int(_get(method_cfg, "recent", 0)), page_size=int(_get(method_cfg, "page_size", 64)),
                   seed=int(_get(method_cfg, "seed", 0)))

    def to_meta(self) -> dict[str, Any]:
        """The record of this format in an artifact's ``meta.json`` (``cache_format``; tuples as lists)."""
        return {"kind": self.kind, **{f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                                      for f in dataclasses.fields(self)}}

    @staticmethod
    def from_meta(record: Mapping[str, Any]) -> "CacheFormat":
        """The format of a ``meta.json`` ``cache_format`` record (`to_meta`); refuses unknown kinds and fields."""
        record = dict(record)
        cls = format_class(str(record.pop("kind", "")), "the artifact's cache_format")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - names)
        if unknown:
            raise ValueError(f"the artifact's cache_format has unknown fields {unknown}; valid: {sorted(names)}")
        return cls(**record)

    @staticmethod
    def of_artifact(meta: Mapping[str, Any]) -> "CacheFormat":
        """The format an artifact was calibrated for: its ``cache_format`` record, or (artifacts written before
        formats were recorded) the format of its ``method`` on its model's head_dim."""
        if "cache_format" in meta:
            return with_key_blocks(CacheFormat.from_meta(meta["cache_format"]), meta)
        return with_key_blocks(CacheFormat.from_method(meta.get("method", {}), int(meta["model"]["head_dim"])), meta)

    def replace(self, **fields: Any) -> "CacheFormat":
        """The same format with other fields (windows, page size at serve time)."""
        return dataclasses.replace(self, **fields)

    # -- consumers ---------------------------------------------------------------------------------

    def check_served(self, consumer: str) -> None:
        """Refuse a consumer that does not serve this format, naming those that do."""
        if consumer not in CONSUMERS:
            raise ValueError(f"consumer {consumer!r} is not valid; choose one of {', '.join(CONSUMERS)}")
        if consumer not in self.served_by:
            raise FormatNotServed(
                f"the {self.kind} cache format of method {self.name!r} is not served by the {_CONSUMER_NAMES[consumer]}; "
                f"it is served by: {', '.join(_CONSUMER_NAMES[c] for c in self.served_by)}. Formats the "
                f"{_CONSUMER_NAMES[consumer]} serves: {', '.join(k for k, c in REGISTRY.items() if consumer in c.served_by)}")

    # The consumers build their own caches and layers from the format's fields and flags
    # (`oscar.cache.device_cache.for_format`, `oscar.cache.torch_cache.cache_spec` and `torch_layer`); these methods
    # forward to them through `BUILDERS`, so that this module, which the consumers import, imports none of them.

    def device_cache(self, **geometry: Any) -> Any:
        """The device cache of this format: `oscar.cache.device_cache.for_format`."""
        self.check_served("device")
        return _builder("device_cache", "oscar.cache.device_cache")(self, **geometry)

    def torch_layer(self, spec: Any, rotations: Any, layer_idx: int) -> Any:
        """The embedded engine's cache layer of this format: `oscar.cache.torch_cache.torch_layer`."""
        return _builder("torch_layer", "oscar.cache.torch_cache")(spec, rotations, layer_idx)

    def cache_spec(self, layers: Optional[Sequence[Any]] = None, **runtime: Any) -> Any:
        """The embedded engine's `CacheSpec` of this format: `oscar.cache.torch_cache.cache_spec` (``layers`` the
        per-layer `LayerRotations` of a rotated format, ``runtime`` the spec's run-time fields)."""
        self.check_served("torch")
        return _builder("cache_spec", "oscar.cache.torch_cache")(self, layers, **runtime)

    # the run-time fields of `oscar.cache.torch_cache.CacheSpec` this format takes (the others are dropped)
    runtime_fields: ClassVar[tuple[str, ...]] = ("mode",)

    # -- accounting --------------------------------------------------------------------------------

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one quantized token takes (all layers, K and V): packed codes plus BF16 scale and zero per
        group; the BF16 rows for an unquantized format."""
        if not self.quantized:
            return 2 * num_layers * num_kv_heads * head_dim * 2
        per_row = head_dim * self.bits // 8 + 2 * 2 * (head_dim // self.group_size)
        return 2 * num_layers * num_kv_heads * per_row

    def window_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int = 2) -> int:
        """BF16 sink + recent window bytes of one sequence (all layers, K and V)."""
        return 2 * num_layers * num_kv_heads * (self.sink + self.recent) * head_dim * itemsize

    def expected_bits(self, num_tokens: int, head_dim: int) -> float:
        """Accounting bits per element of one sequence of ``num_tokens`` (pages full)."""
        return quant.bits_per_element(num_tokens, head_dim, self.bits, self.group_size, self.sink, self.recent)


@dataclass(frozen=True)
class BF16Format(CacheFormat):
    """Every token in BF16 (the reference)."""

    kind: ClassVar[str] = "bf16"
    served_by: ClassVar[tuple[str, ...]] = ("torch", "device")
    quantized: ClassVar[bool] = False

    @classmethod
    def _of_method(cls, method_cfg: Any, head_dim: int) -> "CacheFormat":
        return cls(name=str(_get(method_cfg, "name", "bf16")))

    def expected_bits(self, num_tokens: int, head_dim: int) -> float:
        return 16.0


@dataclass(frozen=True)
class RotatedFormat(CacheFormat):
    """OSCAR's format: BF16 sink, rotated-clipped per-token per-group INT codes with BF16 scale/zero in pages,
    BF16 recent window (docs/DESIGN.md "Quantized storage format", "Paged INT2 pool layout"). Written by
    `oscar.cache.paged.rotate_quantize_pack_kv` (Triton writer or its torch twin), read by
    `oscar.cache.paged.decode_attention` (the mma CUDA kernel, the row Triton kernel or the torch twin)."""

    kind: ClassVar[str] = "rotated"
    served_by: ClassVar[tuple[str, ...]] = ("torch", "device", "pool")
    paged: ClassVar[bool] = True
    rotated: ClassVar[bool] = True
    windowed: ClassVar[bool] = True
    runtime_fields: ClassVar[tuple[str, ...]] = ("mode", "backend", "fold_values", "paged_decode", "store_dtype")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent < 1:
            raise ValueError(f"recent={self.recent}: the rotated cache needs a recent window of at least 1 token")

    # -- pages (device cache and SGLang pool) -------------------------------------------------------

    def resolve_layout(self, layout: str, head_dim: int, device: Any) -> str:
        """``"rows"`` or ``"mma"`` for a requested ``layout`` (``auto``: mma on CUDA where this format allows
        it). An explicit ``"mma"`` for a format it does not cover is refused with the reason."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is not valid; choose one of {', '.join(LAYOUTS)}")
        if layout == "auto":
            return "mma" if torch.device(device).type == "cuda" and self.mma_supported(head_dim) else "rows"
        if layout == "mma":
            quant.check_mma_layout(self.bits, self.group_size, head_dim, self.page_size)
        return layout

    def mma_supported(self, head_dim: int) -> bool:
        """Whether the fragment-order (mma) page layout covers this format (`oscar.core.quant.check_mma_layout`)."""
        try:
            quant.check_mma_layout(self.bits, self.group_size, head_dim, self.page_size)
        except ValueError:
            return False
        return True

    def new_pages(self, num_pages: int, num_kv_heads: int, head_dim: int, device: Any, layout: str,
                  key_block: int = 0) -> tuple[Any, Any]:
        """Empty K and V page stores (`oscar.cache.paged.QuantPages`) of ``num_pages`` pages in a resolved
        ``layout`` (``rows`` or ``mma``: K and V in their fragment orders); ``key_block`` > 0: the K pages of a layer
        with per-channel keys (the layer's ``HeadTransform.block``; `check_key_block` says which this format takes)."""
        self.check_key_block(key_block)
        k_layout, v_layout = ("rows", "rows") if layout == "rows" else ("mma_k", "mma_v")
        dev = torch.device(device)
        return (paged.QuantPages.empty(num_pages, num_kv_heads, self.page_size, head_dim, self.bits, self.group_size,
                                       dev, k_layout, key_block),
                paged.QuantPages.empty(num_pages, num_kv_heads, self.page_size, head_dim, self.bits, self.group_size,
                                       dev, v_layout))

    def check_key_block(self, block: int) -> None:
        """Refuse a layer's key block this format does not store (per-token keys only: 0)."""
        if block:
            raise ValueError(f"the {self.kind} format of method {self.name!r} stores per-token keys; a layer with "
                             f"per-channel keys (block={block}) needs the rotated_channel format (record it in the "
                             "artifact: oscar.cache.formats.record_format, read back by CacheFormat.of_artifact)")

    def layer_key_block(self, layer: int) -> int:
        """Tokens per per-channel key block of ``layer`` (0: per-token keys)."""
        return 0

    def write(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pages: tuple[Any, Any],
              transforms: tuple[Any, Any], **options: Any) -> None:
        """Quantize rows ``k``/``v`` ``[N, Hkv, d]`` (original frame) into token ``slots`` of ``pages``: the
        write path of every consumer (prefill, decode write-through, demotion); ``options`` are the writer's
        (``backend``, ``positions`` of rope-centered keys, ``src_index``)."""
        paged.rotate_quantize_pack_kv(k, v, slots, pages[0], pages[1], transforms[0], transforms[1], **options)

    def attend(self, q: torch.Tensor, pages: tuple[Any, Any], segments: Any, transforms: tuple[Any, Any],
               **options: Any) -> torch.Tensor:
        """Decode attention ``[B, H, d]`` of one query per sequence over BF16 sink + these pages + BF16 recent
        (`oscar.cache.paged.decode_attention`; ``segments``: `oscar.kernels.segments.Segments`, the page table,
        lengths and windows; ``options``: ``sm_scale``, ``output_frame``, ``backend``, ``launch``)."""
        return paged.decode_attention(q, pages[0], pages[1], segments, transforms[0], transforms[1], **options)


@dataclass(frozen=True)
class ChannelKeyFormat(RotatedFormat):
    """OSCAR's paged format with per-channel keys in some or all layers (`auto` with ``method.channel_block=T``,
    served KIVI-2): such a layer's keys are quantized per channel over blocks of ``key_block`` tokens, its K pages
    carry bf16 scale/zero ``[P, Hkv, page_size/T, d]`` and its recent window holds ``W`` to ``W + T - 1`` rows
    (docs/DESIGN.md "Per-channel key pages on the paged path"); values and the other layers as `RotatedFormat`.
    ``layer_blocks``: the block of each layer (0: per-token keys; the artifact's ``meta["key_block"]``), or None when
    every layer has per-channel keys. The per-layer choice travels with the transforms (``HeadTransform.block``)."""

    kind: ClassVar[str] = "rotated_channel"

    key_block: int = 32
    layer_blocks: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_blocks is not None and not isinstance(self.layer_blocks, tuple):
            object.__setattr__(self, "layer_blocks", tuple(int(b) for b in self.layer_blocks))
        paged.check_key_block(self.key_block, self.page_size)
        if self.key_block == 0:
            raise ValueError("key_block=0: the rotated_channel format needs a positive block (per-token keys everywhere "
                             "is the rotated format)")
        bad = sorted({b for b in (self.layer_blocks or ()) if b not in (0, self.key_block)})
        if bad:
            raise ValueError(f"layer_blocks {bad} differ from key_block={self.key_block}; each layer takes 0 (per-token "
                             f"keys) or {self.key_block}")
        paged.check_channel_ring(self.recent, self.key_block)

    def mma_supported(self, head_dim: int) -> bool:
        """The fragment-order layout where it covers the format and the CUDA kernel reads per-channel key pages
        (``oscar.kernels.decode_mma.CHANNEL_KEYS``); ``layout="auto"`` resolves to rows until then."""
        return super().mma_supported(head_dim) and paged._mma_reads_channel_keys()

    def check_key_block(self, block: int) -> None:
        if block not in (0, self.key_block):
            raise ValueError(f"a layer's key block {block} is not one of this format's (0 or key_block={self.key_block})")

    def layer_key_block(self, layer: int) -> int:
        if self.layer_blocks is None:
            return self.key_block
        if not 0 <= layer < len(self.layer_blocks):
            raise ValueError(f"layer {layer} is outside the {len(self.layer_blocks)} layers of layer_blocks")
        return self.layer_blocks[layer]

    def channel_share(self) -> float:
        """Share of layers with per-channel keys."""
        if self.layer_blocks is None:
            return 1.0
        return sum(1 for b in self.layer_blocks if b) / max(1, len(self.layer_blocks))

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one quantized token takes (all layers, K and V): per-channel key rows carry ``4 d / T`` bytes of
        scale and zero per token (one bf16 pair per channel and block), rounded up over the whole token."""
        per_row = head_dim * self.bits // 8 + 2 * 2 * (head_dim // self.group_size)
        ch_row = head_dim * self.bits // 8 + 2 * 2 * head_dim / self.key_block
        blocks = [self.layer_key_block(layer) for layer in range(num_layers)] if self.layer_blocks is not None else \
            [self.key_block] * num_layers
        k_bytes = sum(ch_row if b else per_row for b in blocks)
        return int(math.ceil(num_kv_heads * (k_bytes + num_layers * per_row)))

    def expected_bits(self, num_tokens: int, head_dim: int) -> float:
        """Accounting bits per element of one sequence (pages full; windows of ``sink + recent`` tokens), averaged over
        K and V and over the layers: per-channel keys ``b + 32/T`` per quantized element."""
        tok = quant.bits_per_element(num_tokens, head_dim, self.bits, self.group_size, self.sink, self.recent)
        n_full = min(num_tokens, self.sink + self.recent)
        ch = ((num_tokens - n_full) * quant.channel_bits_per_element(head_dim, self.bits, self.key_block)
              + n_full * 16) / num_tokens
        f = self.channel_share()
        return (tok + f * ch + (1 - f) * tok) / 2

    def layer_rotations(self, num_layers: int, num_kv_heads: int, head_dim: int) -> list[LayerRotations]:
        """Identity `oscar.cache.rotations.LayerRotations` with this format's key blocks (served KIVI-2: no
        rotation, no centering, no clip)."""
        out = []
        for layer in range(num_layers):
            r = LayerRotations.identity(num_kv_heads, head_dim)
            out.append(LayerRotations(r.r_k, r.r_v, k_block=self.layer_key_block(layer)))
        return out

    def identity_transforms(self, num_layers: int) -> list[tuple[Any, Any]]:
        """Per-layer ``(kt, vt)`` `HeadTransform` pairs without rotation, centering or clip, keys per channel where
        this format says (served KIVI-2: the transforms of `oscar.cache.device_cache` and the SGLang pool)."""
        return [(paged.HeadTransform(block=self.layer_key_block(layer)), paged.HeadTransform())
                for layer in range(num_layers)]


@dataclass(frozen=True)
class SimulatedFormat(CacheFormat):
    """An accuracy-only baseline format: the torch cache keeps every token in BF16 and attends to the
    quantize-dequantize image of the tokens the method would hold quantized (`oscar.core.baselines`: real
    codes, then dequantized); its bytes are the method's accounting. No kernel reads it."""

    served_by: ClassVar[tuple[str, ...]] = ("torch",)
    simulated: ClassVar[bool] = True

    def quantizers(self, layer_idx: int, num_kv_heads: int, head_dim: int) -> Any:
        """Per-layer quantizer state (None unless the format has one)."""
        return None

    def bounds(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(key end, value end, start) of the quantized range of sequences of ``total`` tokens."""
        raise NotImplementedError

    def fake(self, k: torch.Tensor, v: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize-dequantize images of history rows ``[B, Hkv, L, d]``."""
        raise NotImplementedError

    def fake_step(self, layer: Any, new: list[int], idx: torch.Tensor, col: torch.Tensor) -> None:
        """Update ``layer.fake_k``/``fake_v`` for the one new token of each sequence in ``new`` (at ``col``)."""
        raise NotImplementedError


@dataclass(frozen=True)
class KiviFormat(SimulatedFormat):
    """KIVI-2: keys per channel over blocks of ``group_size`` tokens, values per token, a BF16 residual of
    ``recent`` tokens (plus the incomplete key block); no sink (`oscar.core.baselines.kivi_split`)."""

    kind: ClassVar[str] = "kivi"

    @classmethod
    def _of_method(cls, method_cfg: Any, head_dim: int) -> "CacheFormat":
        # KIVI groups keys per channel over tokens: its group is the configured one (not capped by head_dim)
        return cls(name=str(_get(method_cfg, "name", "kivi")), bits=int(_get(method_cfg, "bits", 2)),
                   group_size=int(_get(method_cfg, "group_size", 32)), sink=0, recent=int(_get(method_cfg, "recent", 0)))

    def bounds(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        v_end = (total - self.recent).clamp(min=0)
        return torch.div(v_end, self.group_size, rounding_mode="floor") * self.group_size, v_end, 0

    def fake(self, k: torch.Tensor, v: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return kivi_fake_quantize(k.float(), v.float(), self.bits, self.group_size, residual=0)

    def fake_step(self, layer: Any, new: list[int], idx: torch.Tensor, col: torch.Tensor) -> None:
        v_new = layer.hist_v[idx, :, col][:, :, None]
        _, vq = kivi_fake_quantize(v_new.float(), v_new.float(), self.bits, self.group_size, residual=0)
        g = self.group_size
        for b in new:  # a key block completes
            end = layer.hist_len[b]
            if end % g == 0:
                kb, _ = kivi_fake_quantize(layer.hist_k[b, :, end - g : end].float(),
                                           layer.hist_v[b, :, end - g : end].float(), self.bits, g, residual=0)
                layer.fake_k[b, :, end - g : end] = kb
        layer.fake_v[idx, :, col] = vq[:, :, 0]

    def served(self, head_dim: int, page_size: int = 64) -> ChannelKeyFormat:
        """The paged format that serves KIVI-2 on the device cache and the SGLang pool: keys per channel over blocks of
        ``group_size`` tokens, values per token in groups of ``min(group_size, head_dim)`` channels, no sink, the
        residual as the recent window (W to W + T - 1 rows: K and V demote together), BF16 scale/zero, identity
        transforms (`ChannelKeyFormat.identity_transforms`). docs/DESIGN.md "Served KIVI-2" says where it differs
        from this simulated format."""
        g = min(self.group_size, int(head_dim))
        return ChannelKeyFormat(name=f"{self.name}_served", bits=self.bits, group_size=g, sink=0, recent=self.recent,
                                page_size=page_size, seed=self.seed, key_block=self.group_size)

    def expected_bits(self, num_tokens: int, head_dim: int) -> float:
        n, d, g = num_tokens, head_dim, self.group_size
        n_k, n_v = kivi_split(n, g, self.recent)
        k_bits = n_k * d * self.bits + (n_k // g) * d * 2 * 16 + (n - n_k) * d * 16
        v_bits = n_v * d * self.bits + n_v * (d // min(g, d)) * 2 * 16 + (n - n_v) * d * 16
        return (k_bits + v_bits) / (2 * n * d)


@dataclass(frozen=True)
class TurboQuantFormat(SimulatedFormat):
    """TurboQuant (MSE): per row its norm and a Haar-rotated direction on Lloyd-Max levels, seeded per
    (layer, KV head); BF16 sink and recent windows (`oscar.core.baselines.TurboQuantizer`)."""

    kind: ClassVar[str] = "turboquant"
    windowed: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent < 1:
            raise ValueError(f"recent={self.recent}: the turboquant cache needs a recent window of at least 1 token")

    @classmethod
    def _of_method(cls, method_cfg: Any, head_dim: int) -> "CacheFormat":  # one group per row
        return cls(name=str(_get(method_cfg, "name", "turboquant")), bits=int(_get(method_cfg, "bits", 2)),
                   group_size=int(head_dim), sink=int(_get(method_cfg, "sink", 0)),
                   recent=int(_get(method_cfg, "recent", 0)), seed=int(_get(method_cfg, "seed", 0)))

    def quantizers(self, layer_idx: int, num_kv_heads: int, head_dim: int) -> Any:
        base = int(self.seed) * 1_000_003 + layer_idx * num_kv_heads * 2
        return ([TurboQuantizer(head_dim, self.bits, seed=base + 2 * h) for h in range(num_kv_heads)],
                [TurboQuantizer(head_dim, self.bits, seed=base + 2 * h + 1) for h in range(num_kv_heads)])

    def bounds(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        end = (total - self.recent).clamp(min=self.sink)
        return end, end, self.sink

    def fake(self, k: torch.Tensor, v: torch.Tensor, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        tq_k, tq_v = state
        kq = torch.stack([tq_k[h].fake_quantize(k[:, h].float()) for h in range(len(tq_k))], dim=1)
        vq = torch.stack([tq_v[h].fake_quantize(v[:, h].float()) for h in range(len(tq_v))], dim=1)
        return kq, vq

    def fake_step(self, layer: Any, new: list[int], idx: torch.Tensor, col: torch.Tensor) -> None:
        k_new, v_new = layer.hist_k[idx, :, col][:, :, None], layer.hist_v[idx, :, col][:, :, None]
        kq, vq = self.fake(k_new, v_new, layer.quantizers)
        layer.fake_k[idx, :, col] = kq[:, :, 0]
        layer.fake_v[idx, :, col] = vq[:, :, 0]

    def expected_bits(self, num_tokens: int, head_dim: int) -> float:
        n_q = max(0, num_tokens - self.sink - self.recent)
        return (n_q * turboquant_bits_per_element(head_dim, self.bits) + (num_tokens - n_q) * 16) / num_tokens


_CONSUMER_NAMES = {"torch": "embedded engine's torch cache", "device": "device cache (CUDA graphs)",
                   "pool": "SGLang KV pool"}
REGISTRY: dict[str, type[CacheFormat]] = {}

# What the consumer modules build for a format (``device_cache``, ``torch_layer``, ``cache_spec``): each module
# provides its builders when it loads, so the format methods reach them although this module imports no consumer
# (the consumers import it).
BUILDERS: dict[str, Callable[..., Any]] = {}


def provide(name: str, builder: Callable[..., Any]) -> None:
    """Register a consumer's ``builder`` of ``name`` (one of the format methods that forward to `BUILDERS`)."""
    BUILDERS[name] = builder


def _builder(name: str, module: str) -> Callable[..., Any]:
    if name not in BUILDERS:
        raise RuntimeError(f"CacheFormat.{name} is built by {module}, which has not been imported: import it "
                           f"(or call its builder directly)")
    return BUILDERS[name]


def register(cls: type[CacheFormat]) -> type[CacheFormat]:
    """Add a format class to the registry under its ``kind`` (refuses a kind registered twice)."""
    if not cls.kind or cls.kind in REGISTRY:
        raise ValueError(f"format kind {cls.kind!r} is empty or already registered ({', '.join(REGISTRY)})")
    unknown = sorted(set(cls.served_by) - set(CONSUMERS))
    if unknown:
        raise ValueError(f"format {cls.kind!r} names unknown consumers {unknown}; valid: {', '.join(CONSUMERS)}")
    REGISTRY[cls.kind] = cls
    return cls


for _cls in (BF16Format, RotatedFormat, ChannelKeyFormat, KiviFormat, TurboQuantFormat):
    register(_cls)
KINDS: tuple[str, ...] = tuple(REGISTRY)


def format_class(kind: str, where: str = "cache") -> type[CacheFormat]:
    """The registered class of ``kind``; refuses an unknown kind, naming the valid ones."""
    if kind not in REGISTRY:
        raise ValueError(f"{where}: cache kind {kind!r} is not valid; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[kind]


def format_for(kind: str, **fields: Any) -> CacheFormat:
    """A format of ``kind`` with ``fields`` (name, bits, group_size, sink, recent, page_size, seed)."""
    return format_class(kind)(**fields)


def served_kinds(consumer: str) -> tuple[str, ...]:
    """The kinds a consumer serves (``torch``, ``device`` or ``pool``)."""
    if consumer not in CONSUMERS:
        raise ValueError(f"consumer {consumer!r} is not valid; choose one of {', '.join(CONSUMERS)}")
    return tuple(k for k, cls in REGISTRY.items() if consumer in cls.served_by)


def record_format(artifact: Any, method_cfg: Any) -> CacheFormat:
    """Record in ``artifact.meta["cache_format"]`` the format of ``method_cfg`` on the artifact's model
    (what `CacheFormat.of_artifact` reads back); returns it. Called by every artifact writer."""
    fmt = with_key_blocks(CacheFormat.from_method(method_cfg, int(artifact.meta["model"]["head_dim"])), artifact.meta)
    artifact.meta["cache_format"] = fmt.to_meta()
    return fmt


def with_key_blocks(fmt: CacheFormat, meta: Mapping[str, Any]) -> CacheFormat:
    """``fmt``, or, for a rotated format whose artifact has per-channel key layers (``meta["key_block"]``), the
    `ChannelKeyFormat` with those layers' blocks (one block per artifact: `auto`'s ``method.channel_block``)."""
    blocks = [int(b) for b in (meta.get("key_block") or [])]
    if not any(blocks) or type(fmt) is not RotatedFormat:
        return fmt
    sizes = sorted({b for b in blocks if b})
    if len(sizes) > 1:
        raise ValueError(f"the artifact's key_block lists several per-channel blocks {sizes}; one format takes one")
    return ChannelKeyFormat(**{f.name: getattr(fmt, f.name) for f in dataclasses.fields(fmt)}, key_block=sizes[0],
                            layer_blocks=tuple(blocks))


def group_of(method_cfg: Any, head_dim: int) -> int:
    """The effective group of a method on ``head_dim``: ``min(method.group_size, head_dim)`` (docs/DESIGN.md
    "Effective group size"); refuses a group that does not divide head_dim, naming the valid ones."""
    g = min(int(_get(method_cfg, "group_size", 128)), int(head_dim))
    if g <= 0 or head_dim % g:
        valid = [x for x in range(4, head_dim + 1, 4) if head_dim % x == 0]
        raise ValueError(f"method {_get(method_cfg, 'name', '?')!r}: group_size {g} does not divide head_dim {head_dim}; "
                         f"valid group sizes: {valid}")
    return g


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


__all__ = [
    "BF16Format",
    "BUILDERS",
    "CONSUMERS",
    "CacheFormat",
    "ChannelKeyFormat",
    "FormatNotServed",
    "KINDS",
    "KiviFormat",
    "LAYOUTS",
    "REGISTRY",
    "RotatedFormat",
    "SimulatedFormat",
    "TurboQuantFormat",
    "format_class",
    "format_for",
    "group_of",
    "provide",
    "record_format",
    "register",
    "served_kinds",
    "with_key_blocks",
]

"""The one cache-format value: what a method stores per token, shared by every consumer.

A method's configuration is translated into a `CacheFormat` in one place (`CacheFormat.from_method`;
the SGLang settings build theirs with `CacheFormat.serving` from the environment and the artifact), and
every consumer derives its own object from that value: the embedded engine's `oscar.cache.torch_cache.CacheSpec`
(`CacheFormat.cache_spec`), the device caches of the throughput profile (`oscar.bench.throughput.TimedCache`)
and the SGLang KV pool's byte accounting (`bytes_per_token`, `window_bytes`). The value holds only the
storage format (kind, bits, effective group, BF16 windows, page size, seed); rotations and run-time
choices (attention mode, kernels backend, page layout) stay with their consumer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

KINDS = ("bf16", "rotated", "kivi", "turboquant")


@dataclass(frozen=True)
class CacheFormat:
    """A cache's storage format. ``group_size`` is the effective group (it divides head_dim); ``bits`` 16
    and empty windows for the BF16 cache."""

    name: str
    kind: str = "bf16"
    bits: int = 16
    group_size: int = 0
    sink: int = 0
    recent: int = 0
    page_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"cache kind {self.kind!r} is not valid; choose one of {', '.join(KINDS)}")
        from oscar.core.quant import SUPPORTED_BITS

        if self.kind != "bf16" and self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits} is not supported for a {self.kind} cache; valid values are {SUPPORTED_BITS}")
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"sink={self.sink} and recent={self.recent} must be non-negative")

    @property
    def quantized(self) -> bool:
        """Whether the cache stores packed INT rows (every kind but ``bf16``)."""
        return self.kind != "bf16"

    @staticmethod
    def from_method(method_cfg: Any, head_dim: int) -> "CacheFormat":
        """The format of a method configuration (``conf/method/*.yaml``) on a model of ``head_dim``."""
        from oscar.core.methods import effective_group_size

        kind, name = str(method_cfg.kind), str(method_cfg.name)
        if kind == "bf16":
            return CacheFormat(name=name)
        if kind not in KINDS:
            raise ValueError(f"method {name!r} has kind {kind!r}; cache formats exist for kinds {', '.join(KINDS)}")
        if kind == "kivi":  # KIVI groups keys per channel over tokens: its group is the configured one, no sink
            return CacheFormat(name=name, kind=kind, bits=int(method_cfg.bits), group_size=int(method_cfg.group_size),
                               sink=0, recent=int(method_cfg.recent))
        if kind == "turboquant":  # one group per row
            return CacheFormat(name=name, kind=kind, bits=int(method_cfg.bits), group_size=int(head_dim),
                               sink=int(method_cfg.sink), recent=int(method_cfg.recent), seed=int(method_cfg.seed))
        return CacheFormat(name=name, kind=kind, bits=int(method_cfg.bits),
                           group_size=effective_group_size(method_cfg, head_dim), sink=int(method_cfg.sink),
                           recent=int(method_cfg.recent), page_size=int(method_cfg.page_size))

    @staticmethod
    def serving(*, sink: int, recent: int, bits: int, group_size: int, name: str = "oscar") -> "CacheFormat":
        """The rotated format an SGLang server runs (settings from the environment, bits and group from the
        artifact)."""
        return CacheFormat(name=name, kind="rotated", bits=int(bits), group_size=int(group_size), sink=int(sink),
                           recent=int(recent))

    def cache_spec(self, layers: Optional[Sequence[Any]] = None, **runtime: Any) -> Any:
        """The embedded engine's `oscar.cache.torch_cache.CacheSpec` of this format; ``layers`` the per-layer
        `LayerRotations` of a rotated cache, ``runtime`` the spec's run-time fields (mode, backend,
        fold_values, ...)."""
        from oscar.cache.torch_cache import CacheSpec

        if self.kind == "bf16":
            return CacheSpec(kind="bf16", **{k: v for k, v in runtime.items() if k == "mode"})
        extra: dict[str, Any] = {"seed": self.seed} if self.kind == "turboquant" else {}
        if self.kind == "rotated":
            extra.update(page_size=self.page_size, layers=list(layers or []))
        else:
            runtime = {k: v for k, v in runtime.items() if k == "mode"}
        return CacheSpec(kind=self.kind, bits=self.bits, group_size=self.group_size, sink=self.sink,
                         recent=self.recent, **extra, **runtime)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token takes (all layers, K and V): packed codes plus BF16 scale and zero per group for a
        quantized format, the BF16 rows for ``bf16``."""
        if not self.quantized:
            return 2 * num_layers * num_kv_heads * head_dim * 2
        per_row = head_dim * self.bits // 8 + 2 * 2 * (head_dim // self.group_size)
        return 2 * num_layers * num_kv_heads * per_row

    def window_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int = 2) -> int:
        """BF16 sink + recent window bytes of one sequence (all layers, K and V)."""
        return 2 * num_layers * num_kv_heads * (self.sink + self.recent) * head_dim * itemsize


__all__ = ["CacheFormat", "KINDS"]

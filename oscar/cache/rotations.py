"""Per-layer rotation state of a KV cache: `LayerRotations`, the rotations, means, clip ratios, RoPE centering and
key block of every KV head of one layer.

The formats (`oscar.cache.formats`: identity rotations of a served format), the torch cache
(`oscar.cache.torch_cache`, which re-exports the class) and the loaders of calibration artifacts all use it, so it
lives below them: it needs torch and `oscar.cache.paged` (the kernels' `HeadTransform`) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from oscar.cache import paged


@dataclass
class LayerRotations:
    """Per-layer quantization state for every KV head: rotations, means, clip ratios (float32)."""

    r_k: torch.Tensor  # [Hkv, d, d]
    r_v: torch.Tensor  # [Hkv, d, d]
    mu_k: Optional[torch.Tensor] = None  # [Hkv, d]
    mu_v: Optional[torch.Tensor] = None  # [Hkv, d]
    rho_k: Optional[torch.Tensor] = None  # [Hkv]
    rho_v: Optional[torch.Tensor] = None  # [Hkv]
    rope_k: Optional[torch.Tensor] = None  # [Hkv, d] pre-RoPE key means of rope-centered heads (zero rows elsewhere)
    rope: Any = None  # oscar.core.rope.RopeSpec of the layer's keys, with rope_k
    k_block: int = 0  # >0: keys quantized per channel over blocks of k_block tokens (oscar.core.quant.quantize_channels)

    def __post_init__(self) -> None:
        if (self.rope_k is None) != (self.rope is None):
            raise ValueError("rope-centered keys need both the pre-RoPE means (rope_k) and the layer's RoPE (rope)")
        if self.k_block < 0:
            raise ValueError(f"k_block={self.k_block} must be 0 (per-token keys) or a positive block of tokens")

    def to(self, device: torch.device, dtype: torch.dtype = torch.float32) -> "LayerRotations":
        """Copy onto `device` as `dtype` (float32, or float64 for exactness tests)."""

        def mv(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device=device, dtype=dtype)

        return LayerRotations(mv(self.r_k), mv(self.r_v), mv(self.mu_k), mv(self.mu_v), mv(self.rho_k), mv(self.rho_v),
                              mv(self.rope_k), self.rope, self.k_block)

    def paged_transforms(self, where: str, device: Optional[torch.device] = None) -> tuple[Any, Any]:
        """K and V `oscar.cache.paged.HeadTransform`s (float32, on `device` or where the rotations are) for the
        paged/Triton/CUDA kernels; clip ratios only where some are below 1 (reads ignore them).

        Rope-centered keys carry the pre-RoPE means and the layer's RoPE (`rope_mu`, `rope_freq`, `rope_scaling`):
        the writers then need the rows' positions and decode the position of the first quantized token.
        Per-channel keys (`k_block`) carry their block (`HeadTransform.block`): their K pages are
        `QuantPages(..., block=k_block)` (docs/DESIGN.md "Per-channel key pages on the paged path").
        """
        if self.rope_k is not None and self.rope.head_dim != self.r_k.shape[-1]:
            raise ValueError(f"{where}: the RoPE of the rope-centered keys has head_dim {self.rope.head_dim}, the "
                             f"rotations {self.r_k.shape[-1]}")

        def one(rot: torch.Tensor, mu: Optional[torch.Tensor], rho: Optional[torch.Tensor]) -> Any:
            def f32(t: torch.Tensor) -> torch.Tensor:
                return t.to(device=device if device is not None else t.device, dtype=torch.float32)

            clip = rho is not None and bool((rho < 1).any())
            return paged.HeadTransform(f32(rot), None if mu is None else f32(mu), f32(rho) if clip else None)

        kt = one(self.r_k, self.mu_k, self.rho_k)
        if self.rope_k is not None:
            dev = device if device is not None else self.r_k.device
            kt = paged.HeadTransform(kt.R, kt.mu, kt.rho, self.rope_k.to(dev, torch.float32),
                                     self.rope.inv_freq.to(dev, torch.float64), float(self.rope.scaling))
        if self.k_block:
            kt = paged.HeadTransform(kt.R, kt.mu, kt.rho, kt.rope_mu, kt.rope_freq, kt.rope_scaling, self.k_block)
        return kt, one(self.r_v, self.mu_v, self.rho_v)

    def key_offsets(self, positions: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """`RoPE_p(rope_k[h])` `[B, Hkv, L, d]` for token positions `[B, L]` (-1: empty slot, zero offset),
        or None when no key head of the layer is rope-centered (`oscar.core.rope`)."""
        if self.rope_k is None:
            return None
        return self.rope.offsets(self.rope_k, positions, dtype=dtype)

    @staticmethod
    def identity(num_kv_heads: int, head_dim: int) -> "LayerRotations":
        """No rotation, no centering, no clipping (naive INT)."""
        eye = torch.eye(head_dim).expand(num_kv_heads, head_dim, head_dim).clone()
        return LayerRotations(eye, eye.clone())


__all__ = ["LayerRotations"]

"""Model surgery: fold the inverse value rotation into `o_proj`.

The INT segment accumulates values in the rotated frame (`o_rot = sum p v_hat_rot`). Instead of
rotating every output back (`o_rot @ R_V.T`), `o_proj` can absorb the rotation: with row vectors,
`o_proj(o) = o @ W.T` and `o = o_rot @ R_V.T`, so `o_proj(o) = o_rot @ (W R_V).T` per query head.
After folding, the attention returns every segment in the rotated frame (`CacheSpec.fold_values`).
Query head `h` uses the rotation of its KV head `h // (H / Hkv)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from oscar.cache import LayerRotations


@dataclass
class FoldHandle:
    """Original `o_proj` weights of a folded model, to undo the surgery."""

    model: Any
    originals: list[torch.Tensor]

    def undo(self) -> None:
        """Put the original `o_proj` weights back."""
        for o_proj, weight in zip(_o_projs(self.model), self.originals):
            with torch.no_grad():
                o_proj.weight.copy_(weight)
        self.originals = []


def _o_projs(model: Any) -> list[Any]:
    from oscar.models import get_adapter

    adapter = get_adapter(model)
    return [adapter.projections(model, i)["o"] for i in range(len(adapter.layers(model)))]


def folded_weight(weight: torch.Tensor, r_v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`o_proj` weight `[hidden, H*d]` with head block `h` replaced by `W_h @ R_V[h // (H/Hkv)]`."""
    hkv, d, _ = r_v.shape
    hidden, width = weight.shape
    if width != num_heads * d:
        raise ValueError(f"o_proj input width {width} != {num_heads} heads x head_dim {d}")
    if num_heads % hkv:
        raise ValueError(f"{num_heads} query heads do not divide into {hkv} KV heads")
    per = num_heads // hkv
    w = weight.reshape(hidden, hkv, per, d)
    r = r_v.to(device=weight.device, dtype=torch.float64)
    out = torch.einsum("okpd,kde->okpe", w.to(torch.float64), r)
    return out.reshape(hidden, width).to(weight.dtype)


def fold_value_rotations(model: Any, rotations: Sequence[LayerRotations]) -> FoldHandle:
    """Fold each layer's `R_V` into its `o_proj` in place; returns a handle that undoes it."""
    o_projs = _o_projs(model)
    if len(o_projs) != len(rotations):
        raise ValueError(f"{len(rotations)} layer rotations for a model with {len(o_projs)} attention layers")
    num_heads = int(model.config.num_attention_heads)
    originals = []
    for o_proj, rot in zip(o_projs, rotations):
        weight = o_proj.weight
        originals.append(weight.detach().clone())
        with torch.no_grad():
            weight.copy_(folded_weight(weight.detach(), rot.r_v, num_heads))
    return FoldHandle(model, originals)


__all__ = ["FoldHandle", "fold_value_rotations", "folded_weight"]

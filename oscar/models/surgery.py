"""Model surgery: fold the inverse value rotation (and the value mean) into `o_proj`.

The INT segment accumulates centered values in the rotated frame (`o_rot = sum p v_hat_rot`,
`v_rot = (v - mu_V) @ R_V`). Instead of rotating every output back (`o_rot @ R_V.T + mu_V`),
`o_proj` absorbs both: with row vectors `o_proj(o) = o @ W.T + b` and, since the attention
weights of a query sum to 1, `o = x @ R_V.T + mu_V` with `x = (o - mu_V) @ R_V`, so
`o_proj(o) = x @ (W R_V).T + (b + W mu_V)` per query head. After folding the attention returns
`x` for every segment (`CacheSpec.fold_values`, `oscar.cache.paged` `output_frame="rotated"`): the mean is
added back once, through the bias. Query head `h` uses the tensors of KV head `h // (H / Hkv)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from oscar.cache.rotations import LayerRotations
from oscar.models.adapters import get_adapter


@dataclass
class FoldHandle:
    """Original `o_proj` weights and biases of a folded model, to undo the surgery."""

    model: Any
    originals: list[tuple[torch.Tensor, Optional[torch.Tensor]]]

    def undo(self) -> None:
        """Put the original `o_proj` weights (and biases, or their absence) back."""
        for o_proj, (weight, bias) in zip(_o_projs(self.model), self.originals):
            with torch.no_grad():
                o_proj.weight.copy_(weight)
                if bias is None:
                    o_proj.bias = None
                else:
                    o_proj.bias.copy_(bias)
        self.originals = []


def _o_projs(model: Any) -> list[Any]:
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


def folded_bias(weight: torch.Tensor, bias: Optional[torch.Tensor], mu_v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`b + sum_h W_h mu_V[h // (H/Hkv)]`: the value mean, added back once through the bias."""
    hkv, d = mu_v.shape
    hidden = weight.shape[0]
    w = weight.reshape(hidden, hkv, num_heads // hkv, d).to(torch.float64)
    extra = torch.einsum("okpd,kd->o", w, mu_v.to(device=weight.device, dtype=torch.float64))
    base = torch.zeros(hidden, dtype=torch.float64, device=weight.device) if bias is None else bias.to(torch.float64)
    return (base + extra).to(weight.dtype)


def fold_value_rotations(model: Any, rotations: Sequence[LayerRotations]) -> FoldHandle:
    """Fold each layer's `R_V` (and `mu_V`) into its `o_proj` in place; returns a handle that undoes it."""
    o_projs = _o_projs(model)
    if len(o_projs) != len(rotations):
        raise ValueError(f"{len(rotations)} layer rotations for a model with {len(o_projs)} attention layers")
    num_heads = int(model.config.num_attention_heads)
    originals = []
    for o_proj, rot in zip(o_projs, rotations):
        weight, bias = o_proj.weight, o_proj.bias
        originals.append((weight.detach().clone(), None if bias is None else bias.detach().clone()))
        with torch.no_grad():
            if rot.mu_v is not None:
                new_bias = folded_bias(weight.detach(), None if bias is None else bias.detach(), rot.mu_v, num_heads)
                if bias is None:
                    o_proj.bias = torch.nn.Parameter(new_bias, requires_grad=False)
                else:
                    bias.copy_(new_bias)
            weight.copy_(folded_weight(weight.detach(), rot.r_v, num_heads))
    return FoldHandle(model, originals)


__all__ = ["FoldHandle", "fold_value_rotations", "folded_bias", "folded_weight"]

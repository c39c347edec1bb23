"""Attention over the OSCAR cache's three segments, registered as the transformers attention "oscar".

The model's attention modules call `cache.update(k, v, layer)` and then the registered attention
function. `oscar.cache.torch_cache.OscarLayer.update` only records the new keys and values; the function here
takes that record and lets the layer attend and write (`OscarLayer.attend_and_write`), so the cache
sees the padding mask and the mode (serving or decode-equivalent) before it stores anything.

The math in this module (GQA-grouped segment attention, safe softmax with log-sum-exp, LSE merge,
rotated-frame INT segment with key/value mean terms) is plain float32 torch: the specification the
Triton kernels follow.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

ATTN_IMPLEMENTATION = "oscar"

_PENDING = threading.local()


def set_pending(layer: Any, key: torch.Tensor, value: torch.Tensor) -> None:
    """Record the keys/values a cache layer received, for the attention call that follows."""
    previous = getattr(_PENDING, "record", None)
    if previous is not None:
        _PENDING.record = None
        raise RuntimeError(
            "an OSCAR cache layer was updated twice without an attention call in between: the model's "
            f"attention implementation must be {ATTN_IMPLEMENTATION!r} (oscar.cache.attention.enable(model))"
        )
    _PENDING.record = (layer, key, value)


def take_pending(key: torch.Tensor) -> Optional[Any]:
    """The cache layer whose `update` produced `key`, or None when no OSCAR cache is in use."""
    record = getattr(_PENDING, "record", None)
    if record is None:
        return None
    layer, k, _ = record
    if k is not key:
        return None
    _PENDING.record = None
    return layer


def clear_pending() -> None:
    """Forget any unconsumed record (after an exception inside a forward pass)."""
    _PENDING.record = None


# ----------------------------------------------------------------------------- segment math


def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`[B, H, n, d]` -> `[B, Hkv, H/Hkv, n, d]`: query head `h` reads KV head `h // (H/Hkv)`."""
    b, h, n, d = q.shape
    if h % num_kv_heads != 0:
        raise ValueError(f"{h} query heads do not divide into {num_kv_heads} KV heads")
    return q.reshape(b, num_kv_heads, h // num_kv_heads, n, d)


def ungroup(o: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, G, n, d]` -> `[B, H, n, d]`."""
    b, hkv, g, n, d = o.shape
    return o.reshape(b, hkv * g, n, d)


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: Optional[torch.Tensor],
    scale: float,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one segment, returning `(o, lse)` for a log-sum-exp merge.

    `q` `[B, Hkv, G, n, d]`, `k`/`v` `[B, Hkv, L, d]` (float32), `visible` bool broadcastable to
    `[B, 1, 1, n, L]` (None: all visible), `bias` `[B, Hkv, G, n]` added to every logit of a query
    (the INT segment's `q . mu_K` term, already unscaled). A query that sees no key gets `o = 0`,
    `lse = -inf`, so it contributes nothing to a merge.
    """
    s = torch.einsum("bhgnd,bhld->bhgnl", q, k)
    if bias is not None:
        s = s + bias.unsqueeze(-1)
    s = s * scale
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe.unsqueeze(-1))
    o = torch.einsum("bhgnl,bhld->bhgnd", p, v)
    return o, lse


def merge_segments(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Merge per-segment `(o, lse)` by log-sum-exp: `sum_s o_s exp(lse_s - lse)`; empty -> 0."""
    if not parts:
        raise ValueError("merge_segments needs at least one segment")
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])
    total = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    out = torch.zeros_like(parts[0][0])
    for o, lse in parts:
        w = torch.exp(lse - safe)
        w = torch.where(torch.isfinite(lse), w, torch.zeros_like(w))
        out = out + o * w.unsqueeze(-1)
    return out


def rotate_per_kv_head(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """`x @ R[h]` for `x` `[B, Hkv, ..., d]` and `R` `[Hkv, d, d]` (row-vector convention)."""
    shape = x.shape
    flat = x.reshape(shape[0], shape[1], -1, shape[-1])
    return torch.einsum("bhnd,hde->bhne", flat, r).reshape(shape)


def int_segment(
    qg: torch.Tensor,
    k_rot: torch.Tensor,
    v_rot: torch.Tensor,
    visible: Optional[torch.Tensor],
    scale: float,
    r_k: torch.Tensor,
    mu_k: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of grouped queries `qg` over rotated-frame INT rows; returns `(o_rot, lse, mass)`.

    Logits are `scale * ((q @ R_K) . k_hat_rot + q . mu_K)`; `o_rot = sum p v_hat_rot` stays in the
    value-rotated frame; `mass` `[B, Hkv, G, n]` is `sum p` (1 where any row is visible, else 0), the
    weight with which the value mean returns (`o_rot @ R_V.T + mass * mu_V`).
    """
    q_rot = rotate_per_kv_head(qg, r_k)
    bias = None
    if mu_k is not None:
        bias = torch.einsum("bhgnd,hd->bhgn", qg, mu_k)
    o, lse = segment_attention(q_rot, k_rot, v_rot, visible, scale, bias)
    mass = torch.isfinite(lse).to(o.dtype)
    return o, lse, mass


# ----------------------------------------------------------------------------- transformers hooks


def oscar_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Registered attention function: OSCAR cache segments when an OSCAR cache is active, else causal."""
    window = kwargs.get("sliding_window")
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported by the OSCAR attention (inference only)")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    layer = take_pending(key)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"the OSCAR attention expects a 2D padding mask [B, kv_len] or None, got shape {tuple(attention_mask.shape)}"
        )
    if layer is None:
        return plain_causal_attention(module, query, key, value, attention_mask, scale, window), None
    if (window is not None) != bool(getattr(layer, "is_sliding", False)):
        raise ValueError(
            f"layer {getattr(module, 'layer_idx', '?')}: the model's attention has sliding_window={window} but the cache "
            f"layer is {type(layer).__name__}; build the cache with oscar.models.engine.new_cache(model, spec)"
        )
    n = query.shape[2]
    valid = None
    if attention_mask is not None:
        valid = attention_mask[:, -n:].to(torch.bool)
        if bool(valid.all()):
            valid = None
    out = layer.attend_and_write(module, query, key, value, valid, scale)
    return out.transpose(1, 2).contiguous(), None


def plain_causal_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding: Optional[torch.Tensor],
    scale: float,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention without an OSCAR cache (the last `n` keys are the queries' own tokens); with `window`,
    query `t` sees keys `(t - window, t]` (transformers' sliding-window mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n, kv_len = query.shape[2], key.shape[2]
    mask = None
    if padding is not None or (n > 1 and kv_len > n) or (window is not None and kv_len > window):
        qpos = torch.arange(n, device=query.device) + (kv_len - n)
        kpos = torch.arange(kv_len, device=query.device)
        mask = (kpos[None, :] <= qpos[:, None])[None, None]
        if window is not None:
            mask = mask & (kpos[None, :] > qpos[:, None] - int(window))[None, None]
        if padding is not None:
            mask = mask & padding[:, -kv_len:].to(torch.bool)[:, None, None, :]
        mask = mask | ~mask.any(dim=-1, keepdim=True)  # rows of padding queries: avoid NaN, ignored anyway
    out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scale)
    return out


def oscar_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> Optional[torch.Tensor]:
    """Mask interface entry: pass the 2D padding mask `[B, kv_len]` through (None without padding)."""
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    if mask.shape[-1] < kv_length:
        raise ValueError(
            f"padding mask covers {mask.shape[-1]} tokens but the cache and input hold {kv_length}; "
            "pass the attention_mask of the whole sequence so far"
        )
    mask = mask[:, mask.shape[-1] - kv_length :]
    return None if bool(mask.all()) else mask


def register() -> None:
    """Register the "oscar" attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, oscar_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, oscar_mask)


def enable(model: torch.nn.Module) -> str:
    """Switch `model` to the OSCAR attention; returns the previous implementation name."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return previous


__all__ = [
    "ATTN_IMPLEMENTATION",
    "enable",
    "group_queries",
    "int_segment",
    "merge_segments",
    "oscar_attention_forward",
    "oscar_mask",
    "plain_causal_attention",
    "register",
    "rotate_per_kv_head",
    "segment_attention",
    "ungroup",
]

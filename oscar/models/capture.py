"""Activation capture without forking modeling code: a registered transformers attention function.

`capturing(model, sink)` switches the model to the attention implementation `oscar_capture`
(`oscar_capture_eager` for `base="eager"`), registered through `transformers.AttentionInterface`. It receives exactly what the model's own
attention would: post-RoPE queries `[B, H, T, d]`, keys and values `[B, Hkv, T, d]` (after any
q/k norm and partial rotary), computes the attention with the wrapped implementation (`sdpa` or
the model's `eager`), hands `(layer, q, k, v, s)` to the sink, with `s` the per-head attention
output `S.V` `[B, H, T, d]` (before `o_proj`), and returns the unchanged output. Run it without
padding (calibration windows are full): the sink sees every position as a real token.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol

import torch

from oscar.models.adapters import get_adapter

CAPTURE_IMPL = "oscar_capture"  # wraps sdpa (mask from sdpa_mask, may be None = causal)
CAPTURE_IMPL_EAGER = "oscar_capture_eager"  # wraps the model's eager attention (explicit eager_mask)
_SINK_ATTR = "_oscar_capture_sink"
_BASE_ATTR = "_oscar_capture_base"
BASES = {"sdpa": CAPTURE_IMPL, "eager": CAPTURE_IMPL_EAGER}


class CaptureSink(Protocol):
    """Receives one layer's attention tensors during a captured forward."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
        """`q`, `s`: `[B, H, T, d]`; `k`, `v`: `[B, Hkv, T, d]`, all in the model's dtype."""


def _eager_for(module: torch.nn.Module) -> Callable[..., Any]:
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__module__} has no eager_attention_forward; use base='sdpa'")
    return fn


def _capture_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = getattr(module, _BASE_ATTR, "sdpa")
    fn = _eager_for(module) if base == "eager" else ALL_ATTENTION_FUNCTIONS["sdpa"]
    out, weights = fn(module, query, key, value, attention_mask, **kwargs)
    sink = getattr(module, _SINK_ATTR, None)
    if sink is not None:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise RuntimeError(f"attention module {type(module).__name__} has no layer_idx; cannot attribute captures")
        if key.shape[-2] != query.shape[-2]:
            raise RuntimeError(
                f"capture expects a cache-free forward (use_cache=False): layer {layer} got "
                f"{query.shape[-2]} queries against {key.shape[-2]} keys"
            )
        sink(int(layer), query.detach(), key.detach(), value.detach(), out.detach().transpose(1, 2))
    return out, weights


def register_capture_attention() -> None:
    """Register the capture implementations with transformers' attention and mask interfaces (idempotent).

    Each needs the mask its base expects: `sdpa_mask` may return None for a plain causal
    forward (SDPA then applies causality itself), the eager attention needs the explicit mask.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask, sdpa_mask

    for impl, mask_fn in ((CAPTURE_IMPL, sdpa_mask), (CAPTURE_IMPL_EAGER, eager_mask)):
        if impl not in AttentionInterface._global_mapping:
            AttentionInterface.register(impl, _capture_attention)
        if impl not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(impl, mask_fn)


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    adapter = get_adapter(model)
    return [adapter.attention(model, i) for i in range(len(adapter.layers(model)))]


@contextmanager
def capturing(model: torch.nn.Module, sink: CaptureSink, base: str = "sdpa") -> Iterator[torch.nn.Module]:
    """Within the block, every forward of `model` streams each layer's q/k/v/S.V to `sink`."""
    if base not in BASES:
        raise ValueError(f"unknown capture base {base!r}; valid: {', '.join(BASES)}")
    register_capture_attention()
    modules = _attention_modules(model)
    previous = model.config._attn_implementation
    for m in modules:
        setattr(m, _SINK_ATTR, sink)
        setattr(m, _BASE_ATTR, base)
    model.set_attn_implementation(BASES[base])
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
        for m in modules:
            for attr in (_SINK_ATTR, _BASE_ATTR):
                if hasattr(m, attr):
                    delattr(m, attr)


def group_by_kv_head(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`[B, H, T, d]` -> `[Hkv, B*(H/Hkv)*T, d]`: query-head rows grouped under their KV head (GQA)."""
    b, h, t, d = x.shape
    if h % num_kv_heads:
        raise ValueError(f"{h} query heads are not a multiple of {num_kv_heads} KV heads")
    g = h // num_kv_heads
    return x.reshape(b, num_kv_heads, g, t, d).permute(1, 0, 2, 3, 4).reshape(num_kv_heads, b * g * t, d)


@torch.no_grad()
def run_captured(
    model: torch.nn.Module,
    sequences: list[torch.Tensor],
    sink: CaptureSink,
    *,
    base: str = "sdpa",
    progress: str | None = None,
) -> int:
    """Forward every token window (one at a time, no padding) under capture; returns tokens seen."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    seen = 0
    with capturing(model, sink, base=base):
        for ids in tqdm(sequences, desc=progress, disable=progress is None, leave=False):
            batch = ids.view(1, -1).to(device)
            model(input_ids=batch, use_cache=False, logits_to_keep=1)  # only attention matters here
            seen += int(batch.numel())
    return seen

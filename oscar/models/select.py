"""`auto`'s key format per layer chosen by the model's next-token KL against BF16 (`method.select_by=kl`).

The metric study (reports/accuracy/metric) found that next-token KL(BF16 || cache), teacher-forced through the
decode-equivalent cache, orders the HumanEval rows as pass@1 does, while the held-back rows' attention distortion
that `auto` minimizes does not, and that distortion prefers per-channel keys in every layer (they carry more
metadata bits, so the "choice" is not one). Here each layer's key format, per-token or per-channel blocks of
`method.channel_block` tokens, is chosen by what it does to the model's next-token distribution on the calibration
corpus's held-back windows (`calibration.holdout_tokens`: disjoint from the statistics and the evaluation windows):

1. two distortion selections, every layer per-token and every layer per-channel (each KV head its best candidate of
   that format, `oscar.core.clipfit.select_layer(key_format=...)`), values the same in both;
2. the base is every layer per-token; for each layer, the base with that layer's keys per-channel: the mean
   KL over the positions that read quantized history (`t >= sink + recent`) and the cache's measured bits per element;
3. a layer takes per-channel keys when `KL_base - KL_layer > price * (bits_layer - bits_base)` (`method.select_price`,
   nats per bit per cached element; 0 = any KL gain);
4. a guard: the chosen set, all per-token and all per-channel are scored on the same windows by `KL + price * bits`,
   and the lowest is kept (the per-layer gains are measured one at a time, the set together).

Cost: `num_layers + 3` decode-equivalent passes plus one BF16 pass over the held-back windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from oscar.cache import attention
from oscar.models.engine import cache_spec, layer_rotations, new_cache, next_token_kl
from oscar.models.generate import cache_kwarg

BF16_METHOD = {"name": "bf16", "kind": "bf16", "bits": 16}


@dataclass
class KeyFormatChoice:
    """The layers' key formats chosen by KL (True: per-channel keys) and what was measured to choose them."""

    formats: list[bool]
    price: float
    positions: int  # positions per pass that read quantized history (summed over windows)
    kl: dict[str, float] = field(default_factory=dict)  # all_token / all_channel / chosen / kept
    bits: dict[str, float] = field(default_factory=dict)
    layers: list[dict[str, Any]] = field(default_factory=list)
    kept: str = "chosen"  # which set the guard kept: chosen | all_token | all_channel

    def to_meta(self) -> dict[str, Any]:
        """The `meta["selection"]` record of the artifact."""
        return {"by": "kl", "price": self.price, "positions": self.positions, "kept": self.kept, "kl": self.kl,
                "bits": self.bits, "layers": self.layers}


@torch.no_grad()
def kl_and_bits(model: Any, method: Any, rotations: Optional[list], windows: Sequence[torch.Tensor],
                refs: Sequence[torch.Tensor], start: int) -> tuple[float, float]:
    """Mean next-token KL(ref || cache) over the positions `t >= start` of every window and the cache's bits per
    element (mean over windows), each window one decode-equivalent pass through a fresh cache of `method`."""
    attention.enable(model)
    kl_sum, n, bits = 0.0, 0, 0.0
    for ids, ref in zip(windows, refs):
        cache = new_cache(model, cache_spec(method, model, rotations, mode="decode_equivalent"))
        logits = model(input_ids=ids[None].to(ref.device), use_cache=True, **{cache_kwarg(model): cache}).logits
        kl = next_token_kl(ref[0, start:-1], logits[0, start:-1])
        kl_sum, n = kl_sum + float(kl.sum()), n + int(kl.numel())
        bits += float(cache.bits_per_element()) / len(windows)
    return kl_sum / n, bits


@torch.no_grad()
def bf16_logits(model: Any, windows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The reference: each window's logits through the BF16 cache (decode-equivalent, as the quantized passes)."""
    attention.enable(model)
    device = next(model.parameters()).device
    out = []
    for ids in windows:
        cache = new_cache(model, cache_spec(BF16_METHOD, model, mode="decode_equivalent"))
        out.append(model(input_ids=ids[None].to(device), use_cache=True, **{cache_kwarg(model): cache}).logits)
    return out


def select_key_formats(
    model: Any,
    windows: Sequence[torch.Tensor],
    method: Any,
    build: Callable[[list[bool]], Any],
    *,
    skip: Sequence[int] = (),
    step: Optional[Callable[[], None]] = None,
) -> KeyFormatChoice:
    """Each layer's key format by next-token KL (module docstring). `build(formats)` is the artifact of `method`
    with those key formats imposed (`oscar.models.methods.build_rotations(key_formats=...)`); `skip`: layers the
    cache never quantizes (sliding-window layers: per-token, not measured); `step()` after every pass (progress)."""
    price = float(method.get("select_price", 0.0) if hasattr(method, "get") else getattr(method, "select_price", 0.0))
    start = int(method["sink"]) + int(method["recent"])
    if not windows or all(int(w.numel()) - 1 <= start for w in windows):
        raise ValueError(f"select_by=kl scores the positions after sink + recent = {start} tokens, and the held-back "
                         f"windows have {[int(w.numel()) for w in windows]} tokens: raise calibration.holdout_tokens "
                         f"(and seq_len) above {start + 1}, or lower method.sink / method.recent")
    windows = [w for w in windows if int(w.numel()) - 1 > start]
    attention.enable(model)
    num_layers = int(model.config.num_hidden_layers)
    tok = layer_rotations(build([False] * num_layers))
    ch = layer_rotations(build([True] * num_layers))
    refs = bf16_logits(model, windows)
    tick = step or (lambda: None)

    def score(rotations: list) -> tuple[float, float]:
        out = kl_and_bits(model, method, rotations, windows, refs, start)
        tick()
        return out

    kl_tok, bits_tok = score(tok)
    layers: list[dict[str, Any]] = []
    formats = [False] * num_layers
    for layer in range(num_layers):
        if layer in set(skip) or not ch[layer].k_block:
            layers.append({"layer": layer, "measured": False, "channel": False})
            continue
        kl_l, bits_l = score([ch[i] if i == layer else tok[i] for i in range(num_layers)])
        gain, extra = kl_tok - kl_l, bits_l - bits_tok
        formats[layer] = gain > price * extra
        layers.append({"layer": layer, "measured": True, "kl": kl_l, "bits": bits_l, "kl_gain": gain,
                       "extra_bits": extra, "channel": formats[layer]})
    kl_ch, bits_ch = score(ch)
    if any(formats) and not all(f or not m["measured"] for f, m in zip(formats, layers)):
        kl_chosen, bits_chosen = score([ch[i] if formats[i] else tok[i] for i in range(num_layers)])
    else:  # the chosen set is one of the two already measured
        kl_chosen, bits_chosen = (kl_ch, bits_ch) if any(formats) else (kl_tok, bits_tok)
    candidates = {"chosen": (kl_chosen, bits_chosen, formats),
                  "all_token": (kl_tok, bits_tok, [False] * num_layers),
                  "all_channel": (kl_ch, bits_ch, [bool(ch[i].k_block) for i in range(num_layers)])}
    kept = min(candidates, key=lambda k: candidates[k][0] + price * candidates[k][1])
    kl_kept, bits_kept, formats_kept = candidates[kept]
    return KeyFormatChoice(
        formats=list(formats_kept), price=price, positions=sum(int(w.numel()) - 1 - start for w in windows),
        kl={"all_token": kl_tok, "all_channel": kl_ch, "chosen": kl_chosen, "kept": kl_kept},
        bits={"all_token": bits_tok, "all_channel": bits_ch, "chosen": bits_chosen, "kept": bits_kept},
        layers=layers, kept=kept,
    )


__all__ = ["BF16_METHOD", "KeyFormatChoice", "bf16_logits", "kl_and_bits", "select_key_formats"]

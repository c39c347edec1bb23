"""Batched text generation over any KV cache: greedy and sampling (temperature, top-k, top-p, seed),
stop sequences, a token budget; CPU and CUDA.

Prompts of different lengths are left-padded; the padding mask travels with every forward pass
(the OSCAR cache stores no padding, so a padded row behaves as the prompt alone). Positions are
counted per row from its first real token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch


def cache_kwarg(model: Any) -> str:
    """Name of the forward argument that takes the KV cache (`cache` in transformers >= 5.2x)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class SamplingParams:
    """Decoding settings; `temperature == 0` means greedy."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 means no top-k filter)")


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask logits `[B, V]` outside the top-k and the smallest nucleus of mass >= top_p with -inf."""
    out = logits.clone()
    if top_k and top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Pick one token per row from last-position logits `[B, V]`."""
    if params.temperature == 0:
        return logits.argmax(dim=-1)
    scaled = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `input_ids` and attention mask `[B, T]` for token lists of different lengths."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("every prompt must have at least one token")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
        mask[b, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Per-row positions counted from the first real token (padding gets 0)."""
    return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)


@torch.no_grad()
def generate_tokens(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    make_cache: Callable[[], Any],
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    decode: Optional[Callable[[list[int]], str]] = None,
    stats: Optional[dict] = None,
) -> list[list[int]]:
    """Generate up to `max_new_tokens` per prompt; rows stop at an EOS token or a stop string.

    `make_cache()` returns a fresh KV cache (an `OscarCache` or any transformers Cache). Stop strings
    need `decode` (token ids -> text). Returned lists exclude the prompt and the EOS token. `stats`, when
    given, receives wall times of the prefill and of the decode steps (`prefill_s`, `prefill_tokens`,
    `decode_s`, `decode_steps`, `batch`) and, from a cache that measures it, `kv_bits_per_element` at the end.
    """
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id, device)
    bsz = ids.shape[0]
    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(params.seed))
    if params.stop and decode is None:
        raise ValueError("stop sequences need a decode function (token ids -> text)")
    eos = torch.tensor(sorted(set(int(e) for e in eos_token_ids)), device=device, dtype=torch.long)
    out: list[list[int]] = [[] for _ in range(bsz)]
    done = [False] * bsz
    if params.max_new_tokens == 0:
        return out
    cache = make_cache()
    kw = cache_kwarg(model)
    has_pad = bool((mask == 0).any())
    pos = positions_from_mask(mask)
    t0 = time.perf_counter()
    logits = model(
        input_ids=ids,
        attention_mask=mask if has_pad else None,
        position_ids=pos,
        use_cache=True,
        **{kw: cache},
    ).logits[:, -1, :]
    _sync(device)
    prefill_s, decode_s, steps = time.perf_counter() - t0, 0.0, 0
    next_pos = pos[:, -1:] + 1
    for step in range(params.max_new_tokens):
        tok = next_tokens(logits, params, generator)
        for b in range(bsz):
            if done[b]:
                continue
            t = int(tok[b])
            if eos.numel() and bool((eos == t).any()):
                done[b] = True
                continue
            out[b].append(t)
            if params.stop and any(s in decode(out[b]) for s in params.stop):  # type: ignore[misc]
                done[b] = True
        if all(done) or step == params.max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(bsz, 1, dtype=mask.dtype, device=device)], dim=1)
        t1 = time.perf_counter()
        logits = model(
            input_ids=tok[:, None],
            attention_mask=mask if has_pad else None,
            position_ids=next_pos,
            use_cache=True,
            **{kw: cache},
        ).logits[:, -1, :]
        _sync(device)
        decode_s += time.perf_counter() - t1
        steps += 1
        next_pos = next_pos + 1
    if stats is not None:
        stats.update(prefill_s=prefill_s, prefill_tokens=int(mask[:, : ids.shape[1]].sum()), decode_s=decode_s,
                     decode_steps=steps, batch=bsz)
        measure = getattr(cache, "bits_per_element", None)
        if callable(measure):
            try:
                stats["kv_bits_per_element"] = float(measure())
            except ValueError:  # an empty cache
                pass
    return out


def forced_logprobs(model: Any, prompt: Sequence[int], tokens: Sequence[int], make_cache: Callable[[], Any]) -> torch.Tensor:
    """Teacher-forced next-token log-probabilities, [len(tokens), vocab] float32: row i given `prompt` and
    `tokens[:i]`, computed the way `generate_tokens` decodes one prompt (prefill, then one token per step
    through the cache), so two engines or batch shapes can be compared on the same history."""
    device = next(model.parameters()).device
    kw = cache_kwarg(model)
    cache = make_cache()
    rows = []
    with torch.no_grad():
        ids = torch.tensor([list(prompt)], device=device)
        pos = torch.arange(ids.shape[1], device=device)[None]
        logits = model(input_ids=ids, position_ids=pos, use_cache=True, **{kw: cache}).logits[0, -1]
        for step, tok in enumerate(tokens):
            rows.append(torch.log_softmax(logits.float(), -1))
            if step == len(tokens) - 1:
                break
            pos = torch.tensor([[len(prompt) + step]], device=device)
            logits = model(input_ids=torch.tensor([[int(tok)]], device=device), position_ids=pos, use_cache=True,
                           **{kw: cache}).logits[0, -1]
    return torch.stack(rows) if rows else torch.empty(0)


@torch.no_grad()
def generate_continuous(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    make_cache: Callable[[], Any],
    eos_token_ids: Sequence[int] = (),
    pad_token_id: int = 0,
    decode: Optional[Callable[[list[int]], str]] = None,
    max_batch: int = 8,
    on_done: Optional[Callable[[int, list[int], dict], None]] = None,
    stats: Optional[dict] = None,
    prefill: Optional[Callable[[list[int]], tuple[Any, torch.Tensor]]] = None,
) -> list[list[int]]:
    """`generate_tokens` with continuous batching: up to `max_batch` requests decode together, one forward
    pass per step; a request that ends (EOS, stop string, budget) leaves the batch at once and waiting
    requests join it (prefilled together, left-padded, in a fresh cache that is then merged into the
    running one with `OscarCache.batch_extend`), so the batch stays full while requests are waiting.

    Each request sees only its own tokens (the cache stores no padding and keeps per-row lengths, sink
    and recent windows; positions are per row), so in exact arithmetic its tokens do not depend on its
    batch-mates; float sums over another batch shape may differ in the last bits. Sampling draws from one
    generator per request (seed `params.seed` and the request index), so it does not depend on the schedule
    either. `on_done(i, tokens, info)` is called as request `i` ends (`info`: `kv_bits_per_element` of its
    cache rows at that moment, `steps` it was decoded for). Waiting requests are taken shortest prompt first, so
    that a prefill group wastes little on left padding (its forward pass runs every padded slot).
    """
    from collections import deque

    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be at least 1")
    if params.stop and decode is None:
        raise ValueError("stop sequences need a decode function (token ids -> text)")
    device = next(model.parameters()).device
    out: list[list[int]] = [[] for _ in prompts]
    if not prompts or params.max_new_tokens == 0:
        return out
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt must have at least one token")
    eos = set(int(e) for e in eos_token_ids)
    gens: dict[int, torch.Generator] = {}
    kw = cache_kwarg(model)
    last_only = last_logits_only(model)
    queue = deque(sorted(range(len(prompts)), key=lambda i: len(prompts[i])))  # prefill groups of similar lengths
    active: list[int] = []
    cache: Any = None
    logits = next_pos = None
    perf = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_steps": 0, "row_steps": 0}
    refill_at = max(1, max_batch // 4)  # join in groups: one prefill pass for several waiting requests
    while queue or active:
        free = max_batch - len(active)
        if queue and free and (not active or free >= min(refill_at, len(queue))):
            new = [queue.popleft() for _ in range(min(free, len(queue)))]
            t0 = time.perf_counter()
            if prefill is None:
                ids, mask = left_pad([prompts[i] for i in new], pad_token_id, device)
                fresh = make_cache()
                lg = model(input_ids=ids, attention_mask=mask if bool((mask == 0).any()) else None,
                           position_ids=positions_from_mask(mask), use_cache=True, **{kw: fresh}, **last_only).logits[:, -1, :]
            else:
                fresh, lg = prefill(new)
            _sync(device)
            perf["prefill_s"] += time.perf_counter() - t0
            perf["prefill_tokens"] += sum(len(prompts[i]) for i in new)
            pos_next = torch.tensor([[len(prompts[i])] for i in new], dtype=torch.long, device=device)
            if cache is None:
                cache, logits, next_pos = fresh, lg, pos_next
            else:
                cache.batch_extend(fresh)
                logits, next_pos = torch.cat([logits, lg]), torch.cat([next_pos, pos_next])
            active += new
            if params.temperature > 0:
                for i in new:
                    gens[i] = torch.Generator(device=device)
                    gens[i].manual_seed(int(params.seed) * 1_000_003 + i)
        if params.temperature == 0:
            tok = logits.argmax(dim=-1)
        else:
            tok = torch.stack([next_tokens(logits[r : r + 1], params, gens[i])[0] for r, i in enumerate(active)])
        ended: list[int] = []
        for r, i in enumerate(active):
            t = int(tok[r])
            if t in eos:
                ended.append(r)
                continue
            out[i].append(t)
            if len(out[i]) >= params.max_new_tokens or (params.stop and any(s in decode(out[i]) for s in params.stop)):  # type: ignore[misc]
                ended.append(r)
        if ended:
            for r in ended:
                if on_done is not None:
                    info: dict = {"steps": len(out[active[r]])}
                    measure = getattr(cache, "bits_per_element", None)
                    if callable(measure):
                        try:
                            info["kv_bits_per_element"] = float(measure([r]))
                        except (ValueError, TypeError):
                            pass
                    on_done(active[r], out[active[r]], info)
            keep = [r for r in range(len(active)) if r not in set(ended)]
            active = [active[r] for r in keep]
            if not active:
                cache = logits = next_pos = None
                continue
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            tok, next_pos = tok[index], next_pos[index]
        t1 = time.perf_counter()
        logits = model(input_ids=tok[:, None], attention_mask=None, position_ids=next_pos, use_cache=True,
                       **{kw: cache}).logits[:, -1, :]
        _sync(device)
        perf["decode_s"] += time.perf_counter() - t1
        perf["decode_steps"] += 1
        perf["row_steps"] += len(active)
        next_pos = next_pos + 1
    if stats is not None:
        stats.update(perf, batch=max_batch)
    return out


def last_logits_only(model: Any) -> dict:
    """`{"logits_to_keep": 1}` when the model's forward takes it: the prefill then runs the LM head on the
    last position only (Qwen2.5's 152k-token head is 27% of a 0.5B model's weights), else `{}`."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def _sync(device: torch.device) -> None:
    """Wait for the device (so wall times cover the work, not its launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def truncate_at_stop(text: str, stop: Sequence[str]) -> str:
    """Cut `text` at the earliest occurrence of any stop string."""
    cut = len(text)
    for s in stop:
        i = text.find(s)
        if i >= 0:
            cut = min(cut, i)
    return text[:cut]


__all__ = ["SamplingParams", "filter_logits", "generate_continuous", "generate_tokens", "last_logits_only", "left_pad", "next_tokens", "positions_from_mask", "truncate_at_stop"]

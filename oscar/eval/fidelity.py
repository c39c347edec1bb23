"""Fidelity diagnostics of a KV-cache method against BF16 (cheap and sensitive on small models).

Model level, in two scoring modes (both labeled in the outputs):

* ``serving``: the first `prefill` tokens of each window go through a normal prefill (full
  precision inside the pass, as serving engines do), then the rest is teacher-forced one token at a
  time, each step reading the quantized cache; the BF16 reference follows the same path with a BF16 cache.
* ``decode_equivalent``: one teacher-forced pass in which every position attends to the quantized
  history beyond its sink/recent windows, exactly what it would see while decoding.

For each mode: next-token KL(BF16 || method) per position (mean with a block-bootstrap CI), and the
perplexity of both models on the window text.

Attention level, from the queries/keys/values captured per layer during a BF16 forward
(`oscar.models.capture`) and the method's rotations and quantizer (no cache): raw K and V MSE,
QKᵀ logit MSE, S·V MSE (BF16 attention probabilities times quantized values) — paper Fig. 2 — and the
attention-distribution KL per layer as a function of context length (query position) — Fig. 3.
These quantize every key and value (no sink/recent windows) to expose the quantizer alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from oscar.core import quant
from oscar.models.capture import run_captured
from oscar.models.generate import cache_kwarg

MODES = ("serving", "decode_equivalent")


# ------------------------------------------------------------------------------- attention level

def fake_quantize(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None, rho: torch.Tensor | None,
                  bits: int, group_size: int) -> torch.Tensor:
    """Quantize-dequantize rows `[Hkv, T, d]` through the method's frame and back (float32).

    `x_hat = Q((x - mu) @ R) @ R.T + mu`, one rotation, mean and clip ratio per KV head.
    """
    x = x.float()
    mu = mean.float()[:, None, :] if mean is not None else torch.zeros_like(x[:, :1, :])
    rot = torch.matmul(x - mu, rotation.float())
    clip = rho.float()[:, None] if rho is not None else 1.0
    deq = quant.dequantize(quant.quantize(rot, bits, group_size, clip_ratio=clip))
    return torch.matmul(deq, rotation.float().transpose(-1, -2)) + mu


def position_buckets(seq_len: int, first: int = 64) -> list[tuple[int, int]]:
    """Log-spaced query-position buckets [lo, hi) covering 0..seq_len (context length axis of Fig. 3)."""
    edges = [0]
    edge = first
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    edges.append(seq_len)
    return list(zip(edges[:-1], edges[1:]))


@dataclass
class LayerFidelity:
    """Running sums of the attention-level errors of one layer."""

    k_mse: float = 0.0
    v_mse: float = 0.0
    qk_mse: float = 0.0
    sv_mse: float = 0.0
    attn_kl: float = 0.0
    windows: int = 0
    kl_by_bucket: dict[tuple[int, int], list[float]] = field(default_factory=dict)


class AttentionFidelitySink:
    """Capture sink: computes the per-layer attention-level errors of a method as layers stream by."""

    def __init__(self, rotations: Sequence[Any], bits: int, group_size: int, buckets: list[tuple[int, int]]):
        self.rotations = rotations
        self.bits = bits
        self.group_size = group_size
        self.buckets = buckets
        self.layers: dict[int, LayerFidelity] = {}

    @torch.no_grad()
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:  # noqa: ARG002
        """Accumulate the errors of `layer` for one window (batch 1, no padding)."""
        rot = self.rotations[layer]
        q, k, v = q[0].float(), k[0].float(), v[0].float()  # [H, T, d], [Hkv, T, d]
        h, t, d = q.shape
        hkv = k.shape[0]
        k_hat = fake_quantize(k, rot.r_k, rot.mu_k, rot.rho_k, self.bits, self.group_size)
        v_hat = fake_quantize(v, rot.r_v, rot.mu_v, rot.rho_v, self.bits, self.group_size)
        rep = h // hkv
        kk, kh = k.repeat_interleave(rep, 0), k_hat.repeat_interleave(rep, 0)
        vv, vh = v.repeat_interleave(rep, 0), v_hat.repeat_interleave(rep, 0)
        scale = 1.0 / math.sqrt(d)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        logits = torch.matmul(q, kk.transpose(-1, -2)) * scale
        logits_hat = torch.matmul(q, kh.transpose(-1, -2)) * scale
        qk_mse = float(((logits - logits_hat) ** 2).masked_select(causal).mean())
        neg = torch.finfo(torch.float32).min
        lp = torch.log_softmax(logits.masked_fill(~causal, neg), dim=-1)
        lp_hat = torch.log_softmax(logits_hat.masked_fill(~causal, neg), dim=-1)
        p = lp.exp()
        kl_rows = (p * (lp - lp_hat)).masked_fill(~causal, 0.0).sum(-1).clamp_min(0.0)  # [H, T]
        sv_mse = float(((torch.matmul(p, vv) - torch.matmul(p, vh)) ** 2).mean())
        stats = self.layers.setdefault(layer, LayerFidelity())
        stats.k_mse += float(((k - k_hat) ** 2).mean())
        stats.v_mse += float(((v - v_hat) ** 2).mean())
        stats.qk_mse += qk_mse
        stats.sv_mse += sv_mse
        stats.attn_kl += float(kl_rows.mean())
        stats.windows += 1
        per_pos = kl_rows.mean(0)  # [T]
        for lo, hi in self.buckets:
            if lo < t:
                stats.kl_by_bucket.setdefault((lo, hi), []).append(float(per_pos[lo:min(hi, t)].mean()))

    def rows(self) -> list[dict]:
        """One record per layer: mean errors over windows, and attention KL per position bucket."""
        out = []
        for layer in sorted(self.layers):
            st = self.layers[layer]
            n = max(1, st.windows)
            row = {"layer": layer, "k_mse": st.k_mse / n, "v_mse": st.v_mse / n, "qk_mse": st.qk_mse / n,
                   "sv_mse": st.sv_mse / n, "attn_kl": st.attn_kl / n}
            for (lo, hi), vals in sorted(st.kl_by_bucket.items()):
                row[f"attn_kl@{lo}-{hi}"] = sum(vals) / len(vals)
            out.append(row)
        return out


def attention_fidelity(model: Any, windows: list[torch.Tensor], rotations: Sequence[Any], bits: int,
                       group_size: int, progress: str | None = None) -> list[dict]:
    """Per-layer attention-level errors of a method's quantizer on BF16 activations of `windows`."""
    sink = AttentionFidelitySink(rotations, bits, group_size, position_buckets(max(int(w.numel()) for w in windows)))
    run_captured(model, windows, sink, progress=progress)
    return sink.rows()


# ----------------------------------------------------------------------------------- model level

@torch.no_grad()
def serving_logits(engine: Any, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits `[T, V]` for a window: prefill `prefill` tokens, then decode the rest one token at a time."""
    ids = ids.view(1, -1).to(engine.device)
    t = ids.shape[1]
    if not 0 < prefill < t:
        raise ValueError(f"prefill={prefill} must lie in (0, {t}) for a window of {t} tokens")
    cache = engine.new_cache("serving")
    kw = cache_kwarg(engine.model)
    out = engine.model(input_ids=ids[:, :prefill], use_cache=True, **{kw: cache})
    logits = [out.logits[0].float()]
    for pos in range(prefill, t):
        out = engine.model(input_ids=ids[:, pos:pos + 1], use_cache=True, **{kw: cache})
        logits.append(out.logits[0].float())
    return torch.cat(logits, dim=0)


def mode_logits(engine: Any, ids: torch.Tensor, mode: str, prefill: int) -> torch.Tensor:
    """Logits `[T, V]` of a window in one of the two scoring modes."""
    if mode == "serving":
        return serving_logits(engine, ids, prefill)
    if mode == "decode_equivalent":
        return engine.score(ids.view(1, -1), mode="decode_equivalent")[0].float()
    raise ValueError(f"scoring mode {mode!r} is unknown; valid: {', '.join(MODES)}")


def token_kl(logits_ref: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || method) of next-token distributions per position `[T]` (float64)."""
    lr = torch.log_softmax(logits_ref.double(), dim=-1)
    lm = torch.log_softmax(logits.double(), dim=-1)
    return (lr.exp() * (lr - lm)).sum(-1)


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token negative log-likelihood `[T-1]` of `ids` under `logits` `[T, V]`."""
    lp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -lp.gather(-1, ids.view(-1)[1:, None].to(lp.device)).squeeze(-1)


def block_bootstrap_ci(values: list[torch.Tensor], block: int = 64, n_boot: int = 2000, seed: int = 0,
                       alpha: float = 0.05) -> tuple[float, float]:
    """Percentile CI of a per-token mean, resampling contiguous blocks of `block` tokens (serial correlation).

    Callers shrink `block` for short measurements so that there are at least ~16 blocks to resample.
    """
    blocks = [v[i:i + block] for v in values for i in range(0, int(v.numel()), block) if v[i:i + block].numel()]
    sums = torch.tensor([float(b.sum()) for b in blocks], dtype=torch.float64)
    counts = torch.tensor([float(b.numel()) for b in blocks], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, len(blocks), (n_boot, len(blocks)), generator=gen)
    boot = sums[draws].sum(1) / counts[draws].sum(1)
    lo, hi = torch.quantile(boot, torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64)).tolist()
    return float(lo), float(hi)


def model_fidelity(engine: Any, reference: Any, windows: list[torch.Tensor], modes: Sequence[str], prefill: int,
                   progress: bool = False) -> tuple[dict, dict]:
    """Next-token KL and perplexities per mode: (metrics, per-position KL by mode for CSV/plots)."""
    from tqdm.auto import tqdm

    metrics: dict[str, float] = {}
    curves: dict[str, torch.Tensor] = {}
    for mode in modes:
        kls, nll_m, nll_r = [], [], []
        for ids in tqdm(windows, desc=f"fidelity {mode}", disable=not progress, leave=False):
            ref = mode_logits(reference, ids, mode, prefill)
            got = mode_logits(engine, ids, mode, prefill)
            start = prefill if mode == "serving" else 0  # positions that read the method's cache
            kls.append(token_kl(ref, got)[start:])
            nll_m.append(token_nll(got, ids)[max(0, start - 1):])
            nll_r.append(token_nll(ref, ids)[max(0, start - 1):])
        kl_all = torch.cat(kls)
        lo, hi = block_bootstrap_ci(kls, block=max(1, min(64, int(kl_all.numel()) // 16)))
        metrics[f"kl.next_token.{mode}"] = float(kl_all.mean())
        metrics[f"kl.next_token.{mode}.ci_lo"] = lo
        metrics[f"kl.next_token.{mode}.ci_hi"] = hi
        metrics[f"ppl.{mode}"] = math.exp(float(torch.cat(nll_m).mean()))
        metrics[f"ppl.{mode}.bf16"] = math.exp(float(torch.cat(nll_r).mean()))
        metrics[f"tokens.{mode}"] = int(kl_all.numel())
        width = min(int(k.numel()) for k in kls)
        curves[mode] = torch.stack([k[:width] for k in kls]).mean(0)
    return metrics, curves

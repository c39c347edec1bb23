"""Streaming float64 calibration statistics per (layer, KV head), mergeable by addition.

For every layer `l` and KV head `h` the accumulators hold sums (never averages, so that batches
and processes merge by adding):

- `C_Q[h] = sum q q^T` over the post-RoPE query rows of every query head reading KV head `h`
  (GQA: query head `j` reads KV head `j // (H // Hkv)`), `m_Q[h] = sum q`, `n_Q[h]` rows.
- `C_S[h] = sum o o^T` over the attention outputs `o = softmax(q k^T) v` of those same query
  heads (per head, before `o_proj`), `m_S[h] = sum o`, `n_S[h]` rows.
- `C_K[h] = sum k k^T`, `m_K[h] = sum k`, `n_K[h]` rows; `C_V`, `m_V`, `n_V` likewise for values.
- Optional, where the model's RoPE is known (`oscar.core.rope`): `C_Kpre`, `m_Kpre`, `n_Kpre`, the same sums
  over the pre-RoPE keys (post-RoPE keys turned back to position 0), for rope-centered key candidates.

Normalized views: second moment `C / n`, mean `m / n`, covariance `C / n - (m / n)(m / n)^T`.
Optionally a bounded number of raw key/value rows per (layer, head) is kept (`max_samples`) for
clip fitting and `auto` selection on held-back tokens, with their token positions (`sample_pos`).

Saved as `stats.safetensors` (tensors `layers.{l}.C_Q` ... as in docs/DESIGN.md) plus
`stats.json` (shapes and provenance), written atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from oscar.core.files import atomic_write, atomic_write_text  # noqa: F401 - re-exported (oscar.core.stats.atomic_write_text)

STATS_FORMAT_VERSION = 1
SECOND_MOMENTS = ("C_Q", "C_S", "C_K", "C_V")
FIRST_MOMENTS = ("m_Q", "m_S", "m_K", "m_V")
COUNTS = ("n_Q", "n_S", "n_K", "n_V")
SAMPLES = ("K_samples", "V_samples")
PRE_ROPE = ("C_Kpre", "m_Kpre", "n_Kpre")  # optional: absent in statistics of models without a known RoPE
_COUNT_OF = {"Q": "n_Q", "S": "n_S", "K": "n_K", "V": "n_V", "Kpre": "n_Kpre"}


def _valid_rows(x: torch.Tensor, mask: torch.Tensor | None, name: str) -> torch.Tensor:
    """`x` `[B, heads, T, d]` -> float64 `[heads, rows, d]` keeping the valid tokens of `mask` `[B, T]`."""
    if x.ndim != 4:
        raise ValueError(f"{name} must be [B, heads, T, d], got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains non-finite values; calibration statistics need finite inputs")
    b, n_heads, t, d = x.shape
    x = x.to(torch.float64).permute(1, 0, 2, 3)  # [heads, B, T, d]
    if mask is None:
        return x.reshape(n_heads, b * t, d)
    if tuple(mask.shape) != (b, t):
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not match [B, T] = [{b}, {t}] of {name}")
    keep = mask.to(device=x.device, dtype=torch.bool).reshape(-1)
    return x.reshape(n_heads, b * t, d)[:, keep]


def _group_queries(x: torch.Tensor, num_kv_heads: int, name: str) -> torch.Tensor:
    """`[H, rows, d]` -> `[Hkv, (H/Hkv) * rows, d]`: query head `j` goes to KV head `j // (H/Hkv)`."""
    h, rows, d = x.shape
    if h % num_kv_heads:
        raise ValueError(f"{name} has H={h} heads, not a multiple of num_kv_heads={num_kv_heads}")
    return x.reshape(num_kv_heads, (h // num_kv_heads) * rows, d)


def attention_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-head attention outputs `softmax(q k^T * scale) v` `[B, H, T, d]` with GQA, via SDPA.

    Uses `torch.nn.functional.scaled_dot_product_attention` (fused kernels that do not keep the
    `T x T` matrix when available). `mask` `[B, T]` marks valid key tokens (padding excluded);
    queries at padded positions produce outputs that the statistics then skip.
    """
    b, h, t, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"H={h} query heads is not a multiple of Hkv={hkv} KV heads")
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    attn_mask = None
    if mask is not None:
        valid = mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, T] over keys
        if causal:
            tri = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            valid = valid & tri
            causal = False
        # a query row with no valid key (left padding) would be NaN; let it attend to itself
        valid = valid | torch.eye(t, dtype=torch.bool, device=q.device)
        attn_mask = valid
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale)


@dataclass
class LayerStats:
    """Accumulators of one layer: float64 `C_*` `[Hkv, d, d]`, `m_*` `[Hkv, d]`, int64 `n_*` `[Hkv]`."""

    num_kv_heads: int
    head_dim: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        hkv, d = self.num_kv_heads, self.head_dim
        for name in SECOND_MOMENTS:
            self.tensors.setdefault(name, torch.zeros(hkv, d, d, dtype=torch.float64))
        for name in FIRST_MOMENTS:
            self.tensors.setdefault(name, torch.zeros(hkv, d, dtype=torch.float64))
        for name in COUNTS:
            self.tensors.setdefault(name, torch.zeros(hkv, dtype=torch.int64))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class CalibrationStats:
    """Per-layer, per-KV-head second moments, first moments, counts and optional sample rows."""

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_samples: int = 0,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if min(num_layers, num_heads, num_kv_heads, head_dim) <= 0 or max_samples < 0:
            raise ValueError(
                f"sizes must be positive (num_layers={num_layers}, num_heads={num_heads}, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim}) and max_samples={max_samples} >= 0"
            )
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_samples = max_samples
        self.meta: dict[str, Any] = dict(meta or {})
        self.layers = [LayerStats(num_kv_heads, head_dim) for _ in range(num_layers)]
        self.samples: list[dict[str, torch.Tensor]] = [
            {name: torch.zeros(num_kv_heads, 0, head_dim, dtype=torch.float32) for name in SAMPLES}
            for _ in range(num_layers)
        ]
        self.sample_pos: list[torch.Tensor] = [torch.zeros(0, dtype=torch.int64) for _ in range(num_layers)]

    def _check_layer(self, layer: int) -> LayerStats:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range 0..{self.num_layers - 1}")
        return self.layers[layer]

    def _check_shape(self, x: torch.Tensor, heads: int, name: str) -> None:
        if x.ndim != 4 or x.shape[1] != heads or x.shape[3] != self.head_dim:
            raise ValueError(
                f"{name} of shape {tuple(x.shape)} does not match [B, {heads}, T, {self.head_dim}]"
            )

    def update(
        self,
        layer: int,
        q: torch.Tensor | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        attn_out: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        k_pre: torch.Tensor | None = None,
    ) -> None:
        """Add one batch: `q`, `attn_out` `[B, H, T, d]`, `k`, `v` (and pre-RoPE keys `k_pre`) `[B, Hkv, T, d]`,
        `mask` `[B, T]` valid tokens.

        Inputs may live on any device; products are formed there in float64 and added to the
        CPU accumulators.
        """
        st = self._check_layer(layer)
        t = st.tensors
        hkv = self.num_kv_heads
        if k_pre is not None:
            for name in PRE_ROPE:
                if name not in t:
                    shape = {"C": (hkv, self.head_dim, self.head_dim), "m": (hkv, self.head_dim), "n": (hkv,)}[name[0]]
                    t[name] = torch.zeros(shape, dtype=torch.int64 if name[0] == "n" else torch.float64)
        quads = (("Q", q, self.num_heads), ("S", attn_out, self.num_heads), ("K", k, hkv), ("V", v, hkv), ("Kpre", k_pre, hkv))
        for name, x, heads in quads:
            if x is None:
                continue
            label = {"Q": "q", "S": "attn_out", "K": "k", "V": "v", "Kpre": "k_pre"}[name]
            self._check_shape(x, heads, label)
            rows = _valid_rows(x, mask, label)
            if heads != hkv:
                rows = _group_queries(rows, hkv, label)
            # products on the input's device (e.g. GPU), accumulators stay on the CPU
            t[f"C_{name}"] += (rows.transpose(1, 2) @ rows).cpu()
            t[f"m_{name}"] += rows.sum(1).cpu()
            t[f"n_{name}"] += rows.shape[1]

    def add_samples(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Keep raw key/value rows `[B, Hkv, T, d]` (valid tokens, in order) up to `max_samples` per head,
        with their token positions `[B, T]` (default: `0..T-1` in every row, a window without padding)."""
        self._check_layer(layer)
        self._check_shape(k, self.num_kv_heads, "k")
        self._check_shape(v, self.num_kv_heads, "v")
        store = self.samples[layer]
        room = self.max_samples - store["K_samples"].shape[1]
        if room <= 0:
            return
        for name, x in (("K_samples", k), ("V_samples", v)):
            rows = _valid_rows(x, mask, name)[:, :room].to(torch.float32).cpu()
            store[name] = torch.cat([store[name], rows], dim=1)
        b, _, t, _ = k.shape
        pos = torch.arange(t).expand(b, t) if positions is None else positions.cpu().long()
        pos = pos.reshape(-1) if mask is None else pos[mask.cpu().bool()]
        self.sample_pos[layer] = torch.cat([self.sample_pos[layer], pos[:room]])

    def has_pre_rope(self, layer: int) -> bool:
        """True when the pre-RoPE key sums of `layer` were collected (rope-centered candidates possible)."""
        t = self._check_layer(layer).tensors
        n = t.get("n_Kpre")
        return n is not None and bool((n > 0).all()) and torch.equal(n, t["n_K"])

    def merge(self, other: "CalibrationStats") -> "CalibrationStats":
        """Add `other` into this object (sums add; samples concatenate up to `max_samples`)."""
        shape = (self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim)
        oshape = (other.num_layers, other.num_heads, other.num_kv_heads, other.head_dim)
        if shape != oshape:
            raise ValueError(f"cannot merge statistics of shape (L, H, Hkv, d)={oshape} into {shape}")
        for mine, theirs in zip(self.layers, other.layers):
            for name, value in theirs.tensors.items():
                mine.tensors[name] = mine.tensors[name] + value if name in mine.tensors else value.clone()
        for layer, theirs in enumerate(other.samples):
            room = self.max_samples - self.samples[layer]["K_samples"].shape[1]
            if room > 0:
                for name in SAMPLES:
                    self.samples[layer][name] = torch.cat([self.samples[layer][name], theirs[name][:, :room]], 1)
                self.sample_pos[layer] = torch.cat([self.sample_pos[layer], other.sample_pos[layer][:room]])
        return self

    def __iadd__(self, other: "CalibrationStats") -> "CalibrationStats":
        return self.merge(other)

    def count(self, layer: int, which: str) -> torch.Tensor:
        """Row counts `[Hkv]` behind statistic `which` in {"Q", "S", "K", "V"}."""
        if which not in _COUNT_OF:
            raise ValueError(f"unknown statistic {which!r}; valid are {tuple(_COUNT_OF)}")
        return self._check_layer(layer).tensors[_COUNT_OF[which]]

    def mean(self, layer: int, which: str) -> torch.Tensor:
        """Mean row `m / n` `[Hkv, d]` (float64) of statistic `which`."""
        n = self.count(layer, which)
        self._require_rows(layer, which, n)
        return self.layers[layer].tensors[f"m_{which}"] / n.to(torch.float64)[:, None]

    def second_moment(self, layer: int, which: str, centered: bool = False) -> torch.Tensor:
        """`C / n` `[Hkv, d, d]` (float64), or the covariance `C / n - mean mean^T` when `centered`."""
        n = self.count(layer, which)
        self._require_rows(layer, which, n)
        c = self.layers[layer].tensors[f"C_{which}"] / n.to(torch.float64)[:, None, None]
        if centered:
            mu = self.mean(layer, which)
            c = c - mu[:, :, None] * mu[:, None, :]
        return (c + c.transpose(1, 2)) / 2

    def _require_rows(self, layer: int, which: str, n: torch.Tensor) -> None:
        if bool((n <= 0).any()):
            raise ValueError(f"no rows accumulated for statistic {which} at layer {layer} (counts {n.tolist()})")

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat `layers.{l}.<name>` dictionary (contiguous tensors) for safetensors."""
        out: dict[str, torch.Tensor] = {}
        for layer, st in enumerate(self.layers):
            for name, value in st.tensors.items():
                out[f"layers.{layer}.{name}"] = value.contiguous()
            if self.max_samples:
                for name, value in self.samples[layer].items():
                    out[f"layers.{layer}.{name}"] = value.contiguous()
                out[f"layers.{layer}.sample_pos"] = self.sample_pos[layer].contiguous()
        return out

    def header(self) -> dict[str, Any]:
        """JSON header describing the shapes and provenance."""
        return {
            "format_version": STATS_FORMAT_VERSION,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_samples": self.max_samples,
            "tokens": int(self.layers[0].tensors["n_K"][0]) if self.num_layers else 0,
            "meta": self.meta,
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write `stats.safetensors` + `stats.json` atomically into `directory`."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = self.to_tensors()
        atomic_write(out / "stats.safetensors", lambda p: save_file(tensors, str(p)))
        atomic_write_text(out / "stats.json", json.dumps(self.header(), indent=2, sort_keys=True) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "CalibrationStats":
        """Read statistics written by `save` (no pickle)."""
        from safetensors.torch import load_file

        src = Path(directory)
        header_path, tensor_path = src / "stats.json", src / "stats.safetensors"
        for p in (header_path, tensor_path):
            if not p.is_file():
                raise FileNotFoundError(f"statistics file {p} is missing (written by `python -m oscar dump`)")
        header = json.loads(header_path.read_text())
        if header.get("format_version") != STATS_FORMAT_VERSION:
            raise ValueError(
                f"{header_path}: format_version {header.get('format_version')!r}, expected {STATS_FORMAT_VERSION}"
            )
        stats = cls(
            header["num_layers"], header["num_heads"], header["num_kv_heads"], header["head_dim"],
            header.get("max_samples", 0), header.get("meta", {}),
        )
        tensors = load_file(str(tensor_path))
        for layer in range(stats.num_layers):
            for name in (*SECOND_MOMENTS, *FIRST_MOMENTS, *COUNTS):
                key = f"layers.{layer}.{name}"
                if key not in tensors:
                    raise ValueError(f"{tensor_path} lacks tensor {key}")
                expected = stats.layers[layer].tensors[name]
                if tensors[key].shape != expected.shape or tensors[key].dtype != expected.dtype:
                    raise ValueError(
                        f"{tensor_path}: {key} has shape {tuple(tensors[key].shape)} {tensors[key].dtype}, "
                        f"expected {tuple(expected.shape)} {expected.dtype}"
                    )
                stats.layers[layer].tensors[name] = tensors[key]
            for name in PRE_ROPE:
                key = f"layers.{layer}.{name}"
                if key in tensors:
                    stats.layers[layer].tensors[name] = tensors[key]
            for name in SAMPLES:
                key = f"layers.{layer}.{name}"
                if key in tensors:
                    stats.samples[layer][name] = tensors[key]
            key = f"layers.{layer}.sample_pos"
            if key in tensors:
                stats.sample_pos[layer] = tensors[key]
            elif stats.samples[layer]["K_samples"].shape[1]:  # format 1 files before positions were kept
                stats.sample_pos[layer] = torch.arange(stats.samples[layer]["K_samples"].shape[1])
        return stats


def token_hash(token_ids: torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of a token-id tensor, as int64 little-endian bytes."""
    import hashlib

    data = token_ids.detach().to(torch.int64).contiguous().cpu().numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


__all__ = [
    "CalibrationStats",
    "LayerStats",
    "atomic_write",
    "atomic_write_text",
    "attention_output",
    "token_hash",
]

"""Baseline KV quantizers for the accuracy studies: KIVI-2 style and TurboQuant style (real codes).

KIVI (Liu et al., 2024), as simulated here on a whole `[..., T, d]` key/value tensor:

- Keys are quantized per channel: the quantized prefix is cut into blocks of `G` consecutive
  tokens and every channel of a block gets its own asymmetric min/max scale and zero (the
  same arithmetic as `oscar.core.quant`, applied with tokens as the group axis).
- Values are quantized per token, in groups of `G` consecutive channels.
- A full-precision residual window keeps the most recent tokens: values keep the last
  `residual` tokens; keys keep the last `residual` tokens plus the incomplete block before them,
  so the quantized key prefix is `((T - residual) // G) * G` tokens (whole blocks only).

TurboQuant (Zandieh et al., 2025) style, MSE variant: each row is split into its norm (stored,
bf16) and direction; the direction is rotated by a seeded Haar-random orthogonal matrix, which
makes its coordinates close to `N(0, 1/d)`; each coordinate times `sqrt(d)` is quantized to the
nearest level of the Lloyd-Max quantizer of a standard Gaussian at `b` bits, computed in code by
Lloyd iterations on the exact density (erf-based cell probabilities and centroids).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from oscar.core.quant import (
    SUPPORTED_BITS,
    QuantizedRows,
    dequantize,
    pack_codes,
    quantize,
    unpack_codes,
)
from oscar.core.rotation import random_orthogonal

# ---------------------------------------------------------------------------------------------
# KIVI


@dataclass
class KiviQuantized:
    """KIVI codes: key blocks (rows = channels of a token block), value rows, full-precision tails."""

    keys: QuantizedRows | None  # over [..., n_blocks, d, G] (one group of G tokens per channel)
    keys_full: torch.Tensor  # [..., T - n_k, d]
    values: QuantizedRows | None  # over [..., n_v, d]
    values_full: torch.Tensor  # [..., T - n_v, d]
    n_k: int
    n_v: int
    group_size: int


def kivi_split(num_tokens: int, group_size: int, residual: int) -> tuple[int, int]:
    """Number of quantized key tokens (whole blocks) and value tokens for a sequence length."""
    if group_size <= 0 or residual < 0 or num_tokens < 0:
        raise ValueError(f"group_size={group_size} must be positive, residual={residual} and num_tokens={num_tokens} >= 0")
    n_v = max(num_tokens - residual, 0)
    n_k = (n_v // group_size) * group_size
    return n_k, n_v


def kivi_quantize(k: torch.Tensor, v: torch.Tensor, bits: int = 2, group_size: int = 32, residual: int = 128) -> KiviQuantized:
    """Quantize keys per channel over token blocks and values per token (module docstring)."""
    if k.shape != v.shape or k.ndim < 2:
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} must share a shape [..., T, d]")
    t, d = int(k.shape[-2]), int(k.shape[-1])
    n_k, n_v = kivi_split(t, group_size, residual)
    keys = None
    if n_k:
        blocks = k[..., :n_k, :].to(torch.float32).reshape(*k.shape[:-2], n_k // group_size, group_size, d)
        keys = quantize(blocks.transpose(-1, -2), bits, group_size)
    values = quantize(v[..., :n_v, :], bits, group_size) if n_v else None
    return KiviQuantized(keys, k[..., n_k:, :], values, v[..., n_v:, :], n_k, n_v, group_size)


def kivi_dequantize(q: KiviQuantized, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Reconstruct `(k_hat, v_hat)` `[..., T, d]` from `kivi_quantize` output."""
    parts_k = []
    if q.keys is not None:
        blocks = dequantize(q.keys).transpose(-1, -2)  # [..., n_blocks, G, d]
        parts_k.append(blocks.reshape(*blocks.shape[:-3], q.n_k, blocks.shape[-1]))
    parts_k.append(q.keys_full.to(torch.float32))
    parts_v = [dequantize(q.values)] if q.values is not None else []
    parts_v.append(q.values_full.to(torch.float32))
    return torch.cat(parts_k, dim=-2).to(dtype), torch.cat(parts_v, dim=-2).to(dtype)


def kivi_fake_quantize(
    k: torch.Tensor, v: torch.Tensor, bits: int = 2, group_size: int = 32, residual: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI quantize then dequantize, in the input dtype."""
    k_hat, v_hat = kivi_dequantize(kivi_quantize(k, v, bits, group_size, residual))
    return k_hat.to(k.dtype), v_hat.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# TurboQuant


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) if math.isfinite(x) else 0.0


def _cdf(x: float) -> float:
    if x == math.inf:
        return 1.0
    if x == -math.inf:
        return 0.0
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@lru_cache(maxsize=8)
def _lloyd_max(bits: int, iters: int, tol: float) -> tuple[float, ...]:
    n = 2**bits
    # start from equiprobable cell centroids' rough positions
    levels = [math.sqrt(2.0) * _erfinv(2.0 * (i + 0.5) / n - 1.0) for i in range(n)]
    for _ in range(iters):
        edges = [-math.inf] + [(levels[i] + levels[i + 1]) / 2 for i in range(n - 1)] + [math.inf]
        new = []
        for i in range(n):
            mass = _cdf(edges[i + 1]) - _cdf(edges[i])
            new.append((_phi(edges[i]) - _phi(edges[i + 1])) / mass)
        delta = max(abs(a - b) for a, b in zip(new, levels))
        levels = new
        if delta < tol:
            break
    return tuple(levels)


def _erfinv(y: float) -> float:
    return float(torch.erfinv(torch.tensor(y, dtype=torch.float64)))


def lloyd_max_gaussian(bits: int, iters: int = 10_000, tol: float = 1e-13) -> torch.Tensor:
    """Lloyd-Max levels (ascending, float64) of the standard normal at `bits` bits (1..8)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r} must be an integer in 1..8")
    return torch.tensor(_lloyd_max(bits, iters, tol), dtype=torch.float64)


def gaussian_mse(levels: torch.Tensor) -> float:
    """Mean squared error of nearest-level quantization of N(0, 1) with the given ascending levels."""
    c = [float(x) for x in levels]
    edges = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(len(c) - 1)] + [math.inf]
    total = 0.0
    for i, ci in enumerate(c):
        a, b = edges[i], edges[i + 1]
        mass = _cdf(b) - _cdf(a)
        # E[(X - c)^2; a < X < b] = E[X^2] - 2c E[X] + c^2 P over the cell
        ex = _phi(a) - _phi(b)
        ex2 = mass + (a * _phi(a) if math.isfinite(a) else 0.0) - (b * _phi(b) if math.isfinite(b) else 0.0)
        total += ex2 - 2 * ci * ex + ci * ci * mass
    return total


@dataclass
class TurboQuantized:
    """TurboQuant codes: packed level indices `[..., d*bits//8]`, bf16 row norms `[...]`."""

    codes: torch.Tensor
    norms: torch.Tensor
    bits: int
    d: int
    seed: int


class TurboQuantizer:
    """Seeded random rotation + Gaussian Lloyd-Max levels, per-token norm (accuracy baseline)."""

    def __init__(self, head_dim: int, bits: int = 2, seed: int = 0) -> None:
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={bits!r} is not supported for packed codes; valid values are {SUPPORTED_BITS}")
        if head_dim % (8 // bits):
            raise ValueError(f"head_dim={head_dim} must be a multiple of {8 // bits} to pack INT{bits} codes")
        self.head_dim, self.bits, self.seed = head_dim, bits, seed
        self.rotation = random_orthogonal(head_dim, seed).to(torch.float32)
        levels = lloyd_max_gaussian(bits)
        self.levels = levels.to(torch.float32)
        self.edges = ((levels[1:] + levels[:-1]) / 2).to(torch.float32)

    def quantize(self, x: torch.Tensor) -> TurboQuantized:
        """Codes of the rotated unit rows (scaled by sqrt(d)) and the row norms."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"rows have d={x.shape[-1]}, the quantizer was built for head_dim={self.head_dim}")
        xf = x.to(torch.float32)
        if not torch.isfinite(xf).all():
            raise ValueError("TurboQuant input contains non-finite values (NaN or inf)")
        norms = torch.linalg.vector_norm(xf, dim=-1)
        unit = xf / torch.where(norms > 0, norms, torch.ones_like(norms)).unsqueeze(-1)
        y = (unit @ self.rotation.to(xf.device)) * math.sqrt(self.head_dim)
        codes = torch.bucketize(y, self.edges.to(xf.device)).to(torch.uint8)
        packed = pack_codes(codes, self.bits, self.head_dim)
        return TurboQuantized(packed, norms.to(torch.bfloat16), self.bits, self.head_dim, self.seed)

    def dequantize(self, q: TurboQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`norm * levels[codes] / sqrt(d) @ R^T`."""
        codes = unpack_codes(q.codes, q.bits, q.d).long()
        y = self.levels.to(codes.device)[codes] / math.sqrt(q.d)
        x = (y @ self.rotation.to(codes.device).T) * q.norms.to(torch.float32).unsqueeze(-1)
        return x.to(dtype)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize then dequantize, in the input dtype."""
        return self.dequantize(self.quantize(x)).to(x.dtype)


def turboquant_bits_per_element(head_dim: int, bits: int, norm_bits: int = 16) -> float:
    """Storage bits per element of TurboQuant codes plus one norm per token."""
    return bits + norm_bits / head_dim


__all__ = [
    "KiviQuantized",
    "TurboQuantized",
    "TurboQuantizer",
    "gaussian_mse",
    "kivi_dequantize",
    "kivi_fake_quantize",
    "kivi_quantize",
    "kivi_split",
    "lloyd_max_gaussian",
    "turboquant_bits_per_element",
]

"""Synthetic attention-like queries and keys, and the rotation study run on them (torch only).

`attention_like_sample` draws queries and keys with anisotropic covariances: the keys have a
decaying spectrum in a random basis `A` plus a mean along `A[:, 0]` (the "sink" direction real
caches show); the queries have a faster-decaying spectrum whose top `shared` directions are the
keys' top directions and whose other directions come from an independent random basis.
`rotation_study` calibrates every rotation of the studies on one half of the rows and measures
the INT-b logit distortion of the real quantizer on the other half.
"""

from __future__ import annotations

from typing import Sequence

import torch

from oscar.core.clipfit import fit_clip_ratio, measured_distortion
from oscar.core.rotation import build_rotation, random_orthogonal

#: (label, rotation kind, target) of the key rotations compared in the study
STUDY_ROTATIONS = (
    ("identity", "identity", None),
    ("H", "hadamard", None),
    ("H.P", "hp", None),
    ("U.H", "uh", "query"),
    ("U.P", "up", "query"),
    ("U.H.P (OSCAR)", "uhp", "query"),
    ("raw-PCA U.H.P", "uhp", "raw"),
)


def attention_like_sample(
    d: int,
    n: int,
    *,
    seed: int,
    shared: int = 4,
    key_mean: float = 3.0,
    q_decay: float = 4.0,
    k_decay: float = 16.0,
    outlier_channels: int = 0,
    outlier_scale: float = 6.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(Q, K)` float64 `[n, d]` rows (module docstring); `shared=0` makes the two bases unrelated.

    `outlier_channels > 0` multiplies that many original-frame key channels (seeded random
    positions) by `outlier_scale`
    (the per-channel outliers real key caches show, which Hadamard rotations exist to spread).
    """
    if not 0 <= shared <= d:
        raise ValueError(f"shared={shared} must lie in 0..d={d}")
    gen = torch.Generator().manual_seed(seed)
    a = random_orthogonal(d, seed + 1)
    b = random_orthogonal(d, seed + 2)
    qb, _ = torch.linalg.qr(torch.cat([a[:, :shared], b[:, shared:]], dim=1))
    idx = torch.arange(d, dtype=torch.float64)
    lam_q = torch.exp(-idx / q_decay) * 10 + 0.02
    lam_k = torch.exp(-idx / k_decay) * 2 + 0.05
    k = (torch.randn(n, d, generator=gen, dtype=torch.float64) * lam_k.sqrt()) @ a.T + key_mean * a[:, 0]
    q = (torch.randn(n, d, generator=gen, dtype=torch.float64) * lam_q.sqrt()) @ qb.T
    if outlier_channels:
        # at seeded random positions: channels 0..d/G-1 would be freed by H.P by coincidence
        idx = torch.randperm(d, generator=gen)[:outlier_channels]
        k[:, idx] *= outlier_scale
    return q, k


def rotation_study(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    bits: int = 2,
    group_size: int = 128,
    clip_grid: Sequence[float] = (1.0,),
    rotations: Sequence[tuple[str, str, str | None]] = STUDY_ROTATIONS,
) -> list[dict]:
    """Relative logit distortion `E[(q . (k_hat - k))^2] / E[(q . k)^2]` of each rotation.

    The first half of the rows calibrates (`C_Q`, `C_K`, the clip ratio on the grid), the second
    half is held out for the measurement, with the real quantizer (`oscar.core.clipfit`).
    """
    n = q.shape[0] // 2
    if n < 2:
        raise ValueError(f"need at least 4 rows, got {q.shape[0]}")
    q_cal, k_cal, q_out, k_out = q[:n], k[:n], q[n:], k[n:]
    c_q = q_cal.T @ q_cal / n
    c_k = k_cal.T @ k_cal / n
    metric_out = q_out.T @ q_out / q_out.shape[0]
    reference = float(((k_out @ metric_out) * k_out).sum(1).mean())  # E[(q . k)^2] on held-out rows
    d = q.shape[1]
    rows = []
    for label, kind, target in rotations:
        cov = None if target is None else (c_q if target == "query" else c_k)
        r = build_rotation(kind, d, cov=cov)
        fit = fit_clip_ratio(k_cal.float(), r, c_q, clip_grid, bits=bits, group_size=group_size)
        dist = measured_distortion(k_out.float(), r, metric_out, rho=fit.rho, bits=bits, group_size=group_size)
        rows.append({"rotation": label, "rho": fit.rho, "distortion": dist, "relative": dist / reference})
    return rows


__all__ = ["STUDY_ROTATIONS", "attention_like_sample", "rotation_study"]

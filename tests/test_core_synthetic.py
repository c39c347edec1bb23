"""Tests of the synthetic rotation study: statements the math predicts, on attention-like data."""

from __future__ import annotations

import pytest
import torch

from oscar.core.clipfit import measured_distortion
from oscar.core.rotation import build_rotation, random_orthogonal
from oscar.core.synthetic import STUDY_ROTATIONS, attention_like_sample, rotation_study


pytestmark = pytest.mark.usefixtures("single_thread")


def test_uhp_frees_the_shared_sink_direction_that_hp_pays_for():
    """Keys = a large mean along m + small noise, queries mostly along m. `U.H.P` maps m to a
    vector constant in every group (absorbed by the zero point); `H.P` frees only channel 0."""
    d, n = 128, 2000
    gen = torch.Generator().manual_seed(0)
    m = random_orthogonal(d, 5)[:, 0]
    keys = 4.0 * m + 0.2 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    queries = torch.randn(n, 1, generator=gen, dtype=torch.float64) * 3 * m + 0.3 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    c_q = queries.T @ queries / n
    uhp = measured_distortion(keys.float(), build_rotation("uhp", d, cov=c_q), c_q, bits=2, group_size=128)
    hp = measured_distortion(keys.float(), build_rotation("hp", d), c_q, bits=2, group_size=128)
    ident = measured_distortion(keys.float(), torch.eye(d, dtype=torch.float64), c_q, bits=2, group_size=128)
    # the per-channel spread falls from sqrt(0.2^2 + (4/sqrt(d))^2) to 0.2, the error by about 4x
    assert uhp < 0.4 * hp and uhp < 0.4 * ident


def test_rotation_study_rows_and_reference():
    q, k = attention_like_sample(64, 800, seed=1)
    rows = rotation_study(q, k, bits=2, group_size=32, clip_grid=(0.95, 1.0))
    assert [r["rotation"] for r in rows] == [r[0] for r in STUDY_ROTATIONS]
    q_out, k_out = q[400:], k[400:]
    metric = q_out.T @ q_out / 400
    reference = float((q_out @ k_out.T).pow(2).mean())  # E[(q . k)^2] over all held-out pairs
    ident = rows[0]
    expected = measured_distortion(k_out.float(), torch.eye(64, dtype=torch.float64), metric, rho=ident["rho"], bits=2, group_size=32)
    assert abs(ident["distortion"] - expected) < 1e-9 * expected
    assert abs(ident["relative"] - expected / reference) < 1e-9
    assert all(0 < r["relative"] < 1 and r["rho"] in (0.95, 1.0) for r in rows)


def test_attention_like_sample_shares_the_top_directions():
    q, k = attention_like_sample(64, 4000, seed=2, shared=3, key_mean=0.0)
    uq = torch.linalg.eigh(q.T @ q)[1][:, -3:]
    uk = torch.linalg.eigh(k.T @ k)[1][:, -3:]
    overlap = torch.linalg.svdvals(uq.T @ uk)  # cosines of the principal angles
    assert float(overlap.min()) > 0.9
    q2, k2 = attention_like_sample(64, 4000, seed=2, shared=0, key_mean=0.0)
    uq2 = torch.linalg.eigh(q2.T @ q2)[1][:, -3:]
    uk2 = torch.linalg.eigh(k2.T @ k2)[1][:, -3:]
    assert float(torch.linalg.svdvals(uq2.T @ uk2).max()) < 0.7

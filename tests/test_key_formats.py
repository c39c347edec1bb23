"""The key-format study: per-channel (KIVI) vs per-token key distortion on held-back rows, same metric."""

from __future__ import annotations

import torch

from oscar.core.clipfit import measured_distortion
from oscar.core.stats import CalibrationStats
from oscar.studies.key_formats import key_rows, write_report


def _stats(offset: float) -> CalibrationStats:
    gen = torch.Generator().manual_seed(0)
    st = CalibrationStats(1, 2, 1, 64, max_samples=256)
    bias = offset * torch.randn(64, generator=gen, dtype=torch.float64)  # a different constant per channel
    q = torch.randn(1, 2, 256, 64, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 256, 64, generator=gen, dtype=torch.float64) + bias
    v = torch.randn(1, 1, 256, 64, generator=gen, dtype=torch.float64)
    st.update(0, q=q, k=k, v=v, attn_out=torch.randn(1, 2, 256, 64, generator=gen, dtype=torch.float64))
    st.add_samples(0, k, v)
    return st


def _uncentered_auto_meta(st: CalibrationStats) -> dict:
    rows = st.samples[0]["K_samples"][0]
    d = measured_distortion(rows, torch.eye(64, dtype=torch.float64), st.second_moment(0, "Q")[0], bits=2, group_size=64)
    return {"choices": [{"layer": 0, "head": 0, "key_target": "hadamard", "center_k": False, "key_distortion": d}]}


def test_per_channel_keys_win_when_channels_carry_large_offsets(tmp_path):
    """Offsets 10x the per-token spread that differ by channel: one zero point per token cannot absorb them,
    one per channel does (same metric, same rows); without offsets the per-token groups at 64 channels do as well
    or better than per-channel blocks of 64 tokens (same key bits)."""
    st = _stats(10.0)
    (row,) = key_rows(st, _uncentered_auto_meta(st))
    assert row["kivi32"] < 0.1 * row["auto"] and row["kivi64"] < 0.1 * row["auto"]
    assert row["kivi32_over_auto"] == row["kivi32"] / row["auto"]
    flat = _stats(0.0)
    (row0,) = key_rows(flat, _uncentered_auto_meta(flat))
    assert row0["kivi64"] > 0.8 * row0["auto"]
    write_report([row, row0], tmp_path / "kf", model="m", group_size=64, command="cmd")
    md = (tmp_path / "kf.md").read_text()
    wins = sum(r["kivi32"] < r["auto"] for r in (row, row0))
    assert f"T=32: per-channel keys distort less on {wins} of 2 heads" in md
    assert (tmp_path / "kf.csv").read_text().startswith("layer,head,auto_choice,auto,kivi32")

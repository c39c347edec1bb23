"""The KL study's intervals (paired block bootstrap) and its table rendering."""

from __future__ import annotations

import math

import torch

from oscar.studies.kl_table import mean_ci, write_tables


def test_interval_brackets_the_mean_and_a_method_minus_itself_is_exactly_zero():
    gen = torch.Generator().manual_seed(0)
    windows = [torch.rand(2047, generator=gen), torch.rand(1000, generator=gen)]
    mean, lo, hi = mean_ci(windows)
    assert lo < mean < hi and hi - lo < 0.05
    assert mean_ci([w - w for w in windows]) == (0.0, 0.0, 0.0)
    assert all(math.isnan(x) for x in mean_ci([torch.zeros(0)]))


def test_paired_differences_are_tighter_than_the_unpaired_intervals():
    """Two methods with correlated per-token KL: the interval of their difference is much narrower."""
    gen = torch.Generator().manual_seed(1)
    base = [torch.rand(4096, generator=gen) ** 4]
    other = [b + 0.01 + 0.001 * torch.randn(b.shape, generator=gen) for b in base]
    _, lo_a, hi_a = mean_ci(base)
    d, lo_d, hi_d = mean_ci([o - b for o, b in zip(other, base)])
    assert lo_d < 0.01 < hi_d and abs(d - 0.01) < 1e-3
    assert hi_d - lo_d < 0.1 * (hi_a - lo_a)


def test_tables_show_intervals_and_render_older_rows_without_them(tmp_path):
    rows = [
        {"model": "m", "method": "bf16", "bits": 16, "status": "ok", "kl": 0.0, "kl_past_window": 0.0, "ppl": 20.0},
        {"model": "m", "method": "oscar", "bits": 2, "sink": 64, "recent": 256, "status": "ok", "kl": 0.03,
         "kl_lo": 0.02, "kl_hi": 0.04, "kl_past_window": 0.035, "kl_past_lo": 0.025, "kl_past_hi": 0.045, "ppl": 21.0},
        {"model": "m", "method": "oscar_raw", "bits": 2, "sink": 64, "recent": 256, "status": "ok", "kl": 0.01,
         "kl_lo": 0.005, "kl_hi": 0.015, "kl_past_window": 0.012, "kl_past_lo": 0.006, "kl_past_hi": 0.018,
         "diff_ref": "oscar", "diff_past": -0.023, "diff_past_lo": -0.03, "diff_past_hi": -0.015, "ppl": 20.5},
    ]
    write_tables(rows, tmp_path / "kl", "cmd", "note")
    md = (tmp_path / "kl.md").read_text()
    assert "| oscar_raw | 2 | 64/256 | 0.0100 [0.0050, 0.0150] | 0.0120 [0.0060, 0.0180] | -0.0230 [-0.0300, -0.0150] |" in md
    assert "| bf16 | 16 | - | 0.0000 | 0.0000 | - | 20.000 |" in md
    assert "minus oscar" in md
    assert (tmp_path / "kl.csv").read_text().startswith("model,method")

"""The KL study's intervals: block bootstrap of per-token KL, paired differences, table rendering."""

from __future__ import annotations

import math

import numpy as np
import torch

from oscar.studies.kl_table import block_units, bootstrap_ci, write_tables


def test_block_units_cut_each_window_and_keep_every_token():
    sums, counts = block_units([torch.ones(300), torch.full((100,), 2.0)], block=128)
    assert counts.tolist() == [128, 128, 44, 100]  # blocks never straddle two windows
    assert sums.tolist() == [128.0, 128.0, 44.0, 200.0]


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_data():
    gen = torch.Generator().manual_seed(0)
    short = [torch.rand(512, generator=gen)]
    long = [torch.rand(8192, generator=gen)]
    lo_s, hi_s = bootstrap_ci(*block_units(short))
    lo_l, hi_l = bootstrap_ci(*block_units(long))
    assert lo_s < float(short[0].mean()) < hi_s
    assert lo_l < float(long[0].mean()) < hi_l
    assert (hi_l - lo_l) < 0.6 * (hi_s - lo_s)  # 16x the data: about a quarter of the width


def test_paired_difference_of_a_method_with_itself_is_exactly_zero():
    v = [torch.rand(1000, generator=torch.Generator().manual_seed(1))]
    s, c = block_units(v)
    lo, hi = bootstrap_ci(s - s, c)
    assert lo == 0.0 and hi == 0.0
    assert bootstrap_ci(np.array([]), np.array([])) != bootstrap_ci(s, c)  # empty input: NaNs, not an error
    assert all(math.isnan(x) for x in bootstrap_ci(np.array([]), np.array([])))


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

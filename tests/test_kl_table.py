"""The KL study's intervals (paired block bootstrap) and its table rendering."""

from __future__ import annotations

import math

import pytest
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


def test_tables_lead_with_quantized_history_and_state_the_goal(tmp_path):
    rows = [
        {"model": "m", "method": "bf16", "kind": "bf16", "bits": 16, "clip": "none", "status": "ok", "kl": 0.0,
         "kl_past_window": 0.0, "bits_per_element": 16.0, "ppl": 20.0},
        {"model": "m", "method": "kivi2", "kind": "kivi", "bits": 2, "clip": "none", "sink": 0, "recent": 128,
         "status": "ok", "kl": 0.03, "kl_lo": 0.02, "kl_hi": 0.04, "kl_past_window": 0.035, "kl_past_lo": 0.025,
         "kl_past_hi": 0.045, "bits_per_element": 3.9, "windows": 2, "tokens": 4096, "diff_ref": "auto", "diff_past": 0.02, "diff_past_lo": 0.01,
         "diff_past_hi": 0.03, "ppl": 21.0},
        {"model": "m", "method": "auto", "kind": "rotated", "bits": 2, "clip": "fit", "sink": 64, "recent": 256,
         "status": "ok", "kl": 0.01, "kl_lo": 0.005, "kl_hi": 0.015, "kl_past_window": 0.012, "kl_past_lo": 0.006,
         "kl_past_hi": 0.018, "bits_per_element": 4.6, "ppl": 20.5, "edge_key_low": 3, "edge_key_high": 10,
         "edge_key_heads": 90, "edge_value_low": 0, "edge_value_high": 20, "edge_value_heads": 90,
         "grid_k": "[0.5, 1.0]", "grid_v": "[0.5, 1.0]"},
        {"model": "m", "method": "saw_int4", "kind": "rotated", "bits": 4, "clip": "fit", "sink": 64, "recent": 256,
         "status": "ok", "kl": 0.001, "kl_past_window": 0.0012, "bits_per_element": 6.2, "diff_ref": "auto",
         "diff_past": -0.0108, "diff_past_lo": -0.012, "diff_past_hi": -0.009, "ppl": 20.1},
    ]
    write_tables(rows, tmp_path / "kl", "cmd", "note")
    md = (tmp_path / "kl.md").read_text()
    # headline column: positions that read quantized history; all positions second; then the paired difference
    assert "| kivi2 | none | 0/128 | 2 x 2048 | 3.90 | 0.0350 [0.0250, 0.0450] | 0.0300 [0.0200, 0.0400] | +0.0200 [+0.0100, +0.0300] |" in md
    assert "| bf16 | none | - | - | 16.00 | 0.0000 | 0.0000 | - | 20.000 |" in md
    assert "minus auto" in md
    # kivi2 has the higher KL but holds fewer bits per element, and auto has no row at <= 3.90 bits: missed
    assert "Goal for auto (KL <= every other 2-bit method at no more bits per element): 0 of 1 methods met; missed against kivi2." in md
    assert "| kivi2 | 3.90 | 0.0350 | - | - | missed: no auto row at <= 3.90 bits (lowest: auto at 4.60) |" in md
    assert "| m | auto | [0.5, 1.0] | 3 / 10 / 90 | [0.5, 1.0] | 0 / 20 / 90 |" in md
    # an auto window variant under kivi2's bits with a lower KL meets it; the paired interval belongs to plain auto only
    variant = {**rows[2], "method": "auto@64/128", "recent": 128, "bits_per_element": 3.7, "kl_past_window": 0.03}
    write_tables([*rows, variant], tmp_path / "kl2", "cmd", "note")
    md2 = (tmp_path / "kl2.md").read_text()
    assert "met against all 1 of 1 methods." in md2
    assert "| kivi2 | 3.90 | 0.0350 | auto@64/128 at 3.70 bits: 0.0300 | - | met |" in md2
    variant["kl_past_window"] = 0.05
    write_tables([*rows, variant], tmp_path / "kl3", "cmd", "note")
    assert "| kivi2 | 3.90 | 0.0350 | auto@64/128 at 3.70 bits: 0.0500 | - | missed by 0.0150 nats (1.43x) |" in (tmp_path / "kl3.md").read_text()
    rows[1]["bits_per_element"] = 5.0  # kivi2 now holds more bits than auto: the paired difference is quoted
    write_tables(rows, tmp_path / "kl4", "cmd", "note")
    assert "| kivi2 | 5.00 | 0.0350 | auto at 4.60 bits: 0.0120 | +0.0200 [+0.0100, +0.0300] | met |" in (tmp_path / "kl4.md").read_text()
    assert (tmp_path / "kl.csv").read_text().startswith("model,method")
    # a window variant measured against kivi2 (its row holds variant minus kivi2): the paired difference is
    # read from it, sign turned; a miss on points whose interval includes 0 is a tie, one that excludes it a miss
    rows[1]["bits_per_element"] = 3.9
    tie = {**variant, "kl_past_window": 0.036, "diff_ref": "kivi2", "diff_past": 0.001, "diff_past_lo": -0.003,
           "diff_past_hi": 0.004}
    write_tables([*rows, tie], tmp_path / "kl5", "cmd", "note")
    md5 = (tmp_path / "kl5.md").read_text()
    assert "0 of 1 methods met; tied within the paired interval against kivi2." in md5
    assert ("| kivi2 | 3.90 | 0.0350 | auto@64/128 at 3.70 bits: 0.0360 | -0.0010 [-0.0040, +0.0030] | tie: 0.0010 "
            "nats (1.03x) higher on points, the paired interval includes 0 |") in md5
    write_tables([*rows, {**tie, "diff_past_lo": 0.0005}], tmp_path / "kl6", "cmd", "note")
    assert "| -0.0010 [-0.0040, -0.0005] | missed by 0.0010 nats (1.03x) |" in (tmp_path / "kl6.md").read_text()


def test_method_specs_carry_a_clip_policy():
    import pytest

    from oscar.studies.kl_table import spec_windows, split_spec

    assert split_spec("quarot") == ("quarot", None)
    assert split_spec("quarot:paper") == ("quarot", "paper")
    assert split_spec("auto@0/128") == ("auto", None) and spec_windows("auto@0/128") == (0, 128)
    assert spec_windows("oscar:none") is None
    with pytest.raises(ValueError, match="must read S0/W"):
        split_spec("auto@128")
    with pytest.raises(ValueError, match="clip policy 'sometimes' is not one of fit, fixed, none, paper"):
        split_spec("quarot:sometimes")


def test_paired_differences_fill_in_as_soon_as_the_reference_exists():
    from oscar.studies.kl_table import _paired_to_reference, mean_ci

    gen = torch.Generator().manual_seed(2)
    auto = [torch.rand(700, generator=gen)]
    kivi = [a + 0.05 for a in auto]
    rows = [{"model": "m", "method": "kivi2"}]
    per_method = {"kivi2": (kivi, 128)}
    _paired_to_reference(rows, per_method, "m", "auto")
    assert "diff_past" not in rows[0]  # no reference yet
    rows.append({"model": "m", "method": "auto"})
    per_method["auto"] = (auto, 320)
    _paired_to_reference(rows, per_method, "m", "auto")
    # over the positions where both read quantized history: from the later start (320)
    assert rows[0]["diff_from"] == 320 and abs(rows[0]["diff_past"] - 0.05) < 1e-6  # float32 rounding of a + 0.05
    assert (rows[0]["diff_past"], rows[0]["diff_past_lo"], rows[0]["diff_past_hi"]) == mean_ci([k[320:].double() - a[320:].double() for k, a in zip(kivi, auto)])
    assert "diff_past" not in rows[1]


def test_merged_runs_keep_the_latest_row_and_can_label_an_artifacts_rows(tmp_path):
    import pandas as pd

    from oscar.studies.kl_table import merge_rows

    base = {"model": "m", "kind": "rotated", "bits": 2, "status": "ok", "kl_past_window": 0.05, "bits_per_element": 4.0}
    pd.DataFrame([{**base, "method": "auto"}, {**base, "method": "kivi2", "kind": "kivi", "kl_past_window": 0.04,
                   "diff_ref": "auto"}]).to_csv(tmp_path / "a.csv", index=False)
    pd.DataFrame([{**base, "method": "auto@0/160", "kl_past_window": 0.03, "diff_ref": "kivi2"},
                  {**base, "method": "kivi2", "kind": "kivi", "kl_past_window": 0.041}]).to_csv(tmp_path / "b.csv", index=False)
    rows = merge_rows([str(tmp_path / "a.csv"), f"{tmp_path / 'b.csv'}::auto=auto+ch32"])
    by = {r["method"]: r for r in rows}
    assert sorted(by) == ["auto", "auto+ch32@0/160", "kivi2"]
    assert by["kivi2"]["kl_past_window"] == 0.041  # the later run's row
    assert by["auto+ch32@0/160"]["diff_ref"] == "kivi2"
    assert [r["method"] for r in rows] == ["auto", "kivi2", "auto+ch32@0/160"]  # a replaced row keeps its place
    # two references in one model's rows: each paired cell names its own
    for r in rows:
        r.update(ppl=20.0, clip="fit")
    rows[1].update(diff_ref="auto", diff_past=0.01, diff_past_lo=0.0, diff_past_hi=0.02)
    rows[2].update(diff_past=-0.01, diff_past_lo=-0.02, diff_past_hi=0.001)
    write_tables(rows, tmp_path / "mixed", "cmd", "note")
    md = (tmp_path / "mixed.md").read_text()
    assert "KL minus the named reference, paired" in md and "| -0.0100 [-0.0200, +0.0010] vs kivi2 |" in md
    with pytest.raises(ValueError, match="PATH::OLD=NEW"):
        merge_rows([f"{tmp_path / 'b.csv'}::auto"])

"""`python -m oscar.studies.prefix_reuse`: cells of one method with and without radix reuse, paired to the first."""

from __future__ import annotations

import json

import pytest

from oscar.studies import prefix_reuse


def _cell(tmp_path, name, passes, radix=None, text="x"):
    d = tmp_path / name
    d.mkdir()
    recs = [{"id": f"HumanEval/{i}", "correct": p, "prediction": text if i else "same", **({"radix": radix} if radix is not None else {})}
            for i, p in enumerate(passes)]
    (d / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_paired_to_the_first_cell_with_wins_losses_and_equal_completions(tmp_path):
    ref = _cell(tmp_path, "ref", [True, True, False, True, False, True])
    on = _cell(tmp_path, "on", [True, False, False, False, True, True], radix=True, text="y")
    out = tmp_path / "r" / "humaneval"
    out.parent.mkdir()
    assert prefix_reuse.main(["--out", str(out), "--cell", f"embedded={ref}", "--cell", f"radix on={on}"]) == 0
    rows = prefix_reuse.compare([("embedded", prefix_reuse.read_items(ref)), ("radix on", prefix_reuse.read_items(on))])
    assert rows[0]["pass_at_1"] == pytest.approx(4 / 6) and "diff" not in rows[0]
    r = rows[1]
    assert r["pass_at_1"] == pytest.approx(3 / 6) and r["diff"] == pytest.approx(-1 / 6) and r["diff_lo"] <= r["diff"] <= r["diff_hi"]
    assert (r["wins"], r["losses"], r["completions_equal"]) == (1, 2, 1)  # item 0 predicts "same" in both
    assert r["radix"] == "true" and r["prefix_reuse"] == "quantized (before the setting)"
    bf16 = _cell(tmp_path, "bf16", [True], radix=True)
    (bf16 / "items.jsonl").write_text(json.dumps({"id": "HumanEval/0", "correct": True, "radix": True,
                                                  "kv_bits_per_element": 16.0}) + "\n")
    rows = prefix_reuse.compare([("bf16", prefix_reuse.read_items(bf16)), ("on", prefix_reuse.read_items(on))])
    assert rows[0]["prefix_reuse"] == "-"  # SGLang's own BF16 cache: a hit reads BF16
    md = out.with_suffix(".md").read_text()
    assert "| radix on | 6 | 50.0 [" in md and "| 1 / 2 | 1/6 |" in md and "(reference)" in md
    assert out.with_suffix(".csv").read_text().splitlines()[0].startswith("cell,n,pass_at_1,ci_lo,ci_hi,diff,")


def test_bad_cells_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no items.jsonl"):
        prefix_reuse.read_items(tmp_path)
    a = _cell(tmp_path, "a", [True])
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "items.jsonl").write_text(json.dumps({"id": "other", "correct": True}) + "\n")
    with pytest.raises(ValueError, match="share no items"):
        prefix_reuse.compare([("a", prefix_reuse.read_items(a)), ("b", prefix_reuse.read_items(tmp_path / "b"))])

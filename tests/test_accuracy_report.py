"""`oscar.studies.accuracy`: pass@1 / needle tables with intervals, bits and paired differences from cells."""

from __future__ import annotations

import csv
import json

import pytest

from oscar.studies import accuracy


def _cell(root, method, bench, records, finished=True, hashes=None):
    cell = root / "eval" / "m" / method / bench / "seed0"
    cell.mkdir(parents=True)
    if finished:
        (cell / "result.json").write_text(json.dumps({"wall_s": 12.0, "hardware": {"cpu": "test cpu"}}))
        (cell / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        lines = [dict(r, _config_hash=h) for r, h in zip(records, hashes)]
        (cell / "items.partial.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"cut')


def test_humaneval_and_niah_tables(tmp_path):
    ids = [f"HumanEval/{i}" for i in range(10)]
    _cell(tmp_path, "bf16", "humaneval", [{"id": i, "correct": True, "kv_bits_per_element": 16.0} for i in ids])
    _cell(tmp_path, "int2", "humaneval",
          [{"id": i, "correct": k % 2 == 0, "kv_bits_per_element": 3.0 + k % 2} for k, i in enumerate(ids)])
    # a running cell: the stale record of an earlier configuration and the cut last line are ignored
    _cell(tmp_path, "auto", "humaneval", [{"id": ids[0], "correct": False}, {"id": ids[1], "correct": True,
          "kv_bits_per_element": 4.0}, {"id": ids[2], "correct": True, "kv_bits_per_element": 4.0}],
          finished=False, hashes=["old", "new", "new"])
    for method, scores in (("bf16", [1, 1, 0, 1]), ("int2", [0, 1, 0, 0])):
        _cell(tmp_path, method, "niah", [{"id": f"n{k}", "length": 4096 if k < 2 else 8192, "score": s,
                                          "kv_bits_per_element": 2.5} for k, s in enumerate(scores)])
    rows = accuracy.write_reports(tmp_path, "m", tmp_path / "out")
    he = {r["method"]: r for r in rows["humaneval"]}
    assert [r["method"] for r in rows["humaneval"]] == ["bf16", "int2", "auto"]
    assert he["bf16"]["pass_at_1"] == 1.0 and he["bf16"]["n"] == 10 and "diff_vs_bf16" not in he["bf16"]
    assert he["int2"]["pass_at_1"] == 0.5 and he["int2"]["bits_per_element"] == pytest.approx(3.5)
    assert he["int2"]["diff_vs_bf16"] == pytest.approx(-0.5) and he["int2"]["diff_ci_lo"] < -0.5 < he["int2"]["diff_ci_hi"]
    assert he["auto"]["n"] == 2 and he["auto"]["pass_at_1"] == 1.0 and not he["auto"]["complete"]
    assert he["auto"]["diff_vs_bf16"] == 0.0  # paired on the two problems both have
    with open(tmp_path / "out" / "humaneval.csv") as fh:
        table = list(csv.DictReader(fh))
    assert set(["method", "pass_at_1", "ci_lo", "ci_hi", "bits_per_element", "n"]) <= set(table[0])
    assert [r["served"] for r in table] == ["False"] * 3  # the cells' own rows: the embedded engine
    assert (tmp_path / "out" / "humaneval.png").stat().st_size > 0
    md = (tmp_path / "out" / "humaneval.md").read_text()
    assert "| int2 | no | 50.0 [" in md and "2 (running)" in md and "Served rows" not in md
    niah = {(r["method"], r["length"]): r for r in rows["niah"]}
    assert niah[("bf16", 8192)]["score"] == 0.5 and niah[("int2", 4096)]["diff_vs_bf16"] == pytest.approx(-0.5)
    assert (tmp_path / "out" / "niah.png").stat().st_size > 0
    assert accuracy.main(["--results", str(tmp_path / "none"), "--model", "m", "--out-dir", str(tmp_path / "x")]) == 1


def test_humaneval_versus_another_cell_and_agreement_with_another_run(tmp_path):
    ids = [f"HumanEval/{i}" for i in range(8)]
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    _cell(gpu, "bf16", "humaneval", [{"id": i, "correct": True, "prediction": "a"} for i in ids])
    _cell(gpu, "kivi2", "humaneval", [{"id": i, "correct": k < 6, "prediction": "k"} for k, i in enumerate(ids)])
    _cell(gpu, "auto@16x96", "humaneval", [{"id": i, "correct": k < 4, "prediction": "w"} for k, i in enumerate(ids)])
    # the other run holds bf16 on six problems, one with another verdict and completion, and no window variant
    _cell(cpu, "bf16", "humaneval", [{"id": i, "correct": k != 0, "prediction": "a" if k else "b"}
                                     for k, i in enumerate(ids[:6])])
    rows = accuracy.write_reports(gpu, "m", tmp_path / "out", only="humaneval", versus=["kivi2"], agree_with=cpu)
    he = {r["method"]: r for r in rows["humaneval"]}
    assert he["auto@16x96"]["diff_vs_kivi2"] == pytest.approx(-0.25)  # 4/8 against 6/8 on the same problems
    assert he["auto@16x96"]["diff_vs_kivi2_lo"] <= -0.25 <= he["auto@16x96"]["diff_vs_kivi2_hi"]
    assert "diff_vs_kivi2" not in he["kivi2"] and he["bf16"]["diff_vs_kivi2"] == pytest.approx(0.25)
    assert (he["bf16"]["n_common"], he["bf16"]["agree_pass"], he["bf16"]["agree_prediction"]) == (6, 5, 5)
    assert "n_common" not in he["auto@16x96"]  # no cell of that name in the other run
    md = (tmp_path / "out" / "humaneval.md").read_text()
    assert "paired diff to kivi2" in md and "| 5 / 5 of 6 |" in md and "(reference)" in md
    with open(tmp_path / "out" / "humaneval.csv") as fh:
        assert {"diff_vs_kivi2", "diff_vs_kivi2_lo", "agree_pass"} <= set(next(csv.DictReader(fh)))
    assert accuracy.main(["--results", str(gpu), "--model", "m", "--out-dir", str(tmp_path / "x"),
                          "--only", "humaneval", "--versus", "int4"]) == 2  # names the cells there


def test_served_rows_beside_the_cells_and_kept_rows_of_an_earlier_table(tmp_path):
    ids = [f"HumanEval/{i}" for i in range(8)]
    emb, served, out = tmp_path / "emb", tmp_path / "served", tmp_path / "out"
    _cell(emb, "bf16", "humaneval", [{"id": i, "correct": True, "kv_bits_per_element": 16.0} for i in ids])
    _cell(emb, "auto", "humaneval", [{"id": i, "correct": k < 4, "kv_bits_per_element": 7.0} for k, i in enumerate(ids)])
    _cell(served, "bf16", "humaneval_sglang", [{"id": i, "correct": k < 6, "kv_bits_per_element": 16.0}
                                               for k, i in enumerate(ids)])
    _cell(served, "auto", "humaneval_sglang", [{"id": i, "correct": k < 5, "kv_bits_per_element": 2.25}
                                               for k, i in enumerate(ids)])
    _cell(served, "kivi2", "niah_sglang", [{"id": f"n{k}", "length": 4096, "score": 1.0, "kv_bits_per_element": 2.5}
                                           for k in range(3)])  # served needles beside no embedded ones
    rows = accuracy.write_reports(emb, "m", out, header="Text.", served_results=served)
    he = {r["method"]: r for r in rows["humaneval"]}
    assert list(he) == ["bf16", "auto", "bf16@sglang", "auto@sglang"]
    assert not he["auto"]["served"] and he["auto"]["diff_vs_bf16"] == pytest.approx(-0.5)
    auto = he["auto@sglang"]  # paired with the served bf16 (6/8), not the embedded one (8/8)
    assert auto["served"] and auto["pass_at_1"] == 0.625 and auto["bits_per_element"] == 2.25 and auto["n"] == 8
    assert auto["diff_vs_bf16"] == pytest.approx(-0.125) and auto["diff_ci_lo"] <= -0.125 <= auto["diff_ci_hi"]
    assert "diff_vs_bf16" not in he["bf16@sglang"]
    assert [(r["method"], r["served"]) for r in rows["niah"]] == [("kivi2@sglang", True)]
    table = (out / "humaneval.csv").read_text()
    with open(out / "humaneval.csv") as fh:
        assert [r["served"] for r in csv.DictReader(fh)] == ["False", "False", "True", "True"]
    md = (out / "humaneval.md").read_text()
    assert "| method | served |" in md and "| auto@sglang | yes | 62.5 [" in md and "| bf16@sglang | yes |" in md
    assert "| bf16 | no | 100.0 [" in md and "served `bf16@sglang` cell" in md
    assert "| kivi2@sglang | yes | 4096 | 100.0 [" in (out / "niah.md").read_text()
    # the embedded cells elsewhere: their rows and the Markdown text kept as written, the served rows recomputed
    (out / "humaneval.md").write_text(md.replace("Text.", "Text kept.\n\nSecond paragraph."))
    assert accuracy.main(["--results", str(tmp_path / "none"), "--model", "m", "--out-dir", str(out), "--only",
                          "humaneval", "--served-results", str(served), "--keep-rows", "--keep-header"]) == 0
    assert (out / "humaneval.csv").read_text() == table
    again = (out / "humaneval.md").read_text()
    assert again.startswith("Text kept.\n\nSecond paragraph.\n\n| method | served |") and again.count("Served rows") == 1
    assert again.split("\n\n", 2)[2] == md.split("\n\n", 1)[1]

"""`python -m oscar gpu accuracy engine=sglang`: served HumanEval cells against the embedded engine's records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oscar.bench import gpu_accuracy, tables
from oscar.commands import gpu


def _records(n: int, passed: set[int], tag: str = "") -> str:
    return "".join(json.dumps({"id": f"HumanEval/{i}", "prompt_hash": f"h{i}", "correct": i in passed,
                               "prediction": f"p{i}{tag if i % 2 else ''}", "kv_bits_per_element": 2.5}) + "\n"
                   for i in range(n))


def test_served_cells_are_compared_verdict_by_verdict(tmp_path):
    embedded = tmp_path / "partial"
    embedded.mkdir()
    (embedded / "humaneval_auto.items.jsonl").write_text(_records(10, {0, 1, 2, 3}))
    opts = tables.parse("accuracy", ["table=humaneval", "engine=sglang", f"results={tmp_path / 'r'}",
                                     f"embedded={embedded}", "variants=auto=method=auto method.sink=16 method.recent=64;"
                                     "kivi2=method=kivi2 method.sink=16 method.recent=64"])
    cmds = gpu_accuracy.served_commands(opts, "/x/sglang_python")
    assert len(cmds) == 2 and "engine=sglang" in cmds[0] and "engine.python=/x/sglang_python" in cmds[0]
    assert "model.dtype=bfloat16" in cmds[0] and not any("shared_prefill" in a for a in cmds[0])
    assert f"output={tmp_path / 'r'}/eval/qwen2.5-coder-0.5b/auto/humaneval_sglang/seed0" in cmds[0]
    cell = gpu_accuracy.served_output(opts, "auto")
    cell.mkdir(parents=True)
    (cell / "items.jsonl").write_text(_records(10, {0, 1, 2, 4, 5}, tag="x"))  # 3 lost, 4 and 5 gained
    out = tmp_path / "out"
    out.mkdir()
    assert gpu.main(["accuracy", "table=humaneval", "engine=sglang", "report_only=true", "tracking=false", f"out={out}",
                     f"results={tmp_path / 'r'}", f"embedded={embedded}",
                     "variants=auto=method=auto method.sink=16;kivi2=method=kivi2 method.sink=16"]) == 0
    rows = {r["variant"]: r for r in gpu_accuracy.served_rows(opts)}
    auto = rows["auto"]
    assert (auto["n"], auto["pass_served"], auto["pass_embedded"]) == (10, 0.5, 0.4)
    assert auto["verdict_agreement"] == pytest.approx(0.7) and (auto["served_only_pass"], auto["embedded_only_pass"]) == (2, 1)
    assert auto["predictions_equal"] == 0.5 and auto["verdict_agreement_lo"] < 0.7 < auto["verdict_agreement_hi"]
    assert rows["kivi2"]["n"] == 0
    md = (out / "humaneval_served.md").read_text()
    assert "| auto | 10 | 50.0 | 40.0 | +10.0 [" in md and "| 70.0 [" in md and "| 2 / 1 | 50.0 | 2.50 |" in md
    assert "| kivi2 | 0 | (0 served, 0 embedded records)" in md


def test_engine_key_is_checked():
    with pytest.raises(ValueError, match="engine='vllm'; valid: embedded, sglang"):
        gpu_accuracy.needs(tables.parse("accuracy", ["engine=vllm"]))

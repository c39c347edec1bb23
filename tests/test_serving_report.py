"""benchmarks/serving_report.py turns bench rows into decode.{csv,md,png}: the required columns, OSCAR's speed-up
over the best BF16 backend of the same shape, the token agreement, and the statuses of rows that did not run."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "serving_report.py"


def _module():
    spec = importlib.util.spec_from_file_location("serving_report", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_columns_speedup_and_agreement(tmp_path):
    base = dict(cuda_graph=True, device="H200", output_len=16, page_size=1, max_total_num_tokens=1000)
    rows = [dict(base, cache="bf16", backend="triton", tag="t", batch=1, context=100, status="ok", decode_ms=40.0,
                 prefill_s=1.0, tokens=[1, 2, 3]),
            dict(base, cache="bf16", backend="flashinfer", tag="f", batch=1, context=100, status="ok", decode_ms=10.0,
                 prefill_s=0.5, tokens=[1, 2, 3]),
            dict(base, cache="oscar", backend="oscar", tag="o", batch=1, context=100, status="ok", decode_ms=8.0,
                 prefill_s=0.6, tokens=[1, 2, 4]),
            dict(base, cache="oscar", backend="oscar", tag="o", batch=64, context=100, status="oom")]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _module().main([str(src), "--out", str(tmp_path / "out")]) == 0
    table = list(csv.DictReader((tmp_path / "out" / "decode.csv").open()))
    assert {"cache", "backend", "batch", "context", "decode_ms", "prefill_s", "cuda_graph", "status"} <= set(table[0])
    assert [r["status"] for r in table if r["batch"] == "64"] == ["oom"]
    assert {r["cuda_graph"] for r in table} == {"true"}
    md = (tmp_path / "out" / "decode.md").read_text()
    assert "| 1 | 100 | flashinfer 10.00 | o 8.00 | 1.25x |" in md  # against the best BF16, not triton
    assert "| o | flashinfer | 1 | 100 | 2/3 | 2 |" in md
    assert (tmp_path / "out" / "decode.png").stat().st_size > 1000

"""oscar.bench.serving.report turns bench rows into decode.{csv,md,png}: the required columns, OSCAR's speed-up
over the best BF16 backend of the same shape and mode, the token agreement, the statuses of rows that did not run,
the issue's target ratios from the synthetic-state rows, the real-vs-synthetic cross-check, and profile.{csv,md}."""

from __future__ import annotations

import csv
import json

from oscar.bench.serving import report as serving_report


def _module():
    return serving_report


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
    _module().write_report([src], tmp_path / "out")
    table = list(csv.DictReader((tmp_path / "out" / "decode.csv").open()))
    assert {"cache", "backend", "batch", "context", "decode_ms", "prefill_s", "cuda_graph", "status"} <= set(table[0])
    assert [r["status"] for r in table if r["batch"] == "64"] == ["oom"]
    assert {r["cuda_graph"] for r in table} == {"true"}
    md = (tmp_path / "out" / "decode.md").read_text()
    assert "| real | 1 | 100 | flashinfer 10.00 | o 8.00 | 1.25x |" in md  # against the best BF16, not triton
    assert "| o | flashinfer | 1 | 100 | 2/3 | 2 |" in md
    assert (tmp_path / "out" / "decode.png").stat().st_size > 1000


def test_targets_grid_cross_check_and_profile(tmp_path):
    base = dict(cuda_graph=True, radix=False, device="H200", output_len=16, page_size=1, context=1000)
    bf, osc = dict(base, cache="bf16", backend="flashinfer", tag="f", max_total_num_tokens=7 * 1016 + 5), \
        dict(base, cache="oscar", backend="oscar", tag="o", max_total_num_tokens=51 * 1016)
    rows = [dict(bf, batch=1, mode="real", status="ok", decode_ms=9.0, prefill_s=1.0),
            dict(bf, batch=1, mode="synthetic", status="ok", decode_ms=9.9),
            dict(bf, batch=7, mode="synthetic", status="ok", decode_ms=28.0),
            dict(bf, batch=32, mode="synthetic", status="capacity"),
            dict(osc, batch=1, mode="synthetic", status="ok", decode_ms=6.0),
            dict(osc, batch=32, mode="synthetic", status="ok", decode_ms=40.0)]
    mod = _module()
    tg = mod.targets(rows, context=1000)
    assert tg[0] == "| o: batch 1 decode at 1000 vs BF16 | >= 1.5x | flashinfer 9.90 ms / OSCAR 6.00 ms | 1.65x | holds |"
    assert tg[1] == "| o: largest batch at 1000 (token capacity) vs BF16 | >= 6x | OSCAR 51 / BF16 7 | 7.29x | holds |"
    assert tg[2].endswith("| OSCAR 800 / flashinfer BF16 250 tok/s | 3.20x | missed |")  # BF16 at its largest batch, 7
    assert len(tg) == 3  # no FP8 rows: no FP8 lines
    # SGLang's FP8 cache as a second reference: its own batch-1 and capacity goals (1.2x, 3x), no job-tokens goal
    fp8 = dict(bf, cache="fp8", tag="f8", max_total_num_tokens=14 * 1016 + 5)
    tg8 = mod.targets(rows + [dict(fp8, batch=1, mode="synthetic", status="ok", decode_ms=8.0),
                              dict(fp8, batch=14, mode="synthetic", status="ok", decode_ms=35.0)], context=1000)
    assert tg8[:3] == tg
    assert tg8[3] == "| o: batch 1 decode at 1000 vs FP8 | >= 1.2x | flashinfer 8.00 ms / OSCAR 6.00 ms | 1.33x | holds |"
    assert tg8[4] == "| o: largest batch at 1000 (token capacity) vs FP8 | >= 3x | OSCAR 51 / FP8 14 | 3.64x | holds |"
    assert tg8[5].endswith("| - | OSCAR 800 / flashinfer FP8 400 tok/s | 2.00x |  |")
    grid = mod.grid(rows)
    assert "| 32 | 1000 | capacity | 40.00 |  |" in grid and "| 1 | 1000 | 9.90 | 6.00 | 1.65x |" in grid
    assert mod.cross_check(rows) == ["| bf16/flashinfer | 1 | 1000 | 1.00 | 9.00 | 9.90 | +10.0% |"]
    # formats side by side: each against the per-token format and against BF16 of the same CUDA-graph setting
    fmt_rows = [dict(r, format="rotated") if r["cache"] == "oscar" else dict(r, format="bf16") for r in rows] + [
        dict(osc, tag="c", format="rotated_channel", batch=1, mode="synthetic", status="ok", decode_ms=6.6),
        dict(osc, tag="c_nograph", format="rotated_channel", cuda_graph=False, batch=1, mode="synthetic", status="ok",
             decode_ms=30.0),
        dict(bf, tag="f_nograph", cuda_graph=False, batch=1, mode="synthetic", status="ok", decode_ms=15.0)]
    assert mod.format_ratios(fmt_rows) == ["| synthetic | 1 | 1000 | true | rotated_channel 6.60 | rotated 6.00 | 1.10x |"]
    assert "| synthetic | 1 | 1000 | flashinfer 15.00 | c_nograph 30.00 | 0.50x |" in mod.speedups(fmt_rows)
    assert "| synthetic | 1 | 1000 | flashinfer 9.90 | c 6.60 | 1.50x |" in mod.speedups(fmt_rows)
    assert [t.split(":")[0] for t in mod.targets(fmt_rows, context=1000)][:2] == ["| c", "| c"]
    prof = dict(cache="oscar", backend="oscar", tag="o", batch=1, context=1000, status="ok", steps=5,
                graph_wall_ms=8.0, graph_gpu_ms=7.0, eager_wall_ms=40.0, eager_gpu_ms=7.0,
                top_graph=[dict(name="nvjet_x", part="gemm", ms=4.0, calls=217),
                           dict(name="flashinfer::norm::FusedAddRMSNormKernel", part="attention", ms=1.0, calls=72)],
                top_eager=[dict(name="oscar_decode_mma<>", part="oscar.attention", ms=2.0, calls=36),
                           dict(name="nvjet_x", part="gemm", ms=4.0, calls=217)],
                host_eager=[dict(function="oscar/serve/pool.py:445:write_decode", calls_per_step=36.0,
                                 own_us_per_step=900.0, cum_us_per_step=5200.0)])
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "profile_rows.jsonl").write_text(json.dumps(prof) + "\n")
    mod.write_report([src], tmp_path / "out")
    parts = {(r["step"], r["part"]): float(r["ms"]) for r in csv.DictReader((tmp_path / "out" / "profile.csv").open())}
    # the norm kernel re-classified by name; what the list does not cover is reported, not dropped
    assert parts == {("graph", "gemm"): 4.0, ("graph", "norm"): 1.0, ("graph", "unlisted"): 2.0,
                     ("eager", "gemm"): 4.0, ("eager", "oscar.attention"): 2.0, ("eager", "unlisted"): 1.0}
    assert "wall 8.00 ms per step, GPU 7.00 ms, wall - gpu 1.00 ms" in (tmp_path / "out" / "profile.md").read_text()
    assert "| 900 | 5200 | 36 | `oscar/serve/pool.py:445:write_decode` |" in (tmp_path / "out" / "profile.md").read_text()

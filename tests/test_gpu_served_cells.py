"""`python -m oscar gpu accuracy engine=sglang`: served HumanEval cells against the embedded engine's records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oscar.bench import tables
from oscar.bench.accuracy import cells
from oscar.bench.accuracy import report as accuracy_report
from oscar.bench.accuracy import spec as gpu_accuracy
from oscar.commands import gpu


def _records(n: int, passed: set[int], tag: str = "") -> str:
    return "".join(json.dumps({"id": f"HumanEval/{i}", "prompt_hash": f"h{i}", "correct": i in passed,
                               "prediction": f"p{i}{tag if i % 2 else ''}", "kv_bits_per_element": 2.5}) + "\n"
                   for i in range(n))


def _served_cell(opts, name: str, text: str) -> None:
    cell = cells.served_output(opts, name)
    cell.mkdir(parents=True)
    (cell / "items.jsonl").write_text(text)
    (cell / "result.json").write_text(json.dumps({"wall_s": 30.0, "hardware": {"cpu": "host", "gpu": "NVIDIA H200"}}))


def test_served_cells_on_their_own_against_served_bf16_and_kivi2_and_embedded(tmp_path):
    embedded = tmp_path / "partial"
    embedded.mkdir()
    (embedded / "humaneval_auto.items.jsonl").write_text(_records(10, {0, 1, 2, 3}))
    spec = ("variants=bf16=method=bf16;kivi2=method=kivi2 method.sink=0 method.recent=64;auto=method=auto method.channel_block=0 method.sink=16 "
            "method.recent=64;auto+cb32=method=auto method.channel_block=32")
    opts = tables.parse("accuracy", ["table=humaneval", "engine=sglang", f"results={tmp_path / 'r'}",
                                     f"embedded={embedded}", spec])
    cmds = cells.served_commands(opts, "/x/sglang_python")
    assert len(cmds) == 4 and "engine=sglang" in cmds[0] and "engine.python=/x/sglang_python" in cmds[0]
    assert "model.dtype=bfloat16" in cmds[2] and not any("shared_prefill" in a for a in cmds[2])
    assert f"output={tmp_path / 'r'}/eval/qwen2.5-coder-0.5b/auto/humaneval_sglang/seed0" in cmds[2]
    _served_cell(opts, "bf16", _records(10, {0, 1, 2, 3, 4, 5}))
    _served_cell(opts, "kivi2", _records(10, {0, 1, 2, 3, 4}))
    _served_cell(opts, "auto", _records(10, {0, 1, 2, 4, 5}, tag="x"))  # vs embedded: 3 lost, 4 and 5 gained
    _served_cell(opts, "int2", _records(4, {0}))
    out = tmp_path / "out"
    out.mkdir()
    # the committed table (embedded rows of another machine's cells, written before the served column) is kept
    (out / "humaneval.csv").write_text("method,pass_at_1,ci_lo,ci_hi,bits_per_element,n,diff_vs_bf16,diff_ci_lo,"
                                       "diff_ci_hi,complete,wall_s,hardware\n"
                                       "bf16,0.445122,0.365854,0.518293,16,164,,,,True,207.731,AMD EPYC\n"
                                       "auto,0.371951,0.29878,0.445122,7.09604,164,-0.0731707,-0.140244,-0.00609756,"
                                       "True,964.282,AMD EPYC\n")
    (out / "humaneval.md").write_text("Hand-written text.\n\n| method | pass@1 |\n|---|---|\n| bf16 | 44.5 |\n")
    assert gpu.main(["accuracy", "table=humaneval", "engine=sglang", "report_only=true", "tracking=false", f"out={out}",
                     f"results={tmp_path / 'r'}", f"embedded={embedded}", spec]) == 0
    rows = {r["variant"]: r for r in accuracy_report.served_rows(opts)}
    auto = rows["auto"]
    assert (auto["method"], auto["n"], auto["pass_at_1"], auto["bits_per_element"]) == ("auto@sglang", 10, 0.5, 2.5)
    assert auto["ci_lo"] < 0.5 < auto["ci_hi"] and auto["served"] and auto["hardware"] == "NVIDIA H200"
    assert auto["diff_vs_bf16"] == pytest.approx(-0.1) and auto["diff_ci_lo"] < -0.1 < auto["diff_ci_hi"]
    assert auto["diff_vs_kivi2"] == 0.0 and auto["diff_vs_kivi2_lo"] < 0.0 < auto["diff_vs_kivi2_hi"]
    assert "diff_vs_bf16" not in rows["bf16"] and "diff_vs_kivi2" not in rows["kivi2"]
    assert rows["kivi2"]["diff_vs_bf16"] == pytest.approx(-0.1) and rows["kivi2"].get("n_common") is None
    assert (auto["n_common"], auto["pass_served"], auto["pass_embedded"]) == (10, 0.5, 0.4)
    assert auto["diff_vs_embedded"] == pytest.approx(0.1)
    assert auto["verdict_agreement"] == pytest.approx(0.7) and (auto["served_only_pass"], auto["embedded_only_pass"]) == (2, 1)
    assert auto["predictions_equal"] == 0.5 and auto["verdict_agreement_lo"] < 0.7 < auto["verdict_agreement_hi"]
    assert rows["auto+cb32"]["n"] == 0 and rows["int2"]["n"] == 4  # a served cell beside the variants: listed too
    md = (out / "humaneval_served.md").read_text()
    assert (rows["auto"]["windows"], rows["auto"]["calibration"], rows["kivi2"]["windows"], rows["kivi2"]["calibration"],
            rows["bf16"]["windows"], rows["auto+cb32"]["windows"], rows["int2"]["windows"]) == (
        "16/64", "default", "0/64", "-", "-", "64/256", "?")  # the method's file or MethodConfig where unset
    assert "| auto | 16/64 | default | 10 | 50.0 [" in md and "| 2.50 | not recorded / not recorded / not recorded / not recorded | -10.0 [" in md and "| +0.0 [" in md
    assert "| 10 | 50.0 / 40.0 | +10.0 [" in md and "| 70.0 [" in md and "| 2 / 1 | 50.0 |" in md
    assert "| kivi2 | 0/64 | - | 10 | 50.0 [" in md and "(reference)" in md and "| 0 (0 embedded records) |" in md
    assert "| auto+cb32 | 64/256 | default | 0 | (no served cell) |" in md and md.index("| int2 | ? | ? | 4 |") > md.index("| auto+cb32 |")
    served_csv = (out / "humaneval_served.csv").read_text().splitlines()
    assert served_csv[0].startswith("model,variant,method,windows,calibration,n,pass_at_1,ci_lo,ci_hi,bits_per_element,cuda_graph,radix,"
                                    "prefix_reuse,prefill_stage_mib,complete,diff_vs_bf16,")
    table = (out / "humaneval.csv").read_text().splitlines()
    assert table[0].endswith(",complete,wall_s,hardware,served")
    assert table[1] == "bf16,0.445122,0.365854,0.518293,16,164,,,,True,207.731,AMD EPYC,False"
    assert table[2].startswith("auto,0.371951,") and table[2].endswith(",True,964.282,AMD EPYC,False")
    assert [line.split(",")[0] for line in table[3:]] == ["bf16@sglang", "int2@sglang", "auto@sglang", "kivi2@sglang"]
    assert table[5].startswith("auto@sglang,0.5,") and table[5].endswith(",True,30,NVIDIA H200,True")
    he_md = (out / "humaneval.md").read_text()
    assert he_md.startswith("Hand-written text.\n\n| method | served | pass@1")
    assert "| auto@sglang | yes | 50.0 [" in he_md and "| auto | no | 37.2 [29.9, 44.5] | 7.10 | 164 | -7.3 [" in he_md


def test_served_needles_per_length_without_embedded_records(tmp_path):
    opts = tables.parse("accuracy", ["table=niah", "engine=sglang", f"results={tmp_path / 'r'}",
                                     f"embedded={tmp_path / 'none'}"])
    retrieved = {"bf16": (4, 4), "kivi2": (3, 4), "auto": (4, 2)}  # of 4 needles at 4096 and at 8192
    for name, (at4k, at8k) in retrieved.items():
        _served_cell(opts, name, "".join(
            json.dumps({"id": f"n{length}-{k}", "length": length, "score": float(k < hits), "correct": k < hits,
                        "kv_bits_per_element": 16.0 if name == "bf16" else 3.0}) + "\n"
            for length, hits in ((4096, at4k), (8192, at8k)) for k in range(4)))
    rows = accuracy_report.served_rows(opts)
    by = {(r["variant"], r.get("length")): r for r in rows}
    assert by[("int2", None)]["n"] == 0  # a variant of the table without a served cell
    assert by[("auto", 8192)]["score"] == 0.5 and by[("auto", 8192)]["n"] == 4
    assert by[("auto", 8192)]["diff_vs_bf16"] == pytest.approx(-0.5) and by[("auto", 4096)]["diff_vs_bf16"] == 0.0
    assert by[("auto", 8192)]["diff_vs_kivi2"] == pytest.approx(-0.5) and by[("kivi2", 4096)]["diff_vs_bf16"] == -0.25
    assert "n_common" not in by[("auto", 4096)] and by[("auto", 4096)]["embedded_items"] == 0
    out = tmp_path / "out"
    out.mkdir()
    files = accuracy_report.served_report(out, opts)
    md = files[0].read_text()
    assert "| auto | 64/256 | default | 8192 | 4 | 50.0 [" in md
    assert "| int2 | 64/256 | - | - | 0 | (no served cell) |" in md
    assert "| 0 (0 embedded records) |" in md
    assert md.index("| bf16 | - | - | 8192 |") > md.index("| auto | 64/256 | default | 4096 |")  # by context length, variants in table order
    assert files[1].read_text().splitlines()[0].startswith("model,variant,method,windows,calibration,length,n,score,")
    assert files[1].read_text().splitlines()[1].startswith("qwen2.5-coder-0.5b,")
    with pytest.raises(FileNotFoundError, match="no served niah cells"):
        accuracy_report.served_report(out, {**opts, "results": str(tmp_path / "empty")})


def test_multikey_needles_at_chosen_lengths(tmp_path):
    """`table=niah_multikey` (RULER's niah_multikey_1 on the essays) serves at the lengths asked for and reports per
    length like the single needles, in its own cells and files (no embedded table to merge into)."""
    opts = tables.parse("accuracy", ["table=niah_multikey", "engine=sglang", f"results={tmp_path / 'r'}",
                                     "model=qwen2.5-coder-1.5b", "lengths=16384,32768", "samples=4",
                                     f"embedded={tmp_path / 'none'}"])
    cmds = cells.served_commands(opts, "py")
    assert [c for c in cmds[0] if c.startswith("benchmark")] == [
        "benchmark=ruler_niah_multikey", "benchmark.context_lengths=[16384,32768]",
        "benchmark.extra.samples_per_length=4", "benchmark.max_new_tokens=12"]
    assert str(cells.served_output(opts, "auto")).endswith("qwen2.5-coder-1.5b/auto/niah_multikey_sglang/seed0")
    for name, hits in {"bf16": 4, "kivi2": 1, "auto": 3}.items():
        _served_cell(opts, name, "".join(
            json.dumps({"id": f"m{length}-{k}", "length": length, "score": float(k < hits), "correct": k < hits,
                        "kv_bits_per_element": 16.0 if name == "bf16" else 2.6}) + "\n"
            for length in (16384, 32768) for k in range(4)))
    out = tmp_path / "out"
    out.mkdir()
    files = accuracy_report.write_report(out, opts)
    assert [f.name for f in files] == ["niah_multikey_served.md", "niah_multikey_served.csv"]
    md = files[0].read_text()
    assert md.startswith("# niah_multikey: qwen2.5-coder-1.5b served through SGLang")
    assert "| auto | 64/256 | default | 32768 | 4 | 75.0 [" in md and not (out / "niah.csv").exists()
    rows = {(r["variant"], r["length"]): r for r in accuracy_report.served_rows(opts)}
    assert rows[("kivi2", 16384)]["diff_vs_bf16"] == pytest.approx(-0.75) and rows[("auto", 16384)]["model"] == opts["model"]


@pytest.mark.parametrize("args, match", [(["table=humaneval", "lengths=4096"], "only the needle tables"),
                                         (["table=niah", "lengths=4k"], "comma-separated context lengths"),
                                         (["table=niah", "lengths=512"], "at least 1024"),
                                         (["table=niah", "samples=0"], "positive number of needles")])
def test_needle_lengths_and_samples_are_checked(args, match):
    with pytest.raises(ValueError, match=match):
        cells.served_commands(tables.parse("accuracy", [*args, "engine=sglang"]), "py")


def test_engine_key_is_checked():
    with pytest.raises(ValueError, match="engine='vllm'; valid: embedded, sglang"):
        gpu_accuracy.needs(tables.parse("accuracy", ["engine=vllm"]))


def test_a_variant_sets_its_page_size():
    """`page=N` in a served variant is SGLang's --page-size of that cell (per-channel blocks of 32 need pages of 32,
    sink 16 pages of 16); it is not a configuration override."""
    opts = {**gpu_accuracy.DEFAULTS, "table": "humaneval", "engine": "sglang",
            "variants": "a=method=auto method.channel_block=0 method.sink=16;b=method=auto method.channel_block=32 method.sink=0 page=32"}
    a, b = cells.served_commands(opts, "py")
    pages = [[x for x in cmd if x.startswith("engine.extra_args=")][0] for cmd in (a, b)]
    assert pages[0].startswith("engine.extra_args=[--page-size,16,") and pages[1].startswith("engine.extra_args=[--page-size,32,")
    assert not any(x.startswith("page=") for x in a + b) and "method.channel_block=32" in b


def test_the_page_size_follows_the_key_block():
    """Without `page=N` a variant serves in the smallest pages of 16, 32, ... that hold its per-channel key block
    (KIVI-2: its group of 32; `method.channel_block`); a sink that is not whole pages is refused by name (the
    session-11 KIVI-2 needle cell failed in the server on pages of 16)."""
    page = cells.served_page
    assert page(["method=kivi2", "method.sink=0", "method.recent=64"]) == 32
    assert page(["method=kivi2", "method.group_size=64"]) == 64
    assert page(["method=auto", "method.channel_block=0", "method.sink=16"]) == 16
    assert page(["method=auto"]) == 32  # auto's per-channel default (conf/method/auto.yaml), sink 64
    assert page(["method=auto", "method.channel_block=32", "method.sink=0"]) == 32
    assert page(["method=bf16", "page=64"]) == 64
    with pytest.raises(ValueError, match=r"method.sink=16; valid sinks: 0, 32, 64"):
        page(["method=auto", "method.channel_block=32", "method.sink=16"])


def test_a_failed_server_leaves_no_cell(tmp_path):
    """A variant whose server failed (its cell directory holds a log only) is not a served cell: the report is built
    from the others and pairs nothing with it."""
    from oscar.studies import accuracy

    cell = tmp_path / "eval" / "m" / "kivi2" / accuracy.cell_benchmark("niah", accuracy.SERVED_ENGINE) / "seed0"
    cell.mkdir(parents=True)
    (cell / "server.log").write_text("OscarServeError: the served format does not fit --page-size 16\n")
    assert accuracy.served_cells(tmp_path, "m", "niah") == []


def test_a_cell_cut_by_limit_s_gets_sigterm_to_stop_its_server(tmp_path):
    """At `limit_s` the cell's process gets SIGTERM and time to clean up (`oscar eval` stops its SGLang server
    then), not an immediate SIGKILL that would leave the server holding the GPU's memory for the next cell."""
    import sys
    import time

    from oscar.bench import host

    marker = tmp_path / "stopped"
    child = ("import signal, sys, time, pathlib\n"
             f"def stop(*_):\n    pathlib.Path({str(marker)!r}).write_text('server stopped'); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, stop)\nprint('ready', flush=True)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    assert host.run_limited([sys.executable, "-c", child], timeout=2.0, grace_s=20.0) is None
    assert marker.read_text() == "server stopped" and time.monotonic() - t0 < 15
    assert host.run_limited([sys.executable, "-c", "import sys; sys.exit(3)"], timeout=20.0) == 3
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    t0 = time.monotonic()
    assert host.run_limited([sys.executable, "-c", stubborn], timeout=1.0, grace_s=1.0) is None  # then SIGKILL
    assert time.monotonic() - t0 < 15

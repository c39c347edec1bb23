"""`python -m oscar gpu <table>` on a CPU: arguments, the missing-requirement errors, every table dispatching, and
the report writers from small fake rows (the GPU work itself runs on a GPU host: benchmarks/README.md)."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from oscar.bench import host, tables
from oscar.bench.kernels import options as kernel_options
from oscar.bench.kernels import timing as kernel_timing
from oscar.bench.serving import spec as serving
from oscar.commands import gpu

ROOT = Path(__file__).resolve().parents[1]


def test_unknown_table_and_key_are_usage_errors(capsys):
    assert gpu.main(["bogus"]) == 2
    assert "unknown table 'bogus'; valid tables: kernels, serving, prefix, correctness, accuracy, throughput" in \
        capsys.readouterr().err
    assert gpu.main(["kernels", "batchez=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown argument 'batchez=1'" in err and "batches" in err
    assert gpu.main(["kernels", "check=maybe"]) == 2
    assert "check='maybe': expected true or false" in capsys.readouterr().err
    assert gpu.main(["serving", "mem_fraction=lots"]) == 2
    assert "mem_fraction='lots': expected a number in (0, 1] or default" in capsys.readouterr().err


def test_parse_keeps_the_types_of_the_defaults():
    opts = tables.parse("kernels", ["reps=5", "check=false", "layer_weight_mb=10.5", "batches=1,2", "out=/x"])
    assert (opts["reps"], opts["check"], opts["layer_weight_mb"], opts["batches"], opts["out"]) == (5, False, 10.5,
                                                                                                 "1,2", "/x")
    assert tables.out_dir("kernels", tables.parse("kernels", [])) == Path("reports/kernels")
    assert tables.out_dir("accuracy", tables.parse("accuracy", [])) == Path("reports/accuracy")


@pytest.mark.parametrize("table", list(tables.TABLES))
def test_every_table_dispatches_and_names_what_is_missing(table, tmp_path, monkeypatch, capsys):
    """Each table module has the interface, and on this CPU host stops before any work, naming the CUDA device
    (exit 1, nothing measured)."""
    mod = tables.module(table)
    for name in ("AREA", "SUMMARY", "DEFAULTS", "stem", "needs", "measure", "report", "track"):
        assert hasattr(mod, name), (table, name)
    monkeypatch.setattr(host, "cuda_device", lambda: host.Need("CUDA device", "none", "this table runs on a CUDA GPU"))
    monkeypatch.setattr(host, "sglang_version", lambda timeout=120.0: (None, "No module named 'sglang'"))
    monkeypatch.setattr(host, "gpu_memory", lambda: None)
    monkeypatch.setattr(host, "model_gguf", lambda model: host.Need(f"model {model} (GGUF)", "fake", None))
    out = tmp_path / "out"
    assert gpu.main([table, f"out={out}", "tracking=false"]) == 1
    err = capsys.readouterr().err
    assert f"oscar gpu {table}:" in err and "CUDA device (found: none): this table runs on a CUDA GPU" in err
    assert "free GPU memory" in err
    if table in ("serving", "prefix", "correctness", "soak"):
        assert "sglang (found: not importable: No module named 'sglang')" in err
    assert not out.exists()  # stopped before measuring


@pytest.mark.parametrize("table", list(tables.TABLES))
def test_report_only_without_rows_says_what_to_run(table, tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    args = [table, "report_only=true", "tracking=false", f"out={out}"]
    if table == "accuracy":
        args.append(f"results={tmp_path / 'results'}")
    assert gpu.main(args) == 1
    err = capsys.readouterr().err
    assert f"oscar gpu {table}:" in err and ("no rows" in err or "no results" in err or "no " in err)


def test_require_lists_every_missing_need():
    ok = host.Need("a", "here")
    with pytest.raises(host.MissingRequirement) as exc:
        host.require([ok, host.Need("b", "nothing", "install b"), host.Need("c", "3 GiB", "free more")], "kernels")
    text = str(exc.value)
    assert "2 requirement(s) missing" in text and "b (found: nothing): install b" in text
    assert "c (found: 3 GiB): free more" in text and " a " not in text
    assert host.require([ok], "kernels") == [ok]


def _fake_sglang(root: Path, version: str) -> Path:
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return root


def test_sglang_need_reads_the_version_in_the_sglang_environment(tmp_path, monkeypatch):
    """SGLang is found through OSCAR_SGLANG_PYTHONPATH (the offline bundle) in a child process."""
    monkeypatch.setenv(host.SGLANG_PATH_ENV, str(_fake_sglang(tmp_path / "good", "0.5.17")))
    need = host.sglang(("0.5.17", "0.5.23"))
    assert need.ok and need.found.startswith("0.5.17")
    monkeypatch.setenv(host.SGLANG_PATH_ENV, str(_fake_sglang(tmp_path / "old", "0.4.0")))
    need = host.sglang(("0.5.17", "0.5.23"))
    assert not need.ok and "sglang 0.4.0; the oscar plugin supports 0.5.17, 0.5.23" in need.problem
    monkeypatch.setenv(host.SGLANG_PATH_ENV, str(tmp_path / "nothing"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "nothing"))
    monkeypatch.setattr(sys, "path", [p for p in sys.path])
    need = host.sglang(("0.5.17",))
    if need.ok:  # an sglang installed in this environment is found too
        pytest.skip("sglang is installed in this environment")
    assert "not importable" in need.found and "offline route" in need.problem


def test_throughput_table_measures_and_reports_on_a_tiny_model(tmp_path, monkeypatch):
    """The throughput table's own path into `oscar.bench.throughput.run` (tiny architecture, the CPU, uncompiled),
    the command it records, then its report from the files it wrote."""
    from oscar.bench.throughput import options
    from oscar.bench.throughput import spec as gpu_throughput

    monkeypatch.setitem(options.FLAGS, "tiny", True)
    opts = tables.parse("throughput", ["points=1x64", "parts=grid", "reps=1", "models=", "hf_caches="])
    gpu_throughput._run(opts, tmp_path, compile_step=False, command="python -m oscar gpu throughput points=1x64")
    assert json.loads((tmp_path / "env.json").read_text())["commands"] == ["python -m oscar gpu throughput points=1x64"]
    grid = list(csv.DictReader((tmp_path / "grid.csv").open()))
    assert {(r["cache"], r["batch"], r["context"], r["status"]) for r in grid} >= {("bf16", "1", "64", "ok"),
                                                                                    ("oscar", "1", "64", "ok")}
    assert gpu.main(["throughput", "report_only=true", "tracking=false", f"out={tmp_path}"]) == 0
    assert (tmp_path / "throughput.md").stat().st_size > 100


def test_free_memory_and_paths(monkeypatch, tmp_path):
    monkeypatch.setattr(host, "gpu_memory", lambda: {"total_gib": 140.0, "used_gib": 130.0, "free_gib": 10.0})
    need = host.free_gpu_memory(100.0)
    assert not need.ok and "only 10.0 of 140.0 GiB free" in need.problem
    assert host.free_gpu_memory(5.0).ok
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        need = host.cuda_devices(2)
        assert not need.ok and need.problem.startswith("tp=2 needs 2 GPUs of one host")
    missing = host.path_exists(tmp_path / "nope", "thing", "make it")
    assert not missing.ok and missing.problem == "make it" and host.path_exists(tmp_path, "dir", "x").ok


def test_model_gguf_names_where_it_belongs(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    need = host.model_gguf("qwen2.5-coder-0.5b")
    if need.ok:
        pytest.skip("the model is installed from its packages here")
    assert "install-model model=qwen2.5-coder-0.5b" in need.problem
    assert str(tmp_path / "models" / "qwen2.5-coder-0.5b" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") in need.problem


def test_kernel_options_are_checked_before_any_work():
    opts = tables.parse("kernels", [])
    assert list(kernel_options.variants(opts)) == ["int2", "int2_rope", "int4", "int4_rows"]
    extra = kernel_options.variants({**opts, "variants": "int2", "launch": 'w4:{"warps": 4}'})
    assert extra["w4"] == {"bits": 2, "layout": "mma", "warps": 4}
    for bad, needle in ((dict(variants="int3"), "unknown variant 'int3'"), (dict(launch="x:{nope"), "launch='x:{nope'"),
                        (dict(head_dims="96"), "head_dim 64 or 128"), (dict(parts="all"), "parts='all'"),
                        (dict(batches="a"), "comma-separated integers"),
                        (dict(variants="", launch=""), "nothing to time"),
                        (dict(launch='x:{"mma_warps": 4}'), "MmaLaunch takes"),
                        (dict(launch='x:{"warps": 3}'), "warps")):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("{", r"\{")):
            kernel_options.check_options({**opts, **bad})


_SMALL = dict(tables.parse("kernels", []), page_size=16, sink=16, recent=32)


def test_decode_call_reaches_the_library_on_the_cpu():
    """The benchmark's inputs and call go through `oscar.cache.paged.decode_attention` (the twin here), with the
    rope-centered transform where the variant asks for it (it moves every logit, so the output changes)."""
    torch = pytest.importorskip("torch")
    inp = kernel_timing.decode_inputs(2, 200, 8, 2, 64, _SMALL, 2, bits=2, device="cpu")
    plain = kernel_timing.decode_call(inp, 1, kernel_options.VARIANTS["int2"], backend="torch")().float()
    rope = kernel_timing.decode_call(inp, 1, kernel_options.VARIANTS["int2_rope"], backend="torch")().float()
    again = kernel_timing.decode_call(inp, 1, kernel_options.VARIANTS["int2"], backend="torch")().float()
    assert plain.shape == (2, 8, 64) and torch.isfinite(plain).all() and torch.equal(plain, again)
    assert float((rope - plain).norm() / plain.norm()) > 1e-2
    assert kernel_options.launch_of({"bits": 2, "layout": "mma", "warps": 4}).warps == 4
    assert kernel_options.launch_of(kernel_options.VARIANTS["int4_rows"]) is None


def test_row_kernel_through_the_benchmark_call_matches_the_twin():
    """The Triton row kernel (interpreted on the CPU) through the benchmark's call, against the twin."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("the GPU run covers it")
    var = dict(kernel_options.VARIANTS["int4_rows"])
    inp = kernel_timing.decode_inputs(1, 100, 4, 1, 64, _SMALL, 1, bits=4, device="cpu")
    ref = kernel_timing.decode_call(inp, 0, var, backend="torch")().float()
    out = kernel_timing.decode_call(inp, 0, var)().float()
    assert float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max()) < 1.5e-2


def _kernel_rows(path: Path) -> None:
    rows = []
    for d in (128, 64):
        for T in (4096, 32768):
            for B in (1, 8):
                for v, us in (("int2", 10.0), ("int2_rope", 12.0), ("int4", 11.0), ("int4_rows", 20.0)):
                    rows.append(dict(head_dim=d, batch=B, context=T, variant=v, launch="{}", us=us * B, status="ok",
                                     bytes=10**6, sets=4, timing="graph", cudnn_us=15.0 * B, flash_us=18.0 * B,
                                     bf16_best_us=15.0 * B, copy_tb_s=4.2, tb_s=0.1, bw_frac=0.3, speedup=15.0 / us))
    rows[-1].update(us=float("nan"), status="error: OutOfMemoryError")
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_kernel_report_from_fake_rows_with_hardware_and_comparison(tmp_path, capsys):
    out = tmp_path / "k"
    out.mkdir()
    _kernel_rows(out / "decode_attention_rows.csv")
    (out / "decode_attention_env.json").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "driver": "580.1", "torch": "2.11.0", "sglang": None, "copy_tb_s": 4.2, "date": "d",
         "git_commit": "abcdef123456789", "command": "python -m oscar gpu kernels",
         "rel_err_vs_twin": {"int2_d128": 1e-3}}))
    old = tmp_path / "old.csv"
    old.write_text("head_dim,batch,context,cudnn_us,flash_us,int2_us,int4_rows_v8_us\n128,1,4096,15.0,18.0,12.5,20.0\n")
    assert gpu.main(["kernels", "report_only=true", "tracking=false", f"out={out}", f"compare={old}"]) == 0
    md = (out / "decode_attention.md").read_text()
    assert "Hardware: NVIDIA H200, driver 580.1, torch 2.11.0" in md and "`python -m oscar gpu kernels`" in md
    assert "| 128 | 1 | 4096 | 15.0 | 18.0 | 10.0 | 12.0 | 11.0 | 20.0 | 1.20 | 1.50x | 1.25x | 1.36x | 30% |" in md
    assert "| 64 | 8 | 32768 | 120.0 | 144.0 | 80.0 | 96.0 | 88.0 | error: OutOfMemoryError |" in md
    assert "| INT2 | 1 | 0.800 | 0.800 | 0.800 | 0/1 |" in md  # 10.0 now against 12.5 committed
    assert "| INT4 rows (v8) | 1 | 1.000 | 1.000 | 1.000 | 1/1 |" in md  # the committed v8 column name
    table = list(csv.DictReader((out / "decode_attention.csv").open()))
    assert len(table) == 8 and float(table[0]["int2_speedup"]) == pytest.approx(1.5)
    assert (out / "decode_attention.png").stat().st_size > 1000


def test_serving_plan_and_command_line(tmp_path):
    opts = tables.parse("serving", ["backends=oscar,flashinfer", "real=1x100000", "synthetic=1x100000", "profile="])
    runs = serving.plan(opts)
    assert [(r["name"], r["real"], r["synthetic"], r["profile"]) for r in runs] == [
        ("oscar_channel", "1x100000", "1x100000", ""), ("oscar_token", "1x100000", "1x100000", ""),
        ("bf16_flashinfer", "1x100000", "1x100000", "")]
    cmd = serving.command(runs[0], {**opts, "model": "/m"}, tmp_path)
    assert cmd[1:3] == ["-m", "oscar.bench.serving.one_batch"] and cmd[cmd.index("--page-size") + 1] == "32"
    assert serving.command(runs[1], {**opts, "model": "/m"}, tmp_path)[cmd.index("--page-size") + 1] == "16"
    assert "--disable-cuda-graph" not in cmd and "--mem-fraction-static" in cmd
    runs = serving.plan({**opts, "backends": "oscar,flashinfer_fp8", "formats": "mixed", "graphs": "on,off"})
    assert [(r["name"], r["cuda_graph"]) for r in runs] == [("oscar_mixed", True), ("oscar_mixed_nograph", False),
                                                           ("fp8_flashinfer", True), ("fp8_flashinfer_nograph", False)]
    fp8 = serving.command(runs[3], {**opts, "model": "/m", "mem_fraction": "default"}, tmp_path)
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8_e4m3" and "--disable-cuda-graph" in fp8
    assert fp8[fp8.index("--attention-backend") + 1] == "flashinfer" and "--mem-fraction-static" not in fp8
    with pytest.raises(ValueError, match="valid formats are token, channel, mixed, rope"):
        serving.plan({**opts, "formats": "int3"})
    assert "--oscar-shapes=1x100000" in cmd and "--oscar-profile=" in cmd and "--oscar-warmup=1x2048" in cmd
    assert cmd[cmd.index("--batch-size") + 1:cmd.index("--input-len")] == ["1"]
    assert "--tp-size" not in cmd
    tp2 = serving.command(runs[0], {**opts, "model": "/m", "tp": 2}, tmp_path)
    assert tp2[tp2.index("--tp-size") + 1] == "2"
    full = serving.plan(tables.parse("serving", []))
    assert [r["name"] for r in full] == ["oscar_channel", "oscar_token", "bf16_flashinfer", "bf16_triton"]
    assert full[0]["synthetic"].endswith(",51x100000") and full[2]["profile"] == "1x100000"
    with pytest.raises(ValueError, match="shape '1by100' is not valid"):
        serving.plan({**opts, "real": "1by100"})


def test_serving_report_compares_with_the_committed_rows(tmp_path):
    base = dict(cuda_graph=True, radix=False, device="NVIDIA H200", output_len=16, page_size=16, batch=1,
                context=100000, max_total_num_tokens=749474, status="ok")
    rows = [dict(base, cache="bf16", backend="flashinfer", tag="bf16_flashinfer", mode="real", decode_ms=9.2,
                 prefill_s=7.0),
            dict(base, cache="oscar", backend="oscar", tag="oscar", mode="real", decode_ms=8.0, prefill_s=7.5),
            dict(base, cache="bf16", backend="flashinfer", tag="bf16_flashinfer", mode="synthetic", decode_ms=8.8),
            dict(base, cache="oscar", backend="oscar", tag="oscar", mode="synthetic", decode_ms=7.9)]
    out = tmp_path / "s"
    out.mkdir()
    (out / "serving_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "decode_env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "sglang": "0.5.17", "command": "cmd",
                                                     "options": {"sink": 64, "recent": 256, "mem_fraction": 0.85}}))
    # the committed numbers of an earlier run (its decode.csv, written by the same report)
    old = tmp_path / "committed"
    old.mkdir()
    (old / "serving_rows.jsonl").write_text("".join(json.dumps(dict(r, decode_ms=ms)) + "\n" for r, ms in
                                                    zip(rows[2:], (8.71, 8.41))))
    assert gpu.main(["serving", "report_only=true", "tracking=false", f"out={old}"]) == 0
    committed = old / "decode.csv"
    assert gpu.main(["serving", "report_only=true", "tracking=false", f"out={out}", f"compare={committed}"]) == 0
    md = (out / "decode.md").read_text()
    assert "sglang 0.5.17" in md and "Command: `cmd`" in md
    assert "## Against the committed numbers" in md
    assert "| oscar/oscar | synthetic | 1 | 100000 | 8.41 | 7.90 | -6.1% |" in md  # committed 8.41 ms
    assert "| OSCAR speed-up vs best BF16 | synthetic | 1 | 100000 | 1.04x | 1.11x |" in md
    assert {"decode.csv", "decode.md", "decode.png"} <= {p.name for p in out.iterdir()}


def test_prefix_and_correctness_reports_from_fake_rows(tmp_path):
    from oscar.bench.correctness import spec as gpu_correctness

    out = tmp_path / "p"
    out.mkdir()
    base = dict(requests=8, input_len=30000, output_len=16, device="H200", sglang="0.5.17", radix=True, cuda_graph=True,
                page_size=16, kind="sweep", status="ok", shared_tokens=0, ttft_p50_s=1.0, ttft_max_s=2.0,
                cached_tokens=0)
    rows = [dict(base, cache="bf16", backend="flashinfer", tag="bf16_flashinfer", ratio=0.5, job_s=10.0,
                 job_tokens_per_s=24000.0, ttft_mean_s=1.5),
            dict(base, cache="oscar", backend="oscar", tag="oscar", ratio=0.5, job_s=8.0, job_tokens_per_s=30000.0,
                 ttft_mean_s=1.2)]
    (out / "prefix_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert gpu.main(["prefix", "report_only=true", "tracking=false", f"out={out}"]) == 0
    assert "| 0.5 | flashinfer 24000 | 30000 | 1.25x | 1.50 | 1.20 | 0 / 0 |" in (out / "prefix_sweep.md").read_text()
    check = {"plain": {"original": {"rel": 3e-3}, "rotated": {"rel": 3e-2}}}
    summary = gpu_correctness.summary_rows({"greedy_bf16_windows_cover": {"prompts": 8, "prompts_equal": 8,
                                                                          "tokens_equal": True}}, check)
    assert [(r["check"], r["holds"]) for r in summary] == [
        ("pool vs twin: plain, original frame", True), ("pool vs twin: plain, rotated frame", False),
        ("greedy tokens, covering windows vs triton BF16 (prompts equal)", True)]


def test_soak_table_serves_as_a_user_starts_it_and_reports_each_check(tmp_path, monkeypatch):
    """The soak's server gets only what dummy weights need, ``--attention-backend oscar`` and the pool's size (the page
    size, graphs and request slots are the plugin's serving defaults); its report names every check; bad options are
    refused naming the valid values; the log counts find SGLang's leak and retract lines."""
    from oscar.bench.soak import spec as soak

    opts = tables.parse("soak", [])
    args = soak.server_args(opts)
    assert args[args.index("--attention-backend") + 1] == "oscar"
    assert args[args.index("--max-total-tokens") + 1] == "300000"
    assert not {"--page-size", "--disable-cuda-graph", "--disable-radix-cache", "--chunked-prefill-size",
                "--max-running-requests", "--mem-fraction-static"} & set(args)
    assert "--max-total-tokens" not in soak.server_args(tables.parse("soak", ["pool=0"]))
    monkeypatch.setattr(host, "gpu_memory", lambda: None)
    with pytest.raises(ValueError, match="format='bogus'; valid: .*channel"):
        soak.needs(tables.parse("soak", ["format=bogus"]))
    with pytest.raises(ValueError, match="lengths='1000,x'"):
        soak.needs(tables.parse("soak", ["lengths=1000,x"]))
    counts = soak.log_counts("KV cache pool is full. Retract requests.\nTraceback (most recent call last)\n"
                             "token_to_kv_pool_allocator memory leak detected!\n")
    assert counts["retracted"] == 1 and counts["tracebacks"] == 1 and counts["leak"] >= 1
    out = tmp_path / "soak"
    out.mkdir()
    rep = {"ok": True, "checks": {"no_failed_request": True, "healthy_after": True, "free_tokens_restored": True,
                                  "gpu_memory_growth_mib": 12, "greedy_equal": "4/4"},
           "stats": {"sent": 120, "done": 108, "hits": 30, "aborted": 12, "failed": 0, "errors": [],
                     "tokens_in": 4_200_000, "wall_s": 241.0},
           "free_tokens": [300000, 300000], "gpu_memory_mib": [70000, 70012], "log_counts": counts,
           "settings": {"workers": 12, "lengths": "1000,100000", "new_tokens": 32, "seconds": 240.0},
           "command_server": "python -m sglang.launch_server --model-path m " + " ".join(args)}
    (out / "soak.json").write_text(json.dumps(rep))
    assert gpu.main(["soak", "report_only=true", "tracking=false", f"out={out}"]) == 0
    md = (out / "soak.md").read_text()
    assert "**Verdict: clean.**" in md and "| requests sent / answered / aborted on purpose / failed | 120 / 108 / 12 / 0 |" in md
    assert "| pool's free tokens before / after | 300000 / 300000 |" in md and "| greedy samples equal to the fresh server's | 4/4 |" in md
    assert "| prompt tokens sent | 4,200,000 |" in md and "--attention-backend oscar" in md


def test_accuracy_cells_and_their_calibration_needs(tmp_path, monkeypatch):
    from oscar.bench.accuracy import cells
    from oscar.bench.accuracy import spec as gpu_accuracy

    opts = tables.parse("accuracy", [f"results={tmp_path}"])
    args = cells.cell_args(opts)
    assert args.count("--") == 3 and "method=auto" in args and "device=cuda" in args
    assert f"output={tmp_path}/eval/qwen2.5-coder-0.5b/kivi2/niah/seed0" in args
    monkeypatch.setattr(host, "model_gguf", lambda model: host.Need("model", "fake"))
    names = {n.name: n for n in gpu_accuracy.needs(opts)}
    auto = names["calibration artifact of auto"]
    assert not auto.ok and "method=auto" in auto.problem
    assert "calibration artifact of kivi2" not in names
    with pytest.raises(ValueError, match="table=.mmlu.; valid: niah, niah_multikey, humaneval"):
        cells.variants({**opts, "table": "mmlu"})
    he = tables.parse("accuracy", ["table=humaneval", "variants=a=method=auto method.sink=16"])
    assert cells.variants(he) == [("a", ["method=auto", "method.sink=16"])]


def test_kernel_table_tracks_into_mlflow(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    out = tmp_path / "k"
    out.mkdir()
    _kernel_rows(out / "decode_attention_rows.csv")
    (out / "decode_attention_env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "copy_tb_s": 4.2,
                                                               "git_commit": "c0ffee", "command": "cmd"}))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert gpu.main(["kernels", "report_only=true", f"out={out}", f"mlflow_uri={uri}"]) == 0
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("oscar/gpu/kernels")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    parents = [r for r in runs if r.data.tags.get("oscar.role") == "table"]
    children = [r for r in runs if r.data.tags.get("oscar.role") == "cell"]
    assert len(parents) == 1 and len(children) == 8
    assert all(c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for c in children)
    assert parents[0].data.params["hw.gpu"] == "NVIDIA H200" and parents[0].data.tags["git_commit"] == "c0ffee"
    first = next(c for c in children if c.info.run_name == "d128/b1/T4096")
    assert first.data.metrics["perf.int2_us"] == pytest.approx(10.0)


def test_gpu_sh_refuses_without_the_bundle(tmp_path):
    """The offline route's script stops with the way out when neither SGLang nor the bundle is there."""
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "setup"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "SITE": str(tmp_path / "sg"),
                               "OSCAR_GPU_DIR": str(tmp_path / "g"), "HOME": str(tmp_path)}, timeout=60)
    assert proc.returncode == 2 and "no SGLang at" in proc.stderr and "bash benchmarks/gpu.sh pack" in proc.stderr


_TEXT_SUFFIXES = {".py", ".md", ".sh", ".smk", ".rst", ".yaml", ".toml"}


def test_every_bench_module_named_in_the_checkout_exists():
    """Command lines (``python -m oscar.bench.<table>.<module>``, the tables' subprocess argv), imports and documents
    name modules of ``oscar.bench``: each resolves to a module of the checkout, and a name after the module to one of
    its top-level definitions (raw records, .json and .log, keep the names of their time)."""
    name = re.compile(r"oscar\.bench(?:\.\w+)+")
    bad = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".git", "results", "logs", ".dev") or path.is_symlink() or not path.is_file():
            continue
        if path.suffix not in _TEXT_SUFFIXES and path.name not in ("Snakefile", "Makefile"):
            continue
        for found in set(name.findall(path.read_text(errors="replace"))):
            parts = found.split(".")
            i = len(parts)
            while i > 2 and not (ROOT.joinpath(*parts[:i]).with_suffix(".py").is_file()
                                 or (ROOT.joinpath(*parts[:i]) / "__init__.py").is_file()):
                i -= 1
            if i == 2:
                bad.append(f"{rel}: {found} (no such module)")
                continue
            if parts[i:]:
                base = ROOT.joinpath(*parts[:i])
                source = (base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py")
                attr = parts[i]
                if not re.search(rf"^(?:def|class) {attr}\b|^{attr}\s*[:=]|^from .* import .*\b{attr}\b",
                                 source.read_text(), re.M):
                    bad.append(f"{rel}: {found} ({attr} is not defined in {source.relative_to(ROOT)})")
    assert not bad, "\n".join(bad)


def test_gpu_help_lists_every_table_without_heavy_imports():
    """`python -m oscar gpu --help` imports every table's spec module and nothing heavy: the specs import their
    measuring code (torch, omegaconf, SGLang) only when a table measures or reports."""
    code = ("import sys\nfrom oscar.cli import main\ntry:\n    main(['gpu', '--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = ('torch', 'numpy', 'pandas', 'omegaconf', 'hydra', 'transformers', 'triton', 'sglang', 'mlflow')\n"
            "print('LOADED', sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))\n"
            "print('SPECS', sorted(m for m in sys.modules if m.startswith('oscar.bench.') and m.endswith('.spec')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOADED []" in proc.stdout, proc.stdout
    specs = next(x for x in proc.stdout.splitlines() if x.startswith("SPECS"))
    assert all(f"oscar.bench.{t}.spec" in specs for t in tables.TABLES), specs
    assert "python -m oscar gpu" in proc.stdout and all(f"  {t} -> reports/" in proc.stdout for t in tables.TABLES)

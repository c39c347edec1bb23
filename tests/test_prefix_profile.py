"""The prefix profile's trace summary (``oscar.bench.prefix.profile``) on a hand-built chrome trace.

Times are exact sums of the events' durations (integers in microseconds), so the summary is checked exactly:
a kernel belongs to the innermost ``oscar.*`` range around its launch (same correlation id), the extend window runs
from the first ``oscar.extend`` range to the end of the last, self times subtract the direct children on the thread
(a ``record_function`` range that outlives its ``__enter__`` is the child of the function around both).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from oscar.bench.prefix import extend_bench
from oscar.bench.prefix import profile as prefix_profile


def _x(name, cat, ts, dur, tid=1, **args):
    return dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, pid=1, tid=tid, args=args)


def _trace():
    host = [
        _x("oscar.metadata", "user_annotation", 0, 100),
        _x("oscar.extend", "user_annotation", 200, 1000),  # layer 0
        _x("oscar.extend.pages", "user_annotation", 300, 500),
        _x("aten::cat", "cpu_op", 320, 50),
        _x("cuLaunchKernel", "cuda_driver", 400, 10, correlation=1),
        _x("oscar.extend.write", "user_annotation", 900, 200),
        _x("cudaLaunchKernel", "cuda_runtime", 950, 10, correlation=2),
        _x("cudaStreamSynchronize", "cuda_runtime", 1000, 80),
        _x("oscar.extend", "user_annotation", 1300, 500),  # layer 1
        _x("cudaLaunchKernel", "cuda_runtime", 1400, 10, correlation=3),
        _x("cudaLaunchKernel", "cuda_runtime", 1900, 10, correlation=4),  # after the layers: sampling
        # Python stacks: a wrapper whose record_function range opens inside __enter__ and outlives it
        _x("labels.py(45): inner", "python_function", 2000, 300),
        _x("profiler.py(921): __enter__", "python_function", 2001, 20),
        _x("oscar.decode", "user_annotation", 2010, 280),
        _x("scheduler.py(1): event_loop", "python_function", 0, 2400),  # around everything: left out of the top
    ]
    gpu = [_x("_extend_kernel", "kernel", 420, 300, tid=7, correlation=1),
           _x("quantize_pack_kernel", "kernel", 970, 40, tid=7, correlation=2),
           _x("nvjet_gemm", "kernel", 1420, 100, tid=7, correlation=3),
           _x("argmax_kernel", "kernel", 1920, 5, tid=7, correlation=4)]
    return {"traceEvents": [*host, *gpu, {"ph": "M", "name": "process_name", "pid": 1}]}


def test_summary_of_a_known_trace(tmp_path):
    (tmp_path / "hit").mkdir()
    with gzip.open(tmp_path / "hit" / "hit-TP-0.trace.json.gz", "wt") as fh:
        json.dump(_trace(), fh)
    s = prefix_profile.summarize(prefix_profile.read_trace(prefix_profile.find_trace(tmp_path / "hit")))
    e = s["extend"]
    assert (e["wall_ms"], e["layers"], e["start_ms"]) == (1.6, 2, 0.2)
    assert e["gpu_ms"] == pytest.approx(0.44)  # the kernels launched in the window, not the sampling one
    assert e["syncs"] == {"cudaStreamSynchronize": {"calls": 1, "ms": 0.08}}
    assert s["gpu_ms_all"] == pytest.approx(0.445)
    phases = {p["label"]: p for p in s["phases"]}
    assert phases["oscar.extend"]["calls"] == 2 and phases["oscar.extend"]["host_ms"] == pytest.approx(1.5)
    assert phases["oscar.extend"]["self_ms"] == pytest.approx((1000 - 500 - 200 + 500 - 10) / 1e3)
    assert phases["oscar.extend.pages"]["self_ms"] == pytest.approx((500 - 50 - 10) / 1e3)
    assert phases["oscar.extend.write"]["self_ms"] == pytest.approx((200 - 10 - 80) / 1e3)
    assert (phases["oscar.extend.pages"]["gpu_ms"], phases["oscar.extend.pages"]["kernels"]) == (0.3, 1)
    assert phases["oscar.extend"]["gpu_ms"] == 0.1  # the GEMM launched in layer 1 outside any inner label
    assert [(p["part"], p["gpu_ms"], p["kernels"]) for p in s["parts"]] == [
        ("oscar.extend.pages", 0.3, 1), ("oscar.extend", 0.1, 1), ("oscar.extend.write", 0.04, 1)]
    assert s["top_kernels"][0] == dict(name="_extend_kernel", part="oscar.extend.pages", calls=1, gpu_ms=0.3)
    py = {p["name"]: p["self_ms"] for p in s["top_python"]}
    assert py["labels.py(45): inner"] == pytest.approx((300 - 20 - 280) / 1e3)  # the range is its child
    assert "scheduler.py(1): event_loop" not in py
    host = {h["name"]: h["self_ms"] for h in s["top_host"]}
    assert host["oscar.extend.pages"] == pytest.approx(0.44) and "oscar.decode" not in host  # outside the window


def test_profile_files_and_markdown(tmp_path):
    s = prefix_profile.summarize(_trace())
    results = [dict(name="hit", ttft_s=0.42, ttft_unprofiled_s=0.4, cached=29744, summary=s)]
    paths = prefix_profile.write_profile(results, tmp_path, ["# title", "", "intro", ""])
    assert [p.name for p in paths] == ["prefix_profile.md", "prefix_profile.json"]
    md = (tmp_path / "prefix_profile.md").read_text()
    assert "| hit | 0.42 | 0.40 | 29744 | 0.20 | 1.60 | 0.44 | 1.16 | 1 | 2.40 |" in md
    assert "| oscar.extend.pages | 1 | 0.50 | 0.44 | 0.30 | 1 |" in md
    assert "| `_extend_kernel` | oscar.extend.pages | 0.30 | 1 |" in md
    env = dict(gpu="NVIDIA H200", command="python -m oscar gpu prefix profile=true")
    prefix_profile.rewrite(tmp_path, env)
    md = (tmp_path / "prefix_profile.md").read_text()
    assert md.startswith("# title\n\nHardware: NVIDIA H200") and "Command: `python -m oscar gpu prefix profile=true`" in md
    with pytest.raises(FileNotFoundError, match="profile=true"):
        prefix_profile.rewrite(tmp_path / "nothing")
    (tmp_path / "traces").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.json"):
        prefix_profile.find_trace(tmp_path / "traces")


def test_gpu_prefix_profile_report_only(tmp_path, capsys):
    from oscar.commands import gpu

    args = ["prefix", "profile=true", "report_only=true", "tracking=false", f"out={tmp_path}"]
    assert gpu.main(args) == 1 and "no profile" in capsys.readouterr().err
    s = prefix_profile.summarize(_trace())
    prefix_profile.write_profile([dict(name="hit", ttft_s=0.42, cached=29744, summary=s)], tmp_path, ["# t", ""])
    (tmp_path / "prefix_profile_env.json").write_text(json.dumps(dict(gpu="NVIDIA H200", command="c")))
    assert gpu.main(args) == 0
    assert "Hardware: NVIDIA H200" in (tmp_path / "prefix_profile.md").read_text()


def test_extend_bench_rows_and_section(tmp_path):
    """The routes' timing on CPU (the kernels interpreted: the times mean nothing here, the agreement does)."""
    rows = extend_bench.extend_bench(hkv=2, heads=4, d=64, prefix=100, n=8, sink=16, layers=3, reps=1, device="cpu")
    assert [r["route"] for r in rows] == ["pages", "dequant", "twin"] and all("error" not in r for r in rows)
    assert rows[0]["rel_vs_pages"] == 0 and max(r["rel_vs_pages"] for r in rows) < 1e-4  # float32: reduction order
    assert all(r["ms_per_hit"] == pytest.approx(3 * r["ms_per_layer"]) for r in rows)
    prefix_profile.write_profile([dict(name="hit", ttft_s=0.4, cached=84, summary=prefix_profile.summarize(_trace()))],
                                 tmp_path, ["# t", ""])
    (tmp_path / "prefix_extend_bench.json").write_text(json.dumps(rows))
    prefix_profile.rewrite(tmp_path)
    md = (tmp_path / "prefix_profile.md").read_text()
    assert "## One layer's extend attention of the hit, by route (8 queries x 4 heads over 100 cached positions" in md
    assert "| dequant |" in md and "| twin |" in md


def test_profile_mode_runs_the_oscar_engine_alone_then_the_bench(tmp_path, monkeypatch):
    """``gpu prefix profile=true``'s measure step (the GPU calls replaced): one engine process with ``--profile`` and
    the labels on, no sweep ratios, no check row, no flashinfer engine; then the extend bench at the hit's shape."""
    import subprocess

    from oscar.bench import tables
    from oscar.bench.prefix import spec as prefix

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)))
    calls = []

    def run(cmd, **kw):
        calls.append((cmd, kw.get("env") or {}))
        if "--profile" in cmd:
            folder = Path(cmd[cmd.index("--profile") + 1])
            (folder / "traces" / "hit").mkdir(parents=True)
            (folder / "traces" / "hit" / "hit-TP-0.trace.json").write_text(json.dumps(_trace()))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(prefix.subprocess, "run", run)
    monkeypatch.setattr(prefix.subprocess, "Popen", lambda *a, **k: pytest.fail("no flashinfer engine in profile mode"))
    opts = tables.parse("prefix", ["profile=true", f"model={model}"])
    out = tmp_path / "out"
    env: dict = {}
    prefix.measure(opts, out, env)
    (engine, engine_env), (bench, _) = calls
    assert "--check-hit" not in engine and engine[engine.index("--ratios") + 1] == ""
    assert engine[engine.index("--profile") + 1] == str(out) and engine_env["OSCAR_PROFILE_LABELS"] == "1"
    assert bench[bench.index("--prefix") + 1] == "29744" and bench[bench.index("--n") + 1] == "256"
    assert engine[1:3] == ["-m", "oscar.bench.prefix.sweep"] and bench[1:3] == ["-m", "oscar.bench.prefix.extend_bench"]
    assert [r["name"] for r in env["runs"]] == ["oscar", "extend_bench"]
    assert (out / "prefix_traces.tar.gz").is_file() and not (out / "traces").exists()
    assert prefix.stem(opts) == "prefix_profile"

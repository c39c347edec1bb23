"""The throughput measurement (`python -m oscar gpu throughput`, `oscar.bench.throughput`): the report's derived
numbers from result files, the MLflow mirror, the refusals (bad keys before any work, real architectures without a
GPU), and (slow) the whole run on a tiny architecture on the CPU, budget-limited OOM points included."""

from __future__ import annotations

import json
import math

import pytest
import torch

from oscar.bench.throughput import decode as tp
from oscar.bench.throughput import options, report
from oscar.bench.throughput import run as profile_run
from oscar.commands import gpu

GB = 1e9


def write_fixture(out):
    """A small result set in the verb's file format (made-up times: the test checks arithmetic, not speed)."""
    grid = []
    for cache, kv_per_seq, attn in (("bf16", 8 * GB, 4000.0), ("oscar", 1 * GB, 2000.0)):
        for batch, status in ((1, "ok"), (4, "ok" if cache == "oscar" else "OOM")):
            row = {"model": "m", "cache": cache, "batch": batch, "context": 1000, "status": status}
            if status == "ok":
                step = 5000.0 + batch * attn
                row.update(step_us=step, gemm_us=3000.0, attention_us=batch * attn, quantize_us=100.0 if cache != "bf16" else 0.0,
                           other_us=step - 3000.0 - batch * attn, tokens_per_s=batch / (step * 1e-6))
            row.update(kv_bytes=kv_per_seq * batch, kv_bytes_per_element=0.3 if cache == "oscar" else 2.0)
            grid.append(row)
    report.write_csv(out / "grid.csv", grid, profile_run.GRID_KEYS)
    report.write_csv(out / "fit.csv", [{"model": "m", "cache": "bf16", "context": 1000, "max_batch": 2, "budget_gib": 1, "tried": "1 2 4 3"},
                                       {"model": "m", "cache": "oscar", "context": 1000, "max_batch": 16, "budget_gib": 1, "tried": "1"}])
    report.write_csv(out / "job.csv", [
        {"model": "m", "cache": "bf16", "context": 1000, "job_batch": 4, "run_batch": 1, "waves": 4, "status": "ok",
         "step_us": grid[0]["step_us"], "tokens_per_s": grid[0]["tokens_per_s"]},
        {"model": "m", "cache": "oscar", "context": 1000, "job_batch": 4, "run_batch": 4, "waves": 1, "status": "ok",
         "step_us": grid[3]["step_us"], "tokens_per_s": grid[3]["tokens_per_s"]}])
    env = {"copy_bandwidth_tb_s": 4.0, "models": {"m": {"weight_bytes_read_per_step": 10 * GB}},
           "settings": {"job_context": 1000, "reps": 3, "temperature": 0.6}, "formats": {}}
    (out / "env.json").write_text(json.dumps(env))
    return grid


def test_report_numbers_follow_from_the_files(tmp_path):
    grid = write_fixture(tmp_path)
    res = report.analyse(tmp_path)
    sp = res["speedup"][0]
    assert sp["speedup"] == pytest.approx(grid[0]["step_us"] / grid[2]["step_us"])
    assert sp["bound"] == pytest.approx((10 + 8) / (10 + 1))  # (weights + BF16 cache) / (weights + INT cache)
    base = grid[0]
    assert sp["amdahl"] == pytest.approx(base["step_us"] / (base["step_us"] - 4000 + 4000 / 8))
    job = res["jobs"][0]
    assert job["ratio"] == pytest.approx(grid[3]["tokens_per_s"] / grid[0]["tokens_per_s"])
    assert job["bound"] == pytest.approx((4 / (10 + 4 * 1)) / (1 / (10 + 1 * 8)))
    targets = {t["target"].split(":")[0]: t["met"] for t in res["targets"]}
    assert targets["largest batch at 1000"] is False and targets["quantize + demote < 5% of a step"] is True
    paths = report.write_report(tmp_path)
    md = (tmp_path / "throughput.md").read_text()
    assert "| bf16 | hf | 4 | 1,000 | OOM |" in md and (tmp_path / "throughput.png").stat().st_size > 0
    assert all(p.is_file() for p in paths)


def test_mlflow_mirror_has_one_run_per_point(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    grid = write_fixture(tmp_path)
    report.write_report(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for _ in range(2):  # mirroring again replaces the runs
        receipt = report.track(tmp_path, uri, experiment="throughput", root=tmp_path)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("oscar/throughput/throughput")
    runs = client.search_runs([exp.experiment_id], max_results=100)
    assert len(runs) == len(grid) + 1 == len(receipt["children"]) + 1
    ok = [r for r in runs if r.data.tags.get("oscar.status") == "ok"]
    assert {round(r.data.metrics["perf.step_ms"], 6) for r in ok} == {round(g["step_us"] / 1e3, 6) for g in grid if g["status"] == "ok"}
    children = [r for r in runs if "cache" in r.data.params]
    assert {(r.data.params["cache"], r.data.params["layout"]) for r in children} == {("bf16", "-"), ("oscar", "rows")}


def test_the_run_refuses_real_architectures_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from oscar.config import compose

    cfg = compose(["experiment=throughput", "tracking.enabled=false"])
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        profile_run.run(cfg, profile_run.Settings(cfg, {**options.FLAGS, "parts": "grid"}), tmp_path)
    assert not (tmp_path / "grid.csv").exists()


@pytest.mark.parametrize("arg, needle", [("parts=grid,speed", "speed"), ("layout=diag", "layout='diag'"),
                                         ("points=8by32000", "8by32000"), ("budget_gb=-1", "budget_gb=-1")])
def test_bad_keys_are_refused_before_any_work(arg, needle, tmp_path, capsys):
    """`gpu throughput` checks its keys before the host's requirements (exit 2, nothing written)."""
    assert gpu.main(["throughput", arg, f"out={tmp_path / 'out'}", "tracking=false"]) == 2
    assert needle in capsys.readouterr().err and not (tmp_path / "out").exists()
    from oscar.config import compose

    with pytest.raises(ValueError, match="speed"):  # the run's own settings refuse it too
        profile_run.Settings(compose(["experiment=throughput"]), {**options.FLAGS, "parts": "grid,speed"})


@pytest.fixture(scope="module")
def tiny_settings():
    from oscar.config import compose

    cfg = compose(["experiment=throughput"])
    return cfg, profile_run.Settings(cfg, {**options.FLAGS, "tiny": True})


def test_points_over_the_budget_are_marked_oom_and_the_fit_search_finds_the_edge(tiny_settings):
    cfg, s = tiny_settings
    s.reps = 1
    family, dims = s.architecture("tiny-qwen3", cfg)
    model = tp.build_random_model(tp.architecture_config(family, dims), device="cpu", dtype=torch.bfloat16)
    from oscar.cache import device_cache as dc
    from oscar.config import compose

    dc.enable(model)
    fmt = tp.timed_cache(compose(["method=oscar"]).method, model)
    per_seq = tp.new_device_cache(fmt, model, 1, s.job_context, extra_steps=s.extra_steps, device="cpu").nbytes()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    machine = profile_run.Machine("cpu", budget=weights + 3.5 * per_seq)
    machine.cpu_bytes = weights
    row, _ = profile_run.measure_point(model, fmt, 4, s.job_context, s, machine)
    assert row["status"] == "OOM" and machine.cpu_bytes == weights
    bmax, tried = profile_run.max_batch(model, fmt, s.job_context, s, machine)
    assert bmax == 3 and tried[:3] == [1, 2, 4]
    row, _ = profile_run.measure_point(model, fmt, 2, s.job_context, s, machine)
    assert row["status"] == "ok" and row["step_us"] > 0 and math.isclose(row["kv_bytes"], 2 * per_seq, rel_tol=0.02)  # one spare page per cache, not per sequence


@pytest.mark.slow
def test_throughput_run_on_a_tiny_architecture(tmp_path):
    """Every part end to end on the CPU: files written, each cache at each point, the check agreeing."""
    from oscar.config import compose

    cfg = compose(["experiment=throughput", "tracking.enabled=false"])
    profile_run.run(cfg, profile_run.Settings(cfg, {**options.FLAGS, "tiny": True}), tmp_path, command="c")
    report.write_report(tmp_path)
    assert json.loads((tmp_path / "env.json").read_text())["commands"] == ["c"]
    grid = report.read_csv(tmp_path / "grid.csv")
    points = {(r["cache"], r["batch"], r["context"]) for r in grid}
    planned = {(c, b, t) for c in ("bf16", "oscar", "saw_int4", "bf16+hf") for b in (1, 2) for t in (400, 800)}
    assert planned <= points and all(t == 800 for _, _, t in points - planned)  # extras: job batches at the job context
    assert all(r["status"] == "ok" and r["step_us"] > 0 for r in grid)
    assert {r["step_path"] for r in grid} == {"fused", "hf"}  # the CPU runs the fused step uncompiled
    check = report.read_csv(tmp_path / "check.csv")
    # Teacher forced, the paths see the same history; an argmax may still flip where the CPU top-2
    # margin is a near-tie: a flip at margin m needs the two logits to move by m together, so some logit
    # moved by at least m/2. Every disagreement must be explained that way by the measured difference.
    for r in check:
        assert (r["forced_argmax_agree"] == r["tokens_total"]
                or r["forced_disagree_max_margin"] <= 2 * r["forced_max_abs_logit_diff"]), r
    assert {f["cache"] for f in report.read_csv(tmp_path / "fit.csv")} == {"bf16", "oscar", "saw_int4"}
    assert (tmp_path / "throughput.md").is_file() and (tmp_path / "env.json").is_file()


def test_tables_name_each_cache_with_its_page_layout(tmp_path):
    """Every quantized row of the report says which page layout (and so which kernel) it came from; rows
    written before the layout column existed were row pages; one folder holds one layout per cache."""
    grid = write_fixture(tmp_path)
    res = report.analyse(tmp_path)
    assert res["labels"] == {("m", "bf16"): "bf16", ("m", "oscar"): "oscar (rows)"}  # fixture rows have no layout
    for r in grid:
        r["layout"] = "-" if r["cache"] == "bf16" else "mma"
        r["attn_variant"] = "cudnn/rows" if r["cache"] == "bf16" else "v9 CUDA mma kernel, mma pages"
    report.write_csv(tmp_path / "grid.csv", grid, profile_run.GRID_KEYS)
    report.write_report(tmp_path)
    md = (tmp_path / "throughput.md").read_text()
    assert "| m | oscar (mma) | largest batch at 1000" in md and "`oscar (mma)`: v9 CUDA mma kernel, mma pages" in md
    assert "| oscar (mma) | hf | 4 | 1,000 | ok |" in md
    grid[2]["layout"] = "rows"
    report.write_csv(tmp_path / "grid.csv", grid, profile_run.GRID_KEYS)
    with pytest.raises(ValueError, match="two page layouts"):
        report.analyse(tmp_path)


def test_a_second_run_into_a_folder_replaces_only_what_it_measures():
    class S:
        parts, models, caches = ["grid", "fit", "job"], ["m"], ["oscar"]

    rows = [{"model": "m", "cache": c, "batch": b, "context": t} for c in ("bf16", "oscar") for b in (1, 8)
            for t in (100, 200)] + [{"model": "n", "cache": "oscar", "batch": 1, "context": 100}]
    remeasured = {("m", "oscar", 8, 100), ("m", "oscar", 8, 200)}
    kept = profile_run.keep_rows(rows, "grid", S, remeasured)
    assert len(kept) == len(rows) - 2 and not any((r["cache"], r["batch"]) == ("oscar", 8) for r in kept)
    fit = [{"model": "m", "cache": "bf16"}, {"model": "m", "cache": "oscar"}, {"model": "n", "cache": "oscar"}]
    assert profile_run.keep_rows(fit, "fit", S, remeasured) == [fit[0], fit[2]]
    S.parts = ["grid"]
    assert profile_run.keep_rows(fit, "fit", S, remeasured) == fit  # fit not run: all kept


def test_byte_floor_counts_the_weights_a_step_reads_and_the_cache_allocation():
    """Floor = (weights read per step + the cache's allocated bytes) / copy bandwidth: the input embedding table
    is not read by a step (it gathers B rows) unless the LM head shares it; the share is floor / step."""
    cfg = dict(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16, hidden_size=32,
               intermediate_size=64, vocab_size=100, max_position_embeddings=256)
    untied = tp.build_random_model(tp.architecture_config("qwen3", {**cfg, "tie_word_embeddings": False}),
                                   device="cpu", dtype=torch.bfloat16)
    tied = tp.build_random_model(tp.architecture_config("qwen3", {**cfg, "tie_word_embeddings": True}),
                                 device="cpu", dtype=torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in untied.parameters())
    assert profile_run.weight_bytes_read(untied) == total - 100 * 32 * 2
    assert profile_run.weight_bytes_read(tied) == sum(p.numel() * p.element_size() for p in tied.parameters())
    row = {"kv_bytes": 3 * GB, "step_us": 8000.0}
    profile_run.byte_floor(row, int(12 * GB), 4e12)
    assert row["floor_us"] == pytest.approx(15 * GB / 4e12 * 1e6) and row["floor_share"] == pytest.approx(3750 / 8000)
    oom = {"status": "OOM"}
    profile_run.byte_floor(oom, int(12 * GB), 4e12)
    assert "floor_us" not in oom  # nothing allocated, no floor


def test_baseline_rows_are_labelled_and_not_compared_as_quantized_caches(tmp_path):
    """The HF eager + graph rows (cache `<method>+hf`) get their own label and are no quantized cache of the
    speedup table; the compiled BF16 step is the one the targets measure."""
    grid = write_fixture(tmp_path)
    hf = [dict(r, cache="bf16+hf", step_path="hf", step_us=r.get("step_us", 0) * 2 if r["status"] == "ok" else None)
          for r in grid if r["cache"] == "bf16"]
    report.write_csv(tmp_path / "grid.csv", grid + hf, profile_run.GRID_KEYS)
    res = report.analyse(tmp_path)
    assert {x["cache"] for x in res["speedup"]} == {"oscar"}
    assert res["labels"][("m", "bf16+hf")] == "bf16 (HF eager + graph)"
    report.write_report(tmp_path)
    assert "| bf16 (HF eager + graph) | hf | 1 | 1,000 | ok |" in (tmp_path / "throughput.md").read_text()

"""Aggregation and rendering of tables and figures from cell result files."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from oscar.eval.runner import cell_config_hash

from oscar.eval.reporting import (
    ReportError,
    TablePlan,
    aggregate,
    latex_escape,
    pick_metric,
    render_csv,
    render_figure,
    render_latex,
    render_markdown,
    summarize,
)

ROOT = Path(__file__).resolve().parent.parent


def make_eval_plan(root: Path, accuracies: dict[tuple[str, str, int], float], spec: dict | None = None) -> Path:
    """Write result.json files and a table plan for (method, benchmark, seed) -> accuracy."""
    cells = []
    for (method, bench, seed), acc in accuracies.items():
        result_dir = f"results/eval/m/{method}/{bench}/seed{seed}"
        (root / result_dir).mkdir(parents=True, exist_ok=True)
        metrics = {"accuracy": acc, "extracted_rate": 1.0}
        if bench == "code":
            metrics = {"pass@1": acc}
        config_path = f"results/config/eval/m/{method}/{bench}/seed{seed}.yaml"
        (root / config_path).parent.mkdir(parents=True, exist_ok=True)
        (root / config_path).write_text(f"model:\n  name: m\nmethod:\n  name: {method}\n  sink: 4\n"
                                        f"benchmark:\n  name: {bench}\n  batch_size: 2\ncalibration:\n  name: default\n"
                                        f"seed: {seed}\n")
        chash = cell_config_hash(OmegaConf.load(str(root / config_path)))
        (root / result_dir / "result.json").write_text(json.dumps(
            {"model": "m", "method": method, "benchmark": bench, "seed": seed, "n": 10, "metrics": metrics,
             "stand_in_for": "gpqa-diamond" if bench == "mmlu" else None, "wall_s": 1.5, "config_hash": chash}))
        (root / result_dir / "items.jsonl").write_text('{"id": 1}\n')
        cells.append({"table": "t2", "kind": "eval", "model": "m", "method": method, "variant": "", "item": bench,
                      "benchmark": bench, "seed": seed, "overrides": [], "flags": [], "method_label": method,
                      "result_dir": result_dir, "config_path": config_path})
    spec = {"title": "Accuracy", "rows": ["method"], "columns": ["benchmark"], "metrics": ["acc"],
            "lower_is_better": False, "figure": "bar", "caption": "A caption.", **(spec or {})}
    plan = {"experiment": "exp", "table": "t2", "kind": "eval", "spec": spec, "cells": cells}
    path = root / "results/plan/exp/t2.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan))
    return path


@pytest.fixture
def eval_plan(tmp_path):
    accs = {("bf16", "mmlu", 0): 0.5, ("bf16", "mmlu", 1): 0.7, ("int2", "mmlu", 0): 0.2, ("int2", "mmlu", 1): 0.4,
            ("bf16", "code", 0): 0.3, ("bf16", "code", 1): 0.3, ("int2", "code", 0): 0.1, ("int2", "code", 1): 0.3}
    return make_eval_plan(tmp_path, accs)


def test_pick_metric_exact_alias_prefix():
    assert pick_metric(["accuracy", "score"], "acc") == "accuracy"
    assert pick_metric(["pass@1"], "acc") == "pass@1"
    assert pick_metric(["kl.next_token.serving", "kl.next_token.decode_equivalent"], "kl") == "kl.next_token.decode_equivalent"
    assert pick_metric(["ppl.serving"], "ppl.serving") == "ppl.serving"
    assert pick_metric(["x"], "acc") is None


def test_aggregate_long_table(eval_plan, tmp_path):
    long = aggregate(TablePlan.load(eval_plan), root=tmp_path)
    assert len(long) == 8 * 2 - 4  # mmlu cells carry two metrics, code cells one
    row = long[(long.method == "int2") & (long.benchmark == "mmlu") & (long.seed == 1) & (long.metric == "accuracy")]
    assert float(row.value.iloc[0]) == pytest.approx(0.4)
    assert set(long.stand_in_for[long.benchmark == "mmlu"]) == {"gpqa-diamond"}


def test_summary_means_and_stds_over_seeds(eval_plan, tmp_path):
    plan = TablePlan.load(eval_plan)
    summary = summarize(plan, aggregate(plan, root=tmp_path))
    rec = summary[(summary.method == "bf16") & (summary.benchmark == "mmlu")].iloc[0]
    assert rec["mean"] == pytest.approx(0.6)
    assert rec["std"] == pytest.approx(math.sqrt(0.02))  # sample std of 0.5, 0.7
    assert rec["seeds"] == 2
    code = summary[(summary.method == "int2") & (summary.benchmark == "code")].iloc[0]
    assert code["source_metric"] == "pass@1" and code["mean"] == pytest.approx(0.2)


def test_markdown_layout_bold_and_stand_in(eval_plan, tmp_path):
    plan = TablePlan.load(eval_plan)
    text = render_markdown(plan, summarize(plan, aggregate(plan, root=tmp_path)))
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| method"))
    assert header == "| method | mmlu (for gpqa-diamond) | code |"
    assert "| bf16 | **60.0 ± 14.1** | **30.0 ± 0.0** |" in lines
    assert "| int2 | 30.0 ± 14.1 | 20.0 ± 14.1 |" in lines
    assert "- mmlu is an offline stand-in for gpqa-diamond." in lines
    assert "A caption." in lines


def test_latex_is_escaped_booktabs(eval_plan, tmp_path):
    plan = TablePlan.load(eval_plan)
    tex = render_latex(plan, summarize(plan, aggregate(plan, root=tmp_path)))
    assert tex.startswith("\\begin{table}") and "\\toprule" in tex and "\\bottomrule" in tex
    assert "\\textbf{60.0 $\\pm$ 14.1}" in tex
    assert "\\label{tab:exp-t2}" in tex
    assert latex_escape("a_b & 5%") == "a\\_b \\& 5\\%"


def test_csv_summary_is_numeric(eval_plan, tmp_path):
    plan = TablePlan.load(eval_plan)
    out = tmp_path / "s.csv"
    out.write_text(render_csv(plan, summarize(plan, aggregate(plan, root=tmp_path))))
    frame = pd.read_csv(out)
    assert {"method", "benchmark", "metric", "mean", "std", "seeds"} <= set(frame.columns)
    assert len(frame) == 4


def test_missing_metric_and_missing_result_are_named(eval_plan, tmp_path):
    plan = TablePlan.load(eval_plan)
    plan.spec["metrics"] = ["ppl"]
    with pytest.raises(ReportError, match="no metric matching 'ppl'"):
        summarize(plan, aggregate(plan, root=tmp_path))
    (tmp_path / plan.cells[0]["result_dir"] / "result.json").unlink()
    with pytest.raises(ReportError, match=plan.cells[0]["result_dir"]):
        aggregate(plan, root=tmp_path)


def test_confidence_interval_shown_for_one_seed(tmp_path):
    result_dir = tmp_path / "results/fidelity/m/oscar/pg"
    result_dir.mkdir(parents=True)
    (result_dir / "result.json").write_text(json.dumps({"metrics": {
        "kl.next_token.decode_equivalent": 0.05, "kl.next_token.decode_equivalent.ci_lo": 0.04,
        "kl.next_token.decode_equivalent.ci_hi": 0.06}}))
    plan = TablePlan("exp", "t4", "fidelity", {"rows": ["method"], "columns": ["metric"],
                     "metrics": ["kl.next_token.decode_equivalent"], "lower_is_better": True},
                     [{"model": "m", "method": "oscar", "variant": "", "method_label": "oscar", "corpus": "pg",
                       "seed": 0, "result_dir": "results/fidelity/m/oscar/pg", "kind": "fidelity"}])
    text = render_markdown(plan, summarize(plan, aggregate(plan, root=tmp_path)))
    assert "0.05 [0.04, 0.06]" in text and "bootstrap confidence interval" in text


@pytest.mark.parametrize("figure", ["bar", "line"])
def test_summary_figures_are_png(eval_plan, tmp_path, figure):
    plan = TablePlan.load(eval_plan)
    plan.spec["figure"] = figure
    out = tmp_path / f"{figure}.png"
    render_figure(plan, summarize(plan, aggregate(plan, root=tmp_path)), out, root=tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("figure", ["per_layer", "by_position"])
def test_per_layer_figures(tmp_path, figure):
    cells = []
    for method, scale in (("int2", 1.0), ("oscar", 0.1)):
        result_dir = tmp_path / f"results/fidelity/m/{method}/pg"
        result_dir.mkdir(parents=True)
        rows = [{"layer": l, "qk_mse": scale * (l + 1), "sv_mse": scale, "attn_kl": scale,
                 "attn_kl@0-64": scale, "attn_kl@64-256": 2 * scale} for l in range(4)]
        pd.DataFrame(rows).to_csv(result_dir / "per_layer.csv", index=False)
        (result_dir / "result.json").write_text(json.dumps({"metrics": {"mse.qk": scale, "mse.sv": scale, "kl.attn": scale}}))
        cells.append({"model": "m", "method": method, "variant": "", "method_label": method, "corpus": "pg", "seed": 0,
                      "result_dir": f"results/fidelity/m/{method}/pg", "kind": "fidelity"})
    plan = TablePlan("exp", "f", "fidelity", {"rows": ["method"], "columns": ["metric"], "metrics": ["mse.qk", "mse.sv"],
                                              "figure": figure, "title": "F"}, cells)
    out = tmp_path / "f.png"
    render_figure(plan, summarize(plan, aggregate(plan, root=tmp_path)), out, root=tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verbs_aggregate_then_report(eval_plan, tmp_path):
    long = tmp_path / "results/tables/exp/t2.csv"
    run = lambda *args: subprocess.run([sys.executable, "-m", "oscar", *args], cwd=tmp_path, capture_output=True,
                                       text=True, check=False, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    agg = run("aggregate", "--plan", str(eval_plan), "--output", str(long))
    assert agg.returncode == 0, agg.stderr
    rep = run("report", "--plan", str(eval_plan), "--table", str(long), "--output-dir", "reports/exp",
              "--formats", "csv", "md", "tex", "png")
    assert rep.returncode == 0, rep.stderr
    for ext in ("csv", "md", "tex", "png"):
        assert (tmp_path / f"reports/exp/t2.{ext}").stat().st_size > 0
    (tmp_path / "results/eval/m/bf16/mmlu/seed0/result.json").write_text("{broken")
    bad = run("aggregate", "--plan", str(eval_plan), "--output", str(long))
    assert bad.returncode == 1 and "results/eval/m/bf16/mmlu/seed0/result.json" in bad.stderr


def test_aggregate_refuses_a_cell_made_with_other_settings(eval_plan, tmp_path):
    """An ad-hoc run written into a planned cell folder (its config hash differs) is never aggregated."""
    result = tmp_path / "results/eval/m/int2/mmlu/seed1/result.json"
    data = json.loads(result.read_text())
    data["config_hash"] = "0123456789abcdef"
    result.write_text(json.dumps(data))
    with pytest.raises(ReportError, match=r"int2/mmlu/seed1/result.json was made with other settings.*--forcerun"):
        aggregate(TablePlan.load(eval_plan), root=tmp_path)


def _write_items(root: Path, method: str, predictions: list[str]) -> None:
    path = root / f"results/eval/m/{method}/mmlu/seed0/items.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prediction": p}) + "\n" for i, p in enumerate(predictions)))


def test_reference_metrics_agree_and_prefix(tmp_path):
    """agree/prefix against the reference method's cell; the reference row is exactly 1 with a zero-width interval."""
    plan_path = make_eval_plan(tmp_path, {("bf16", "mmlu", 0): 0.5, ("int2", "mmlu", 0): 0.3},
                               spec={"reference": "bf16", "item_metrics": {"mmlu": ["agree", "prefix"]}})
    _write_items(tmp_path, "bf16", ["abcd", "A", "B", "C"])
    _write_items(tmp_path, "int2", ["abXY", "A", "D", "C"])
    plan = TablePlan.load(plan_path)
    long = aggregate(plan, root=tmp_path)
    got = {(r.method, r.metric): r.value for r in long.itertuples()}
    assert got[("int2", "agree")] == pytest.approx(0.5)
    assert got[("int2", "prefix")] == pytest.approx((0.5 + 1 + 0 + 1) / 4)
    assert got[("bf16", "agree")] == 1.0 and got[("bf16", "agree.ci_lo")] == 1.0 and got[("bf16", "agree.ci_hi")] == 1.0
    assert got[("int2", "agree.ci_lo")] <= 0.5 <= got[("int2", "agree.ci_hi")]
    summary = summarize(plan, long)
    assert set(summary.metric) == {"agree", "prefix"}  # item_metrics replace `metrics` for mmlu
    text = render_markdown(plan, summary)
    assert "mmlu (for gpqa-diamond) / agree %" in text and "100.0 [100.0, 100.0]" in text


def test_reference_cell_missing_is_named(tmp_path):
    plan_path = make_eval_plan(tmp_path, {("int2", "mmlu", 0): 0.3}, spec={"reference": "bf16"})
    with pytest.raises(ReportError, match="compares with 'bf16'"):
        aggregate(TablePlan.load(plan_path), root=tmp_path)


def test_report_files_are_readable_by_others(eval_plan, tmp_path):
    """Atomic writes go through mkstemp (0600); the files users get follow the umask like any other."""
    import os

    plan = TablePlan.load(eval_plan)
    summary = summarize(plan, aggregate(plan, root=tmp_path))
    old = os.umask(0o022)
    try:
        render_figure(plan, summary, tmp_path / "fig.png", root=tmp_path)
        from oscar.core.files import atomic_write_text

        atomic_write_text(tmp_path / "t.md", render_markdown(plan, summary))
    finally:
        os.umask(old)
    assert (tmp_path / "fig.png").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "t.md").stat().st_mode & 0o777 == 0o644

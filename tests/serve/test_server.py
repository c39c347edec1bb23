"""`python -m sglang.launch_server --attention-backend oscar` as a managed subprocess (oscar.serve.server):
start, one batched OpenAI-compatible request of several prompts, stop with the port freed and no process
left; bad input refused at start-up with a clear message, a non-zero exit and nothing left running."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from oscar.serve.server import SGLangServer, ServerError, group_alive, port_in_use
from serve_helpers import save_in_code_artifact

ARGS = ["--device", "cpu", "--dtype", "float32", "--disable-radix-cache", "--chunked-prefill-size", "-1",
        "--max-running-requests", "8", "--max-total-tokens", "4096", "--mem-fraction-static", "0.5",
        "--attention-backend", "oscar"]


@pytest.fixture(scope="module")
def quarot(tiny_llama, tmp_path_factory):
    return save_in_code_artifact(tiny_llama, "quarot", tmp_path_factory.mktemp("art") / "quarot")


def test_start_batched_request_stop(tiny_llama, quarot, tmp_path):
    env = {"OSCAR_ARTIFACT": str(quarot), "OSCAR_SINK": "4", "OSCAR_RECENT": "8"}
    server = SGLangServer(str(tiny_llama), ARGS, env=env, log_path=tmp_path / "server.log")
    with server:
        pgid = server.proc.pid
        prompts = ["The quick brown fox", "def main(): return 42", "Calibration text for a tiny model:"]
        out = server.post("/v1/completions", {"model": str(tiny_llama), "prompt": prompts, "max_tokens": 20,
                                               "temperature": 0})
        assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2]
        assert all(c["finish_reason"] == "length" for c in out["choices"])
        assert out["usage"]["completion_tokens"] == 60
    assert not group_alive(pgid)
    assert not port_in_use(server.host, server.port)
    assert "OSCAR KV pool: INT2" in (tmp_path / "server.log").read_text()


def _refused(tmp_path: Path, model: Path, env: dict[str, str], expect: str) -> None:
    server = SGLangServer(str(model), ARGS, env=env, log_path=tmp_path / "server.log", startup_timeout_s=300)
    with pytest.raises(ServerError) as err:
        server.start()
    msg = str(err.value)
    assert "exited with code" in msg and "exited with code 0" not in msg, msg[-2000:]
    assert expect in msg, msg[-3000:]
    assert server.proc is None and not port_in_use(server.host, server.port)
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmd_has(p, str(server.port))]


def _cmd_has(proc_dir: Path, port: str) -> bool:
    try:
        cmd = (proc_dir / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"sglang.launch_server" in cmd and port.encode() in cmd


# Each refusal below is a real server launch (~20 s of imports on this CPU); the other refusals of the same
# check (no OSCAR_ARTIFACT, a corrupt artifact, bits/group mismatch, sliding-window and MLA configs) are
# tested on oscar.serve.settings directly in tests/test_serve_settings.py.


def test_missing_artifact_refused(tiny_llama, tmp_path):
    _refused(tmp_path, tiny_llama, {"OSCAR_ARTIFACT": str(tmp_path / "nowhere")}, "is not a directory")


def test_other_models_artifact_refused(tiny_llama, tmp_path):
    from oscar.models.tiny import save_random_model

    other = save_random_model("llama", tmp_path / "other", num_layers=3)
    foreign = save_in_code_artifact(other, "quarot", tmp_path / "foreign")
    _refused(tmp_path, tiny_llama, {"OSCAR_ARTIFACT": str(foreign)}, "config_hash")


def test_unsupported_architecture_refused(tiny_llama, quarot, tmp_path):
    model = tmp_path / "mistral"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16)
    (model / "config.json").write_text(json.dumps(cfg))
    _refused(tmp_path, model, {"OSCAR_ARTIFACT": str(quarot)}, "cannot serve this model")


CHILD = """
import sys, time
from pathlib import Path
from oscar.serve.server import SGLangServer
args = {args!r}
srv = SGLangServer({model!r}, args, env={env!r}, log_path=Path({log!r}))
with srv:
    print("UP", srv.port, srv.proc.pid, flush=True)
    time.sleep(600)
"""


def test_ctrl_c_stops_the_server(tiny_llama, quarot, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from oscar.serve.server import group_alive

    code = CHILD.format(args=ARGS, model=str(tiny_llama), env={"OSCAR_ARTIFACT": str(quarot)},
                        log=str(tmp_path / "server.log"))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = ""
    deadline = time.monotonic() + 600
    while not line.startswith("UP") and time.monotonic() < deadline:
        line = child.stdout.readline()
        if not line and child.poll() is not None:
            break
    assert line.startswith("UP"), (line, (tmp_path / "server.log").read_text()[-3000:])
    _, port, pgid = line.split()
    child.send_signal(signal.SIGINT)
    assert child.wait(timeout=120) != 0  # KeyboardInterrupt propagated after the server was stopped
    assert not group_alive(int(pgid))
    assert not port_in_use("127.0.0.1", int(port))


def test_cpu_engine_variable_only_for_cpu_servers(monkeypatch):
    """``SGLANG_USE_CPU_ENGINE=1`` goes to a ``--device cpu`` server (and one naming no device, as before), never to
    a GPU server (SGLang would take the GPU host for a CPU one); a value the caller set is kept."""
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert SGLangServer("m", ["--device", "cpu"], port=1).child_env()["SGLANG_USE_CPU_ENGINE"] == "1"
    assert SGLangServer("m", [], port=1).child_env()["SGLANG_USE_CPU_ENGINE"] == "1"
    gpu = SGLangServer("m", ["--device", "cuda", "--dtype", "bfloat16"], env={"OSCAR_SINK": "64"}, port=1)
    assert gpu.device == "cuda" and "SGLANG_USE_CPU_ENGINE" not in gpu.child_env()
    assert gpu.child_env()["OSCAR_SINK"] == "64"
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "0")
    assert SGLangServer("m", ["--device", "cpu"], port=1).child_env()["SGLANG_USE_CPU_ENGINE"] == "0"


def test_engine_sglang_refuses_a_float32_model_on_a_gpu():
    """SGLang's CUDA RMSNorm has no float32 kernel (measured on the H200, reports/serving/gpu_correctness.md): the
    runner's engine refuses at once, naming the setting, before any model or server is touched."""
    from oscar.config import compose
    from oscar.serve.client import SGLangEngine

    cfg = compose(["engine=sglang", "device=cuda", "model.dtype=float32", "method=quarot", "method.clip=paper"])
    with pytest.raises(ValueError, match=r"model.dtype=float32.*model.dtype=bfloat16"):
        SGLangEngine(cfg)

"""The soak table (``python -m oscar gpu soak``): one SGLang server as a user starts it (``--attention-backend oscar``
and nothing else that OSCAR needs: the plugin's serving defaults fill in the page size, prefill graphs and request
slots; CUDA graphs and the radix cache on, SGLang's chunked prefill), dummy weights of ``model=`` (default: the
bundle's Qwen3-8B) and a timing artifact of ``format=`` (default ``channel``: the default ``auto`` format, per-channel
keys on every layer), driven for ``seconds`` by ``oscar.serve.soak``: prompts of ``lengths`` tokens from ``workers``
threads, radix hits, misses and aborted streams, a pool of ``pool`` tokens (``--max-total-tokens``; 0: SGLang's
default sizing) small enough that the requests in flight fill it, so that requests queue and running ones are
retracted. The checks (``oscar.serve.soak.run``): every request answered, the server healthy after SGLang's strict
idle leak check (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1``), the pool's free tokens as before, GPU memory
growth within ``memory_slack_mib``, and greedy samples equal to the same samples sent to the fresh server before the
run. Writes ``soak.json`` (the driver's report, the server's log counts) and ``soak.md``; the server log under
``logs/soak_server.log``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from oscar.bench import host
from oscar.bench.serving.formats import FORMATS
from oscar.bench.serving.spec import model_dir, oscar_engine_needs
from oscar.core.files import atomic_write_json, atomic_write_text
from oscar.serve.server import SGLangServer
from oscar.serve.soak import run

AREA = "serving"
SUMMARY = "soak of the served default: minutes of mixed requests (1k-100k tokens, hits, aborts, a full pool), then leak checks"
DEFAULTS: dict[str, Any] = {
    "format": "channel",  # the served format's timing artifact (oscar.bench.serving.formats.FORMATS)
    "model": "",
    "seconds": 240,
    "lengths": "1000,8000,30000,100000",
    "workers": 12,
    "pool": 300000,  # --max-total-tokens: below what 12 workers keep in flight (~12 x 35k), so requests queue
    "new_tokens": 32,
    "samples": 4,
    "memory_slack_mib": 512,
    "sink": 64,
    "recent": 256,
    "startup_s": 900,
}
# what dummy weights need; everything else is SGLang's default or the plugin's serving default
SERVER_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--sampling-backend", "pytorch",
               "--grammar-backend", "none", "--attention-backend", "oscar"]
# the server's log lines counted in the report
LOG_COUNTS = {"tracebacks": r"Traceback", "leak": r"memory leak detected|token_to_kv_pool_allocator memory leak",
              "retracted": r"[Rr]etract", "out_of_memory": r"out of memory|OutOfMemoryError",
              "cuda_graph_captured": r"Capture cuda graph end|Capture (decode )?cuda graph.*end"}


def stem(opts: dict[str, Any]) -> str:
    return "soak"


def _lengths(opts: dict[str, Any]) -> list[int]:
    try:
        vals = [int(x) for x in str(opts["lengths"]).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"lengths={opts['lengths']!r}: expected comma-separated token counts, e.g. 1000,8000") from None
    if not vals or min(vals) < 16:
        raise ValueError(f"lengths={opts['lengths']!r}: expected comma-separated token counts of at least 16")
    return vals


def server_args(opts: dict[str, Any]) -> list[str]:
    """The server's flags: what dummy weights need, ``--attention-backend oscar`` and the pool's size."""
    return SERVER_ARGS + (["--max-total-tokens", str(int(opts["pool"]))] if int(opts["pool"]) else [])


def needs(opts: dict[str, Any]) -> list[host.Need]:
    if opts["format"] not in FORMATS:
        raise ValueError(f"format={opts['format']!r}; valid: {', '.join(FORMATS)}")
    _lengths(opts)
    return oscar_engine_needs(opts)


def log_counts(text: str) -> dict[str, int]:
    """How often each of ``LOG_COUNTS``' patterns occurs in the server's log."""
    return {k: len(re.findall(p, text)) for k, p in LOG_COUNTS.items()}


def measure(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
    from oscar.bench.serving.timing_artifact import write_timing_artifact  # local: keeps torch out of `gpu --help`

    art = Path(tempfile.gettempdir()) / "oscar_soak_artifact" / str(opts["format"])
    print(write_timing_artifact(model_dir(opts), art, mu=True, sink=int(opts["sink"]), recent=int(opts["recent"]),
                                fmt=str(opts["format"])), flush=True)
    vocab = int(json.loads((model_dir(opts) / "config.json").read_text())["vocab_size"])
    log = out / "logs" / "soak_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    extra = host.sglang_env({"OSCAR_ARTIFACT": str(art), "OSCAR_SINK": str(opts["sink"]),
                             "OSCAR_RECENT": str(opts["recent"]), "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"})
    args = server_args(opts)
    env["server"] = {"args": args, "artifact_format": opts["format"], "sink": opts["sink"], "recent": opts["recent"]}
    a = argparse.Namespace(vocab=vocab, lengths=str(opts["lengths"]), seconds=float(opts["seconds"]),
                           max_requests=100_000, workers=int(opts["workers"]), new_tokens=int(opts["new_tokens"]),
                           samples=int(opts["samples"]), idle_s=5.0, request_timeout_s=600.0, gpu_memory=True,
                           memory_slack_mib=int(opts["memory_slack_mib"]))
    server = SGLangServer(str(model_dir(opts)), args, env=extra, python=sys.executable, log_path=log,
                          startup_timeout_s=float(opts["startup_s"]))
    try:
        with server:
            rep = run(server.url, a)
            rep["server_alive_at_end"] = server.proc is not None and server.proc.poll() is None
    except Exception as err:  # noqa: BLE001 - a server that dies is the soak's finding: reported, not lost
        rep = {"ok": False, "error": f"{type(err).__name__}: {str(err)[-3000:]}"}
    rep["log_counts"] = log_counts(log.read_text(errors="replace")) if log.exists() else {}
    if rep["log_counts"].get("tracebacks") or rep["log_counts"].get("leak"):
        rep["ok"] = False
    rep["command_server"] = " ".join(["python -m sglang.launch_server --model-path", str(model_dir(opts)), *args])
    atomic_write_json(out / "soak.json", rep)
    print(json.dumps({k: rep.get(k) for k in ("ok", "checks", "stats", "log_counts", "error")}, default=str)[:3000],
          flush=True)


def _md(rep: dict[str, Any], env: dict[str, Any]) -> str:
    checks, stats, counts = rep.get("checks", {}), rep.get("stats", {}), rep.get("log_counts", {})
    s = rep.get("settings", {})
    lines = ["# Soak of the served default", "",
             host.hardware_line(env) if env else "", "",
             f"Command: `{env.get('command', '')}`. Server: `{rep.get('command_server', '')}` with a timing artifact "
             f"of the `{env.get('server', {}).get('artifact_format', '?')}` format (sink "
             f"{env.get('server', {}).get('sink', '?')}, recent {env.get('server', {}).get('recent', '?')}), "
             "`SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1`; everything else at SGLang's defaults and the plugin's "
             "serving defaults (CUDA graphs, radix cache, chunked prefill on). Driver: `oscar.serve.soak` "
             f"({s.get('workers', '?')} workers, prompts of {s.get('lengths', '?')} tokens, "
             f"{s.get('new_tokens', '?')} new tokens each, {s.get('seconds', '?')} s).", "",
             f"**Verdict: {'clean' if rep.get('ok') else 'NOT clean'}.**", ""]
    if rep.get("error"):
        lines += ["The server failed:", "", "```", rep["error"][-2000:], "```", ""]
    lines += ["| check | result |", "|---|---|",
              f"| requests sent / answered / aborted on purpose / failed | {stats.get('sent', '-')} / "
              f"{stats.get('done', '-')} / {stats.get('aborted', '-')} / {stats.get('failed', '-')} |",
              f"| of which radix hits (shared prefix) | {stats.get('hits', '-')} |",
              f"| prompt tokens sent | {stats.get('tokens_in', '-'):,} |" if isinstance(stats.get('tokens_in'), int)
              else "| prompt tokens sent | - |",
              f"| wall (s) | {stats.get('wall_s', '-')} |",
              f"| healthy after the idle leak check | {checks.get('healthy_after', '-')} |",
              f"| pool's free tokens before / after | {' / '.join(str(x) for x in rep.get('free_tokens', ['-', '-']))} |",
              f"| GPU memory before / after (MiB) | {' / '.join(str(x) for x in rep.get('gpu_memory_mib', ['-', '-']))} |",
              f"| greedy samples equal to the fresh server's | {checks.get('greedy_equal', '-')} |",
              "| server log: tracebacks / leak reports / retract lines / out-of-memory | "
              f"{counts.get('tracebacks', '-')} / {counts.get('leak', '-')} / {counts.get('retracted', '-')} / "
              f"{counts.get('out_of_memory', '-')} |"]
    if stats.get("errors"):
        lines += ["", "Failed requests (first 10):", ""] + [f"- `{e}`" for e in stats["errors"]]
    return "\n".join(lines) + "\n"


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
    path = out / "soak.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no soak report (run `python -m oscar gpu soak out={out}` on a GPU first)")
    rep = json.loads(path.read_text())
    env = host.read_env(out / "soak_env.json")
    atomic_write_text(out / "soak.md", _md(rep, env))
    return [out / "soak.md", path]


def track(out: Path, opts: dict[str, Any], uri: str) -> str:
    return "none (the soak writes soak.{md,json} only)"

"""A short soak of the served default format on SGLang's CPU engine (`oscar.serve.soak`; the GPU run is the same
driver against the production server, benchmarks/README.md).

Tiny random Llama (vocab 320), an artifact whose layers both have per-channel keys over blocks of 32 (`auto`'s
default format) in pages of 32, the radix cache on, chunked prefill of 64 tokens, a pool of 1,536 tokens for 4
running requests (long prompts fill it: requests queue and are retracted). 4 workers send 36 requests of 40 to 600
tokens for at most 150 s: shared prefixes (radix hits), misses and aborted streams. Then: every request answered,
the server healthy after the idle self-check (SGLang stops a server whose allocator leaked; strict on 0.5.23), the
pool's free tokens as before, and 3 greedy samples equal to the same samples sent before the run.
"""

from __future__ import annotations

import argparse

import pytest

from oscar.serve.server import SGLangServer

pytestmark = pytest.mark.slow


def test_soak_of_the_per_channel_default_on_the_cpu_engine(tiny_llama, tmp_path):
    from oscar.serve.soak import run
    from test_pool_channel import _channel_artifact

    art = _channel_artifact(tiny_llama, "quarot", tmp_path / "art", [32, 32])
    args = ["--device", "cpu", "--dtype", "float32", "--page-size", "32", "--chunked-prefill-size", "64",
            "--max-running-requests", "4", "--max-total-tokens", "1536", "--mem-fraction-static", "0.5",
            "--attention-backend", "oscar"]
    env = {"OSCAR_ARTIFACT": str(art), "OSCAR_SINK": "0", "OSCAR_RECENT": "32", "OSCAR_PREFIX_REUSE": "quantized",
           "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}  # quantized reuse: hits take cached INT2 pages
    server = SGLangServer(str(tiny_llama), args, env=env, log_path=tmp_path / "server.log", startup_timeout_s=600)
    opts = argparse.Namespace(vocab=320, lengths="40,120,300,600", seconds=150.0, max_requests=36, workers=4,
                              new_tokens=8, samples=3, idle_s=3.0, request_timeout_s=300.0, gpu_memory=False,
                              memory_slack_mib=0)
    with server:
        rep = run(server.url, opts)
        log = server.log_tail(200_000)
    assert rep["stats"]["done"] + rep["stats"]["aborted"] == rep["stats"]["sent"] >= 20, rep
    assert rep["stats"]["hits"] >= 3 and rep["stats"]["aborted"] >= 1, rep["stats"]
    assert rep["ok"], (rep, log[-4000:])
    assert "memory leak detected" not in log and "Traceback" not in log, log[-4000:]

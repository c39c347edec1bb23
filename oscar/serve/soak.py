"""A soak run of a served model: mixed requests for a while, then the checks a long-lived server must pass.

    python -m oscar.serve.soak --url http://127.0.0.1:30000 --vocab 32000 --lengths 1000,8000,30000,100000 \
        --seconds 300 --workers 8 --out soak.json

The run (`soak`) sends, from ``workers`` threads and for at most ``seconds`` (and ``max_requests``), greedy
``/generate`` requests of random token ids whose lengths are drawn from ``lengths``: a share of them repeats one of
a few shared prefixes (radix hits, a new tail each time), a share is aborted (streamed, the connection closed after
the first chunk: SGLang aborts a request whose client left), and the rest are misses. Enough concurrent long prompts
fill the pool, so requests queue and running ones are retracted. Every request is bounded in time.

The checks (`check`): the server answered every request that was not aborted and is healthy afterwards; after a
flush of the radix cache and a pause, SGLang's own idle self-check (the scheduler compares the allocator's free
list with the pool's size whenever it is idle, and stops the server on a leak) has not fired; the pool's free
tokens after the run equal those before it (``/get_server_info``'s ``available_kv_tokens`` where SGLang reports it);
GPU memory in use after the run (``--gpu-memory``: ``nvidia-smi``) within ``memory_slack_mib`` of before; and a
sample of greedy outputs, sent one at a time after the flush, equal to the same sample sent to the server before
the run (same batch shape and settings: equal by construction, so any difference is state the run left behind).
Only loopback addresses are allowed as targets.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Optional

from oscar.core.files import atomic_write_text

def _post(url: str, path: str, payload: dict, timeout_s: float) -> Any:
    req = urllib.request.Request(url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _get(url: str, path: str, timeout_s: float = 30.0) -> Any:
    with urllib.request.urlopen(url + path, timeout=timeout_s) as resp:
        body = resp.read()
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")


def _abort_after_first_chunk(url: str, payload: dict, timeout_s: float) -> None:
    req = urllib.request.Request(url + "/generate", data=json.dumps({**payload, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        resp.readline()  # the first chunk; closing the connection aborts the request server-side


def greedy(url: str, ids: list[int], new_tokens: int, timeout_s: float) -> list[int]:
    """One greedy request's output token ids."""
    out = _post(url, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,
                                                                          "ignore_eos": True}}, timeout_s)
    out = out[0] if isinstance(out, list) else out
    return [int(t) for t in out.get("output_ids") or out.get("meta_info", {}).get("output_ids") or []]


def available_tokens(url: str) -> Optional[int]:
    """The pool's free tokens as SGLang reports them (``/get_server_info``), or None where it does not."""
    try:
        info = _get(url, "/get_server_info")
    except (urllib.error.URLError, OSError):
        return None
    states = info.get("internal_states") if isinstance(info, dict) else None
    for state in states or []:
        for key in ("available_kv_tokens", "#available_kv_tokens", "available_tokens"):
            if key in state:
                return int(state[key])
    return None


def gpu_memory_mib() -> Optional[int]:
    """GPU memory in use (MiB, the first GPU) from nvidia-smi, or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def sample_prompts(vocab: int, n: int, length: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def soak(url: str, *, vocab: int, lengths: list[int], seconds: float, workers: int, max_requests: int,
         new_tokens: int = 16, hit_share: float = 0.3, abort_share: float = 0.1, prefixes: int = 3,
         request_timeout_s: float = 600.0, seed: int = 0) -> dict[str, Any]:
    """The mixed load (module docstring); returns counts and timings."""
    rng = random.Random(seed)
    shared = [[rng.randrange(10, vocab) for _ in range(max(lengths))] for _ in range(prefixes)]
    lock = threading.Lock()
    stats: dict[str, Any] = {"sent": 0, "done": 0, "hits": 0, "aborted": 0, "failed": 0, "errors": [],
                             "tokens_in": 0}
    deadline = time.monotonic() + seconds

    def next_request() -> Optional[tuple[str, dict]]:
        with lock:
            if stats["sent"] >= max_requests or time.monotonic() > deadline:
                return None
            stats["sent"] += 1
            n = rng.choice(lengths)
            kind = rng.random()
            if kind < hit_share and n > 16:  # a shared prefix, then a new tail of up to an eighth of it
                tail = max(1, n // 8)
                ids = shared[rng.randrange(prefixes)][: n - tail] + [rng.randrange(10, vocab) for _ in range(tail)]
                what = "hit"
            else:
                ids = [rng.randrange(10, vocab) for _ in range(n)]
                what = "abort" if kind < hit_share + abort_share else "miss"
            stats["tokens_in"] += n
        return what, {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens,
                                                            "ignore_eos": True}}

    def worker() -> None:
        while (job := next_request()) is not None:
            what, payload = job
            try:
                if what == "abort":
                    _abort_after_first_chunk(url, payload, request_timeout_s)
                else:
                    _post(url, "/generate", payload, request_timeout_s)
                with lock:
                    stats["aborted" if what == "abort" else "done"] += 1
                    stats["hits"] += what == "hit"
            except Exception as err:  # noqa: BLE001 - counted and reported, the run goes on
                with lock:
                    stats["failed"] += 1
                    if len(stats["errors"]) < 10:
                        stats["errors"].append(f"{what}: {type(err).__name__}: {str(err)[:300]}")

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + request_timeout_s + 60)
    stats["wall_s"] = round(time.monotonic() - t0, 1)
    return stats


def run(url: str, a: argparse.Namespace) -> dict[str, Any]:
    """Sample before, soak, flush and idle, sample after; the report (``ok`` and the failed checks)."""
    host = urllib.parse.urlparse(url).hostname or ""
    if not (host.startswith("127.") or host in ("localhost", "::1")):
        raise SystemExit(f"--url {url}: a soak run targets this machine only (127.0.0.0/8, localhost, [::1])")
    lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    sample = sample_prompts(a.vocab, a.samples, min(lengths))
    mem0 = gpu_memory_mib() if a.gpu_memory else None
    before = [greedy(url, p, a.new_tokens, a.request_timeout_s) for p in sample]
    _get_or_post_flush(url)
    free0 = available_tokens(url)
    stats = soak(url, vocab=a.vocab, lengths=lengths, seconds=a.seconds, workers=a.workers,
                 max_requests=a.max_requests, new_tokens=a.new_tokens, request_timeout_s=a.request_timeout_s)
    time.sleep(a.idle_s)  # the scheduler's idle self-check runs now
    _get_or_post_flush(url)
    time.sleep(a.idle_s)
    healthy = _healthy(url)
    free1 = available_tokens(url)
    after = [greedy(url, p, a.new_tokens, a.request_timeout_s) for p in sample] if healthy else []
    mem1 = gpu_memory_mib() if a.gpu_memory else None
    equal = sum(x == y for x, y in zip(before, after))
    checks = {
        "no_failed_request": stats["failed"] == 0,
        "healthy_after": healthy,
        "free_tokens_restored": None if free0 is None or free1 is None else free1 == free0,
        "gpu_memory_growth_mib": None if mem0 is None or mem1 is None else mem1 - mem0,
        "greedy_equal": f"{equal}/{len(sample)}",
    }
    ok = (checks["no_failed_request"] and healthy and checks["free_tokens_restored"] is not False
          and equal == len(sample)
          and (checks["gpu_memory_growth_mib"] is None or checks["gpu_memory_growth_mib"] <= a.memory_slack_mib))
    return {"ok": bool(ok), "checks": checks, "stats": stats, "free_tokens": [free0, free1], "gpu_memory_mib": [mem0, mem1],
            "settings": {k: v for k, v in vars(a).items() if k != "url"}}


def _get_or_post_flush(url: str) -> None:
    """``/flush_cache`` (SGLang takes GET or POST depending on the version); a busy server refuses: retried."""
    for _ in range(30):
        for method in ("POST", "GET"):
            try:
                req = urllib.request.Request(url + "/flush_cache", method=method, data=b"" if method == "POST" else None)
                with urllib.request.urlopen(req, timeout=60) as resp:
                    if resp.status == 200:
                        return
            except urllib.error.HTTPError as err:
                if err.code in (404, 405):
                    continue
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(1.0)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=60) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--vocab", type=int, required=True, help="token ids are drawn from [10, vocab)")
    ap.add_argument("--lengths", default="1000,8000,30000,100000", help="prompt lengths (tokens), comma-separated")
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--max-requests", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4, help="greedy prompts compared before and after")
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--gpu-memory", action="store_true", help="check GPU memory growth with nvidia-smi")
    ap.add_argument("--memory-slack-mib", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    rep = run(a.url, a)
    text = json.dumps(rep, indent=1, default=str)
    print(text)
    if a.out:
        atomic_write_text(a.out, text + "\n")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

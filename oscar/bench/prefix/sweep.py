"""Prefix-hit sweep (the paper's Fig. 6): one job of N requests sharing a prefix, through SGLang's offline Engine.

    python -m oscar.bench.prefix.sweep --model-path M --attention-backend oscar|flashinfer|... --out rows.jsonl \
        [--tag T] [--requests 8] [--input-len 30000] [--output-len 16] [--ratios 0,0.25,0.5,0.75,0.99] \
        [--check-hit] [--profile DIR] [--time-limit S] [--engine KEY=VALUE ...]

The radix cache is on. For each ratio ``r`` the cache is flushed, then the job (``N`` prompts of ``--input-len``
random token ids whose first ``round(r * input_len)`` tokens are shared, the rest unique; seeded, so every
backend gets the same prompts) is submitted at once through ``Engine.async_generate`` (streaming): SGLang's
scheduler computes the shared prefix once and later requests hit it in the tree. One JSON line per ratio:
``job_s`` (first submit to last token), ``job_tokens_per_s`` (prompt + output tokens / job_s), ``ttft_mean_s`` /
``ttft_p50_s`` / ``ttft_max_s``, ``cached_tokens`` (SGLang's own count of prompt tokens served from the cache),
and the greedy tokens of the last request. ``--check-hit``: also one prompt of the ``0.99`` shape generated twice
(cold, then hitting its own cached prefix) -> ``check`` row with both token lists and ``first_logprob_gap``, the
largest difference of the first token's top-2 log-probabilities between the two. ``--profile DIR``: one prompt of
the ``0.99`` shape cold, then hitting its cached prefix twice, first unprofiled, then each request under SGLang's
``torch.profiler`` in the scheduler process (the second hit also with Python stacks); the traces go to
``DIR/traces/<name>/`` and their summary (``oscar.bench.prefix.profile``) to ``DIR/prefix_profile.{md,json}``; set
``OSCAR_PROFILE_LABELS=1`` for the plugin's phases. ``--ratios ""`` runs no sweep.

The oscar plugin is loaded through its ``sglang.srt.plugins`` entry point (the checkout installed with
``pip install --no-deps -e .``; ``python -m oscar gpu prefix`` checks it). ``python -m oscar gpu prefix`` runs
two of these processes (flashinfer and OSCAR) and writes the report.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from oscar.bench import host
from oscar.bench.prefix import profile as prefix_profile


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def prompts(n: int, length: int, ratio: float, seed: int, vocab: int = 30000) -> list[list[int]]:
    """``n`` seeded prompts of ``length`` token ids sharing their first ``round(ratio * length)``."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab) for _ in range(round(ratio * length))]
    return [shared + [rng.randrange(100, vocab) for _ in range(length - len(shared))] for _ in range(n)]


async def _one(engine: Any, ids: list[int], sampling: dict, t0: float, **extra: Any) -> dict[str, Any]:
    first, out, meta = None, [], {}
    gen = await engine.async_generate(input_ids=ids, sampling_params=sampling, stream=True, **extra)
    first_top = None
    async for chunk in gen:
        if first is None:
            first = time.perf_counter() - t0
        if first_top is None:  # the first token's top log-probabilities (cumulative or incremental streaming)
            first_top = (chunk.get("meta_info", {}).get("output_top_logprobs") or [None])[0]
        ids = list(chunk.get("output_ids") or [])
        out = ids if ids[: len(out)] == out else out + ids  # cumulative or incremental streaming
        meta = chunk.get("meta_info", meta)
    return dict(ttft=first, end=time.perf_counter() - t0, output_ids=out, cached=int(meta.get("cached_tokens", 0)),
                first_top=first_top)


async def _job(engine: Any, batch: list[list[int]], sampling: dict,
               **extra: Any) -> tuple[float, list[dict[str, Any]]]:
    t0 = time.perf_counter()
    res = await asyncio.gather(*(_one(engine, ids, sampling, t0, **extra) for ids in batch))
    return max(r["end"] for r in res), list(res)


def first_logprob_gap(cold: Any, hit: Any) -> Any:
    """Largest difference of the first generated token's top-2 log-probabilities (SGLang's ``output_top_logprobs``
    entries ``(logprob, token id, text)``) over the tokens both runs list; None when either is missing."""
    if not cold or not hit:
        return None
    a, b = ({int(t[1]): float(t[0]) for t in top} for top in (cold, hit))
    common = set(a) & set(b)
    return max(abs(a[t] - b[t]) for t in common) if common else None


def _profiled(engine: Any, ids: list[int], sampling: dict, folder: Path, stack: bool) -> dict[str, Any]:
    """One request under SGLang's profiler (started before it is submitted, stopped once it finished)."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    engine.start_profile(output_dir=str(folder), activities=["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"],
                         with_stack=stack, record_shapes=False, profile_id=folder.name)
    try:
        _, (res,) = engine.loop.run_until_complete(_job(engine, [ids], sampling))
    finally:
        engine.stop_profile()
    return res


def profile_hits(engine: Any, a: argparse.Namespace, sampling: dict, base: dict[str, Any], out: Path) -> list[Path]:
    """``--profile``: cold, hit, hit again unprofiled, then the same under the profiler; writes the summary."""
    (ids,) = prompts(1, a.input_len, 0.99, a.seed + 777, a.vocab)
    plain: dict[str, dict[str, Any]] = {}
    engine.flush_cache()
    for name in ("cold", "hit", "hit2"):
        _, (plain[name],) = engine.loop.run_until_complete(_job(engine, [ids], sampling))
    engine.flush_cache()
    short = dict(sampling, max_new_tokens=min(2, int(sampling["max_new_tokens"])))  # the prefill and one decode step
    results = []
    for name, stack in (("cold", False), ("hit", False), ("hit2_stack", True)):
        res = _profiled(engine, ids, short, out / "traces" / name, stack)
        trace = prefix_profile.find_trace(out / "traces" / name)
        results.append(dict(name=name, ttft_s=res["ttft"], ttft_unprofiled_s=plain[name.split("_")[0]]["ttft"],
                            cached=res["cached"], cached_unprofiled=plain[name.split("_")[0]]["cached"],
                            trace=str(trace.relative_to(out)), summary=prefix_profile.summarize(prefix_profile.read_trace(trace))))
    header = [f"# Where a prefix hit's time goes: {a.attention_backend}, one prompt of {a.input_len} tokens, 99% then cached",
              "", f"SGLang {base['sglang']}, {base['device']}, page size {base['page_size']}, CUDA graphs "
              f"{base['cuda_graph']}; `oscar.bench.prefix.sweep --profile` (`python -m oscar gpu prefix profile=1`). "
              "Unprofiled: the prompt cold, then hitting its cached prefix twice (TTFT as served, "
              f"{sampling['max_new_tokens']} output tokens). Profiled (SGLang's torch.profiler in the scheduler, "
              "CPU + CUDA, 2 output tokens): the same after a flush, the last hit also with Python stacks (slower "
              "host). Phases `oscar.*`: oscar.serve.labels; the rest by kernel name. Module docstring of "
              "oscar.bench.prefix.profile: what each column means.", ""]
    return prefix_profile.write_profile(results, out, header)


def _capacity(engine: Any) -> dict[str, Any]:
    """The pool's token capacity and the settings SGLang resolved, as the engine reports them (``get_server_info``),
    and the GPU memory in use (MiB, used/total)."""
    try:
        info = engine.get_server_info()
    except Exception as err:  # noqa: BLE001 - a missing field is reported, the row is still written
        return {"capacity_error": f"{type(err).__name__}: {err}"[:200]}
    pick = {**info, **(info.get("internal_states") or [{}])[0]}
    mem = host.gpu_memory()
    return {**{k: pick.get(k) for k in ("max_total_num_tokens", "mem_fraction_static", "chunked_prefill_size",
                                        "context_len", "page_size", "max_running_requests")},
            "gpu_memory_used_mib": mem and f"{mem['used_gib'] * 1024:.0f}/{mem['total_gib'] * 1024:.0f}"}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--attention-backend", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tag", default="")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=30000)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--ratios", default="0,0.25,0.5,0.75,0.99")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=30000, help="token ids are drawn from [100, vocab)")
    ap.add_argument("--check-hit", action="store_true")
    ap.add_argument("--profile", type=Path, default=None, help="profile a cold request and a hit into this folder")
    ap.add_argument("--time-limit", type=float, default=0.0, help="skip the remaining ratios after this many seconds")
    ap.add_argument("--wait-for", type=Path, default=None, help="after the warm-up, wait until this file exists "
                    "(two engines started in one run: the second compiles while the first measures)")
    ap.add_argument("--ready", type=Path, default=None, help="touch this file once the engine is warm")
    ap.add_argument("--gpu-memory", action="store_true", help="the check row also records the pool's token capacity "
                    "and the GPU memory in use after the long prompt (nvidia-smi)")
    ap.add_argument("--engine", nargs="*", default=[], help="more sglang.Engine arguments, KEY=VALUE")
    a = ap.parse_args(argv)
    import sglang
    import torch

    kwargs = dict(model_path=a.model_path, attention_backend=a.attention_backend, disable_radix_cache=False,
                  log_level="warning", random_seed=0)
    kwargs.update({k: _value(v) for k, v in (x.split("=", 1) for x in a.engine)})
    t_start = time.perf_counter()
    engine = sglang.Engine(**kwargs)
    started = time.perf_counter() - t_start
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    kv_dtype = str(kwargs.get("kv_cache_dtype", "auto"))
    base = dict(cache="oscar" if a.attention_backend == "oscar" else "fp8" if kv_dtype.startswith("fp8") else "bf16",
                backend=a.attention_backend, kv_cache_dtype=kv_dtype,
                tag=a.tag, requests=a.requests, input_len=a.input_len, output_len=a.output_len, device=device,
                radix=True, cuda_graph=not bool(kwargs.get("disable_cuda_graph", False)),
                page_size=int(kwargs.get("page_size", 1)), engine_start_s=round(started, 2),
                sglang=str(sglang.__version__), **{f"env_{k}": v for k, v in os.environ.items() if k.startswith("OSCAR_")
                                                   and k != "OSCAR_SERVE_ACTIVE"})
    sampling = {"temperature": 0, "max_new_tokens": a.output_len, "ignore_eos": True}
    loop = engine.loop  # the engine's own loop: its tokenizer manager's tasks (and flush_cache) live there

    def write(row: dict[str, Any]) -> None:
        print("PREFIX_ROW " + json.dumps({k: v for k, v in row.items() if "tokens" not in k or k.endswith("_s")
                                          or k in ("cached_tokens", "job_tokens_per_s")}), flush=True)
        with open(a.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    try:
        # warm-up (CUDA graphs are captured at start): a prompt, then the same prompt hitting its cached prefix
        # (the prefill kernels with and without a cached prefix, JIT caches)
        warm = prompts(1, min(a.input_len, 2048), 0.0, 12345, a.vocab)
        for _ in range(2):
            loop.run_until_complete(_job(engine, warm, sampling))
        base["warm_s"] = round(time.perf_counter() - t_start, 2)
        if a.ready is not None:
            a.ready.touch()
        if a.wait_for is not None:
            t_wait = time.perf_counter()
            while not a.wait_for.exists():
                time.sleep(0.5)
            base["waited_s"] = round(time.perf_counter() - t_wait, 2)
        if a.check_hit:
            engine.flush_cache()
            (ids,) = prompts(1, a.input_len, 0.99, a.seed + 777, a.vocab)
            lp = dict(return_logprob=True, top_logprobs_num=2)
            _, (cold,) = loop.run_until_complete(_job(engine, [ids], sampling, **lp))
            _, (hit,) = loop.run_until_complete(_job(engine, [ids], sampling, **lp))
            if a.gpu_memory:
                base.update(_capacity(engine))
            write(dict(base, kind="check", cold_tokens=cold["output_ids"], hit_tokens=hit["output_ids"],
                       cold_cached=cold["cached"], hit_cached=hit["cached"], cold_ttft_s=cold["ttft"],
                       hit_ttft_s=hit["ttft"], equal=cold["output_ids"] == hit["output_ids"],
                       first_logprob_gap=first_logprob_gap(cold["first_top"], hit["first_top"])))
        if a.profile is not None:
            for path in profile_hits(engine, a, sampling, base, a.profile):
                print(f"PREFIX_PROFILE {path}", flush=True)
        for ratio in (float(x) for x in a.ratios.split(",") if x.strip()):
            if a.time_limit and time.perf_counter() - t_start > a.time_limit:
                write(dict(base, kind="sweep", ratio=ratio, status="skipped (time limit)"))
                continue
            engine.flush_cache()
            batch = prompts(a.requests, a.input_len, ratio, a.seed + int(ratio * 1000), a.vocab)
            job_s, res = loop.run_until_complete(_job(engine, batch, sampling))
            ttft = [r["ttft"] for r in res]
            tokens = a.requests * (a.input_len + a.output_len)
            write(dict(base, kind="sweep", ratio=ratio, shared_tokens=round(ratio * a.input_len), status="ok",
                       job_s=job_s, job_tokens_per_s=tokens / job_s, ttft_mean_s=statistics.mean(ttft),
                       ttft_p50_s=statistics.median(ttft), ttft_max_s=max(ttft),
                       cached_tokens=sum(r["cached"] for r in res), last_tokens=res[-1]["output_ids"]))
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""SGLang's own one-batch benchmark (``sglang.benchmark.one_batch``) with the oscar plugin loaded.

    python -m oscar.bench.serving.one_batch --model-path M --load-format dummy --attention-backend oscar --page-size 16 \
        --batch-size 1 8 --input-len 4096 30000 --output-len 16 ... --oscar-out rows.jsonl [--oscar-tag T]

SGLang's ``bench_one_batch`` neither loads plugins nor runs ``ServerArgs.check_server_args`` (only its
``Engine`` does), so this entry point registers the plugin and applies its hooks, runs the start-up check,
then drives SGLang's ``load_model`` and ``latency_test_run_once`` (the same prefill and decode timing as
``bench_one_batch``: one warm-up at the first shape, then each batch x input length). Each shape becomes one
JSON line in ``--oscar-out``: ``cache``, ``backend``, ``batch``, ``context``, ``decode_ms`` (median),
``prefill_s``, ``cuda_graph``, ``status`` (ok | capacity: over the pool's tokens | oom), the pool's token
capacity and the greedy tokens of the first request (the inputs are seeded, so two backends get the same
prompts: the GPU correctness check compares them).

``--tp-size N`` runs one process per TP rank on GPUs ``0..N-1`` (as ``bench_one_batch`` does), each with the plugin's
hooks; every rank runs the same rows (their collectives pair up) and rank 0 writes them (``tp_size`` in each row,
the pool's token capacity per rank).

``--oscar-synthetic BATCHxCONTEXT,...`` adds rows timed on a synthetic state (``oscar.bench.serving.synthetic``:
SGLang's own allocation of the batch's slots, random valid pool contents, no prefill forward; ``mode``
``synthetic``, ``prefill_s`` empty) and ``--oscar-profile BATCHxCONTEXT,...`` profiles the decode step there
(``torch.profiler``: CUDA-graph replays and eager steps, GPU time per part of the step) into
``--oscar-profile-out``. Rows of ``--oscar-shapes`` are ``mode`` ``real`` (prefill forward, then decode).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from oscar.bench.serving import synthetic as sy
from oscar.bench.serving.trace import attribute_kernels, summarize, top_kernels
from oscar.serve.plugin import register


def _load_plugin() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    register()
    HookRegistry.apply_hooks()


def _record_tokens(runner: Any, store: list) -> None:
    """Keep the next-token tensors the bench runner returns (device clones: no sync inside the timing)."""
    extend, decode = runner.extend, runner.decode

    def ext(reqs: Any) -> Any:
        out = extend(reqs)
        store.append(out[0].clone())
        return out

    def dec(ids: Any, batch: Any) -> Any:
        out = decode(ids, batch)
        store.append(out[0].clone())
        return out

    runner.extend, runner.decode = ext, dec


def _shapes(text: str) -> list[tuple[int, int]]:
    """``BATCHxINPUT,...`` -> [(batch, input), ...]."""
    out = []
    for item in (x for x in text.split(",") if x.strip()):
        b, sep, n = item.strip().partition("x")
        if not sep or not b.isdigit() or not n.isdigit() or int(b) < 1 or int(n) < 1:
            raise SystemExit(f"shape {item!r} is not valid; write BATCHxINPUT with positive integers, e.g. 32x100000")
        out.append((int(b), int(n)))
    return out


def _synthetic_batch(runner: Any, bs: int, il: int, seed: int) -> Any:
    """A ScheduleBatch of ``bs`` requests of ``il`` tokens whose slots SGLang's allocator and req_to_token
    hold, as after a prefill, without the prefill forward (``oscar.bench.serving.synthetic``)."""
    import numpy as np
    from sglang.benchmark import one_batch as ob

    mr = runner.torch_runner
    np.random.seed(seed)
    reqs = ob.prepare_synthetic_inputs_for_latency_test(bs, il)
    tree = ob.TreeCacheNamespace(page_size=mr.server_args.page_size, device=mr.device,
                                 token_to_kv_pool_allocator=mr.token_to_kv_pool_allocator)
    batch = ob.ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=mr.req_to_token_pool,
                                      token_to_kv_pool_allocator=mr.token_to_kv_pool_allocator, tree_cache=tree,
                                      model_config=mr.model_config, enable_overlap=False,
                                      spec_algorithm=ob.SpeculativeAlgorithm.NONE)
    batch.prepare_for_extend()
    ob._maybe_prepare_mlp_sync_batch(batch, mr)
    batch.prefill_input_ids_cpu = None  # no prefill forward reads it
    return batch


def _decode_steps(runner: Any, batch: Any, next_ids: Any, steps: int) -> tuple[list[float], Any]:
    """``steps`` decode steps timed as ``latency_test_run_once`` times them (synchronize, step, synchronize)."""
    lat = []
    for _ in range(steps):
        runner.synchronize()
        tic = time.perf_counter()
        next_ids, _ = runner.decode(next_ids, batch)
        runner.synchronize()
        lat.append(time.perf_counter() - tic)
    return lat, next_ids


def _synthetic_row(runner: Any, row: dict[str, Any], bs: int, il: int, ol: int) -> dict[str, Any]:
    """One row timed on the synthetic state (``ol - 1`` decode steps, the median, as bench_one_batch)."""
    import numpy as np
    import torch

    if not sy.fits(int(row["max_total_num_tokens"]), bs, il, ol):
        return dict(row, status="capacity")
    runner.clear()
    try:
        t0 = time.perf_counter()
        batch = _synthetic_batch(runner, bs, il, 0)
        setup = time.perf_counter() - t0
        ids = torch.randint(0, 10000, (bs,), device=runner.torch_runner.device)
        lat, _ = _decode_steps(runner, batch, ids, ol - 1)
    except torch.cuda.OutOfMemoryError as err:
        runner.clear()
        torch.cuda.empty_cache()
        return dict(row, status="oom", error=str(err).splitlines()[0][:200])
    except Exception as err:  # noqa: BLE001 - a failed row is reported, the next rows still run
        runner.clear()
        return dict(row, status="failed", error=f"{type(err).__name__}: {err}"[:300])
    return dict(row, status="ok", decode_ms=1e3 * float(np.median(lat)), setup_s=setup,
                decode_ms_all=[round(1e3 * x, 3) for x in lat])


def _profile(runner: Any, bs: int, il: int, ol: int, steps: int = 5) -> dict[str, Any]:
    """The decode step at (bs, il) on the synthetic state under ``torch.profiler``: ``steps`` CUDA-graph
    replays, then ``steps`` eager steps (the decode graph runner set aside) with the plugin's calls labelled;
    GPU ms per part of the step and the wall ms per step of each."""
    import torch

    if not sy.fits(int(runner.torch_runner.max_total_num_tokens), bs, il, 4 + 4 * steps):
        return dict(status="capacity")
    mr = runner.torch_runner
    runner.clear()
    batch = _synthetic_batch(runner, bs, il, 0)
    ids = torch.randint(0, 10000, (bs,), device=mr.device)
    out: dict[str, Any] = dict(status="ok", steps=steps)
    graph_runner = mr.decode_cuda_graph_runner
    for mode in ("graph", "eager"):
        if mode == "eager":
            mr.decode_cuda_graph_runner = None
        try:
            trace = _profiled_steps(runner, batch, ids, steps, mr.attn_backend, out, mode)
            if mode == "eager":  # where the host time goes: the Python functions of the eager step (cProfile)
                out["host_eager"] = _host_profile(runner, batch, ids, steps)
        except Exception as err:  # noqa: BLE001 - reported; the other mode still runs
            out[f"{mode}_error"] = f"{type(err).__name__}: {err}"[:300]
            continue
        finally:
            mr.decode_cuda_graph_runner = graph_runner
        kernels = attribute_kernels(trace)
        out[f"{mode}_gpu_ms"] = sum(k["dur_us"] for k in kernels) / 1e3 / steps
        out[f"{mode}_parts"] = summarize(kernels, steps)
        out[f"top_{mode}"] = top_kernels(kernels, steps)
    return out


def _host_profile(runner: Any, batch: Any, ids: Any, steps: int, top: int = 30) -> list[dict[str, Any]]:
    """``steps`` eager decode steps under ``cProfile``: the ``top`` functions by own time, each with its calls and
    its own and cumulative microseconds per step (where an eager step's host time goes)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    _decode_steps(runner, batch, ids, steps)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    root = str(Path(__file__).resolve().parents[3])
    return [{"function": f"{file.replace(root + '/', '')}:{line}:{name}", "calls_per_step": round(v[1] / steps, 1),
             "own_us_per_step": round(1e6 * v[2] / steps, 1), "cum_us_per_step": round(1e6 * v[3] / steps, 1)}
            for (file, line, name), v in rows]


def _profiled_steps(runner: Any, batch: Any, ids: Any, steps: int, attn_backend: Any, out: dict[str, Any],
                    mode: str) -> dict[str, Any]:
    """Warm-up, ``steps`` timed steps (their median wall ms into ``out``), then ``steps`` under the profiler;
    returns the profiler's chrome trace."""
    import os
    import tempfile

    import numpy as np
    from torch.profiler import ProfilerActivity, profile

    _, ids = _decode_steps(runner, batch, ids, 2)
    wall, ids = _decode_steps(runner, batch, ids, steps)
    out[f"{mode}_wall_ms"] = 1e3 * float(np.median(wall))
    with sy.label_ranges(attn_backend), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        _decode_steps(runner, batch, ids, steps)
    with tempfile.TemporaryDirectory() as tmp:  # scratch for the trace, read back at once
        path = os.path.join(tmp, "trace.json")
        p.export_chrome_trace(path)
        with open(path) as fh:
            return json.load(fh)


def main(argv: list[str]) -> int:
    _load_plugin()
    from sglang.benchmark import one_batch as ob
    from sglang.srt.server_args import PortArgs, ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ob.BenchArgs.add_cli_args(parser)
    parser.add_argument("--oscar-out", required=True, help="JSON-lines file the rows are appended to")
    parser.add_argument("--oscar-tag", default="", help="free text stored with each row")
    parser.add_argument("--oscar-seed", type=int, default=0, help="seed of the synthetic prompts")
    parser.add_argument("--oscar-shapes", default=None, help="BATCHxINPUT,... to run instead of every --batch-size x "
                        "--input-len (the first one is also the warm-up); empty: no real rows")
    parser.add_argument("--oscar-warmup", default="", help="BATCHxINPUT of the real warm-up run (default: the first "
                        "shape of --oscar-shapes)")
    parser.add_argument("--oscar-synthetic", default="", help="BATCHxCONTEXT,... timed on a synthetic state")
    parser.add_argument("--oscar-profile", default="", help="BATCHxCONTEXT,... whose decode step is profiled")
    parser.add_argument("--oscar-profile-out", default="", help="JSON-lines file of the profile results")
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    bench_args = ob.BenchArgs.from_cli_args(args)
    server_args.check_server_args()  # the plugin's start-up check runs after SGLang's (a hook)
    if server_args.cuda_graph_config is not None:
        from sglang.srt.model_executor.cuda_graph_config import Phase

        # capture exactly the batch sizes of the rows (no padded replays, no unused captures)
        sizes = sorted({*bench_args.batch_size, *(b for b, _ in _shapes(args.oscar_shapes or "")),
                        *(b for b, _ in _shapes(args.oscar_synthetic)), *(b for b, _ in _shapes(args.oscar_profile))})
        server_args.cuda_graph_config[Phase.DECODE].max_bs = sizes[-1]
        server_args.cuda_graph_config[Phase.DECODE].bs = sizes
    ob._set_envs_and_config(server_args)
    port_args = PortArgs.init_new(server_args)
    tp = int(server_args.tp_size or 1)
    if tp == 1:
        return _bench(args, server_args, bench_args, port_args, 0)
    import multiprocessing

    # one process per TP rank on GPU `rank` (bench_one_batch's own layout); every rank runs the same steps
    # (their collectives pair up), rank 0 prints and writes the rows
    procs = [multiprocessing.Process(target=_bench_rank, args=(args, server_args, bench_args, port_args, rank))
             for rank in range(tp)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    codes = [proc.exitcode for proc in procs]
    if any(codes):
        print(f"TP ranks exited with {codes}", flush=True)
    return max(abs(int(c or 0)) for c in codes)


def _bench_rank(args: Any, server_args: Any, bench_args: Any, port_args: Any, tp_rank: int) -> None:
    """A spawned TP rank: the plugin's hooks in this process, then the rank's benchmark."""
    _load_plugin()
    sys.exit(_bench(args, server_args, bench_args, port_args, tp_rank))


def _bench(args: Any, server_args: Any, bench_args: Any, port_args: Any, tp_rank: int) -> int:
    """Load the model on GPU ``tp_rank`` as TP rank ``tp_rank`` and run the rows (rank 0 reports them)."""
    import numpy as np
    import torch
    from sglang.benchmark import one_batch as ob

    lead = tp_rank == 0
    say = print if lead else (lambda *a, **k: None)
    runner, _ = ob.load_model(server_args, port_args, tp_rank, tp_rank)
    capacity = int(runner.torch_runner.max_total_num_tokens)
    oscar = server_args.attention_backend == "oscar"
    pool = getattr(getattr(runner, "torch_runner", runner), "token_to_kv_pool", None)
    kv_dtype = str(getattr(server_args, "kv_cache_dtype", "auto") or "auto")
    # the served format: the pool's registry kind (rotated, rotated_channel; +rope where keys are rope-centered) or
    # SGLang's own cache (bf16, fp8_e4m3)
    fmt = (getattr(getattr(pool, "format", None), "kind", "?") + ("+rope" if getattr(pool, "rope_centered", False)
                                                                  else "")) if oscar else \
        ("bf16" if kv_dtype in ("auto", "bfloat16") else kv_dtype)
    base = dict(cache="oscar" if oscar else ("bf16" if fmt == "bf16" else "fp8"), format=fmt,
                backend=server_args.attention_backend,
                cuda_graph=not server_args.disable_cuda_graph, page_size=int(server_args.page_size or 1),
                radix=not server_args.disable_radix_cache, chunked_prefill_size=server_args.chunked_prefill_size,
                mem_fraction_static=server_args.mem_fraction_static, tp_size=int(server_args.tp_size or 1),
                max_total_num_tokens=capacity, tag=args.oscar_tag, device=torch.cuda.get_device_name())
    tokens: list = []
    _record_tokens(runner, tokens)

    def run(bs: int, il: int, ol: int) -> dict[str, Any]:
        np.random.seed(args.oscar_seed)
        reqs = ob.prepare_synthetic_inputs_for_latency_test(bs, il)
        tokens.clear()
        row = dict(base, batch=bs, context=il, output_len=ol, mode="real")
        try:
            ret = ob.latency_test_run_once(bench_args.run_name, runner, say, reqs, bs, il, ol, 0, False, False,
                                           ("CPU", "GPU"), "", "all", tp_rank)
        except torch.cuda.OutOfMemoryError as err:
            runner.clear()
            torch.cuda.empty_cache()
            return dict(row, status="oom", error=str(err).splitlines()[0][:200])
        if ret is None:
            return dict(row, status="capacity")
        first = [int(t[0]) for t in tokens] if tokens else []
        return dict(row, status="ok", decode_ms=1e3 * float(ret["median_decode_latency"]),
                    prefill_s=float(ret["prefill_latency"]), tokens=first)

    ol = bench_args.output_len[0]
    shapes = [(bs, il) for bs in bench_args.batch_size for il in bench_args.input_len]
    if args.oscar_shapes is not None:
        shapes = _shapes(args.oscar_shapes)
    if not args.oscar_warmup and not shapes:
        raise SystemExit("no warm-up shape: give --oscar-warmup BATCHxINPUT when --oscar-shapes is empty")
    warm = _shapes(args.oscar_warmup)[0] if args.oscar_warmup else shapes[0]
    say("Warmup ...", flush=True)
    run(warm[0], warm[1], min(8, ol))

    def emit(row: dict[str, Any]) -> None:
        if not lead:
            return
        print("OSCAR_ROW " + json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
        with open(args.oscar_out, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    for bs, il in shapes:
        emit(run(bs, il, ol))
    synth = _shapes(args.oscar_synthetic)
    prof = _shapes(args.oscar_profile)
    if synth or prof:
        t0 = time.perf_counter()
        kind = sy.fill_pool(runner.torch_runner.token_to_kv_pool, seed=args.oscar_seed)
        torch.cuda.synchronize()
        say(f"synthetic state: filled the {kind} pool in {time.perf_counter() - t0:.2f} s", flush=True)
    for bs, il in synth:
        emit(_synthetic_row(runner, dict(base, batch=bs, context=il, output_len=ol, mode="synthetic"), bs, il, ol))
    for bs, il in prof:
        res = _profile(runner, bs, il, ol)
        res = dict({k: base[k] for k in ("cache", "backend", "page_size", "tag", "device")}, batch=bs, context=il, **res)
        say("OSCAR_PROFILE " + json.dumps({k: v for k, v in res.items() if k not in ("top_graph", "top_eager")}),
            flush=True)
        if args.oscar_profile_out and lead:
            with open(args.oscar_profile_out, "a") as fh:
                fh.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The kernel table's measuring: timers, workloads and the run that writes the raw rows (torch and the kernels).

``time_calls`` (CUDA-graph replays of one call per input set, the sets together several times the L2, median per
call) is also what the experiments under ``oscar.bench.experimental`` and ``benchmarks/studies/`` time with;
``decode_inputs`` / ``decode_call`` build a decode step's inputs and its call through the library's dispatcher.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from oscar.bench.kernels.options import ints, launch_of
from oscar.cache import paged
from oscar.cache.paged import HeadTransform, QuantPages, Segments, rotate_quantize_pack, rotate_quantize_pack_kv
from oscar.core.files import atomic_write_csv, atomic_write_json


# ----------------------------------------------------------------------------------------------------- timing


def time_calls(calls: list[Callable[[], Any]], reps: int = 20, graph: bool = True) -> tuple[float, str]:
    """Median microseconds per call: CUDA-graph replays of all ``calls`` (one per input set), else eager."""
    for c in calls:  # warm-up: compilation, plans, allocator
        c()
    torch.cuda.synchronize()
    try:
        if not graph:
            raise RuntimeError("eager timing requested")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for c in calls:
                c()
        mode = "graph"
        run = cuda_graph.replay
    except Exception as exc:  # noqa: BLE001 - capture unsupported for this call: time eager launches instead
        if graph:
            print(f"  graph capture failed ({type(exc).__name__}: {exc}); timing eagerly", file=sys.stderr)
        torch.cuda.synchronize()
        mode = "eager"

        def run() -> None:
            for c in calls:
                c()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times), mode


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    best = 0.0
    for nbytes in (1 << 30, 1 << 31):
        src = torch.randn(nbytes // 4, device="cuda")
        dst = torch.empty_like(src)
        us, _ = time_calls([lambda: dst.copy_(src)], reps=20, graph=False)  # a graph memcpy node is slower
        best = max(best, 2 * nbytes / (us * 1e-6))
        del src, dst
    torch.cuda.empty_cache()
    return best


def _n_sets(bytes_per_set: int, l2: int, factor: int, mem_bytes: int) -> int:
    want = max(1, math.ceil(factor * l2 / max(1, bytes_per_set)))
    fit = max(1, mem_bytes // max(1, bytes_per_set))
    return int(min(want, fit, 16))


# -------------------------------------------------------------------------------------------------- workloads


def bench_sdpa(B: int, T: int, H: int, hkv: int, d: int, backend: str, opts: dict[str, Any], l2: int) -> dict[str, Any]:
    """BF16 SDPA decode (one query per sequence, GQA) with one backend (cudnn | flash): microseconds and bytes."""
    kv_bytes = 2 * B * hkv * T * d * 2
    if kv_bytes > opts["mem_gb"] * 2**30 * 0.6:
        return {"us": float("nan"), "status": "skipped: memory"}
    n = _n_sets(kv_bytes, l2, opts["l2_factor"], int(opts["mem_gb"] * 2**30 * 0.45))
    sets = [(torch.randn(B, H, 1, d, device="cuda", dtype=torch.bfloat16),
             torch.randn(B, hkv, T, d, device="cuda", dtype=torch.bfloat16),
             torch.randn(B, hkv, T, d, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def call(q, k, v):
        def f():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return f

    try:
        us, mode = time_calls([call(*s) for s in sets], reps=opts["reps"])
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is a row status
        us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:120]}"
    del sets
    torch.cuda.empty_cache()
    return {"us": us, "timing": mode, "bytes": kv_bytes + 2 * B * H * d * 2, "sets": n, "status": status}


def decode_inputs(B: int, T: int, H: int, hkv: int, d: int, opts: dict[str, Any], n_sets: int, seed: int = 0,
                  bits: int = 2, device: str = "cuda") -> dict[str, Any]:
    """Random pool, shuffled page tables (one set per page range), BF16 windows and transforms: a decode step's
    inputs. The codes are valid in both page layouts, so the same bytes time the mma and the row kernels."""
    g = torch.Generator(device=device).manual_seed(seed)
    ps, S0, W = opts["page_size"], opts["sink"], opts["recent"]
    t_int = max(0, T - S0 - W)
    pages_per_seq = max(1, -(-t_int // ps))
    npages = n_sets * B * pages_per_seq
    nbytes = d * bits // 8

    def pages() -> tuple:
        codes = torch.randint(0, 256, (npages, hkv, ps, nbytes), device=device, dtype=torch.uint8, generator=g)
        scale = (0.02 + 0.05 * torch.rand(npages, hkv, ps, 1, device=device, generator=g)).to(torch.bfloat16)
        zero = (-0.1 * torch.rand(npages, hkv, ps, 1, device=device, generator=g)).to(torch.bfloat16)
        return codes, scale, zero

    kc, vc = pages(), pages()
    perm = torch.randperm(npages, device=device, generator=g).to(torch.int32)
    tables = [perm[s * B * pages_per_seq:(s + 1) * B * pages_per_seq].reshape(B, pages_per_seq).contiguous()
              for s in range(n_sets)]

    def orth() -> torch.Tensor:
        return torch.linalg.qr(torch.randn(hkv, d, d, device=device, generator=g))[0].contiguous()

    kt = HeadTransform(R=orth(), mu=0.1 * torch.randn(hkv, d, device=device, generator=g),
                       rho=torch.full((hkv,), 0.95, device=device))
    vt = HeadTransform(R=orth(), mu=0.1 * torch.randn(hkv, d, device=device, generator=g),
                       rho=torch.full((hkv,), 0.92, device=device))
    kt_rope = HeadTransform(kt.R, kt.mu, kt.rho, 0.5 * torch.randn(hkv, d, device=device, generator=g),
                            1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))

    def bf16(n: int) -> torch.Tensor:
        return torch.randn(B, hkv, n, d, device=device, generator=g).to(torch.bfloat16)

    int_len = torch.full((B,), t_int, dtype=torch.int32, device=device)
    def lens(n: int) -> torch.Tensor:
        return torch.full((B,), n, dtype=torch.int32, device=device)

    segs = [Segments(tables[s], int_len, sink_k=bf16(S0), sink_v=bf16(S0), sink_len=lens(S0), recent_k=bf16(W),
                     recent_v=bf16(W), recent_len=lens(W), int_pos0=S0) for s in range(n_sets)]
    qs = [torch.randn(B, H, d, device=device, generator=g).to(torch.bfloat16) for _ in range(n_sets)]
    per_seq = hkv * (t_int * 2 * (nbytes + 2 * 2) + (S0 + W) * d * 2 * 2)
    layouts = {"rows": ("rows", "rows"), "mma": ("mma_k", "mma_v")}
    return dict(pages={lay: (QuantPages(*kc, bits, d, k_lay), QuantPages(*vc, bits, d, v_lay))
                       for lay, (k_lay, v_lay) in layouts.items()},
                kt=kt, vt=vt, kt_rope=kt_rope, segs=segs, qs=qs, bytes=B * (per_seq + 2 * H * d * 2), bits=bits)


def decode_call(inp: dict[str, Any], s: int, variant: dict[str, Any], backend: str = "triton") -> Callable[[], Any]:
    """One decode call of input set ``s`` for ``variant`` through the library's dispatcher (the path the caches
    and the serving backend take); ``backend="torch"``: the float32 twin on the same pages."""
    kp, vp = inp["pages"][variant["layout"]]
    kt = inp["kt_rope"] if variant.get("rope") else inp["kt"]
    launch = launch_of(variant) if backend != "torch" else None

    def f():
        return paged.decode_attention(inp["qs"][s], kp, vp, inp["segs"][s], kt, inp["vt"], backend=backend,
                                      launch=launch)
    return f


def bench_decode(B: int, T: int, H: int, hkv: int, d: int, opts: dict[str, Any], l2: int,
                 named: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Time each variant of ``named`` (variants of one bit width share one input pool)."""
    t_int = max(0, T - opts["sink"] - opts["recent"])
    out: dict[str, dict[str, Any]] = {}
    for bits in sorted({v["bits"] for v in named.values()}):
        group = {k: v for k, v in named.items() if v["bits"] == bits}
        per_set = 2 * B * hkv * (t_int * (d * bits // 8 + 4) + (opts["sink"] + opts["recent"]) * d * 2)
        n = _n_sets(per_set, l2, opts["l2_factor"], int(opts["mem_gb"] * 2**30 * 0.5))
        inp = decode_inputs(B, T, H, hkv, d, opts, n, bits=bits)
        for name, var in group.items():
            try:
                us, mode = time_calls([decode_call(inp, s, var) for s in range(n)], reps=opts["reps"])
                status = "ok"
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run this shape is a row status
                us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:160]}"
            out[name] = {"us": us, "timing": mode, "bytes": inp["bytes"], "sets": n, "status": status}
        del inp
        torch.cuda.empty_cache()
    return out


def check_against_twin(d: int, opts: dict[str, Any], variant: dict[str, Any]) -> float:
    """Largest relative error per head of ``variant`` against the float32 twin on the same pages (batch 4, 8k)."""
    inp = decode_inputs(4, 8192, opts["q_heads"], opts["kv_heads"], d, opts, 1, seed=3, bits=variant["bits"])
    ref = decode_call(inp, 0, variant, backend="torch")().float()
    out = decode_call(inp, 0, variant)().float()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def bench_quantize(B: int, d: int, hkv: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Demotion (B rows of K and V: rotation + centering + clip + pack, one fused launch) and prefill
    quantization (8192 rows), in the mma layouts; 16 launches per graph replay for the demotion."""
    g = torch.Generator(device="cuda").manual_seed(1)
    ps, W = opts["page_size"], opts["recent"]
    out = []
    for kind, n_rows in (("demote", B), ("prefill", 8192)):
        n_sets = 16 if kind == "demote" else 1  # a single small launch would time the graph launch, not the kernel
        npages = -(-n_rows // ps) + 1
        pages = [[QuantPages.empty(npages, hkv, ps, d, 2, d, "cuda", lay) for lay in ("mma_k", "mma_v")]
                 for _ in range(n_sets)]
        R = torch.linalg.qr(torch.randn(hkv, d, d, device="cuda", generator=g))[0].contiguous()
        t = HeadTransform(R=R, mu=torch.randn(hkv, d, device="cuda", generator=g),
                          rho=torch.full((hkv,), 0.95, device="cuda"))
        slots = torch.randperm(npages * ps, device="cuda", generator=g)[:n_rows]
        calls = []
        for k in range(n_sets):
            if kind == "demote":
                src = torch.randn(n_rows, hkv, W, d, device="cuda", generator=g).to(torch.bfloat16)
                idx = torch.randint(0, W, (n_rows,), device="cuda", generator=g)

                def f(src=src, idx=idx, pg=pages[k]):
                    rotate_quantize_pack_kv(src, src, slots, pg[0], pg[1], t, t, src_index=idx, backend="triton")
            else:
                src = torch.randn(n_rows, hkv, d, device="cuda", generator=g).to(torch.bfloat16)

                def f(src=src, pg=pages[k]):
                    rotate_quantize_pack(src, slots, pg[0], t, backend="triton")
            calls.append(f)
        try:
            us, mode = time_calls(calls, reps=opts["reps"])
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - reported as the row's status
            us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:160]}"
        out.append({"kind": kind, "batch": B, "head_dim": d, "rows": n_rows, "us": us, "timing": mode, "status": status,
                    "layout": "mma"})
    return out


# ------------------------------------------------------------------------------------------------------ the run


def measure(opts: dict[str, Any], out: Path, env: dict[str, Any], named: dict[str, dict[str, Any]], name: str) -> None:
    """Time every shape x variant of ``named`` (and the quantization kernels); raw rows to ``<name>_rows.csv``."""
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    bw = copy_bandwidth()
    env.update(copy_tb_s=bw / 1e12, variants={k: v for k, v in named.items()},
               shape={k: opts[k] for k in ("q_heads", "kv_heads", "sink", "recent", "page_size")})
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    H, hkv = opts["q_heads"], opts["kv_heads"]
    if opts["check"]:
        acc = {}
        for d in ints(opts["head_dims"]):
            for vname, var in named.items():
                try:
                    acc[f"{vname}_d{d}"] = check_against_twin(d, opts, var)
                except Exception as exc:  # noqa: BLE001 - recorded; its timing row will fail the same way
                    acc[f"{vname}_d{d}"] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
        env["rel_err_vs_twin"] = acc
        print(f"against the float32 twin (batch 4, 8k): {json.dumps(acc)}", flush=True)
    atomic_write_json(out / f"{name}_env.json", env)
    parts = {p.strip() for p in str(opts["parts"]).split(",")}
    rows: list[dict[str, Any]] = []
    shapes = [(d, T, B) for d in ints(opts["head_dims"]) for T in ints(opts["contexts"])
              for B in ints(opts["batches"])]
    for d, T, B in (shapes if "attention" in parts else []):
        if opts["budget_s"] and time.time() - t0 > opts["budget_s"]:
            print(f"budget of {opts['budget_s']} s spent: stopping before d={d} B={B} T={T}", flush=True)
            env["stopped_before"] = f"d={d} batch={B} context={T}"
            break
        sd = {be: bench_sdpa(B, T, H, hkv, d, be, opts, l2) for be in ("cudnn", "flash")}
        ok = [sd[k]["us"] for k in sd if sd[k].get("status") == "ok"]
        best_bf16 = min(ok) if ok else float("nan")
        res = bench_decode(B, T, H, hkv, d, opts, l2, named)
        for vname, r in res.items():
            rows.append({"head_dim": d, "batch": B, "context": T, "variant": vname,
                         "launch": json.dumps(named[vname], sort_keys=True), "us": r["us"], "status": r["status"],
                         "bytes": r["bytes"], "sets": r["sets"], "timing": r["timing"], "cudnn_us": sd["cudnn"]["us"],
                         "flash_us": sd["flash"]["us"], "bf16_best_us": best_bf16, "copy_tb_s": bw / 1e12,
                         "tb_s": r["bytes"] / (r["us"] * 1e-6) / 1e12, "bw_frac": r["bytes"] / (r["us"] * 1e-6) / bw,
                         "speedup": best_bf16 / r["us"]})
        line = " / ".join(f"{k} {r['us']:.1f}" if r["status"] == "ok" else f"{k} {r['status'][:60]}"
                          for k, r in res.items())
        print(f"d={d} B={B} T={T} cudnn={sd['cudnn']['us']:.1f} flash={sd['flash']['us']:.1f} {line} "
              f"({time.time() - t0:.0f} s)", flush=True)
        atomic_write_csv(out / f"{name}_rows.csv", rows)
    q_rows = []
    for d in (ints(opts["head_dims"]) if "quantize" in parts else []):
        for B in ints(opts["batches"]):
            q_rows += bench_quantize(B, d, hkv, opts)
    if q_rows:
        atomic_write_csv(out / f"{name}_quantize.csv", q_rows)
    env["layer_weight_mb"] = opts["layer_weight_mb"]
    atomic_write_json(out / f"{name}_env.json", env)

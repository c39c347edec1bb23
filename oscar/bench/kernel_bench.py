"""GPU kernel benchmarks (the library behind `python -m oscar bench-kernels`): kernels against BF16 SDPA.

Times, in one run and on the same GPU: a large device-to-device copy (the bandwidth ceiling),
torch SDPA BF16 decode attention with the cuDNN and flash backends, the paged INT2 decode
attention over its three segments (BF16 sink + INT2 pages + BF16 recent; by default pages in the
tensor-core fragment layout read by the CUDA kernel, beside the Triton row-layout path), the
demotion of one token per sequence (K and V through rotate-clip-quantize-pack) and the prefill
quantization. Each timing replays a CUDA graph that holds one call per input set, the sets together
several times the L2 cache, and reports the median per call (eager `do_bench` medians when capture fails).

`run(opts)` writes (atomically) `output` (decode attention table), and beside it `<stem>_tune.csv`,
`<stem>_quantize.csv`, `<stem>.md` (Markdown summary with hardware and command) and `<stem>.png`
(plot, when matplotlib is present). The scripts in `benchmarks/` reuse the timing helpers.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from oscar.core.files import atomic_write, atomic_write_csv, atomic_write_text

DEFAULTS: dict[str, Any] = {
    "output": "reports/kernels/decode_attention.csv",
    "head_dims": "128,64",
    "batches": "1,8,32,64,128",
    "contexts": "4096,32768,65536,131072",
    "q_heads": 32,
    "kv_heads": 8,
    "sink": 64,
    "recent": 256,
    "page_size": 64,
    "bits": 2,
    "tune": "false",
    "variants": "",
    "mem_gb": 120,
    "l2_factor": 4,
    "reps": 20,
    "check": "true",
    "parts": "attention,quantize",
    "layer_weight_mb": 385.9,
    "layout": "mma",
}


def _ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


# ----------------------------------------------------------------------------------------------
# timing


def time_calls(calls: list[Callable[[], Any]], reps: int = 20, graph: bool = True) -> tuple[float, str]:
    """Median microseconds per call: CUDA-graph replays of all ``calls`` (one per input set), else eager."""
    import torch

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
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        mode = "graph"
        run = graph.replay
    except Exception as exc:  # capture unsupported for this call: fall back to eager launches
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
    import torch

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


# ----------------------------------------------------------------------------------------------
# workloads


def bench_sdpa(B: int, T: int, H: int, hkv: int, d: int, backend: str, opts: dict[str, Any], l2: int) -> dict[str, Any]:
    """BF16 SDPA decode (one query per sequence, GQA) with one backend: microseconds and bytes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv_bytes = 2 * B * hkv * T * d * 2
    n = _n_sets(kv_bytes, l2, opts["l2_factor"], int(opts["mem_gb"] * 2**30 * 0.45))
    if kv_bytes > opts["mem_gb"] * 2**30 * 0.6:
        return {"status": "skipped: memory"}
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
    except Exception as exc:
        us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:120]}"
    del sets
    torch.cuda.empty_cache()
    return {"us": us, "timing": mode, "bytes": kv_bytes + 2 * B * H * d * 2, "sets": n, "status": status}


def _int2_inputs(B: int, T: int, H: int, hkv: int, d: int, opts: dict[str, Any], n_sets: int, seed: int = 0):
    """Random pool + page tables (one set per page range), BF16 windows, transforms: the decode inputs."""
    import torch

    from oscar.cache.paged import HeadTransform, QuantPages

    g = torch.Generator(device="cuda").manual_seed(seed)
    bits, G, ps = opts["bits"], d, opts["page_size"]
    S0, W = opts["sink"], opts["recent"]
    t_int = max(0, T - S0 - W)
    pages_per_seq = max(1, -(-t_int // ps))
    npages = n_sets * B * pages_per_seq
    nbytes = d * bits // 8

    def pages() -> QuantPages:
        codes = torch.randint(0, 256, (npages, hkv, ps, nbytes), device="cuda", dtype=torch.uint8, generator=g)
        scale = (0.02 + 0.05 * torch.rand(npages, hkv, ps, d // G, device="cuda", generator=g)).to(torch.bfloat16)
        zero = (-0.1 * torch.rand(npages, hkv, ps, d // G, device="cuda", generator=g)).to(torch.bfloat16)
        return QuantPages(codes, scale, zero, bits, G)

    kp, vp = pages(), pages()
    perm = torch.randperm(npages, device="cuda", generator=g).to(torch.int32)
    tables = [perm[s * B * pages_per_seq:(s + 1) * B * pages_per_seq].reshape(B, pages_per_seq).contiguous()
              for s in range(n_sets)]
    int_len = torch.full((B,), t_int, dtype=torch.int32, device="cuda")

    def orth() -> torch.Tensor:
        return torch.linalg.qr(torch.randn(hkv, d, d, device="cuda", generator=g))[0]

    kt = HeadTransform(R=orth(), mu=0.1 * torch.randn(hkv, d, device="cuda", generator=g),
                       rho=torch.full((hkv,), 0.95, device="cuda"))
    vt = HeadTransform(R=orth(), mu=0.1 * torch.randn(hkv, d, device="cuda", generator=g),
                       rho=torch.full((hkv,), 0.92, device="cuda"))
    segs = []
    for _ in range(n_sets):
        segs.append(dict(
            sink_k=torch.randn(B, hkv, S0, d, device="cuda", generator=g).to(torch.bfloat16),
            sink_v=torch.randn(B, hkv, S0, d, device="cuda", generator=g).to(torch.bfloat16),
            sink_len=torch.full((B,), S0, dtype=torch.int32, device="cuda"),
            recent_k=torch.randn(B, hkv, W, d, device="cuda", generator=g).to(torch.bfloat16),
            recent_v=torch.randn(B, hkv, W, d, device="cuda", generator=g).to(torch.bfloat16),
            recent_len=torch.full((B,), W, dtype=torch.int32, device="cuda"),
        ))
    qs = [torch.randn(B, H, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(n_sets)]
    per_seq_bytes = hkv * (t_int * 2 * (nbytes + 2 * 2 * (d // G)) + (S0 + W) * d * 2 * 2)
    return kp, vp, tables, int_len, kt, vt, segs, qs, B * (per_seq_bytes + 2 * H * d * 2)


def bench_int2(B: int, T: int, H: int, hkv: int, d: int, opts: dict[str, Any], l2: int,
               variants: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Time the paged INT2 decode attention (three segments) for each variant."""
    import torch

    from oscar.kernels.decode_attention import paged_decode_attention

    t_int = max(0, T - opts["sink"] - opts["recent"])
    per_set = 2 * B * hkv * (t_int * (d * opts["bits"] // 8 + 4) + (opts["sink"] + opts["recent"]) * d * 2)
    n = _n_sets(per_set, l2, opts["l2_factor"], int(opts["mem_gb"] * 2**30 * 0.5))
    kp, vp, tables, int_len, kt, vt, segs, qs, nbytes = _int2_inputs(B, T, H, hkv, d, opts, n)
    rows = []
    for var in variants:
        kw = {k: v for k, v in var.items() if k != "rope"}
        if var.get("rope"):  # rope-centered keys: every head centered, Qwen-style RoPE, int positions from the sink
            kw.update(rope_mu=0.5 * torch.randn(hkv, d, device="cuda"), rope_scaling=1.0, rope_pos0=opts["sink"],
                      rope_freq=1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))

        def call(s: int, kw=kw):
            def f():
                return paged_decode_attention(
                    qs[s], kp.codes, kp.scale, kp.zero, vp.codes, vp.scale, vp.zero, tables[s], int_len,
                    bits=kp.bits, group_size=kp.group_size, R_K=kt.R, mu_K=kt.mu, R_V=vt.R, mu_V=vt.mu,
                    **segs[s], **kw)
            return f

        try:
            us, mode = time_calls([call(s) for s in range(n)], reps=opts["reps"])
            status = "ok"
        except Exception as exc:
            us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:160]}"
        rows.append({"us": us, "timing": mode, "bytes": nbytes, "sets": n, "status": status,
                     "variant": json.dumps(var, sort_keys=True)})
    del kp, vp, tables, segs, qs
    torch.cuda.empty_cache()
    return rows


def bench_quantize(B: int, d: int, hkv: int, opts: dict[str, Any], l2: int) -> list[dict[str, Any]]:
    """Demotion (B rows of K and V, rotation + centering + clip) and prefill quantization (B*1024 rows)."""
    import torch

    from oscar.cache.paged import HeadTransform, QuantPages, rotate_quantize_pack, rotate_quantize_pack_kv

    g = torch.Generator(device="cuda").manual_seed(1)
    bits, ps, W = opts["bits"], opts["page_size"], opts["recent"]
    out = []
    sets = 16  # launches per graph replay: a single small launch would time the graph launch, not the kernel
    for kind, n_rows in (("demote", B), ("prefill", 8192)):
        n_sets = sets if kind == "demote" else 1
        npages = -(-n_rows // ps) + 1
        lay = ("mma_k", "mma_v") if _mma(opts) and d in (64, 128) else ("rows", "rows")  # the benchmarked layout
        pages = [[QuantPages.empty(npages, hkv, ps, d, bits, d, "cuda", lay[i]) for i in range(2)]
                 for _ in range(n_sets)]
        R = torch.linalg.qr(torch.randn(hkv, d, d, device="cuda", generator=g))[0]
        t = HeadTransform(R=R, mu=torch.randn(hkv, d, device="cuda", generator=g), rho=torch.full((hkv,), 0.95, device="cuda"))
        slots = torch.randperm(npages * ps, device="cuda", generator=g)[:n_rows]
        calls = []
        for k in range(n_sets):
            if kind == "demote":  # K and V of one layer, one fused launch
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
        except Exception as exc:
            us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:160]}"
        out.append({"kind": kind, "batch": B, "head_dim": d, "rows": n_rows, "us": us, "timing": mode, "status": status,
                    "layout": lay[0]})
    return out


def _mma(opts: dict[str, Any]) -> bool:
    if opts["layout"] not in ("mma", "rows"):
        raise ValueError(f"bench-kernels: layout={opts['layout']!r}; valid: mma, rows")
    return opts["layout"] == "mma" and opts["bits"] in (2, 4)


def check_against_twin(d: int, opts: dict[str, Any], rope: bool = False) -> float:
    """Max relative error per head of the kernel vs the float32 torch twin on a mid-size GPU case (the random
    codes read in the benchmarked layout by both); ``rope``: rope-centered keys (mma layout)."""
    import torch

    from oscar.kernels.decode_attention import paged_decode_attention
    from oscar.cache.paged import HeadTransform, QuantPages, decode_attention_torch

    B, T, H, hkv = 4, 8192, opts["q_heads"], opts["kv_heads"]
    kp, vp, tables, int_len, kt, vt, segs, qs, _ = _int2_inputs(B, T, H, hkv, d, opts, 1, seed=3)
    layout = "mma" if _mma(opts) else "rows"
    if layout == "mma":
        kp = QuantPages(kp.codes, kp.scale, kp.zero, kp.bits, kp.group_size, "mma_k")
        vp = QuantPages(vp.codes, vp.scale, vp.zero, vp.bits, vp.group_size, "mma_v")
    kw: dict[str, Any] = {}
    if rope:
        g = torch.Generator(device="cuda").manual_seed(4)
        kt = HeadTransform(kt.R, kt.mu, kt.rho, 0.5 * torch.randn(hkv, d, device="cuda", generator=g),
                           1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        kw = dict(rope_mu=kt.rope_mu, rope_freq=kt.rope_freq, rope_pos0=opts["sink"])
    ref = decode_attention_torch(qs[0], kp, vp, tables[0], int_len, kt, vt, int_pos0=opts["sink"], **segs[0]).float()
    out = paged_decode_attention(qs[0], kp.codes, kp.scale, kp.zero, vp.codes, vp.scale, vp.zero, tables[0],
                                 int_len, bits=kp.bits, group_size=kp.group_size, R_K=kt.R, mu_K=kt.mu,
                                 R_V=vt.R, mu_V=vt.mu, layout=layout, **kw, **segs[0]).float()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


# ----------------------------------------------------------------------------------------------


def _variants(spec: str) -> list[dict[str, Any]]:
    if spec:
        return [json.loads(v) for v in spec.split(";")]
    out = [{"block_n": 128, "num_warps": 4, "num_stages": 2, "fast_unpack": True, "heads_in_m": False,
            "span_pages": True, "merge_sp": 8, "fuse_bf16": False},  # v7 long-context default
           {"block_n": 64, "num_warps": 4, "num_stages": 2, "fast_unpack": True, "heads_in_m": False,
            "span_pages": False, "merge_sp": 8, "fuse_bf16": True}]  # v7 short-context default
    for him in (False, True):
        for bn in (32, 64):
            for nw in (4, 8):
                out.append({"block_n": bn, "num_warps": nw, "num_stages": 2, "fast_unpack": True, "heads_in_m": him})
    out.append({"block_n": 64, "num_warps": 4, "num_stages": 2, "fast_unpack": False, "heads_in_m": True})
    return out


def run(opts: dict[str, Any]) -> int:
    """Run the benchmark and write its outputs; returns a process exit code."""
    import torch

    if not torch.cuda.is_available():
        print("bench-kernels: no CUDA device; the kernel benchmark needs a GPU (nothing written)", file=sys.stderr)
        return 2
    out_csv = Path(opts["output"])
    stem = out_csv.with_suffix("")
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    import triton

    from oscar.kernels.decode_attention import default_num_splits

    env = {"gpu": props.name, "sms": props.multi_processor_count, "l2_mb": l2 / 2**20, "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda}
    bw = copy_bandwidth()
    env["copy_tb_s"] = bw / 1e12
    print(f"device {env}", flush=True)
    H, hkv = opts["q_heads"], opts["kv_heads"]
    env["bits"] = opts["bits"]
    if opts["check"] == "true":
        for d in _ints(opts["head_dims"]):
            env[f"rel_err_vs_twin_d{d}"] = check_against_twin(d, opts)
        print(f"check vs torch twin: {env}", flush=True)

    variants = _variants(opts["variants"])
    tune_rows: list[dict[str, Any]] = []
    if opts["tune"] == "true" and len(variants) > 1:
        for (B, T) in ((1, 32768), (8, 32768), (32, 32768), (1, 131072), (32, 131072), (1, 4096), (64, 4096)):
            for mult in (1.0, 2.0):
                vs = []
                for v in variants:
                    ns = max(1, int(round(mult * default_num_splits(B, hkv, max(1, T - 320), v["block_n"]))))
                    vs.append({**v, "num_splits": ns})
                for r, v in zip(bench_int2(B, T, H, hkv, 128, opts, l2, vs), vs):
                    tune_rows.append({"batch": B, "context": T, "head_dim": 128, "split_mult": mult, **v,
                                      "us": r["us"], "status": r["status"], "timing": r["timing"]})
                    print(f"tune B={B} T={T} {v} -> {r['us']:.1f} us {r['status']}", flush=True)
        atomic_write_csv(Path(f"{stem}_tune.csv"), tune_rows)
        ok = [r for r in tune_rows if r["status"] == "ok"]
        score: dict[str, list[float]] = {}
        for r in ok:  # geometric-mean speed relative to the best per (B, T), split multiplier included
            best = min(x["us"] for x in ok if x["batch"] == r["batch"] and x["context"] == r["context"])
            key = json.dumps({k: r[k] for k in ("block_n", "num_warps", "num_stages", "fast_unpack", "heads_in_m",
                                                "span_pages", "merge_sp", "fuse_bf16") if k in r}, sort_keys=True)
            score.setdefault(key, []).append(math.log(r["us"] / best))
        best_cfg = json.loads(min(score, key=lambda k: sum(score[k]) / len(score[k])))
        print(f"best config {best_cfg}", flush=True)
    else:
        best_cfg = variants[0]

    parts = {p.strip() for p in opts["parts"].split(",") if p.strip()}
    bad = parts - {"attention", "quantize"}
    if bad:
        raise ValueError(f"bench-kernels: unknown parts {sorted(bad)}; valid: attention, quantize")
    rows: list[dict[str, Any]] = []
    for d in (_ints(opts["head_dims"]) if "attention" in parts else []):
        for T in _ints(opts["contexts"]):
            for B in _ints(opts["batches"]):
                base = {"head_dim": d, "batch": B, "context": T, "q_heads": H, "kv_heads": hkv}
                sd = {be: bench_sdpa(B, T, H, hkv, d, be, opts, l2) for be in ("cudnn", "flash")}
                if opts["tune"] == "true":  # the tuned configuration at three split counts, best of them
                    ns0 = default_num_splits(B, hkv, max(1, T - 320), best_cfg["block_n"])
                    vs = [{**best_cfg, "num_splits": max(1, int(round(m * ns0)))} for m in (0.5, 1.0, 2.0)]
                elif _mma(opts):  # what a caller gets on mma-layout pages, and the Triton row-layout path (v8)
                    vs = [{"layout": "mma"}, {}]
                else:  # what a caller gets on row-layout pages (v8), and the v7 word path for reference
                    vs = [{}, {"planes": False}]
                res = bench_int2(B, T, H, hkv, d, opts, l2, vs)
                ours = [r for r in (res if opts["tune"] == "true" else res[:1]) if r["status"] == "ok"]
                best = min(ours, key=lambda r: r["us"]) if ours else None
                bf = [sd[k]["us"] for k in sd if sd[k].get("status") == "ok"]
                row = dict(base)
                for be in ("cudnn", "flash"):
                    row[f"{be}_us"] = sd[be].get("us", float("nan"))
                    row[f"{be}_status"] = sd[be].get("status")
                best_bf = min(bf) if bf else float("nan")
                row["bf16_best_us"] = best_bf
                row["bf16_tb_s"] = (sd["cudnn"].get("bytes", 0) / (best_bf * 1e-6) / 1e12) if bf else float("nan")
                if best is not None:
                    row.update({"int2_us": best["us"], "int2_variant": best["variant"], "int2_timing": best["timing"],
                                "int2_bytes": best["bytes"], "int2_sets": best["sets"],
                                "int2_tb_s": best["bytes"] / (best["us"] * 1e-6) / 1e12,
                                "int2_bw_frac": best["bytes"] / (best["us"] * 1e-6) / bw,
                                "int2_floor_us": best["bytes"] / bw * 1e6,
                                "speedup_vs_best_bf16": best_bf / best["us"]})
                if opts["tune"] != "true" and res[1]["status"] == "ok":
                    row["int2_ref_us"] = res[1]["us"]
                    row["int2_ref"] = "rows (v8)" if _mma(opts) else "v7"
                rows.append(row)
                print(f"d={d} B={B:4d} T={T:6d} cudnn={row['cudnn_us']:.1f} flash={row['flash_us']:.1f} "
                      f"int2={row.get('int2_us', float('nan')):.1f} us x{row.get('speedup_vs_best_bf16', float('nan')):.2f} "
                      f"bw={row.get('int2_bw_frac', float('nan')):.2f}", flush=True)
                atomic_write_csv(out_csv, rows)

    q_rows = []
    for d in (_ints(opts["head_dims"]) if "quantize" in parts else []):
        for B in _ints(opts["batches"]):
            q_rows += bench_quantize(B, d, hkv, opts, l2)
    if not rows and out_csv.exists():  # quantize-only run: shares against the attention table already there
        with open(out_csv, newline="") as fh:
            rows = [{k: (float(v) if k in ("int2_us",) else int(v) if k in ("batch", "head_dim", "context") else v)
                     for k, v in r.items() if v != ""} for r in csv.DictReader(fh)]
        attention_from = str(out_csv)
    else:
        attention_from = "this run"
    weights_us = opts["layer_weight_mb"] * 1e6 / bw * 1e6  # one layer's BF16 weights read at copy bandwidth
    env["layer_weight_mb"] = opts["layer_weight_mb"]
    env["layer_weights_us"] = weights_us
    env["quantize_attention_from"] = attention_from
    for r in q_rows:
        if r["kind"] == "demote":
            att = [x for x in rows if x["batch"] == r["batch"] and x["head_dim"] == r["head_dim"] and "int2_us" in x]
            if att:
                r["attn_us_min"] = min(x["int2_us"] for x in att)
                r["frac_of_step_worst"] = r["us"] / (r["us"] + r["attn_us_min"])
                r["frac_of_layer_step"] = r["us"] / (r["us"] + r["attn_us_min"] + weights_us)
    if q_rows:
        atomic_write_csv(Path(f"{stem}_quantize.csv"), q_rows)
    atomic_write_text(Path(f"{stem}_env.json"), json.dumps(env, indent=2))
    md = Path(f"{stem}.md") if "attention" in parts else Path(f"{stem}_quantize.md")
    shown = rows if "attention" in parts else []
    atomic_write_text(md, summary_markdown(shown, q_rows, env, " ".join(sys.argv)))
    if "attention" in parts:
        try:
            plot(rows, Path(f"{stem}.png"))
        except ImportError:
            print("matplotlib missing: no plot", file=sys.stderr)
    print(summary_markdown(shown, q_rows, env, " ".join(sys.argv)))
    return 0


def summary_markdown(rows: list[dict[str, Any]], q_rows: list[dict[str, Any]], env: dict[str, Any], cmd: str) -> str:
    """Short Markdown report: hardware, command, one line per (head_dim, batch, context)."""
    q = f"INT{env.get('bits', 2)}"
    lines = [f"# Decode attention: paged {q} (sink 64 + {q} + recent 256) vs BF16 SDPA", "",
             f"Hardware: {env.get('gpu')} ({env.get('sms')} SMs, L2 {env.get('l2_mb', 0):.0f} MiB), torch {env.get('torch')}, "
             f"triton {env.get('triton')}, CUDA {env.get('cuda')}. Measured copy bandwidth (read+write): "
             f"{env.get('copy_tb_s', float('nan')):.2f} TB/s.", "",
             f"Command: `{cmd}`", "",
             "One layer, one query per sequence, times in microseconds per call (median of CUDA-graph replays "
             f"over input sets larger than L2). Bandwidth fraction: {q} bytes read / time / copy bandwidth.", "",
             f"| d | batch | context | cuDNN | flash | {q} (defaults) | {q} {rows[0].get('int2_ref', 'ref') if rows else 'ref'} "
             "| speedup vs best BF16 | {q} TB/s | of copy bw |".replace("{q}", q),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['head_dim']} | {r['batch']} | {r['context']} | {r['cudnn_us']:.1f} | {r['flash_us']:.1f} | "
                     f"{r.get('int2_us', float('nan')):.1f} | {r.get('int2_ref_us', float('nan')):.1f} | "
                     f"{r.get('speedup_vs_best_bf16', float('nan')):.2f}x | "
                     f"{r.get('int2_tb_s', float('nan')):.2f} | {100 * r.get('int2_bw_frac', float('nan')):.0f}% |")
    if q_rows:
        lines += ["", "Quantization kernels (rotation + centering + clip + pack, K and V for demotion; 16 launches "
                  "per graph replay, time per launch):", "",
                  "| kind | d | batch | rows | us | share of attention + demotion (fastest attention of that batch) "
                  f"| share of a layer step (+ {env.get('layer_weight_mb', 0):.0f} MB of BF16 weights at copy "
                  "bandwidth, Qwen3-8B) |",
                  "|---|---|---|---|---|---|---|"]
        for r in q_rows:
            frac = r.get("frac_of_step_worst")
            frac2 = r.get("frac_of_layer_step")
            lines.append(f"| {r['kind']} | {r['head_dim']} | {r['batch']} | {r['rows']} | {r['us']:.1f} | "
                         f"{'' if frac is None else f'{100 * frac:.1f}%'} | "
                         f"{'' if frac2 is None else f'{100 * frac2:.1f}%'} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Speedup over the best BF16 and bandwidth fraction against context, one line per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["head_dim"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(len(dims), 2, figsize=(11, 4 * len(dims)), squeeze=False)
    for i, d in enumerate(dims):
        for B in sorted({r["batch"] for r in rows}):
            rs = sorted([r for r in rows if r["head_dim"] == d and r["batch"] == B and "int2_us" in r],
                        key=lambda r: r["context"])
            if not rs:
                continue
            xs = [r["context"] // 1024 for r in rs]
            axes[i][0].plot(xs, [r["speedup_vs_best_bf16"] for r in rs], marker="o", label=f"batch {B}")
            axes[i][1].plot(xs, [100 * r["int2_bw_frac"] for r in rs], marker="o", label=f"batch {B}")
        axes[i][0].axhline(3, color="gray", ls="--", lw=1)  # issue 15's targets: 3x the best BF16, 50% of copy bw
        axes[i][0].axhline(1, color="black", lw=0.5)
        axes[i][1].axhline(50, color="gray", ls="--", lw=1)
        axes[i][0].set(xscale="log", xlabel="context (k tokens)", ylabel="speedup vs best BF16 SDPA",
                       title=f"INT2 decode attention, head_dim {d}")
        axes[i][1].set(xscale="log", xlabel="context (k tokens)", ylabel="% of measured copy bandwidth",
                       title=f"achieved bandwidth, head_dim {d}")
        axes[i][0].legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110))

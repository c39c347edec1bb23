"""One-call H200 sweep: decode-attention variants (block, page size, pipelining, splits) vs cuDNN/flash; demotion.

Usage (repo root of a copy where ``oscar.kernels`` imports, e.g. inside ``benchmarks/gpu_sweep.sh``):

    python3 benchmarks/sweep_decode.py OUTDIR [budget_seconds]

Writes ``OUTDIR/sweep_decode.csv`` (every timing), ``sweep_quantize.csv`` (demotion variants),
``sweep_decode.md`` (best variant per shape against the v7 default (BASELINE) and BF16) and
``sweep_decode.png``; rewrites them after every shape so a run cut short still reports. Shapes run
in priority order; once the time budget is spent the remaining shapes are skipped (and listed).
A failing variant is logged with its error and the sweep goes on.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from oscar.core.files import atomic_write_csv, atomic_write_text
from oscar.bench.kernel_bench import bench_int2, bench_sdpa, copy_bandwidth, time_calls

HQ, HKV = 32, 8
# (head_dim, batch, context) in priority order
SHAPES = [(128, 8, 32768), (128, 1, 32768), (128, 1, 4096), (128, 32, 131072), (128, 8, 4096), (128, 32, 32768),
          (128, 32, 4096), (128, 1, 131072), (64, 8, 32768), (128, 8, 131072)]
# name -> (page_size, kernel options, split multipliers of default_num_splits). "v7" is the previous default
# (word unpack, tokens in M, blocks of 128 spanning pages of 64); "pl_*" are the bit-plane path (v8): int8
# tensor-core scores with a two-level int8 query ("i8"; "l1": one level, timing only, too coarse), fp16
# scores ("f16"), fp16 value planes; "fused": BF16 chunks as extra programs of the split-K launch.
BASELINE = "v7"
V7 = {"planes": False}
PL = {"planes": True, "num_warps": 4, "prefetch": False}
VARIANTS: dict[str, tuple[int, dict[str, Any], tuple[float, ...]]] = {
    "v7": (64, V7, (0.0,)),  # multiplier 0: the kernel's own default split count
    "v8_default": (64, {}, (0.0,)),
    "pl_b128_r128": (64, {**PL, "block_n": 128, "span_pages": True, "maxnreg": 128}, (2.0, 4.0)),
    "pl_b128_r168": (64, {**PL, "block_n": 128, "span_pages": True, "maxnreg": 168}, (2.0, 4.0)),
    "pl_b128": (64, {**PL, "block_n": 128, "span_pages": True}, (2.0,)),
    "pl_b64": (64, {**PL, "block_n": 64}, (2.0, 4.0)),
    "pl_b64_fused": (64, {**PL, "block_n": 64, "fuse_bf16": True}, (2.0, 4.0)),
    "pl_b256_r168": (64, {**PL, "block_n": 256, "span_pages": True, "maxnreg": 168}, (1.0, 2.0)),
    "pl_b64_r128": (64, {**PL, "block_n": 64, "maxnreg": 128}, (2.0,)),
}


def profile_breakdown(l2: int) -> list[dict[str, Any]]:
    """Per-kernel GPU time of the default call at batch 1 (torch.profiler): where small-batch time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from oscar.bench.kernel_bench import _int2_inputs
    from oscar.kernels.decode_attention import paged_decode_attention

    out = []
    for T in (4096, 32768):
        B, d = 1, 128
        kp, vp, tables, int_len, kt, vt, segs, qs, _ = _int2_inputs(B, T, HQ, HKV, d, _opts(64), 2)

        def f():
            return paged_decode_attention(qs[0], kp.codes, kp.scale, kp.zero, vp.codes, vp.scale, vp.zero, tables[0],
                                          int_len, bits=2, group_size=d, R_K=kt.R, mu_K=kt.mu, R_V=vt.R, mu_V=vt.mu,
                                          **segs[0])
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                f()
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" or getattr(ev, "device_time", 0):
                us = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)
                out.append({"batch": B, "context": T, "kernel": ev.key[:60], "calls": ev.count, "us_per_call": us})
                print(f"  profile B={B} T={T} {ev.key[:60]}: {us:.2f} us x {ev.count}", flush=True)
    return out


def _opts(page_size: int) -> dict[str, Any]:
    return {"page_size": page_size, "bits": 2, "sink": 64, "recent": 256, "l2_factor": 4, "mem_gb": 120, "reps": 20}


def sweep_shape(d: int, B: int, T: int, l2: int) -> list[dict[str, Any]]:
    """BF16 baselines and every variant x split multiplier at one shape."""
    from oscar.kernels.decode_attention import default_num_splits

    rows: list[dict[str, Any]] = []
    base = {"head_dim": d, "batch": B, "context": T}
    for be in ("cudnn", "flash"):
        r = bench_sdpa(B, T, HQ, HKV, d, be, _opts(64), l2)
        rows.append({**base, "kind": be, "us": r.get("us", float("nan")), "status": r.get("status")})
    by_page: dict[int, list[tuple[str, dict[str, Any], float]]] = {}
    for name, (ps, opt, mults) in VARIANTS.items():
        ns0 = default_num_splits(B, HKV, max(1, T - 320), opt.get("block_n", 128))
        for m in mults:
            var = dict(opt) if m == 0.0 else {**opt, "num_splits": max(1, int(round(m * ns0)))}
            by_page.setdefault(ps, []).append((name, var, m))
    for ps, items in by_page.items():
        try:
            res = bench_int2(B, T, HQ, HKV, d, _opts(ps), l2, [v for _, v, _ in items])
        except Exception as exc:  # inputs or a whole page size failed: log and go on
            res = [{"us": float("nan"), "status": f"error: {type(exc).__name__}: {str(exc)[:160]}", "bytes": 0}
                   for _ in items]
        for (name, v, m), r in zip(items, res):
            rows.append({**base, "kind": "int2", "variant": name, "page_size": ps, "split_mult": m,
                         "num_splits": v.get("num_splits", 0), "config": json.dumps(v, sort_keys=True), "us": r["us"],
                         "bytes": r.get("bytes", 0), "status": r["status"]})
            print(f"  d={d} B={B} T={T} {name} x{m} ns={v.get('num_splits', 'default')}: {r['us']:.1f} us {r['status']}",
                  flush=True)
    return rows


def sweep_quantize(l2: int) -> list[dict[str, Any]]:
    """Demotion of K and V (one fused launch) and prefill quantization: binary vs 16-ary clip search, 4/8 warps."""
    import torch

    from oscar.kernels.quantize import rotate_quantize_pack_pair
    from oscar.cache.paged import QuantPages

    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for d in (128,):
        R = torch.linalg.qr(torch.randn(HKV, d, d, device="cuda", generator=g))[0]
        mu = torch.randn(HKV, d, device="cuda", generator=g)
        rho = torch.full((HKV,), 0.95, device="cuda")
        for B, kind in ((1, "demote"), (8, "demote"), (32, "demote"), (8192, "prefill")):
            npages = -(-B // 64) + 1
            pages = [QuantPages.empty(npages, HKV, 64, d, 2, d, "cuda") for _ in range(2)]
            slots = torch.randperm(npages * 64, device="cuda", generator=g)[:B]
            if kind == "demote":
                src = torch.randn(B, HKV, 256, d, device="cuda", generator=g).to(torch.bfloat16)
                idx = torch.randint(0, 256, (B,), device="cuda", generator=g)
            else:
                src = torch.randn(B, HKV, d, device="cuda", generator=g).to(torch.bfloat16)
                idx = None
            for radix4, nw, row in ((False, 8, False), (False, 4, True), (False, 2, True), (False, 1, True)):
                if row and B > 64:
                    continue

                def f(radix4=radix4, nw=nw, row=row):
                    rotate_quantize_pack_pair(src, src, slots, (pages[0].codes, pages[0].scale, pages[0].zero),
                                              (pages[1].codes, pages[1].scale, pages[1].zero), bits=2,
                                              group_size=d, k_transform=(R, mu, rho), v_transform=(R, mu, rho),
                                              src_index=idx, num_warps=nw, radix4=radix4, row_path=row,
                                              row_warps=nw)
                try:
                    us, mode = time_calls([f], reps=20)
                    status = "ok"
                except Exception as exc:
                    us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:160]}"
                path = "rows (FMA rotation, rank select)" if row else "blocks (3xTF32 rotation, radix-2 select)"
                out.append({"kind": kind, "head_dim": d, "rows": B, "path": path, "num_warps": nw,
                            "us": us, "timing": mode, "status": status})
                print(f"  {kind} d={d} rows={B} {path} warps={nw}: {us:.1f} us {status}", flush=True)
    return out


def summarize(rows: list[dict[str, Any]], q_rows: list[dict[str, Any]], env: dict[str, Any], skipped: list) -> str:
    """Markdown: per shape cuDNN, flash, v5 default, best variant; demotion table."""
    lines = ["# Decode-attention sweep (paged INT2, sink 64 + INT2 + recent 256) vs BF16 SDPA", "",
             f"Hardware: {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"copy bandwidth {env.get('copy_tb_s', float('nan')):.2f} TB/s. Command: `bash benchmarks/gpu_sweep.sh`.",
             "", "| d | batch | context | cuDNN | flash | INT2 v7 default | best INT2 | best variant (splits) | "
             "speedup vs best BF16 (v7 -> best) | best INT2 % of copy bw |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    shapes = []
    for r in rows:
        key = (r["head_dim"], r["batch"], r["context"])
        if key not in shapes:
            shapes.append(key)
    for key in shapes:
        rs = [r for r in rows if (r["head_dim"], r["batch"], r["context"]) == key]
        bf = {r["kind"]: r["us"] for r in rs if r["kind"] in ("cudnn", "flash") and r["status"] == "ok"}
        ints = [r for r in rs if r["kind"] == "int2" and r["status"] == "ok" and math.isfinite(r["us"])]
        v5 = [r for r in ints if r["variant"] == BASELINE]
        best = min(ints, key=lambda r: r["us"]) if ints else None
        best_bf = min(bf.values()) if bf else float("nan")
        v5_us = v5[0]["us"] if v5 else float("nan")
        if best is None:
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {bf.get('cudnn', float('nan')):.1f} | "
                         f"{bf.get('flash', float('nan')):.1f} | - | - | all variants failed | - | - |")
            continue
        bw = best["bytes"] / (best["us"] * 1e-6) / (env.get("copy_tb_s", float("nan")) * 1e12)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {bf.get('cudnn', float('nan')):.1f} | "
                     f"{bf.get('flash', float('nan')):.1f} | {v5_us:.1f} | {best['us']:.1f} | {best['variant']} "
                     f"({best['num_splits']}) | {best_bf / v5_us:.2f}x -> {best_bf / best['us']:.2f}x | "
                     f"{100 * bw:.0f}% |")
    if skipped:
        lines += ["", f"Skipped (time budget): {skipped}"]
    errs = sorted({f"{r.get('variant', r['kind'])}: {r['status']}" for r in rows if r["status"] != "ok"})
    if errs:
        lines += ["", "Errors:", ""] + [f"- {e}" for e in errs]
    if q_rows:
        lines += ["", "Demotion (K+V, one launch) and prefill quantization (rotation, centering, clip, pack):",
                  "",
                  "| kind | d | rows | kernel path | warps | us |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['kind']} | {r['head_dim']} | {r['rows']} | {r['path']} | {r['num_warps']} | {r['us']:.1f} |"
                  for r in q_rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Speedup over the best BF16 per shape: v5 default vs best variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, v5s, bests = [], [], []
    for key in dict.fromkeys((r["head_dim"], r["batch"], r["context"]) for r in rows):
        rs = [r for r in rows if (r["head_dim"], r["batch"], r["context"]) == key and r["status"] == "ok"]
        bf = [r["us"] for r in rs if r["kind"] in ("cudnn", "flash")]
        ints = [r for r in rs if r["kind"] == "int2"]
        v5 = [r["us"] for r in ints if r["variant"] == BASELINE]
        if not bf or not ints or not v5:
            continue
        labels.append(f"d{key[0]} B{key[1]} {key[2] // 1024}k")
        v5s.append(min(bf) / v5[0])
        bests.append(min(bf) / min(r["us"] for r in ints))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], v5s, 0.4, label=f"{BASELINE} default")
    ax.bar([x + 0.2 for x in xs], bests, 0.4, label="best variant")
    ax.axhline(1, color="black", lw=0.6)
    ax.set_xticks(list(xs), labels, rotation=30, fontsize=8)
    ax.set_ylabel("speedup vs best BF16 SDPA")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(path)


def main(argv: list[str]) -> int:
    """Run the sweep into ``argv[0]`` within ``argv[1]`` seconds (default 200)."""
    import torch
    import triton

    out = Path(argv[0])
    budget = float(argv[1]) if len(argv) > 1 else 200.0
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    env = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "triton": triton.__version__, "copy_tb_s": copy_bandwidth() / 1e12}
    print(f"device {env}", flush=True)
    rows: list[dict[str, Any]] = []
    q_rows: list[dict[str, Any]] = []
    skipped: list = []

    def write() -> None:
        atomic_write_csv(out / "sweep_decode.csv", rows)
        atomic_write_csv(out / "sweep_quantize.csv", q_rows)
        atomic_write_text(out / "sweep_decode.md", summarize(rows, q_rows, env, skipped))

    try:
        q_rows = sweep_quantize(l2)
    except Exception:
        traceback.print_exc()
    try:
        atomic_write_csv(out / "profile_b1.csv", profile_breakdown(l2))
    except Exception:
        traceback.print_exc()
    write()
    for d, B, T in SHAPES:
        if time.time() - t0 > budget:
            skipped.append((d, B, T))
            continue
        try:
            rows += sweep_shape(d, B, T, l2)
        except Exception:
            traceback.print_exc()
        write()
        print(f"[{time.time() - t0:.0f} s] done d={d} B={B} T={T}", flush=True)
    write()
    try:
        plot(rows, out / "sweep_decode.png")
    except Exception:
        traceback.print_exc()
    print((out / "sweep_decode.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

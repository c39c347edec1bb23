"""Decode kernel v11 against v10 and cuDNN BF16 in one process (issue 31): accuracy, times, achieved bandwidth.

Usage on a GPU host (checkout installed with ``pip install -e .``):

    python -m oscar.bench.v11_bench --out DIR [--batches 1,8,32] [--contexts 4096,32768,131072] [--variants ...]

For each shape (head_dim 128, 32 query heads, 8 KV heads, sink 64 + INT2 pages + recent 256, pages of 64): torch SDPA
BF16 with the cuDNN backend, the v10 mma kernel through ``oscar.cache.paged.decode_attention`` (the served path)
and the v11 kernel (``oscar.kernels.decode_v11``) on records packed from the same pages, each timed as the kernel
table does (``oscar.bench.kernel_bench.time_calls``: CUDA-graph replays over input sets several times the L2,
median per call). Before timing, v11 and v10 are checked against the float32 twin (batch 4, 8k). Bandwidth: the
INT2 bytes read (codes, scale/zero, both windows) per second against the measured device copy bandwidth (read +
write). Writes ``DIR/<name>.csv`` (one row per shape and kernel) and ``DIR/<name>_env.json``. ``--ncu B,T``: only
a few calls of the first variant at one shape, to run under Nsight Compute.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from oscar.bench.kernel_bench import _n_sets, bench_sdpa, copy_bandwidth, decode_inputs, time_calls
from oscar.cache.paged import decode_attention, decode_attention_torch
from oscar.kernels.decode_v11 import RecordLayout, V11Launch, pack_records, paged_decode_attention_v11

OPTS = {"sink": 64, "recent": 256, "page_size": 64, "mem_gb": 120, "l2_factor": 4, "reps": 20}
H, HKV, D = 32, 8, 128


def _variant(spec: str) -> tuple[str, V11Launch]:
    """``NAME:warps,stages,min_blocks[,num_splits]`` (min_blocks 0: the launcher's default)."""
    name, _, vals = spec.partition(":")
    w, s, m, *sp = (int(x) for x in vals.split(","))
    return name, V11Launch(warps=w, stages=s, min_blocks=m or None, num_splits=sp[0] if sp else None)


def ncu_target(B: int, T: int, launch: V11Launch) -> None:
    """A few v11 calls at one shape, for ``ncu -k regex:oscar_decode_v11 --launch-skip 3 --launch-count 1``."""
    inp = decode_inputs(B, T, H, HKV, D, OPTS, 1)
    rec, lay = _records(inp)
    for _ in range(5):
        paged_decode_attention_v11(inp["qs"][0], rec, lay, inp["segs"][0], inp["kt"], inp["vt"], launch=launch)
    torch.cuda.synchronize()


def _records(inp: dict) -> tuple[torch.Tensor, RecordLayout]:
    kp, vp = inp["pages"]["mma"]
    lay = RecordLayout(D, int(kp.codes.shape[2]))
    return pack_records(kp.codes, kp.scale, kp.zero, vp.codes, vp.scale, vp.zero, lay), lay


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max())


def accuracy(variants: dict[str, V11Launch]) -> dict[str, float]:
    """Largest relative error per head against the float32 twin on the same pages (batch 4, 8k, as the table)."""
    inp = decode_inputs(4, 8192, H, HKV, D, OPTS, 1, seed=3)
    kp, vp = inp["pages"]["mma"]
    q, seg = inp["qs"][0], inp["segs"][0]
    ref = decode_attention_torch(q, kp, vp, seg, inp["kt"], inp["vt"])
    errs = {"v10": _rel(decode_attention(q, kp, vp, seg, inp["kt"], inp["vt"], backend="triton"), ref)}
    rec, lay = _records(inp)
    for name, launch in variants.items():
        out = paged_decode_attention_v11(q, rec, lay, seg, inp["kt"], inp["vt"], launch=launch)
        again = paged_decode_attention_v11(q, rec, lay, seg, inp["kt"], inp["vt"], launch=launch)
        errs[name] = _rel(out, ref) if torch.equal(out, again) else float("nan")
    return errs


def bench_shape(B: int, T: int, variants: dict[str, V11Launch], l2: int) -> list[dict]:
    rows = []
    sd = bench_sdpa(B, T, H, HKV, D, "cudnn", OPTS, l2)
    rows.append({"kernel": "cudnn", "us": sd["us"], "bytes": sd.get("bytes", 0), "status": sd["status"]})
    t_int = max(0, T - OPTS["sink"] - OPTS["recent"])
    per_set = 2 * B * HKV * (t_int * (D // 4 + 4) + (OPTS["sink"] + OPTS["recent"]) * D * 2)
    n = _n_sets(per_set, l2, OPTS["l2_factor"], int(OPTS["mem_gb"] * 2**30 * 0.3))
    inp = decode_inputs(B, T, H, HKV, D, OPTS, n)
    kp, vp = inp["pages"]["mma"]

    def v10(s):
        return lambda: decode_attention(inp["qs"][s], kp, vp, inp["segs"][s], inp["kt"], inp["vt"], backend="triton")

    runs = {"v10": [v10(s) for s in range(n)]}
    rec, lay = _records(inp)
    for name, launch in variants.items():
        runs[name] = [(lambda s=s, launch=launch: paged_decode_attention_v11(
            inp["qs"][s], rec, lay, inp["segs"][s], inp["kt"], inp["vt"], launch=launch)) for s in range(n)]
    for name, calls in runs.items():
        try:
            us, mode = time_calls(calls, reps=OPTS["reps"])
            status = "ok" if mode == "graph" else f"ok ({mode})"
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot run a shape is a row status
            us, status = float("nan"), f"error: {type(exc).__name__}: {str(exc)[:160]}"
        rows.append({"kernel": name, "us": us, "bytes": inp["bytes"], "status": status, "sets": n})
    del inp, rec, runs
    torch.cuda.empty_cache()
    for r in rows:
        r.update(batch=B, context=T, head_dim=D)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--variants", default="v11:4,8,0", help="NAME:warps,stages,min_blocks;...")
    ap.add_argument("--budget_s", type=float, default=0, help="stop before the next shape after this many seconds")
    ap.add_argument("--name", default="v11", help="stem of the CSV and JSON files")
    ap.add_argument("--no-check", action="store_true", help="skip the accuracy check against the twin")
    ap.add_argument("--ncu", default="", help="B,T: only run the first variant a few times at that shape (for ncu)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    variants = dict(_variant(v) for v in args.variants.split(";") if v)
    if args.ncu:
        B, T = (int(x) for x in args.ncu.split(","))
        ncu_target(B, T, next(iter(variants.values())))
        return 0
    prop = torch.cuda.get_device_properties(0)
    l2 = int(getattr(prop, "L2_cache_size", 50 * 2**20))
    bw = copy_bandwidth()
    errs = {} if args.no_check else accuracy(variants)
    env = {"device": prop.name, "sms": prop.multi_processor_count, "torch": torch.__version__,
           "cuda": torch.version.cuda, "copy_bandwidth_TBps": bw / 1e12, "rel_err_vs_twin_b4_8k": errs,
           "variants": {k: vars(v) if hasattr(v, "__dict__") else str(v) for k, v in variants.items()},
           "command": "python -m oscar.bench.v11_bench " + " ".join(sys.argv[1:]), "opts": OPTS}
    print(json.dumps(env, default=str), flush=True)
    rows: list[dict] = []
    fields = ["head_dim", "batch", "context", "kernel", "us", "bytes", "TBps", "frac_copy", "x_cudnn", "x_v10", "sets",
              "status"]
    for B in (int(x) for x in args.batches.split(",")):
        for T in (int(x) for x in args.contexts.split(",")):
            if args.budget_s and time.time() - t0 > args.budget_s:
                print(f"budget reached before B={B} T={T}", flush=True)
                break
            shape = bench_shape(B, T, variants, l2)
            base = {r["kernel"]: r["us"] for r in shape}
            for r in shape:
                ok = r["us"] == r["us"] and r["us"] > 0
                r["TBps"] = r["bytes"] / (r["us"] * 1e-6) / 1e12 if ok else float("nan")
                r["frac_copy"] = r["TBps"] * 1e12 / bw if ok else float("nan")
                r["x_cudnn"] = base["cudnn"] / r["us"] if ok else float("nan")
                r["x_v10"] = base["v10"] / r["us"] if ok else float("nan")
            rows.extend(shape)
            print(" | ".join(f"B={B} T={T} {r['kernel']} {r['us']:.1f}us {r['frac_copy']:.2f}copy "
                             f"{r['x_cudnn']:.2f}x_cudnn {r['status']}" for r in shape), flush=True)
            with open(args.out / f"{args.name}.csv", "w") as f:
                f.write(",".join(fields) + "\n")
                for r in rows:
                    f.write(",".join(_fmt(r.get(k, "")) for k in fields) + "\n")
    env["seconds"] = time.time() - t0
    (args.out / f"{args.name}_env.json").write_text(json.dumps(env, indent=1, default=str))
    return 0


def _fmt(x: object) -> str:
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.4g}"
    return str(x).replace(",", ";")


if __name__ == "__main__":
    raise SystemExit(main())

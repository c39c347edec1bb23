"""Decode kernel v11 against v10 and cuDNN BF16 in one process: accuracy, times, achieved bandwidth.

Usage on a GPU host (checkout installed with ``pip install -e .``):

    python -m oscar.bench.experimental.v11_bench --out DIR [--batches 1,8,32] [--contexts 4096,32768,131072] [--variants ...]
        [--formats token,rope,channel]

For each shape (head_dim 128, 32 query heads, 8 KV heads, sink 64 + INT2 pages + recent 256, pages of 64): torch SDPA
BF16 with the cuDNN backend, then for each key format the v10 mma kernel through ``oscar.cache.paged.decode_attention``
(the served path) and the v11 kernel (``oscar.kernels.decode_v11``) on records packed from the same pages
(``pack_pages``), each timed as the kernel table does (``oscar.bench.kernels.timing.time_calls``: CUDA-graph replays
over input sets several times the L2, median per call). Formats: ``token`` (per-token INT2 keys), ``rope``
(rope-centered keys, the served ``auto`` format), ``channel`` (per-channel key pages, blocks of 64 tokens),
``rope_channel`` (both). Before timing, v11 and v10 are checked against the float32 twin for each format (batch 4,
8k). Bandwidth: the INT2 bytes read (codes, scale/zero, both windows) per second against the measured device copy
bandwidth (read + write). Writes ``DIR/<name>.csv`` (one row per shape, format and kernel) and
``DIR/<name>_env.json``. ``--ncu B,T``: only a few calls of the first variant at one shape (first format), to run
under Nsight Compute.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from oscar.bench.kernels.timing import _n_sets, bench_sdpa, copy_bandwidth, decode_inputs, time_calls
from oscar.cache.paged import HeadTransform, QuantPages, decode_attention, decode_attention_torch
from oscar.kernels.decode_v11 import RecordLayout, V11Launch, pack_pages, paged_decode_attention_v11

OPTS = {"sink": 64, "recent": 256, "page_size": 64, "mem_gb": 120, "l2_factor": 4, "reps": 20}
H, HKV, D = 32, 8, 128
KEY_BLOCK = 64  # tokens per channel block of the per-channel key format (auto's /ch64 candidates)
FORMATS = ("token", "rope", "channel", "rope_channel")


def format_inputs(inp: dict, fmt: str) -> tuple[QuantPages, QuantPages, HeadTransform]:
    """K pages, V pages and the key transform of one key format on a decode step's inputs (``decode_inputs``): the same
    codes and V pages for every format; per-channel keys get random per-channel scale/zero (blocks of ``KEY_BLOCK``),
    rope-centered keys the inputs' ``kt_rope`` (their ``int_pos0`` is the sink's length)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
    kp, vp = inp["pages"]["mma"]
    kt = inp["kt_rope"] if fmt.startswith("rope") else inp["kt"]
    if fmt.endswith("channel"):
        if "channel_pages" not in inp:
            g = torch.Generator(device=kp.codes.device).manual_seed(7)
            shape = (kp.codes.shape[0], HKV, kp.codes.shape[2] // KEY_BLOCK, D)
            scale = (0.02 + 0.05 * torch.rand(shape, device=kp.codes.device, generator=g)).to(torch.bfloat16)
            zero = (-0.1 * torch.rand(shape, device=kp.codes.device, generator=g)).to(torch.bfloat16)
            inp["channel_pages"] = QuantPages(kp.codes, scale, zero, 2, D, "mma_k", KEY_BLOCK)
        kp = inp["channel_pages"]
        kt = HeadTransform(kt.R, kt.mu, kt.rho, kt.rope_mu, kt.rope_freq, kt.rope_scaling, block=KEY_BLOCK)
    return kp, vp, kt


def format_bytes(inp: dict, fmt: str, B: int, T: int) -> int:
    """Bytes a decode step reads: ``inp["bytes"]`` (per-token keys), with per-channel keys' K scale/zero per block of
    ``KEY_BLOCK`` tokens and channel in place of the per-token K scale/zero."""
    if not fmt.endswith("channel"):
        return int(inp["bytes"])
    t_int = max(0, T - OPTS["sink"] - OPTS["recent"])
    return int(inp["bytes"]) - B * HKV * t_int * 4 + B * HKV * (t_int // KEY_BLOCK) * 4 * D


def _variant(spec: str) -> tuple[str, V11Launch]:
    """``NAME:warps,stages,min_blocks[,num_splits]`` (min_blocks 0: the launcher's default)."""
    name, _, vals = spec.partition(":")
    w, s, m, *sp = (int(x) for x in vals.split(","))
    return name, V11Launch(warps=w, stages=s, min_blocks=m or None, num_splits=sp[0] if sp else None)


def ncu_target(B: int, T: int, launch: V11Launch, fmt: str = "token") -> None:
    """A few v11 calls at one shape, for ``ncu -k regex:oscar_decode_v11 --launch-skip 3 --launch-count 1``."""
    inp = decode_inputs(B, T, H, HKV, D, OPTS, 1)
    kp, vp, kt = format_inputs(inp, fmt)
    rec, lay = pack_pages(kp, vp)
    for _ in range(5):
        paged_decode_attention_v11(inp["qs"][0], rec, lay, inp["segs"][0], kt, inp["vt"], launch=launch)
    torch.cuda.synchronize()


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max())


def accuracy(variants: dict[str, V11Launch], formats: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Largest relative error per head against the float32 twin on the same pages (batch 4, 8k, as the table), per
    format; a v11 call is repeated and must give the same bits (nan otherwise)."""
    inp = decode_inputs(4, 8192, H, HKV, D, OPTS, 1, seed=3)
    q, seg = inp["qs"][0], inp["segs"][0]
    errs: dict[str, dict[str, float]] = {}
    for fmt in formats:
        kp, vp, kt = format_inputs(inp, fmt)
        ref = decode_attention_torch(q, kp, vp, seg, kt, inp["vt"])
        errs[fmt] = {"v10": _rel(decode_attention(q, kp, vp, seg, kt, inp["vt"], backend="triton"), ref)}
        rec, lay = pack_pages(kp, vp)
        for name, launch in variants.items():
            out = paged_decode_attention_v11(q, rec, lay, seg, kt, inp["vt"], launch=launch)
            again = paged_decode_attention_v11(q, rec, lay, seg, kt, inp["vt"], launch=launch)
            errs[fmt][name] = _rel(out, ref) if torch.equal(out, again) else float("nan")
        del rec
    return errs


def _time(calls: list) -> tuple[float, str]:
    try:
        us, mode = time_calls(calls, reps=OPTS["reps"])
        return us, "ok" if mode == "graph" else f"ok ({mode})"
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot run a shape is a row status
        return float("nan"), f"error: {type(exc).__name__}: {str(exc)[:160]}"


def bench_shape(B: int, T: int, variants: dict[str, V11Launch], l2: int,
                formats: tuple[str, ...] = ("token",)) -> list[dict]:
    """cuDNN once, then v10 and the v11 variants for each key format, at one shape (one row per kernel and format)."""
    rows = []
    sd = bench_sdpa(B, T, H, HKV, D, "cudnn", OPTS, l2)
    rows.append({"kernel": "cudnn", "format": "bf16", "us": sd["us"], "bytes": sd.get("bytes", 0),
                 "status": sd["status"]})
    t_int = max(0, T - OPTS["sink"] - OPTS["recent"])
    per_set = 2 * B * HKV * (t_int * (D // 4 + 4) + (OPTS["sink"] + OPTS["recent"]) * D * 2)
    n = _n_sets(per_set, l2, OPTS["l2_factor"], int(OPTS["mem_gb"] * 2**30 * 0.3))
    inp = decode_inputs(B, T, H, HKV, D, OPTS, n)
    for fmt in formats:
        kp, vp, kt = format_inputs(inp, fmt)
        v10 = [(lambda s=s: decode_attention(inp["qs"][s], kp, vp, inp["segs"][s], kt, inp["vt"], backend="triton"))
               for s in range(n)]
        runs = {"v10": v10}
        rec, lay = pack_pages(kp, vp)
        for name, launch in variants.items():
            runs[name] = [(lambda s=s, launch=launch: paged_decode_attention_v11(
                inp["qs"][s], rec, lay, inp["segs"][s], kt, inp["vt"], launch=launch)) for s in range(n)]
        nbytes = format_bytes(inp, fmt, B, T)
        for name, calls in runs.items():
            us, status = _time(calls)
            rows.append({"kernel": name, "format": fmt, "us": us, "bytes": nbytes, "status": status, "sets": n})
        del rec, runs
        torch.cuda.empty_cache()
    del inp
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
    ap.add_argument("--formats", default="token", help=f"key formats, comma-separated, of {FORMATS}")
    ap.add_argument("--ncu", default="", help="B,T: only run the first variant a few times at that shape (for ncu)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    variants = dict(_variant(v) for v in args.variants.split(";") if v)
    formats = tuple(f for f in args.formats.split(",") if f)
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        ap.error(f"--formats {args.formats!r}: each must be one of {FORMATS}")
    if args.ncu:
        B, T = (int(x) for x in args.ncu.split(","))
        ncu_target(B, T, next(iter(variants.values())), formats[0])
        return 0
    prop = torch.cuda.get_device_properties(0)
    l2 = int(getattr(prop, "L2_cache_size", 50 * 2**20))
    bw = copy_bandwidth()
    errs = {} if args.no_check else accuracy(variants, formats)
    env = {"device": prop.name, "sms": prop.multi_processor_count, "torch": torch.__version__,
           "cuda": torch.version.cuda, "copy_bandwidth_TBps": bw / 1e12, "rel_err_vs_twin_b4_8k": errs,
           "variants": {k: vars(v) if hasattr(v, "__dict__") else str(v) for k, v in variants.items()},
           "command": "python -m oscar.bench.experimental.v11_bench " + " ".join(sys.argv[1:]), "opts": OPTS}
    print(json.dumps(env, default=str), flush=True)
    (args.out / f"{args.name}_env.json").write_text(json.dumps(env, indent=1, default=str))  # again at the end
    rows: list[dict] = []
    fields = ["head_dim", "batch", "context", "format", "kernel", "us", "bytes", "TBps", "frac_copy", "x_cudnn", "x_v10",
              "sets", "status"]
    for B in (int(x) for x in args.batches.split(",")):
        for T in (int(x) for x in args.contexts.split(",")):
            if args.budget_s and time.time() - t0 > args.budget_s:
                print(f"budget reached before B={B} T={T}", flush=True)
                break
            shape = bench_shape(B, T, variants, l2, formats)
            cudnn = shape[0]["us"]
            v10 = {r["format"]: r["us"] for r in shape if r["kernel"] == "v10"}
            for r in shape:
                ok = r["us"] == r["us"] and r["us"] > 0
                r["TBps"] = r["bytes"] / (r["us"] * 1e-6) / 1e12 if ok else float("nan")
                r["frac_copy"] = r["TBps"] * 1e12 / bw if ok else float("nan")
                r["x_cudnn"] = cudnn / r["us"] if ok else float("nan")
                r["x_v10"] = v10.get(r["format"], float("nan")) / r["us"] if ok else float("nan")
            rows.extend(shape)
            for r in shape:
                print(f"B={B} T={T} {r['format']} {r['kernel']} {r['us']:.1f}us {r['frac_copy']:.2f}copy "
                      f"{r['x_cudnn']:.2f}x_cudnn {r['x_v10']:.2f}x_v10 {r['status']}", flush=True)
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

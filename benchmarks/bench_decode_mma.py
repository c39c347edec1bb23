"""Time the mma-layout CUDA decode kernel against cuDNN/flash BF16 SDPA and the Triton v8 path (H200).

Usage (repo root on the GPU machine, after `source benchmarks/_gpu_copy.sh`):
    python3 benchmarks/bench_decode_mma.py OUTDIR [shapes=sweep|table] [variants=JSON;JSON...]

Random codes are valid in both layouts, so the same inputs time both paths. Each timing replays a CUDA
graph over input sets several times the L2 (oscar.bench.kernel_bench.time_calls); per shape it
writes one row per variant to OUTDIR/decode_mma_<shapes>.csv and prints a table of the best variant.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from oscar.core.files import atomic_write_csv
from oscar.bench.kernel_bench import DEFAULTS, bench_int2, bench_sdpa, copy_bandwidth
from oscar.kernels.decode_mma import default_num_splits  # noqa: F401  (variants name their waves)

SHAPES = {
    "sweep": [(128, 1, 4096), (128, 8, 4096), (128, 1, 32768), (128, 8, 32768), (128, 32, 32768), (128, 1, 131072),
              (128, 32, 131072), (64, 1, 4096), (64, 8, 32768), (64, 32, 131072)],
    "table": [(d, b, t) for d in (128, 64) for t in (4096, 32768, 65536, 131072) for b in (1, 8, 32, 64, 128)],
}
MMA_VARIANTS = [dict(mma_warps=w, mma_stages=st, mma_min_blocks=mb, waves=wv) for (w, st, mb, wv) in
                ((8, 2, 2, 1.0), (8, 3, 2, 1.0), (8, 4, 2, 0.5), (8, 4, 2, 1.0), (8, 4, 2, 2.0), (4, 4, 4, 1.0),
                 (4, 6, 4, 1.0), (4, 4, 4, 0.5))]


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    kv = dict(a.split("=", 1) for a in argv[1:])
    which = kv.get("shapes", "sweep")
    variants = [json.loads(v) for v in kv["variants"].split(";")] if "variants" in kv else MMA_VARIANTS
    with_v8 = kv.get("v8", "true") == "true"
    opts = dict(DEFAULTS)
    opts.update(reps=int(kv.get("reps", 20)), mem_gb=120, l2_factor=4)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    bw = copy_bandwidth()
    print(f"device {props.name} sms={props.multi_processor_count} copy={bw / 1e12:.2f} TB/s", flush=True)
    H, hkv, S0, W = opts["q_heads"], opts["kv_heads"], opts["sink"], opts["recent"]
    rows, table = [], []
    for d, B, T in SHAPES[which]:
        sd = {be: bench_sdpa(B, T, H, hkv, d, be, opts, l2) for be in ("cudnn", "flash")}
        cap = max(1, T - S0 - W)
        vs = [{"layout": "mma", **{k: x for k, x in v.items() if k != "waves"},
               "num_splits": default_num_splits(B, hkv, -(-cap // 64) * 64, v["mma_warps"], waves=v["waves"])}
              for v in variants]
        if with_v8:
            vs.append({})
        res = bench_int2(B, T, H, hkv, d, opts, l2, vs)
        bf = min(sd[k]["us"] for k in sd if sd[k].get("status") == "ok")
        for v, r in zip(vs, res):
            rows.append({"head_dim": d, "batch": B, "context": T, "variant": json.dumps(v, sort_keys=True),
                         "us": r["us"],
                         "status": r["status"], "bytes": r["bytes"], "cudnn_us": sd["cudnn"]["us"],
                         "flash_us": sd["flash"]["us"], "bf16_best_us": bf, "copy_tb_s": bw / 1e12,
                         "tb_s": r["bytes"] / (r["us"] * 1e-6) / 1e12, "bw_frac": r["bytes"] / (r["us"] * 1e-6) / bw,
                         "speedup": bf / r["us"]})
        mma = [x for x in rows[-len(vs):] if '"mma"' in x["variant"] and x["status"] == "ok"]
        best = min(mma, key=lambda x: x["us"]) if mma else None
        v8 = rows[-1]["us"] if with_v8 else float("nan")
        table.append((d, B, T, sd["cudnn"]["us"], sd["flash"]["us"], v8, best))
        print(f"d={d} B={B} T={T} cudnn={sd['cudnn']['us']:.1f} flash={sd['flash']['us']:.1f} v8={v8:.1f} "
              f"mma={best['us'] if best else float('nan'):.1f} x{best['speedup'] if best else float('nan'):.2f} "
              f"bw={best['bw_frac'] if best else float('nan'):.2f} {best['variant'] if best else ''}", flush=True)
        for x in rows[-len(vs):]:
            if x["status"] != "ok":
                print("  failed", x["variant"], x["status"], flush=True)
        atomic_write_csv(out / f"decode_mma_{which}.csv", rows, sorted({k for r in rows for k in r}))
    print("| d | batch | context | cuDNN | flash | v8 | mma | x best BF16 | of copy bw | variant |")
    for d, B, T, cu, fl, v8, best in table:
        if best:
            print(f"| {d} | {B} | {T} | {cu:.1f} | {fl:.1f} | {v8:.1f} | {best['us']:.1f} | {best['speedup']:.2f}x | "
                  f"{100 * best['bw_frac']:.0f}% | {best['variant']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

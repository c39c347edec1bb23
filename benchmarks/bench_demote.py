"""Demotion kernel variants on a GPU: one token per sequence, K and V of one layer in one launch.

Usage (repo root of a copy where ``oscar.kernels`` imports, e.g. after ``benchmarks/gpu_run.sh``'s copy):

    python3 benchmarks/bench_demote.py OUTDIR

Times, per (head_dim, rows), the row path (one program per row, head and tensor: FMA rotation,
clip threshold by extracting extremes) at 1, 2 and 4 warps and the block path (16 rows per
program: tensor-core rotation, radix select). 16 launches on different pages per CUDA-graph
replay, time per launch. Writes ``OUTDIR/bench_demote.csv`` and prints a Markdown table.
"""

from __future__ import annotations

import sys
from pathlib import Path

from oscar.core.files import atomic_write_csv
from oscar.bench.kernel_bench import time_calls

HKV, W, PS = 8, 256, 64


def main(argv: list[str]) -> int:
    import torch

    from oscar.kernels.quantize import rotate_quantize_pack_pair
    from oscar.cache.paged import QuantPages

    out = Path(argv[0])
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for d in (128, 64):
        R = torch.linalg.qr(torch.randn(HKV, d, d, device="cuda", generator=g))[0]
        mu = torch.randn(HKV, d, device="cuda", generator=g)
        rho = torch.full((HKV,), 0.95, device="cuda")
        for B in (1, 8, 32, 64, 128):
            npages = -(-B // PS) + 1
            sets = []
            for _ in range(16):
                pages = [QuantPages.empty(npages, HKV, PS, d, 2, d, "cuda") for _ in range(2)]
                src = torch.randn(B, HKV, W, d, device="cuda", generator=g).to(torch.bfloat16)
                idx = torch.randint(0, W, (B,), device="cuda", generator=g)
                sets.append((pages, src, idx))
            slots = torch.randperm(npages * PS, device="cuda", generator=g)[:B]
            for name, kw in (("rows_w1", dict(row_path=True, row_warps=1)), ("rows_w2", dict(row_path=True, row_warps=2)),
                             ("rows_w4", dict(row_path=True, row_warps=4)), ("blocks_w8", dict(row_path=False, num_warps=8))):
                calls = []
                for pages, src, idx in sets:
                    def f(pages=pages, src=src, idx=idx, kw=kw):
                        rotate_quantize_pack_pair(src, src, slots, (pages[0].codes, pages[0].scale, pages[0].zero),
                                                  (pages[1].codes, pages[1].scale, pages[1].zero), bits=2,
                                                  group_size=d, k_transform=(R, mu, rho), v_transform=(R, mu, rho),
                                                  src_index=idx, **kw)
                    calls.append(f)
                try:
                    us, mode = time_calls(calls, reps=20)
                    status = "ok"
                except Exception as exc:
                    us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:160]}"
                rows.append({"head_dim": d, "rows": B, "variant": name, "us": us, "timing": mode, "status": status})
                print(f"  d={d} rows={B} {name}: {us:.1f} us {status}", flush=True)
    atomic_write_csv(out / "bench_demote.csv", rows)
    names = list(dict.fromkeys(r["variant"] for r in rows))
    print("| d | rows | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for d in (128, 64):
        for B in (1, 8, 32, 64, 128):
            vals = [next((r["us"] for r in rows if r["head_dim"] == d and r["rows"] == B and r["variant"] == n), float("nan"))
                    for n in names]
            print(f"| {d} | {B} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

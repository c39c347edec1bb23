"""CPU decode step of one cache layer at continuous-batching shapes (the HumanEval cells of issue 20):
ms per step per layer for the rotated INT2 cache (OSCAR/auto/QuaRot/INT2/Saw-INT4) and the KIVI/TurboQuant
simulations, batch 64, Qwen2.5-Coder-0.5B's attention geometry (14 query heads, 2 KV heads, head_dim 64),
S0/W = 16/64, after a 200-token prefill.

    python benchmarks/cpu_cache_step.py [--steps 60] [--threads 1] [--out reports/throughput/cpu_cache_step.csv]

Run it on two revisions (e.g. `git stash` / a worktree) to compare; it prints a table and writes the CSV.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oscar.cache.attention import take_pending  # noqa: E402
from oscar.cache.torch_cache import CacheSpec, LayerRotations, OscarLayer, SimulatedLayer  # noqa: E402
from oscar.core.files import atomic_write_csv  # noqa: E402
from oscar.core.rotation import random_orthogonal  # noqa: E402

B, H, HKV, D = 64, 14, 2, 64


class _Module:
    num_key_value_groups = H // HKV
    training = False
    is_causal = True


def layer(kind: str):
    if kind == "rotated":
        rk = torch.stack([random_orthogonal(D, seed=h) for h in range(HKV)])
        rv = torch.stack([random_orthogonal(D, seed=h + 9) for h in range(HKV)])
        rot = LayerRotations(rk, rv, 0.1 * torch.randn(HKV, D), 0.1 * torch.randn(HKV, D),
                             torch.full((HKV,), 0.95), torch.full((HKV,), 0.9))
        spec = CacheSpec(kind="rotated", bits=2, group_size=64, sink=16, recent=64, page_size=64, layers=[rot])
        return OscarLayer(spec, rot, 0)
    spec = CacheSpec(kind=kind, bits=2, group_size=64, sink=16 if kind == "turboquant" else 0, recent=64, page_size=64)
    return SimulatedLayer(spec, None, 0)


def time_kind(kind: str, steps: int, prefill: int = 200) -> float:
    torch.manual_seed(0)
    lay, mod = layer(kind), _Module()

    def step(n: int) -> torch.Tensor:
        q, k, v = torch.randn(B, H, n, D), torch.randn(B, HKV, n, D), torch.randn(B, HKV, n, D)
        lay.update(k, v)
        take_pending(k)
        return lay.attend_and_write(mod, q, k, v, None, D**-0.5)

    with torch.no_grad():
        step(prefill)
        step(1)  # warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            step(1)
        return (time.perf_counter() - t0) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("reports/throughput/cpu_cache_step.csv"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = [{"kind": k, "ms_per_step_per_layer": round(time_kind(k, a.steps), 2), "batch": B, "steps": a.steps,
             "threads": a.threads, "cpu": platform.processor() or platform.machine()}
            for k in ("rotated", "kivi", "turboquant")]
    print("| cache | ms / decode step / layer |\n|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['ms_per_step_per_layer']} |")
    atomic_write_csv(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

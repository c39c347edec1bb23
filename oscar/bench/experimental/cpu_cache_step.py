"""CPU decode step of one cache layer at continuous-batching shapes (the shapes of the continuous-batching HumanEval cells):
ms per step per layer for the rotated INT2 cache (OSCAR/auto/QuaRot/INT2/Saw-INT4) and the KIVI/TurboQuant
simulations, batch 64, Qwen2.5-Coder-0.5B's attention geometry (14 query heads, 2 KV heads, head_dim 64),
S0/W = 16/64, after a 200-token prefill.

    python -m oscar.bench.experimental.cpu_cache_step [--steps 60] [--threads 1] [--out reports/throughput/cpu_cache_step.csv]

Run it on two revisions (e.g. a worktree of each) to compare; it prints a table and writes the CSV.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from oscar.cache.attention import take_pending
from oscar.cache.formats import KINDS, format_class, format_for
from oscar.cache.torch_cache import LayerRotations
from oscar.core.files import atomic_write_csv
from oscar.core.rotation import random_orthogonal

B, H, HKV, D = 64, 14, 2, 64


class _Module:
    num_key_value_groups = H // HKV
    training = False
    is_causal = True


def layer(kind: str):
    fmt = format_for(kind, name=kind, bits=2, group_size=64, sink=16 if format_class(kind).windowed else 0, recent=64)
    rot = None
    if fmt.rotated:
        rk = torch.stack([random_orthogonal(D, seed=h) for h in range(HKV)])
        rv = torch.stack([random_orthogonal(D, seed=h + 9) for h in range(HKV)])
        rot = LayerRotations(rk, rv, 0.1 * torch.randn(HKV, D), 0.1 * torch.randn(HKV, D),
                             torch.full((HKV,), 0.95), torch.full((HKV,), 0.9))
    return fmt.torch_layer(fmt.cache_spec([rot] if rot is not None else None), rot, 0)


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
            for k in KINDS if format_class(k).quantized]
    print("| cache | ms / decode step / layer |\n|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['ms_per_step_per_layer']} |")
    atomic_write_csv(a.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

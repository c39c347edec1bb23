"""What one layer's extend of a radix hit allocates and where its CPU time goes, by prefix length (issue 31): prints
the table of reports/serving/prefix_extend.md (Markdown on stdout; the report's text around it is written by hand).

    .venv-serve/bin/python benchmarks/studies/prefix_extend.py [--prefixes 1024,4096,16384]

One layer of Qwen3-8B's shape (8 KV / 32 query heads, d 128, INT2 fragment-order pages of 16, S0 64, W 256), a hit
extending ``n = 256`` tokens over a cached prefix, one CPU thread. Old route (``extend_in_place_max = 0``): the
prefix dequantized, rotated back and copied (``cached_rows``), then SDPA. Kernel route (``OSCAR_KERNELS=triton``):
``oscar.cache.extend.extend_attention`` with the Triton kernel replaced by a stub, so that what is counted is what the
torch ops around it allocate (the kernel reads the pages in place). Bytes: the sum of the torch ops' allocations
(torch.profiler ``profile_memory``); CPU shares: self CPU time of the old route's ops.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

import oscar.kernels.extend_paged as kernel
from oscar.cache.formats import RotatedFormat
from oscar.cache.torch_cache import LayerRotations
from oscar.serve.backend import OscarAttnBackend
from oscar.serve.pool import OscarTokenToKVPool
from oscar.serve.settings import ServeSettings

HKV, H, D, PAGE, S0, W = 8, 32, 128, 16, 64, 256


def _profile(fn):
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.key_averages()
    return events, sum(max(e.self_cpu_memory_usage, 0) for e in events)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", default="1024,4096,16384")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)

    def orth() -> torch.Tensor:
        return torch.linalg.qr(torch.randn(HKV, D, D, generator=gen))[0]

    rots = [LayerRotations(orth(), orth(), 0.1 * torch.randn(HKV, D, generator=gen), None)]
    state = dict(settings=ServeSettings(artifact=Path("unused"), sink=S0, recent=W, kernels="torch"), rotations=rots,
                 format=RotatedFormat(name="oscar", bits=2, group_size=D, sink=S0, recent=W), fold=True,
                 prefix_cache=True)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=H, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                            scaling=D**-0.5, sliding_window_size=-1, logit_cap=0)
    print("| prefix | old route: allocated MiB | old route: ms (1 CPU thread) | cached_rows share of the old route | "
          "kernel route: allocated MiB (kernel stubbed) |\n|---|---|---|---|---|")
    for p in (int(x) for x in a.prefixes.split(",")):
        n = W
        L = p + n
        pool = OscarTokenToKVPool(L + 64, PAGE, torch.bfloat16, HKV, D, 1, "cpu", False, oscar_state=state,
                                  oscar_layout="mma")
        pool.bind_requests(2)
        r2t = torch.zeros(2, L + 16, dtype=torch.int32)
        r2t[0, :L] = torch.arange(PAGE, PAGE + L, dtype=torch.int32)
        k = torch.randn(L, HKV, D, generator=gen).to(torch.bfloat16)
        v = torch.randn(L, HKV, D, generator=gen).to(torch.bfloat16)
        pool.write(0, k[:p], v[:p], r2t[0, :p].long(), torch.zeros(p, dtype=torch.long), torch.arange(p),
                   torch.full((p,), p))
        pool.slot_generation[0] = 1
        q = torch.randn(n, H * D, generator=gen).to(torch.bfloat16)
        fb = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: False, is_idle=lambda: False),
                             req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([L]),
                             seq_lens_cpu=torch.tensor([L]), extend_seq_lens_cpu=[n], extend_prefix_lens_cpu=[p],
                             out_cache_loc=r2t[0, p:L].long())
        be = OscarAttnBackend.__new__(OscarAttnBackend)
        be.pool, be.device, be.folded, be.graph, be.num_splits, be.meta = pool, "cpu", True, None, {}, None
        be.req_to_token_pool = SimpleNamespace(req_to_token=r2t, req_generation=torch.tensor([1, 0]))
        be.init_forward_metadata(fb)
        be.meta.hit, be.meta.sink_ids = [True], [None]  # a hit (its sink rows are already in the slot)

        def run() -> torch.Tensor:
            return be.forward_extend(q, k[p:].reshape(n, -1), v[p:].reshape(n, -1), layer, fb, save_kv_cache=False)

        be.extend_in_place_max = 0  # the old route
        t0 = time.perf_counter()
        run()
        old_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        pool.cached_rows(0, r2t, 0, p, ring=False)
        rows_ms = (time.perf_counter() - t0) * 1e3
        _, old_bytes = _profile(run)
        be.extend_in_place_max = 4096
        pool.kernels = "triton"
        real = kernel.extend_paged_attention
        kernel.extend_paged_attention = lambda q_rot, *args, **kw: torch.zeros_like(q_rot)
        try:
            _, new_bytes = _profile(run)
        finally:
            kernel.extend_paged_attention = real
            pool.kernels = "torch"
        print(f"| {p} | {old_bytes / 2**20:.1f} | {old_ms:.0f} | {100 * rows_ms / old_ms:.0f}% | "
              f"{new_bytes / 2**20:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

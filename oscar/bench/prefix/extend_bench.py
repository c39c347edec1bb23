"""One layer's extend attention of a prefix hit, by route (``gpu prefix profile=true`` runs it after the engine).

    python -m oscar.bench.prefix.extend_bench --bench OUT.json --config CONFIG.json [--prefix 29744] [--n 256]
        [--sink 64] [--device cuda]

``n`` queries over ``prefix`` cached positions (the BF16 sink, the rest quantized) of the model whose
``config.json`` is given (heads, KV heads, head_dim), through ``oscar.cache.extend.extend_attention``: ``pages``
(the Triton kernel reading the codes in place, the served route), ``dequant`` (the pages dequantized once, then
SDPA), ``twin`` (torch dequantization, as the old route). Writes the rows as JSON; their Markdown
(``oscar.bench.prefix.profile.bench_lines``) becomes a section of ``prefix_profile.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch

from oscar.bench.prefix.profile import bench_lines
from oscar.cache import extend, paged
from oscar.core.files import atomic_write_text
from oscar.kernels.segments import HeadTransform


def extend_bench(hkv: int, heads: int, d: int, prefix: int, n: int, sink: int, layers: int, page: int = 16,
                 bits: int = 2, reps: int = 10, device: str = "cuda") -> list[dict[str, Any]]:
    """One layer's extend attention of a hit (``n`` queries over ``prefix`` cached positions: the BF16 sink, the rest
    quantized) by each route, timed with CUDA events (median of ``reps`` after 2 warm-ups; on a CPU: wall time):
    ``pages`` (the Triton kernel reading the codes in place), ``dequant`` (dequantize once, then SDPA), ``twin``
    (torch dequantization, as the old route). Random rotations and rows, the served pool's page layout."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    int_len = prefix - sink
    layout = ("mma_k", "mma_v") if dev.type == "cuda" and bits == 2 else ("rows", "rows")
    npages = -(-int_len // page) + 1
    kp, vp = (paged.QuantPages.empty(npages + 1, hkv, page, d, bits, d, dev, lay) for lay in layout)
    table = (torch.randperm(npages, generator=gen) + 1).to(torch.int32).to(dev)
    orth = lambda: torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0].to(dev)  # noqa: E731
    kt, vt = (HeadTransform(orth(), (0.05 * torch.randn(hkv, d, generator=gen)).to(dev)) for _ in range(2))
    pos = torch.arange(int_len, device=dev)
    slots = table[pos // page].long() * page + pos % page
    backend = "triton" if dev.type == "cuda" else "torch"
    for p, t in ((kp, kt), (vp, vt)):
        paged.rotate_quantize_pack(torch.randn(int_len, hkv, d, generator=gen).to(dev, torch.bfloat16), slots, p, t,
                                   backend=backend)
    q = torch.randn(n, heads, d, generator=gen).to(dev, torch.bfloat16)
    bk, bv = (torch.randn(hkv, sink + n, d, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
    args = (q, kp, vp, table, int_len, bk, bv, sink, kt, vt)
    kw = dict(sm_scale=d ** -0.5, output_frame="rotated")
    runs = {"pages": dict(backend="triton", route="pages"), "dequant": dict(backend="triton", route="dequant"),
            "twin": dict(backend="torch")}
    out, ref = [], None
    for name, opt in runs.items():
        def call() -> Any:
            return extend.extend_attention(*args, **kw, **opt)
        try:
            for _ in range(2):
                o = call()
            times = []
            for _ in range(reps):
                if dev.type == "cuda":
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    call()
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b))
                else:
                    t0 = time.perf_counter()
                    call()
                    times.append(1e3 * (time.perf_counter() - t0))
        except Exception as err:  # noqa: BLE001 - reported in the table; the other routes still run
            out.append(dict(route=name, error=f"{type(err).__name__}: {err}"[:200]))
            continue
        ref = o.float() if ref is None else ref
        ms = statistics.median(times)
        rel = ((o.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        out.append(dict(route=name, ms_per_layer=ms, ms_per_hit=ms * layers, rel_vs_pages=rel))
    return [dict(r, hkv=hkv, heads=heads, d=d, prefix=prefix, n=n, sink=sink, layers=layers, device=str(dev))
            for r in out]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="one layer's extend attention of a prefix hit, by route")
    ap.add_argument("--bench", type=Path, required=True, help="JSON file of the rows")
    ap.add_argument("--config", type=Path, required=True, help="the model's config.json (heads, KV heads, head_dim)")
    ap.add_argument("--prefix", type=int, default=29744)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    cfg = json.loads(a.config.read_text())
    heads = int(cfg["num_attention_heads"])
    rows = extend_bench(int(cfg.get("num_key_value_heads", heads)), heads,
                        int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads), a.prefix, a.n, a.sink,
                        int(cfg["num_hidden_layers"]), device=a.device)
    atomic_write_text(a.bench, json.dumps(rows, indent=1) + "\n")
    print("\n".join(bench_lines(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

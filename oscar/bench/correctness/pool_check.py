"""The plugin's CUDA decode path against the torch twin on the pool's own pages (one GPU, no model).

    python -m oscar.bench.correctness.pool_check [--out check.json]      (sglang importable: 0.5.17 bundle or 0.5.23)

(``python -m oscar gpu correctness`` runs it beside the real-weight checks.)

Builds an ``OscarTokenToKVPool`` on CUDA (16-token pages, the fragment-order layout), fills two requests the way the
backend does (``write`` for the prefill rows through the fused Triton writer, then decode steps through
``decode_metadata`` + ``write_decode``, the metadata built into fixed buffers as under CUDA graphs and the last
step captured and replayed in a CUDA graph), and compares the backend's attention call (the v9 kernel over the
gathered windows, both output frames, random rotations with means) with ``oscar.cache.paged.decode_attention_torch`` on
the same pages and windows. With plain keys (mean-centered), with rope-centered keys (a pre-RoPE mean ``m`` per
head: the writers take each row's position, the kernel adds ``q . RoPE_p(m)`` at ``int_pos0 = S0``), and with
rope-centered keys in SmolLM2-135M's geometry (3 KV heads of 3 query heads, padded to 4 for the kernel; d 64), and
with QuaRot's served state in that geometry (one Hadamard for keys and values, no means, no clip).
Prints one JSON line; exit status 1 when a relative error exceeds 2e-2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from oscar.cache import paged
from oscar.cache.formats import format_for
from oscar.cache.torch_cache import LayerRotations
from oscar.core.files import atomic_write_text
from oscar.core.rope import RopeSpec
from oscar.core.rotation import hadamard
from oscar.kernels.launch import MmaLaunch
from oscar.serve.settings import ServeSettings


def check(rope: bool, device: str = "cuda", heads: tuple[int, int, int] = (8, 32, 128), quarot: bool = False) -> dict:
    """One pool (plain or rope-centered keys; ``quarot``: QuaRot's served state, one normalized Hadamard for every
    head's keys and values, no means, no clip): the relative error of both output frames against the twin
    (``device="cpu"``: the twin through the same calls, eager: a smoke test of the script without a GPU)."""
    from oscar.serve.backend import DecodeMeta, decode_metadata  # local: keeps sglang out of import time
    from oscar.serve.pool import OscarTokenToKVPool  # local: keeps sglang out of import time

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    (hkv, H, d), P, S0, W = heads, 16, 64, 256
    orth = lambda: torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0]  # noqa: E731
    spec = RopeSpec(1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)), 1.0, head_dim=d)
    rope_k = 4.0 * torch.randn(hkv, d, generator=gen) if rope else None  # a k_proj bias turned by RoPE
    rot = LayerRotations(orth(), orth(), 0.3 * torch.randn(hkv, d, generator=gen), 0.2 * torch.randn(hkv, d, generator=gen),
                         rope_k=rope_k, rope=spec if rope else None)
    if quarot:
        had = hadamard(d, torch.float32).expand(hkv, d, d).contiguous()
        rot = LayerRotations(had, had.clone())
    state = dict(settings=ServeSettings(artifact=Path("unused"), sink=S0, recent=W, kernels="triton" if cuda else "torch"),
                 rotations=[rot], format=format_for("rotated", name="int2", bits=2, group_size=d, sink=S0, recent=W,
                                                    page_size=P), fold=True)
    size, ctx, lens = 1 << 16, 8192, [5000, 700]
    pool = OscarTokenToKVPool(size, P, torch.bfloat16, hkv, d, 1, str(dev), False, oscar_state=state, oscar_layout="mma")
    pool.bind_requests(4)
    r2t = torch.zeros(4, ctx, dtype=torch.int32, device=dev)
    pages = (torch.randperm(size // P - 1, generator=gen) + 1).tolist()
    reqs = [2, 0]
    for r, n in zip(reqs, lens):
        for j in range(math.ceil((n + 8) / P)):
            g = pages.pop()
            r2t[r, j * P : (j + 1) * P] = torch.arange(g * P, (g + 1) * P, dtype=torch.int32, device=dev)
    for r, n in zip(reqs, lens):  # prefill rows
        k = torch.randn(n, hkv, d, generator=gen).to(dev, torch.bfloat16)
        v = torch.randn(n, hkv, d, generator=gen).to(dev, torch.bfloat16)
        pos = torch.arange(n, device=dev)
        pool.write(0, k, v, r2t[r, :n].long(), torch.full((n,), r, device=dev), pos, torch.full((n,), n, device=dev))
    bufs = DecodeMeta(req=torch.zeros(8, dtype=torch.int64, device=dev),
                      win_row=torch.zeros(8, dtype=torch.int32, device=dev),
                      col=torch.zeros(8, dtype=torch.int64, device=dev),
                      sink_len=torch.zeros(8, dtype=torch.int32, device=dev),
                      recent_len=torch.zeros(8, dtype=torch.int32, device=dev),
                      int_len=torch.zeros(8, dtype=torch.int32, device=dev),
                      page_table=torch.zeros(8, pool.page_columns(r2t).shape[1], dtype=torch.int32, device=dev),
                      pos=torch.zeros(8, dtype=torch.int64, device=dev))
    pos0 = S0 if rope else None  # INT row t of a sequence is token S0 + t
    req_t = torch.tensor(reqs, device=dev)
    seq = torch.tensor(lens, device=dev)
    kt, vt = pool.transforms[0]
    sk, sv = pool.sink_view(0)
    rk, rv = pool.ring_view(0)
    q = torch.randn(2, H, d, generator=gen).to(dev, torch.bfloat16)
    knew = torch.randn(2, hkv, d, generator=gen).to(dev, torch.bfloat16)
    vnew = torch.randn(2, hkv, d, generator=gen).to(dev, torch.bfloat16)

    def step(frame: str) -> torch.Tensor:
        loc = torch.gather(r2t[req_t], 1, (seq - 1)[:, None]).squeeze(1).long()
        m = decode_metadata(pool, r2t, req_t, seq, loc, out=bufs)
        pool.write_decode(0, knew, vnew, loc, m.req, m.col, m.pos)
        # the windows read in place by request slot (the backend's path); the twin below reads gathered copies
        seg = paged.Segments(m.page_table, m.int_len, sink_k=sk, sink_v=sv, sink_len=m.sink_len, recent_k=rk,
                             recent_v=rv, recent_len=m.recent_len, window_rows=m.win_row, int_pos0=pos0)
        launch = MmaLaunch(num_splits=33) if pool.kernels != "torch" else None
        return paged.decode_attention(q, pool.k_pages[0], pool.v_pages[0], seg, kt, vt, sm_scale=d**-0.5,
                                      output_frame=frame, backend=pool.kernels, launch=launch)

    result = {}
    for frame in ("original", "rotated"):
        seq += 1
        out = step(frame)  # eager (JIT, derived copies)
        if cuda:
            seq += 1
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step(frame)
            seq += 1  # the replay must see the new lengths through the captured metadata ops
            graph.replay()
            torch.cuda.synchronize()
        m = decode_metadata(pool, r2t, req_t, seq, torch.ones_like(seq))
        ref_seg = paged.Segments(m.page_table, m.int_len, sink_k=sk[m.req], sink_v=sv[m.req], sink_len=m.sink_len,
                                 recent_k=rk[m.req], recent_v=rv[m.req], recent_len=m.recent_len, int_pos0=pos0)
        ref = paged.decode_attention_torch(q, pool.k_pages[0], pool.v_pages[0], ref_seg, kt, vt, sm_scale=d**-0.5,
                                           output_frame=frame)
        rel = float(((out.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max())
        result[frame] = {"rel": rel, "int_len": m.int_len.tolist()}
    return {"layout": pool.layout, "page_size": P, "rope_centered": pool.rope_centered, "kv_heads": hkv, "q_heads": H,
            "head_dim": d, **result}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke test: twin against twin)")
    a = ap.parse_args(argv)
    results = {"plain": check(False, a.device), "rope_centered": check(True, a.device),
               # SmolLM2-135M's heads: GQA 3 (query heads padded to 4 for the kernel), head_dim 64
               "rope_centered_gqa3_d64": check(True, a.device, (3, 9, 64)),
               # served QuaRot on SmolLM2-135M: Hadamard keys and values, no means, no clip
               "quarot_gqa3_d64": check(False, a.device, (3, 9, 64), quarot=True)}
    line = json.dumps(results)
    print(line)
    if a.out is not None:
        atomic_write_text(a.out, line + "\n")
    return 0 if all(r[f]["rel"] < 2e-2 for r in results.values() for f in ("original", "rotated")) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

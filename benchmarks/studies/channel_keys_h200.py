"""Per-channel vs per-token key pages through the v10 CUDA mma decode kernel (issue 33): the rows of
reports/kernels/channel_keys_h200.{md,csv} (GPU host).

    python benchmarks/studies/channel_keys_h200.py OUT_DIR [--batches 1,8] [--contexts 32768,131072] [--reps 20]

Same inputs as the kernel table (``oscar.bench.kernels.timing.decode_inputs``: Qwen3-8B attention shape, 32 q heads,
8 KV heads, d 128, pages of 64, sink 64, recent 256, random INT2 codes, shuffled page tables, rotation and means),
the same codes read as per-token K pages (one bf16 scale/zero per slot) and as per-channel K pages of blocks of
T = 64 and 32 (bf16 scale/zero ``[P, Hkv, 64/T, d]``), with and without rope-centered keys; each call through
``oscar.cache.paged.decode_attention(backend="triton")``, timed by ``oscar.bench.kernels.timing.time_calls``
(CUDA-graph replays of one call per input set, sets several times L2, median of ``reps``). Each variant is first checked against the
float32 twin (batch 4, 8k). Writes ``channel_keys_h200.csv`` and ``channel_keys_h200_env.json`` under OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from oscar.bench import host
from oscar.bench.kernels import spec
from oscar.bench.kernels import timing as kb
from oscar.cache import paged
from oscar.cache.paged import QuantPages
from oscar.core.files import atomic_write_csv, atomic_write_json

VARIANTS = {"token": (0, False), "ch64": (64, False), "ch32": (32, False), "token_rope": (0, True),
            "ch64_rope": (64, True)}


def channel_inputs(inp: dict, blocks: list[int], seed: int = 1) -> dict:
    """Per-channel K pages over the same codes as ``inp``'s mma pages, one per block size."""
    kp, _ = inp["pages"]["mma"]
    P, hkv, ps, _ = kp.codes.shape
    d = kp.head_dim
    dev = kp.codes.device
    g = torch.Generator(device=dev).manual_seed(seed)
    out = {}
    for T in blocks:
        scale = (0.02 + 0.05 * torch.rand(P, hkv, ps // T, d, device=dev, generator=g)).to(torch.bfloat16)
        zero = (-0.1 * torch.rand(P, hkv, ps // T, d, device=dev, generator=g)).to(torch.bfloat16)
        out[T] = QuantPages(kp.codes, scale, zero, kp.bits, kp.group_size, "mma_k", T)
    return out


def call(inp: dict, chan: dict, s: int, block: int, rope: bool, backend: str = "triton"):
    kp, vp = inp["pages"]["mma"]
    if block:
        kp = chan[block]
    kt = inp["kt_rope"] if rope else inp["kt"]
    kt = paged.HeadTransform(kt.R, kt.mu, kt.rho, kt.rope_mu, kt.rope_freq, kt.rope_scaling, block)

    def f():
        return paged.decode_attention(inp["qs"][s], kp, vp, inp["segs"][s], kt, inp["vt"], backend=backend)
    return f


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for channel_keys_h200.csv and channel_keys_h200_env.json")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--contexts", default="32768,131072", help="comma-separated context lengths")
    ap.add_argument("--reps", type=int, default=20, help="CUDA-graph replays per timing (the median is kept)")
    a = ap.parse_args(argv)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    opts = dict(spec.DEFAULTS, reps=a.reps)
    batches = [int(x) for x in a.batches.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    H, hkv, d = opts["q_heads"], opts["kv_heads"], 128
    env = host.hardware("python benchmarks/studies/channel_keys_h200.py " + " ".join(argv))
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20))
    blocks = sorted({b for b, _ in VARIANTS.values() if b})
    chk = kb.decode_inputs(4, 8192, H, hkv, d, opts, 1, seed=3)
    chk_c = channel_inputs(chk, blocks)
    acc = {}
    for name, (block, rope) in VARIANTS.items():
        ref = call(chk, chk_c, 0, block, rope, backend="torch")().float()
        got = call(chk, chk_c, 0, block, rope)().float()
        acc[name] = float(((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
    env["rel_err_vs_twin"] = acc
    print("against the float32 twin (batch 4, 8k):", json.dumps(acc), flush=True)
    del chk, chk_c
    rows = []
    for T in contexts:
        for B in batches:
            t_int = max(0, T - opts["sink"] - opts["recent"])
            per_set = 2 * B * hkv * (t_int * (d * 2 // 8 + 4) + (opts["sink"] + opts["recent"]) * d * 2)
            n = kb._n_sets(per_set, l2, opts["l2_factor"], int(opts["mem_gb"] * 2**30 * 0.5))
            inp = kb.decode_inputs(B, T, H, hkv, d, opts, n)
            chan = channel_inputs(inp, blocks)
            base = {}
            for name, (block, rope) in VARIANTS.items():
                us, mode = kb.time_calls([call(inp, chan, s, block, rope) for s in range(n)], reps=opts["reps"])
                ref = base.setdefault(rope, us) if not block else base[rope]
                rows.append({"head_dim": d, "batch": B, "context": T, "variant": name, "key_block": block,
                             "rope": rope, "us": round(us, 2), "vs_token": round(us / ref, 4), "timing": mode,
                             "sets": n})
                print(f"B={B} T={T} {name}: {us:.1f} us ({us / ref:.3f} of per-token)", flush=True)
            atomic_write_csv(out / "channel_keys_h200.csv", rows)
            del inp, chan
            torch.cuda.empty_cache()
    atomic_write_json(out / "channel_keys_h200_env.json", env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

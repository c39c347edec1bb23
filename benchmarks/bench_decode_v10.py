"""Time the v10 decode paths against cuDNN/flash BF16 SDPA in one process (H200): INT2 mma (uncentered), INT2 mma
with rope-centered keys (per ``rope_blocks``), and extra variants; accuracy against the float32 twin first.

Usage (repo root on the GPU machine, after ``source benchmarks/_gpu_copy.sh``):
    python3 benchmarks/bench_decode_v10.py OUTDIR [shapes=table|small] [budget_s=170] [variants=JSON;JSON...]

Writes OUTDIR/decode_v10_<shapes>.csv (one row per shape and variant, rewritten after every shape) and
OUTDIR/decode_v10_env.json (hardware, accuracy); prints one line per shape and a Markdown table last. Shapes are
taken in order until ``budget_s`` seconds have passed (the most important first).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from oscar.core.files import atomic_write_csv, atomic_write_text
from oscar.bench.kernel_bench import DEFAULTS, bench_int2, bench_sdpa, check_against_twin, copy_bandwidth

SHAPES = {
    "table": [(d, b, t) for d in (128, 64) for t in (32768, 131072, 4096) for b in (1, 8, 32, 128)],
    "small": [(128, 1, 4096), (128, 8, 4096), (64, 1, 4096), (64, 8, 4096), (64, 1, 32768), (128, 1, 32768)],
}
VARIANTS = [{"layout": "mma"}, {"layout": "mma", "rope": True, "rope_blocks": 8},
            {"layout": "mma", "rope": True, "rope_blocks": 16}, {"layout": "mma", "mma_carveout": 44},
            {"layout": "mma", "rope": True, "rope_blocks": 8, "mma_carveout": 44},
            {"layout": "mma", "rope": True, "rope_blocks": 16, "mma_carveout": 44}]
INT4_VARIANTS = [{"layout": "mma"}, {}]  # INT4 in the fragment-order layout; INT4 rows (v8 Triton)


def _write(path: Path, text: str) -> None:
    atomic_write_text(path, text)


def _write_csv(path: Path, rows: list[dict]) -> None:
    atomic_write_csv(path, rows, sorted({k for r in rows for k in r}))


def main(argv: list[str]) -> int:
    t0 = time.time()
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    kv = dict(a.split("=", 1) for a in argv[1:])
    which = kv.get("shapes", "table")
    budget = float(kv.get("budget_s", 170))
    variants = [json.loads(v) for v in kv["variants"].split(";")] if "variants" in kv else VARIANTS
    opts = dict(DEFAULTS)
    opts.update(reps=int(kv.get("reps", 20)), mem_gb=120, l2_factor=4)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    bw = copy_bandwidth()
    env = {"gpu": props.name, "sms": props.multi_processor_count, "l2_mb": l2 / 2**20, "torch": torch.__version__,
           "cuda": torch.version.cuda, "copy_tb_s": bw / 1e12, "command": " ".join(sys.argv)}
    for d in (128, 64):
        for rope in (False, True):
            env[f"rel_err_vs_twin_d{d}{'_rope' if rope else ''}"] = check_against_twin(d, opts, rope=rope)
        env[f"rel_err_vs_twin_d{d}_int4"] = check_against_twin(d, {**opts, "bits": 4})
    opts4 = {**opts, "bits": 4}
    _write(out / "decode_v10_env.json", json.dumps(env, indent=2) + "\n")
    print(json.dumps(env), flush=True)
    H, hkv = opts["q_heads"], opts["kv_heads"]
    rows, done = [], []
    for d, B, T in SHAPES[which]:
        if time.time() - t0 > budget:
            print(f"budget of {budget:.0f} s spent: stopping before d={d} B={B} T={T}", flush=True)
            break
        sd = {be: bench_sdpa(B, T, H, hkv, d, be, opts, l2) for be in ("cudnn", "flash")}
        ok = [sd[k]["us"] for k in sd if sd[k].get("status") == "ok"]
        bf = min(ok) if ok else float("nan")
        res = bench_int2(B, T, H, hkv, d, opts, l2, variants)
        res4 = bench_int2(B, T, H, hkv, d, opts4, l2, INT4_VARIANTS) if kv.get("int4", "true") == "true" else []
        line = []
        for v, r in zip(variants + [{**x, "bits": 4} for x in INT4_VARIANTS[:len(res4)]], res + res4):
            rows.append({"head_dim": d, "batch": B, "context": T, "variant": json.dumps(v, sort_keys=True),
                         "us": r["us"], "status": r["status"], "bytes": r["bytes"], "cudnn_us": sd["cudnn"]["us"],
                         "flash_us": sd["flash"]["us"], "bf16_best_us": bf, "copy_tb_s": bw / 1e12,
                         "tb_s": r["bytes"] / (r["us"] * 1e-6) / 1e12, "bw_frac": r["bytes"] / (r["us"] * 1e-6) / bw,
                         "speedup": bf / r["us"], "timing": r["timing"]})
            line.append(f"{r['us']:.1f}" if r["status"] == "ok" else "fail")
            if r["status"] != "ok":
                print("  failed", v, r["status"], flush=True)
        done.append((d, B, T))
        print(f"d={d} B={B} T={T} cudnn={sd['cudnn']['us']:.1f} flash={sd['flash']['us']:.1f} "
              f"variants={' / '.join(line)} ({time.time() - t0:.0f} s)", flush=True)
        _write_csv(out / f"decode_v10_{which}.csv", rows)
    names = [json.dumps(v, sort_keys=True) for v in variants + [{**x, "bits": 4} for x in INT4_VARIANTS]]
    names = [n for n in names if any(r["variant"] == n for r in rows)]
    print("| d | batch | context | cuDNN | flash | " + " | ".join(f"v{i}" for i in range(len(variants)))
          + " | v0 x best BF16 | rope (v1) / v0 |")
    for i, v in enumerate(names):
        print(f"v{i} = {v}")
    for d, B, T in done:
        rs = {r["variant"]: r for r in rows if (r["head_dim"], r["batch"], r["context"]) == (d, B, T)}
        us = [rs[n]["us"] for n in names]
        r0 = rs[names[0]]
        ratio = us[1] / us[0] if len(us) > 1 else float("nan")
        print(f"| {d} | {B} | {T} | {r0['cudnn_us']:.1f} | {r0['flash_us']:.1f} | "
              + " | ".join(f"{u:.1f}" for u in us) + f" | {r0['speedup']:.2f}x | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

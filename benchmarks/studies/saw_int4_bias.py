"""Per layer of Qwen2.5-Coder-0.5B: the projection's bias norm against the token-dependent part of the pre-RoPE keys
on one HumanEval prompt with BF16's completion, and the per-token INT4 step (range / 15 after the 64-wide Hadamard)
with and without the bias, relative to the signal's RMS: prints the layer table of reports/accuracy/saw_int4.md.

    python benchmarks/studies/saw_int4_bias.py                 # keys (k_proj)
    python benchmarks/studies/saw_int4_bias.py --proj v_proj   # values

The prompt and completion are the first record of `--bf16-records` (default
reports/accuracy/partial/humaneval_bf16.items.jsonl under the repository root).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from oscar.config import compose
from oscar.core.rotation import block_hadamard
from oscar.models import load_model

ROOT = Path(__file__).resolve().parents[2]  # the repository root (this file is benchmarks/studies/<name>.py)
BF16_RECORDS = ROOT / "reports" / "accuracy" / "partial" / "humaneval_bf16.items.jsonl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--proj", choices=("k_proj", "v_proj"), default="k_proj", help="keys (k_proj) or values (v_proj)")
    p.add_argument("--bf16-records", type=Path, default=BF16_RECORDS,
                   help="BF16's HumanEval records (items.jsonl): the first one's prompt and completion are run")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = compose(["model=qwen2.5-coder-0.5b"])
    model, tok = load_model(cfg.model, device="cpu")
    with open(a.bf16_records) as fh:
        rec = json.loads(fh.readline())
    ids = tok(rec["target"]["prompt"] + rec["prediction"], return_tensors="pt")["input_ids"]
    rows: dict[int, torch.Tensor] = {}
    for n, layer in enumerate(model.model.layers):
        getattr(layer.self_attn, a.proj).register_forward_hook(
            lambda m, i, o, n=n: rows.__setitem__(n, o[0].detach()))
    with torch.no_grad():
        model(ids)
    H = block_hadamard(64, 64, torch.float32)

    def step(x: torch.Tensor) -> torch.Tensor:
        return ((x.amax(-1) - x.amin(-1)) / 15).mean(0)

    print("layer  |b|/|k-b| (rms per head)  step/rms(signal): plain, hadamard, hadamard-centered")
    for n, layer in enumerate(model.model.layers):
        b = getattr(layer.self_attn, a.proj).bias.detach().view(2, 64)
        k = rows[n].view(-1, 2, 64)  # [T, Hkv, d] pre-RoPE
        sig = k - b
        rms = sig.pow(2).mean(dim=(0, 2)).sqrt()
        print(n, [round(float(v), 1) for v in b.norm(dim=-1) / sig.norm(dim=-1).mean(0)],
              [round(float(v), 2) for v in step(k) / rms], [round(float(v), 2) for v in step(k @ H) / rms],
              [round(float(v), 2) for v in step(sig @ H) / rms])
    return 0


if __name__ == "__main__":
    sys.exit(main())

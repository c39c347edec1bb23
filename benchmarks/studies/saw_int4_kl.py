"""Saw-INT4 on Qwen2.5-Coder-0.5B, which part costs the accuracy: the KL table of reports/accuracy/saw_int4.md (rows
appended to `--out`, one JSON line each; the report's table is written from them).

    python benchmarks/studies/saw_int4_kl.py --every 24 --threads 2 --out saw_kl.jsonl \\
        --variants g64,none g64,none,bias g32,none g64,q0.9 id,g64,none g16,none id,g64,none,bias

Next-token KL(BF16 || variant), decode-equivalent teacher forcing over HumanEval chat prompts + BF16's own greedy
completion (`--bf16-records`, default reports/accuracy/partial/humaneval_bf16.items.jsonl under the repository root:
the trajectory the task reads), BF16 windows S0/W 16/64 as in the HumanEval table; KL over positions t >= 80 (those
reading INT4 history). Each variant's per-layer rotations are built in code (`oscar.models.engine.rotations_in_code`);
`bias` sets the layer's `rope_k` to the `k_proj` bias with the layer's RoPE (`oscar.models.adapters.key_rope`), which
the torch cache applies as rope-centered keys.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from oscar.config import compose
from oscar.eval.runner import generation_prompt, prepare_items
from oscar.models import load_model
from oscar.models.adapters import key_rope
from oscar.models.engine import Engine, rotations_from_artifact, rotations_in_code
from oscar.studies.kl_table import kl_and_nll, mean_ci, score_and_bits

ROOT = Path(__file__).resolve().parents[2]  # the repository root (this file is benchmarks/studies/<name>.py)
BF16_RECORDS = ROOT / "reports" / "accuracy" / "partial" / "humaneval_bf16.items.jsonl"
BASE = ["model=qwen2.5-coder-0.5b", "benchmark=humaneval", "benchmark.limit=164",
        "+benchmark.extra.answer_start=function", "method.sink=16", "method.recent=64"]
START = 16 + 64  # the first position that reads INT4 history (S0 + W)


def variant(spec: str, model, artifact: str, bias: list[torch.Tensor]):
    """saw_int4 variant from a spec: g<group>, none | q<fixed ratio> | fit (`artifact`), id (no rotation), bias (keys
    rope-centered on the k_proj bias), e.g. 'g64,none', 'g64,none,bias', 'g32,none', 'g64,q0.9', 'id,g64,none'."""
    parts = spec.split(",")
    g = next(int(x[1:]) for x in parts if x.startswith("g"))
    clip = "fit" if "fit" in parts else "fixed" if any(x.startswith("q") for x in parts) else "none"
    rho = next((float(x[1:]) for x in parts if x.startswith("q")), 1.0)
    over = ["method=saw_int4"] + BASE + [f"method.group_size={g}", f"method.clip={clip}", f"method.rho_k={rho}",
                                         f"method.rho_v={rho}"]
    if "id" in parts:
        over += ["method.key_rotation=identity", "method.value_rotation=identity"]
    mcfg = compose(over)
    m = OmegaConf.create(OmegaConf.to_container(mcfg.method, resolve=True))
    rots = rotations_from_artifact(Path(artifact), m, model) if clip == "fit" else rotations_in_code(m, model)
    if "bias" in parts:  # keys rope-centered on the k_proj bias (exact: b is the same for every token)
        hkv, d = rots[0].r_k.shape[0], rots[0].r_k.shape[-1]
        for layer, r in enumerate(rots):
            spec_l, why = key_rope(model, layer)
            if spec_l is None:
                raise SystemExit(why)
            r.rope_k, r.rope = bias[layer].view(hkv, d).float(), spec_l
    return m, rots


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=int, default=4, help="every k-th HumanEval problem")
    p.add_argument("--variants", nargs="+", required=True)
    p.add_argument("--artifact", default="", help="saw_int4 artifact dir (fitted clip) for variants with 'fit'")
    p.add_argument("--bf16-records", type=Path, default=BF16_RECORDS,
                   help="BF16's HumanEval records (items.jsonl): the completions teacher-forced")
    p.add_argument("--out", required=True, help="JSON-lines file the rows are appended to")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = compose(["method=bf16"] + BASE)
    model, tok = load_model(cfg.model, device="cpu")
    items, _ = prepare_items(cfg, tok)
    items = items[:: a.every]
    view = SimpleNamespace(tokenizer=tok)
    with open(a.bf16_records) as fh:
        bf16_pred = {r["id"]: r["prediction"] for r in map(json.loads, fh)}
    seqs = []
    for it in items:
        prompt = generation_prompt(view, cfg, it)
        body = bf16_pred[it.id]
        seqs.append(torch.tensor(tok(prompt + body + "```", add_special_tokens=True)["input_ids"]))
    print(f"{len(seqs)} sequences, {sum(len(s) for s in seqs)} tokens, "
          f"{sum(max(0, len(s) - 1 - START) for s in seqs)} positions reading INT history", flush=True)
    refs = [Engine(model, tok, cfg.method).score(s[None], mode="decode_equivalent") for s in seqs]
    bias = [layer.self_attn.k_proj.bias.detach().double() for layer in model.model.layers]
    for spec in a.variants:
        t0 = time.time()
        m, rots = variant(spec, model, a.artifact, bias)
        eng = Engine(model, tok, m, rots)
        kls, agree, bpe = [], [], []
        for s, ref in zip(seqs, refs):
            logits, bits = score_and_bits(eng, s[None])
            kl, _ = kl_and_nll(ref, logits, s[None])
            kls.append(kl[START:])
            agree.append((ref[0, START:-1].argmax(-1) == logits[0, START:-1].argmax(-1)).double())
            bpe.append(bits)
        mean, lo, hi = mean_ci(kls)
        ag = float(torch.cat(agree).mean())
        row = dict(variant=spec, group=m.group_size, clip=m.clip, kl=mean, kl_lo=lo, kl_hi=hi, top1_agree=ag,
                   bits_per_element=sum(bpe) / len(bpe), seconds=round(time.time() - t0, 1))
        print(json.dumps(row), flush=True)
        with open(a.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

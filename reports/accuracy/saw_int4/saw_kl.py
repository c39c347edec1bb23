"""Saw-INT4 on Qwen2.5-Coder-0.5B: which part costs the accuracy? Next-token KL(BF16 || variant), decode-equivalent
teacher forcing over HumanEval chat prompts + BF16's own greedy completion (reports/accuracy/partial: the trajectory the task reads), BF16 windows
S0/W 16/64 as in the HumanEval table; KL over positions t >= 80 (those reading INT4 history)."""
import argparse, json, time
from pathlib import Path
from types import SimpleNamespace
import torch
from omegaconf import OmegaConf
from oscar.config import compose
from oscar.eval.runner import generation_prompt, prepare_items
from oscar.models import load_model
from oscar.models.adapters import key_rope
from oscar.models.engine import Engine, rotations_in_code, rotations_from_artifact
from oscar.studies.kl_table import kl_and_nll, mean_ci, score_and_bits

p = argparse.ArgumentParser()
p.add_argument("--every", type=int, default=4, help="every k-th HumanEval problem")
p.add_argument("--variants", nargs="+", required=True)
p.add_argument("--artifact", default="", help="saw_int4 artifact dir (fitted clip) for variants with 'fit'")
p.add_argument("--out", required=True)
p.add_argument("--threads", type=int, default=2)
a = p.parse_args()
torch.set_num_threads(a.threads)
B = ["model=qwen2.5-coder-0.5b", "benchmark=humaneval", "benchmark.limit=164", "+benchmark.extra.answer_start=function",
     "method.sink=16", "method.recent=64"]
cfg = compose(["method=bf16"] + B)
model, tok = load_model(cfg.model, device="cpu")
items, _ = prepare_items(cfg, tok)
items = items[:: a.every]
view = SimpleNamespace(tokenizer=tok)
bf16_pred = {r["id"]: r["prediction"] for r in map(json.loads, open("reports/accuracy/partial/humaneval_bf16.items.jsonl"))}
seqs = []
for it in items:
    prompt = generation_prompt(view, cfg, it)
    body = bf16_pred[it.id]
    seqs.append(torch.tensor(tok(prompt + body + "```", add_special_tokens=True)["input_ids"]))
start = 16 + 64
print(f"{len(seqs)} sequences, {sum(len(s) for s in seqs)} tokens, {sum(max(0, len(s) - 1 - start) for s in seqs)} "
      "positions reading INT history", flush=True)
refs = [Engine(model, tok, cfg.method).score(s[None], mode="decode_equivalent") for s in seqs]
bias = [layer.self_attn.k_proj.bias.detach().double() for layer in model.model.layers]


def variant(spec: str):
    """saw_int4 variant from a spec: g<group>, none | q<fixed ratio> | fit (--artifact), id (no rotation), bias (keys
    rope-centered on the k_proj bias), e.g. 'g64,none', 'g64,none,bias', 'g32,none', 'g64,q0.9', 'id,g64,none'."""
    parts = spec.split(",")
    g = next(int(x[1:]) for x in parts if x.startswith("g"))
    clip = "fit" if "fit" in parts else "fixed" if any(x.startswith("q") for x in parts) else "none"
    rho = next((float(x[1:]) for x in parts if x.startswith("q")), 1.0)
    over = ["method=saw_int4"] + B + [f"method.group_size={g}", f"method.clip={clip}", f"method.rho_k={rho}", f"method.rho_v={rho}"]
    if "id" in parts:
        over += ["method.key_rotation=identity", "method.value_rotation=identity"]
    mcfg = compose(over)
    m = OmegaConf.create(OmegaConf.to_container(mcfg.method, resolve=True))
    rots = rotations_from_artifact(Path(a.artifact), m, model) if clip == "fit" else rotations_in_code(m, model)
    if "bias" in parts:  # keys rope-centered on the k_proj bias (exact: b is the same for every token)
        hkv, d = rots[0].r_k.shape[0], rots[0].r_k.shape[-1]
        for l, r in enumerate(rots):
            spec_l, why = key_rope(model, l)
            if spec_l is None:
                raise SystemExit(why)
            r.rope_k, r.rope = bias[l].view(hkv, d).float(), spec_l
    return m, rots


rows = []
for spec in a.variants:
    t0 = time.time()
    m, rots = variant(spec)
    eng = Engine(model, tok, m, rots)
    kls, agree, bpe = [], [], []
    for s, ref in zip(seqs, refs):
        logits, bits = score_and_bits(eng, s[None])
        kl, _ = kl_and_nll(ref, logits, s[None])
        kls.append(kl[start:])
        agree.append((ref[0, start:-1].argmax(-1) == logits[0, start:-1].argmax(-1)).double())
        bpe.append(bits)
    mean, lo, hi = mean_ci(kls)
    ag = float(torch.cat(agree).mean())
    row = dict(variant=spec, group=m.group_size, clip=m.clip, kl=mean, kl_lo=lo, kl_hi=hi, top1_agree=ag,
               bits_per_element=sum(bpe) / len(bpe), seconds=round(time.time() - t0, 1))
    rows.append(row)
    print(json.dumps(row), flush=True)
    with open(a.out, "a") as fh:
        fh.write(json.dumps(row) + "\n")

"""Per layer: k_proj bias norm vs the token-dependent part of the pre-RoPE keys on a HumanEval prompt, and the per-token
INT4 step (range/15 after the 64-wide Hadamard) with and without the bias, relative to the signal's RMS."""
import json
import torch
from oscar.config import compose
from oscar.core.rotation import block_hadamard
from oscar.models import load_model
torch.set_num_threads(1)
cfg = compose(["model=qwen2.5-coder-0.5b"])
model, tok = load_model(cfg.model, device="cpu")
rec = json.loads(open("reports/accuracy/partial/humaneval_bf16.items.jsonl").readline())
ids = tok(rec["target"]["prompt"] + rec["prediction"], return_tensors="pt")["input_ids"]
keys = {}
hooks = [l.self_attn.k_proj.register_forward_hook(lambda m, i, o, n=n: keys.__setitem__(n, o[0].detach()))
         for n, l in enumerate(model.model.layers)]
with torch.no_grad():
    model(ids)
H = block_hadamard(64, 64, torch.float32)
print("layer  |b|/|k-b| (rms per head)  step/rms(signal): plain, hadamard, hadamard-centered")
for n, l in enumerate(model.model.layers):
    b = l.self_attn.k_proj.bias.detach().view(2, 64)
    k = keys[n].view(-1, 2, 64)  # [T, Hkv, d] pre-RoPE
    sig = k - b
    rms = sig.pow(2).mean(dim=(0, 2)).sqrt()
    def step(x):
        return ((x.amax(-1) - x.amin(-1)) / 15).mean(0)
    print(n, [round(float(v), 1) for v in b.norm(dim=-1) / sig.norm(dim=-1).mean(0)],
          [round(float(v), 2) for v in step(k) / rms], [round(float(v), 2) for v in step(k @ H) / rms],
          [round(float(v), 2) for v in step(sig @ H) / rms])

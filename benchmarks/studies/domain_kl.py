"""Domain effect on next-token KL: the KL table of reports/accuracy/domain/humaneval.md (rows appended to `--out`,
one JSON line each; the report's table is written from them).

    python benchmarks/studies/domain_kl.py --out domain_kl.jsonl --rows \\
        auto-essays=results/h4/calibration/qwen2.5-coder-0.5b/auto:0 kivi2

Held-out windows of one domain (`--domain`: `code`, the `code` corpus's evaluation split, disjoint from the code
and the mixed calibrations' windows; `default`, the essays' evaluation split, disjoint from the essays and the mixed
calibrations' windows),
decode-equivalent teacher forcing, S0/W 16/64 as in the HumanEval cells; KL(BF16 || method) over positions t >= 80,
block-bootstrap intervals, paired differences to the first row. Artifact paths are read from the working directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from oscar.config import compose
from oscar.data.corpora import eval_sequences
from oscar.models import load_model
from oscar.models.engine import Engine, rotations_from_artifact
from oscar.studies.kl_table import kl_and_nll, mean_ci, paired, score_and_bits

WINDOWS = ["model=qwen2.5-coder-0.5b", "method.sink=16", "method.recent=64"]
START = 80  # the first position that reads quantized history (S0 + W)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", required=True, help="label=artifact_dir:channel_block, or kivi2")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="JSON-lines file the rows are appended to")
    p.add_argument("--domain", default="code", choices=["code", "default"],
                   help="whose evaluation split to score: code (the standard library) or default (the essays)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    base = compose([f"calibration={a.domain}"] + WINDOWS + ["method=bf16"])
    model, tok = load_model(base.model, device="cpu")
    wins = eval_sequences(tok, base.calibration, a.tokens, seq_len=a.seq_len)
    print(f"{len(wins)} held-out {a.domain} windows of {a.seq_len}", flush=True)
    refs = [Engine(model, tok, base.method).score(w[None], mode="decode_equivalent") for w in wins]
    per: dict[str, list] = {}
    for spec in a.rows:
        t0 = time.time()
        label, _, rest = spec.partition("=")
        if label == "kivi2":
            m = compose(WINDOWS + ["method=kivi2"]).method
            eng = Engine(model, tok, m)
        else:
            art, _, cb = rest.partition(":")
            over = WINDOWS + ["method=auto", f"method.channel_block={cb or 0}"]
            m = OmegaConf.create(OmegaConf.to_container(compose(over).method))
            eng = Engine(model, tok, m, rotations_from_artifact(Path(art), m, model))
        kls, bits = [], []
        for w, ref in zip(wins, refs):
            logits, b = score_and_bits(eng, w[None])
            kl, _ = kl_and_nll(ref, logits, w[None])
            kls.append(kl[START:])
            bits.append(b)
        per[label] = kls
        mean, lo, hi = mean_ci(kls)
        row = dict(row=label, domain=a.domain, kl=mean, kl_lo=lo, kl_hi=hi, bits_per_element=sum(bits) / len(bits),
                   seconds=round(time.time() - t0, 1))
        first = next(iter(per))
        if label != first:
            d, dlo, dhi = paired(kls, 0, per[first], 0)
            row.update(diff_vs=first, diff=d, diff_lo=dlo, diff_hi=dhi)
        print(json.dumps(row), flush=True)
        with open(a.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

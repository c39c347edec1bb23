"""Is served QuaRot INT2's disagreement with the embedded engine (H200, BF16 model: largest log-probability
difference 3.9 nats, 86% next-token agreement, while served `auto` gave 98%) a defect of the served path or
QuaRot's sensitivity to float rounding? Reproduced on CPU with SGLang's CPU engine (sglang 0.5.23, the pool's
torch twins) at the GPU run's settings (SmolLM2-135M, the 8 prompts and 32 greedy tokens of
``oscar.bench.correctness.real_weights``, sink 16, recent 16), and compared with what two float paths of the embedded
engine alone give along the same tokens:

- embedded vs embedded, along its own greedy tokens: the BF16 model with the prompts in one batch vs in two
  halves (another reduction order of the same BF16 arithmetic), and BF16 vs float32 (another precision);
- with ``--served bfloat16[,float32]``: served (SGLang's CPU engine) vs embedded along SGLang's tokens;
- for the methods given (quarot, auto = results/calibration/smollm2-135m/auto, int2) and the BF16 cache.

Writes reports/serving/int2_regime.{csv,md} (one row per compared pair); the reading is in
reports/serving/gpu_correctness.md ("QuaRot").

    nice -n 10 .venv-serve/bin/python tests/serve/served_int2_regime.py [--methods quarot,auto] [--prompts 4
        --new-tokens 16] [--served bfloat16]

On this project's loaded 2-core box one method at 8 prompts x 32 tokens takes ~35 min (2026-12-03).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from serve_helpers import SMOLLM2_DENSE, run_driver, save_in_code_artifact  # noqa: E402

from oscar.bench.correctness.compare import forced_logprobs_batch  # noqa: E402
from oscar.bench.correctness.real_weights import NEW_TOKENS, S0_INT2, TEXTS, W_INT2, wilson  # noqa: E402
from oscar.core.files import atomic_write_csv, atomic_write_text  # noqa: E402

AUTO = ROOT / "results" / "calibration" / "smollm2-135m" / "auto"


def forced(model, method: str, art: Path, prompts, toks, batch: bool, overrides=()):
    """Teacher-forced log-probabilities of the embedded engine (value rotation folded) along `toks`."""
    from oscar.config import compose
    from oscar.models.engine import Engine, rotations_from_artifact
    from oscar.models.generate import forced_logprobs

    cfg = compose([f"method={method}", *overrides, f"method.sink={S0_INT2}", f"method.recent={W_INT2}"])
    rots = None if art is None else rotations_from_artifact(art, cfg.method, model)
    engine = Engine(model, None, cfg.method, rots, fold_values=art is not None)
    try:
        if batch:
            return forced_logprobs_batch(model, prompts, toks, engine.new_cache)
        return [forced_logprobs(model, p, t, engine.new_cache).cpu() for p, t in zip(prompts, toks)]
    finally:
        engine.close()


def compare(ref, other, toks, served=None) -> dict:
    """Per step: the largest |difference| over the token and each side's top 2 (the GPU check's quantity), and
    whether the argmaxes agree. `served`: SGLang's logprobs (then `other` is None and its top 2 are used)."""
    diffs, agree, n = [], 0, 0
    for p, t in enumerate(toks):
        for i, tok in enumerate(t):
            a = ref[p][i]
            if served is not None:
                lp = served[p]
                rep = {int(e[1]): float(e[0]) for e in lp["output_top_logprobs"][i][:2]}
                rep[tok] = float(lp["output_token_logprobs"][i][0])
                diffs.append(max(abs(v - float(a[j])) for j, v in rep.items()))
                agree += int(int(a.argmax()) == tok)
            else:
                b = other[p][i]
                ids = set(a.topk(2).indices.tolist()) | set(b.topk(2).indices.tolist()) | {tok}
                diffs.append(max(abs(float(a[j] - b[j])) for j in ids))
                agree += int(int(a.argmax()) == int(b.argmax()))
            n += 1
    lo, hi = wilson(agree, n)
    return {"steps": n, "agreement": agree / n, "agreement_lo": lo, "agreement_hi": hi,
            "max_diff": max(diffs), "median_diff": statistics.median(diffs)}


def sensitivity(ref, toks) -> dict:
    """How often the INT2 model is near a tie: the share of steps whose top-2 margin is below 0.5 nats."""
    margins = [float(ref[p][i].topk(2).values.diff().abs()) for p, t in enumerate(toks) for i in range(len(t))]
    return {"near_ties_0.5": sum(m < 0.5 for m in margins) / len(margins), "median_margin": statistics.median(margins)}


def greedy(model, method: str, art, prompts, new_tokens: int, overrides=()):
    """The embedded engine's own greedy tokens (all prompts in one batch)."""
    from oscar.config import compose
    from oscar.models.engine import Engine, rotations_from_artifact
    from oscar.models.generate import SamplingParams, generate_tokens

    cfg = compose([f"method={method}", *overrides, f"method.sink={S0_INT2}", f"method.recent={W_INT2}"])
    rots = None if art is None else rotations_from_artifact(art, cfg.method, model)
    engine = Engine(model, None, cfg.method, rots, fold_values=art is not None)
    try:
        return generate_tokens(model, prompts, SamplingParams(new_tokens, 0.0, 1.0, 0, 0, ()), engine.new_cache)
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="quarot,auto,int2")
    ap.add_argument("--served", default="bfloat16", help="model dtypes of the SGLang runs ('' for none)")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "serving" / "int2_regime")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--prompts", type=int, default=len(TEXTS))
    ap.add_argument("--reuse", type=Path, default=None, help="a served-runs JSON of an earlier run (skips SGLang)")
    ap.add_argument("--skip-embedded-pairs", action="store_true", help="only the served comparisons")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from oscar.config import compose
    from oscar.models import load_model

    torch.set_num_threads(2)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(str(SMOLLM2_DENSE))
    prompts = [tok(t, add_special_tokens=True)["input_ids"] for t in TEXTS[:a.prompts]]
    tmp = Path(tempfile.mkdtemp(prefix="int2_regime_"))
    arts = {"quarot": (save_in_code_artifact(SMOLLM2_DENSE, "quarot", tmp / "quarot"), ("method.clip=paper",)),
            "int2": (save_in_code_artifact(SMOLLM2_DENSE, "int2", tmp / "int2"), ("method.clip=paper",)),
            "auto": (AUTO, ()), "bf16": (None, ())}
    methods = a.methods.split(",")
    mcfg = compose(["model=smollm2-135m"]).model
    models = {dt: load_model(mcfg, device="cpu", dtype=dt)[0].eval() for dt in ("bfloat16", "float32")}
    rows: list[dict] = []
    # 1. the embedded engine against itself, along its own BF16 greedy tokens (no SGLang)
    for m in [] if a.skip_embedded_pairs else methods + ["bf16"]:
        art, ov = arts[m]
        toks = greedy(models["bfloat16"], m, art, prompts, a.new_tokens, ov)
        one = forced(models["bfloat16"], m, art, prompts, toks, True, ov)  # all prompts in one batch
        half = len(prompts) // 2  # the same prompts in two batches: another reduction order of the same arithmetic
        halves = (forced(models["bfloat16"], m, art, prompts[:half], toks[:half], True, ov)
                  + forced(models["bfloat16"], m, art, prompts[half:], toks[half:], True, ov))
        rows.append({"method": m, "pair": f"embedded vs embedded, bfloat16 model: {len(prompts)} prompts in a batch vs "
                                          f"{half} + {len(prompts) - half}",
                     **compare(one, halves, toks), **sensitivity(one, toks)})
        rows.append({"method": m, "pair": "embedded vs embedded: bfloat16 vs float32 model",
                     **compare(one, forced(models["float32"], m, art, prompts, toks, True, ov), toks),
                     **sensitivity(one, toks)})
        print(rows[-2], rows[-1], sep="\n", flush=True)
        write(rows, a.out, time.time() - t0)
    # 2. SGLang's CPU engine (the pool's torch twins) against the embedded engine along SGLang's tokens
    dtypes = [d for d in a.served.split(",") if d]
    if not dtypes:
        return 0
    sampling = {"temperature": 0, "max_new_tokens": a.new_tokens, "ignore_eos": True}
    runs = [{"name": f"{m}_{dt}", "engine_args": {"model_path": str(SMOLLM2_DENSE), "attention_backend": "oscar",
                                                   "dtype": dt, "page_size": 16},
             "env": {"OSCAR_ARTIFACT": str(arts[m][0]), "OSCAR_SINK": S0_INT2, "OSCAR_RECENT": W_INT2},
             "input_ids": prompts, "sampling": sampling, "generate_args": {"return_logprob": True, "top_logprobs_num": 2}}
            for m in methods if m != "bf16" for dt in dtypes]
    if a.reuse is not None:
        served = json.loads(a.reuse.read_text())
    else:
        served, _ = run_driver(runs, tmp)
        atomic_write_text(a.out.with_name(a.out.name + "_served.json"), json.dumps(served))
    print(f"served runs done after {time.time() - t0:.0f} s", flush=True)
    for r in runs:
        m, dt = r["name"].rsplit("_", 1)
        art, ov = arts[m]
        run = served[r["name"]]
        toks = run["output_ids"]
        one = forced(models[dt], m, art, prompts, toks, True, ov)
        rows.append({"method": m, "pair": f"served (SGLang CPU) vs embedded, {dt} model",
                     **compare(one, None, toks, run["logprobs"]), **sensitivity(one, toks)})
        print(rows[-1], flush=True)
        write(rows, a.out, time.time() - t0)
    return 0


def write(rows: list[dict], out: Path, seconds: float) -> None:
    atomic_write_csv(out.with_suffix(".csv"), rows)
    lines = [f"# Served vs embedded INT2 on CPU, and the embedded engine against itself (SmolLM2-135M, sink "
             f"{S0_INT2}, recent {W_INT2}, torch {torch.__version__}, {seconds:.0f} s)", "",
             "Made by `nice -n 10 .venv-serve/bin/python tests/serve/served_int2_regime.py`. Per step: the largest "
             "|log-probability difference| over the forced token and each side's top 2; argmax agreement with a "
             "Wilson 95% interval; near ties: steps whose top-2 margin is below 0.5 nats.", "",
             "| method | pair | steps | argmax agreement | largest / median difference | near ties | median margin |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['pair']} | {r['steps']} | {r['agreement']:.3f} [{r['agreement_lo']:.3f}, "
                     f"{r['agreement_hi']:.3f}] | {r['max_diff']:.3f} / {r['median_diff']:.4f} | "
                     f"{r['near_ties_0.5']:.2f} | {r['median_margin']:.2f} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""Do a prefix hit and a cold prefill give the same tokens, and is either worse against BF16? (real weights)

    SGLANG_USE_CPU_ENGINE=1 .venv-serve/bin/python -m oscar.bench.prefix.agreement \
        --model-path ~/.cache/oscar/models/smollm2-135m/dense --artifact results/calibration/smollm2-135m/auto \
        --device cpu --prompts 8 --prompt-len 1024 --new 32 --out reports/serving/hit_agreement

Held-out prompts (windows of the essays corpus past its calibration part), each through SGLang's offline Engine with
the radix cache on, first with SGLang's BF16 attention (``--bf16-backend``: ``torch_native`` on a CPU, ``flashinfer`` on a GPU) for
the reference greedy completion, then with ``--attention-backend oscar`` (the artifact's format, the plugin's serving
defaults):

- free-running: the prompt cold (cache flushed), then again as a hit (its prefix from the radix tree, read as the
  cache holds it: INT2 past the sink); greedy tokens of each against the other and against BF16's;
- teacher-forced: the prompt followed by BF16's completion, cold and then as a hit, one position at a time
  (``input_top_logprobs``): how often the argmax at a completion position is BF16's token there. The two paths
  read the same history, one as the prefill computed it, one as the cache holds it: their agreement with BF16 says
  whether the hit is worse.

Writes ``<out>.json`` (per prompt) and ``<out>.md`` (means with 95% bootstrap intervals over prompts, the paired
difference hit - cold).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

from oscar.core.files import atomic_write_text
from oscar.data.corpora import corpus_text
from oscar.serve.reuse import ENV_PREFIX_REUSE, PREFIX_REUSE


def held_out_prompts(tokenizer: Any, n: int, length: int, skip_tokens: int = 16384) -> list[list[int]]:
    """``n`` windows of ``length`` tokens of the essays corpus after its first ``skip_tokens`` tokens (the
    calibration reads the start of the corpus)."""
    ids = tokenizer(corpus_text("paul_graham"), add_special_tokens=False)["input_ids"]
    need = skip_tokens + n * length
    if len(ids) < need:
        raise ValueError(f"the essays corpus has {len(ids)} tokens; {n} prompts of {length} after {skip_tokens} "
                         f"need {need}: ask for fewer or shorter prompts")
    return [ids[skip_tokens + i * length: skip_tokens + (i + 1) * length] for i in range(n)]


def _generate(engine: Any, ids: list[int], new: int, **extra: Any) -> dict[str, Any]:
    return engine.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": new,
                                                           "ignore_eos": True}, **extra)


def forced_argmax(engine: Any, prompt: list[int], completion: list[int]) -> tuple[list[int], int]:
    """The argmax at each completion position with ``prompt + completion`` as input (teacher forcing), and the
    prompt tokens SGLang served from its cache."""
    out = _generate(engine, prompt + completion, 1, return_logprob=True, logprob_start_len=len(prompt) - 1,
                    top_logprobs_num=1)
    meta = out["meta_info"]
    # entry i: the distribution over the token at input position logprob_start_len + i (the first entry has none:
    # its distribution is at the position before the range), so the last len(completion) entries are the
    # completion's
    picks = [int(t[0][1]) if t else -1 for t in meta["input_top_logprobs"]][-len(completion):]
    return picks, int(meta.get("cached_tokens", 0))


def same_prefix(a: list[int], b: list[int]) -> int:
    """Tokens equal from the start until the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _agree(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(1, min(len(a), len(b)))


def bootstrap(values: list[float], seed: int = 0, n: int = 2000) -> tuple[float, float, float]:
    """Mean and a 95% percentile bootstrap interval over the items."""
    rng = random.Random(seed)
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, mean, mean
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(n))
    return mean, means[int(0.025 * n)], means[int(0.975 * n) - 1]


def run(a: argparse.Namespace) -> dict[str, Any]:
    import sglang
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_path)
    prompts = held_out_prompts(tok, a.prompts, a.prompt_len)
    common = dict(model_path=a.model_path, device=a.device, dtype=a.dtype, disable_radix_cache=False, random_seed=0,
                  log_level="warning", mem_fraction_static=a.mem_fraction, skip_tokenizer_init=True,
                  **({"disable_cuda_graph": True} if a.device == "cpu" else {}))
    t0 = time.time()
    engine = sglang.Engine(**common, attention_backend=a.bf16_backend)
    try:
        ref = [_generate(engine, p, a.new)["output_ids"] for p in prompts]
        engine.flush_cache()
        ref_forced = [forced_argmax(engine, p, r)[0] for p, r in zip(prompts, ref)]
    finally:
        engine.shutdown()
    os.environ["OSCAR_ARTIFACT"] = str(a.artifact)
    os.environ[ENV_PREFIX_REUSE] = a.prefix_reuse
    engine = sglang.Engine(**common, attention_backend="oscar")
    rows = []
    try:
        for i, (p, r) in enumerate(zip(prompts, ref)):
            engine.flush_cache()
            cold = _generate(engine, p, a.new)
            hit = _generate(engine, p, a.new)
            engine.flush_cache()
            tf_cold, _ = forced_argmax(engine, p, r)
            tf_hit, cached = forced_argmax(engine, p, r)
            rows.append(dict(prompt=i, cold=cold["output_ids"], hit=hit["output_ids"], bf16=r,
                             hit_cached=int(hit["meta_info"].get("cached_tokens", 0)), forced_hit_cached=cached,
                             cold_eq_hit=_agree(cold["output_ids"], hit["output_ids"]),
                             cold_prefix_bf16=same_prefix(cold["output_ids"], r),
                             hit_prefix_bf16=same_prefix(hit["output_ids"], r),
                             forced_cold=_agree(tf_cold, r), forced_hit=_agree(tf_hit, r)))
            print(f"prompt {i}: hit cached {rows[-1]['hit_cached']}, cold=hit {rows[-1]['cold_eq_hit']:.2f}, "
                  f"forced agreement with BF16 cold {rows[-1]['forced_cold']:.3f} hit {rows[-1]['forced_hit']:.3f}",
                  flush=True)
    finally:
        engine.shutdown()
    return dict(model_path=str(a.model_path), artifact=str(a.artifact), device=a.device, dtype=a.dtype,
                prompts=a.prompts, prompt_len=a.prompt_len, new=a.new, bf16_backend=a.bf16_backend,
                sglang=str(sglang.__version__), wall_s=round(time.time() - t0, 1),
                bf16_self_forced=sum(_agree(f, r) for f, r in zip(ref_forced, ref)) / len(ref), rows=rows)


def report(res: dict[str, Any], command: str) -> str:
    rows = res["rows"]
    col = lambda k: [float(r[k]) for r in rows]  # noqa: E731
    fmt = lambda t: f"{t[0]:.3f} [{t[1]:.3f}, {t[2]:.3f}]"  # noqa: E731
    diff = [h - c for h, c in zip(col("forced_hit"), col("forced_cold"))]
    same = sum(r["cold"] == r["hit"] for r in rows)
    lines = [f"# Prefix hit against cold prefill on real weights ({Path(res['model_path']).parent.name or res['model_path']})",
             "",
             f"SGLang {res['sglang']} offline Engine on `{res['device']}` ({res['dtype']}), radix cache on; "
             f"{res['prompts']} held-out essay prompts of {res['prompt_len']} tokens, {res['new']} greedy tokens; "
             f"BF16 reference: `{res['bf16_backend']}`; OSCAR artifact `{res['artifact']}`; {res['wall_s']} s. "
             f"Command: `{command}`", "",
             "| measure | cold prefill | prefix hit | hit - cold (paired) |", "|---|---|---|---|",
             f"| teacher-forced agreement with BF16's tokens | {fmt(bootstrap(col('forced_cold')))} | "
             f"{fmt(bootstrap(col('forced_hit')))} | {fmt(bootstrap(diff))} |",
             f"| free-running: tokens equal to BF16's before the first difference (mean) | "
             f"{sum(col('cold_prefix_bf16')) / len(rows):.1f} | {sum(col('hit_prefix_bf16')) / len(rows):.1f} | |",
             "", f"Free-running hit and cold completions identical: {same} of {len(rows)} prompts (token agreement "
             f"{fmt(bootstrap(col('cold_eq_hit')))}); prompt tokens served from the cache on a hit: "
             f"{min(int(r['hit_cached']) for r in rows)}-{max(int(r['hit_cached']) for r in rows)}. BF16 teacher-forced "
             f"on its own completion agrees with it at {res['bf16_self_forced']:.3f} of the positions (the check "
             "that the forced positions line up)."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--artifact", type=Path, required=True, help="the OSCAR calibration artifact to serve")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--bf16-backend", default="", help="SGLang's BF16 attention (default: torch_native on cpu, "
                    "flashinfer on cuda)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--mem-fraction", type=float, default=0.5)
    ap.add_argument("--prefix-reuse", default="quantized", choices=PREFIX_REUSE,
                    help="OSCAR_PREFIX_REUSE of the OSCAR engine (quantized: the hit reads the cached INT2 pages)")
    ap.add_argument("--out", type=Path, required=True, help="writes <out>.json and <out>.md")
    a = ap.parse_args(argv)
    a.bf16_backend = a.bf16_backend or ("torch_native" if a.device == "cpu" else "flashinfer")
    if not (a.artifact / "meta.json").is_file():
        raise SystemExit(f"--artifact {a.artifact}: no meta.json there (python -m oscar calibrate model=... method=...)")
    res = run(a)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out.with_suffix(".json"), json.dumps(res, indent=1) + "\n")
    md = report(res, "python -m oscar.bench.prefix.agreement " + " ".join(sys.argv[1:] if argv is None else argv))
    atomic_write_text(a.out.with_suffix(".md"), md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

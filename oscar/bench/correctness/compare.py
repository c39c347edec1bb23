"""How a served INT2 run is compared with the embedded engine: the tolerances and the teacher-forced check.

Shared by the correctness table (``oscar.bench.correctness.real_weights``) and the serving tests (``tests/serve``).
Two float32 forwards of the same INT2 model that differ only at the rounding level (SGLang's model code vs
transformers', another CPU ISA) are far apart under INT2: a rounding difference moves key/value elements across
BF16 or INT2 code boundaries. ``tests/serve/int2_reduction_order.py`` measured it (the embedded engine against
itself with every weight moved by <= 1 float32 ulp, SmolLM2-135M, quarot S0=8 W=16, 2 x 48 teacher-forced steps,
AMD EPYC; reports/serve/int2_reduction_order.md): largest difference of a top-2 log-probability 0.57 nats,
median 0.066 / 0.048, the argmax changed at 7 and 3 of 48 steps (top-2 margins up to 0.66); SGLang against the
embedded engine on that CPU: 0.014 largest, 0.0012 median, 9 decided steps agreeing. The bounds below are the
one-ulp maxima with margin (x1.75 and x3).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

INT2_LOGPROB_TOL = 1.0  # every reported log-probability
INT2_MEDIAN_TOL = 0.2  # the median over a run's steps of the largest difference per step


def check_teacher_forced(served: dict, forced: list[Any], tol: float = INT2_LOGPROB_TOL,
                         median_tol: float = INT2_MEDIAN_TOL) -> tuple[float, float, int]:
    """Compare an SGLang greedy run (with `return_logprob`, `top_logprobs_num=2`) with the embedded engine
    forced along SGLang's own tokens: at every step the log-probabilities SGLang reports (its token and its
    top 2) agree within `tol`, the median over steps of the per-step largest difference is within
    `median_tol`, and SGLang's token is the embedded argmax wherever the embedded top-2 margin exceeds
    2 * tol (elsewhere the two forwards may rank them either way). Raises AssertionError naming the step.
    Returns (largest difference, median, number of steps whose token was checked)."""
    per_step, decided = [], 0
    for p, (toks, lp, lf) in enumerate(zip(served["output_ids"], served["logprobs"], forced)):
        for i, tok in enumerate(toks):
            chosen = lp["output_token_logprobs"][i]
            assert int(chosen[1]) == tok, (p, i, chosen, tok)
            reported = {int(e[1]): float(e[0]) for e in lp["output_top_logprobs"][i]}
            reported[tok] = float(chosen[0])
            diffs = {j: abs(value - float(lf[i, j])) for j, value in reported.items()}
            worst_j = max(diffs, key=diffs.get)
            assert diffs[worst_j] <= tol, (f"prompt {p} step {i} token {worst_j}: SGLang {reported[worst_j]:.5f}, "
                                           f"embedded {float(lf[i, worst_j]):.5f}")
            per_step.append(diffs[worst_j])
            top = lf[i].topk(2)
            if float(top.values[0] - top.values[1]) > 2 * tol:
                assert int(top.indices[0]) == tok, (p, i, int(top.indices[0]), tok)
                decided += 1
    median = statistics.median(per_step)
    assert median <= median_tol, (median, per_step)
    return max(per_step), median, decided


def save_in_code_artifact(model_dir: Path, method: str, out: Path, overrides: tuple = ("method.clip=paper",)) -> Path:
    """The artifact of a method that needs no calibration (int2: identity, quarot: Hadamard) for a local model.

    `method.clip=paper` (the default `overrides`) selects the published, unclipped baseline: under the default fair
    clip policy (`fit`) these methods fit their clip on calibration statistics like every other row. Other overrides
    (e.g. `method.bits=4`) follow it."""
    from transformers import AutoConfig

    from oscar.config import compose  # local: keeps omegaconf out of `gpu --help`
    from oscar.core.artifact import (  # local: keeps torch out of `gpu --help`
        config_hash_of, model_config_fields, save_artifact)
    from oscar.models.methods import in_code_artifact  # local: keeps omegaconf out of `gpu --help`

    hf = AutoConfig.from_pretrained(str(model_dir))
    f = model_config_fields(hf)
    cfg = compose([f"method={method}", *overrides])
    art = in_code_artifact(cfg.method, num_layers=f["num_layers"], num_kv_heads=f["num_kv_heads"],
                           head_dim=f["head_dim"], model_id=str(model_dir), config_hash=config_hash_of(hf))
    save_artifact(art, out)
    return out


def forced_logprobs_batch(model: Any, prompts: list[list[int]], tokens: list[list[int]], make_cache: Any,
                          pad_id: int = 0) -> list[Any]:
    """`oscar.models.generate.forced_logprobs` for every prompt in one batch: the prompts left-padded and prefilled
    together, then one forward per step for all of them (the way `generate_tokens` decodes a batch), so a
    teacher-forced comparison costs `max(len(tokens))` forwards instead of their sum. Returns one float32
    `[len(tokens[b]), vocab]` tensor per prompt (on the CPU). Batch shapes change the float reduction order, not
    the arithmetic: against the one-prompt path it agrees to rounding (tests/test_serve_compare.py)."""
    import torch

    from oscar.models.generate import cache_kwarg, left_pad, positions_from_mask  # local: keeps torch out of `gpu --help`

    if len(prompts) != len(tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(tokens)} token lists; give one token list per prompt")
    device = next(model.parameters()).device
    steps = max((len(t) for t in tokens), default=0)
    ids, mask = left_pad(prompts, pad_id, device)
    has_pad = bool((mask == 0).any())
    pos = positions_from_mask(mask)
    # a row whose forced tokens end early is fed its last token again (its rows past the end are dropped)
    feed = torch.tensor([[t[min(i, len(t) - 1)] if t else pad_id for i in range(steps)] for t in tokens],
                        dtype=torch.long, device=device)
    kw, cache, rows = cache_kwarg(model), make_cache(), []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask if has_pad else None, position_ids=pos, use_cache=True,
                       **{kw: cache}).logits[:, -1]
        next_pos = pos[:, -1:] + 1
        for step in range(steps):
            rows.append(torch.log_softmax(logits.float(), -1).cpu())
            if step == steps - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            logits = model(input_ids=feed[:, step:step + 1], attention_mask=mask if has_pad else None,
                           position_ids=next_pos, use_cache=True, **{kw: cache}).logits[:, -1]
            next_pos = next_pos + 1
    if not rows:
        return [torch.empty(0) for _ in prompts]
    stacked = torch.stack(rows, dim=1)  # [B, steps, vocab]
    return [stacked[b, :len(t)] for b, t in enumerate(tokens)]

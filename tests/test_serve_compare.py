"""The teacher-forced comparison of the correctness table: the batched forced log-probabilities."""

from __future__ import annotations

import torch

from oscar.bench.correctness.compare import forced_logprobs_batch
from oscar.cache.attention import enable
from oscar.cache.torch_cache import spec_for_model
from oscar.models.engine import new_cache
from oscar.models.generate import forced_logprobs

from test_cache import random_rotations, tiny_llama


def test_batched_forced_logprobs_equal_one_prompt_at_a_time_to_rounding() -> None:
    """All prompts left-padded in one batch, one forward per step, against `forced_logprobs` prompt by prompt
    through an INT2 cache whose quantized segment is reached at prefill and by demotion (sink 2, recent 4):
    the same arithmetic in another batch shape, so within float32 rounding (measured: 9.5e-7 at most, 2026-12-03)
    except where a rounding difference flips an INT2 code (then one step may part: 90% of steps are required);
    forced tokens of unequal lengths keep their own rows."""
    model = tiny_llama()
    enable(model)
    rots = random_rotations(model)
    factory = lambda: new_cache(model, spec_for_model(model, kind="rotated", rotations=rots, sink=2, recent=4,  # noqa: E731
                                                      group_size=8))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (11, 3, 7)]
    tokens = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (9, 9, 5)]
    batched = forced_logprobs_batch(model, prompts, tokens, factory)
    assert [tuple(b.shape) for b in batched] == [(9, 96), (9, 96), (5, 96)]
    diffs = torch.cat([(b - forced_logprobs(model, p, t, factory)).abs().amax(-1)
                       for b, p, t in zip(batched, prompts, tokens)])
    assert float(diffs.median()) < 1e-4, diffs
    assert float((diffs < 1e-4).float().mean()) >= 0.9, diffs


def test_served_run_comparison_and_its_table() -> None:
    """`compare_served` on a synthetic served run: SGLang's top-256 log-probabilities taken from a row that differs
    from the embedded one by a known shift at one step; the table row and the CSV rows carry what it measured."""
    from oscar.bench.correctness.spec import summary_rows
    from oscar.bench.correctness.real_weights import TOP, compare_served, render

    gen = torch.Generator().manual_seed(0)
    emb = [torch.log_softmax(3 * torch.randn(4, 300, generator=gen), -1) for _ in range(2)]
    bf16 = [torch.log_softmax(e + 0.1 * torch.randn(e.shape, generator=gen), -1) for e in emb]
    served_rows_ = [e.clone() for e in emb]
    served_rows_[1][2] = torch.log_softmax(served_rows_[1][2] + torch.where(torch.arange(300) == 7, 2.0, 0.0), -1)
    toks = [[int(r.argmax()) for r in s] for s in served_rows_]

    def entry(row, t):
        top = row.topk(TOP)
        return [[float(v), int(i), None] for v, i in zip(top.values, top.indices)], [float(row[t]), t, None]

    logprobs = []
    for s, tk in zip(served_rows_, toks):
        tops, chosen = zip(*(entry(s[i], t) for i, t in enumerate(tk)))
        logprobs.append({"output_top_logprobs": list(tops), "output_token_logprobs": list(chosen)})
    c = compare_served({"output_ids": toks, "logprobs": logprobs}, emb, bf16)
    shifted = served_rows_[1][2] - emb[1][2]
    assert c["steps"] == 8 and c["median_logprob_diff"] < 1e-5
    compared = [toks[1][2], *served_rows_[1][2].topk(2).indices.tolist()]  # SGLang's token and its top 2
    assert abs(c["max_logprob_diff"] - float(shifted[compared].abs().max())) < 1e-4 and c["max_logprob_diff"] > 0.01
    assert c["agreement_with_embedded_int2"] == (8 - int(toks[1][2] != int(emb[1][2].argmax()))) / 8
    assert 0 < c["kl_served_vs_embedded_top_mean"] < 1 and c["teacher_forced_ok"]
    report = {"device": "cpu", "model": "m", "prompts": 2, "prompt_tokens": [5, 6], "new_tokens": 4, "torch": "t",
              "runs": {"oscar_quarot": {"start_s": 3.0, "generate_s": 1.0}}, "methods": {"quarot": c},
              "timings": {"model_load_s": 2.0}, "total_s": 9.0}
    md = render(report)
    assert f"| quarot | 8 | {c['agreement_with_embedded_int2']:.3f} [" in md and "model_load 2.0" in md
    rows = summary_rows(report, {})
    assert [r["check"] for r in rows][:2] == ["quarot: teacher-forced check (largest log-prob difference)",
                                             "quarot: median log-prob difference"]


def test_rebuilt_correctness_report_keeps_the_quarot_finding(tmp_path) -> None:
    import json

    from oscar.commands import gpu

    rep = {"device": "cpu", "model": "m", "prompts": 1, "prompt_tokens": [5], "new_tokens": 4, "torch": "t", "runs": {},
           "methods": {}, "timings": {}, "total_s": 1.0}
    (tmp_path / "gpu_correctness.json").write_text(json.dumps(rep))
    (tmp_path / "gpu_correctness.md").write_text("# old\n\n## Runs\n\nold rows\n\n## QuaRot\n\nthe finding, 86%\n")
    assert gpu.main(["correctness", "report_only=true", "tracking=false", f"out={tmp_path}"]) == 0
    md = (tmp_path / "gpu_correctness.md").read_text()
    assert md.startswith("# GPU correctness") and "old rows" not in md and md.endswith("## QuaRot\n\nthe finding, 86%\n")

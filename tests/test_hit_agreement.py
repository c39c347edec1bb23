"""The hit-against-cold agreement tool's pieces without an engine (`oscar.bench.prefix.agreement`): held-out
prompts, the agreement measures, the bootstrap, the report (the engine run itself: tests/serve and the report
under reports/serving)."""

from __future__ import annotations

import pytest

from oscar.bench.prefix import agreement as ag


class _Tok:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text.split())))}


def test_prompts_are_held_out_windows(monkeypatch):
    monkeypatch.setattr(ag, "corpus_text", lambda name: " ".join(["w"] * 5000))
    ps = ag.held_out_prompts(_Tok(), 3, 100, skip_tokens=1000)
    assert [p[0] for p in ps] == [1000, 1100, 1200] and all(len(p) == 100 for p in ps)
    with pytest.raises(ValueError, match="has 5000 tokens; 3 prompts of 2000 after 1000 need 7000"):
        ag.held_out_prompts(_Tok(), 3, 2000, skip_tokens=1000)


def test_measures_and_report():
    assert ag.same_prefix([1, 2, 3], [1, 2, 4]) == 2 and ag.same_prefix([], [1]) == 0
    mean, lo, hi = ag.bootstrap([0.9, 1.0, 0.8, 0.95])
    assert lo <= mean <= hi and abs(mean - 0.9125) < 1e-9
    assert ag.bootstrap([0.5]) == (0.5, 0.5, 0.5)
    rows = [dict(prompt=i, cold=[1, 2, 3], hit=[1, 2, 3] if i else [1, 5, 6], bf16=[1, 2, 3], hit_cached=700 + i,
                 forced_hit_cached=700, cold_eq_hit=1.0 if i else 1 / 3, cold_prefix_bf16=3,
                 hit_prefix_bf16=3 if i else 1, forced_cold=1.0, forced_hit=1.0 if i else 2 / 3) for i in range(3)]
    res = dict(model_path="/m/smollm2/dense", artifact="a", device="cpu", dtype="float32", prompts=3,
               prompt_len=1024, new=3, bf16_backend="torch_native", sglang="0.5.23", wall_s=1.0, bf16_self_forced=1.0,
               rows=rows)
    md = ag.report(res, "cmd")
    assert "Free-running hit and cold completions identical: 2 of 3 prompts" in md
    assert "| teacher-forced agreement with BF16's tokens | 1.000 [1.000, 1.000] | 0.889 [" in md
    assert "| free-running: tokens equal to BF16's before the first difference (mean) | 3.0 | 2.3 | |" in md
    assert "from the cache on a hit: 700-702" in md

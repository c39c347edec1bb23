"""The selection-metric study (oscar.studies.metric) on a tiny random Llama: rank statistics, the per-problem
measurements through the decode-equivalent cache, and the summary that pairs them with pass@1."""

from __future__ import annotations

import pytest
import torch

from oscar.studies import metric


def test_ranks_average_ties_and_spearman_matches_the_closed_form():
    assert metric.ranks([3.0, 1.0, 3.0, 2.0]).tolist() == [3.5, 1.0, 3.5, 2.0]
    a, b = [1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 1.0, 4.0, 3.0, 5.0]
    d2 = sum((x - y) ** 2 for x, y in zip(a, b))
    assert metric.spearman(a, b) == pytest.approx(1 - 6 * d2 / (5 * (25 - 1)))
    assert metric.spearman(a, a[::-1]) == pytest.approx(-1.0)
    assert metric.spearman(a, [1.0] * 5) != metric.spearman(a, [1.0] * 5)  # constant side: NaN


def test_bootstrap_spearman_of_an_error_metric_that_orders_the_rows():
    g = torch.Generator().manual_seed(0)
    rates = torch.tensor([0.9, 0.6, 0.3, 0.1])
    verdicts = (torch.rand(4, 200, generator=g) < rates[:, None]).float()
    counts = torch.ones(4, 200, dtype=torch.float64)
    sums = (1.0 - rates.double())[:, None] * counts  # error falls as the pass rate rises
    subset = torch.ones(200, dtype=torch.bool)
    point, lo, hi = metric.bootstrap_spearman(verdicts, sums, counts, subset, higher_better=False, n_boot=200)
    assert point == pytest.approx(1.0)
    assert -1.0 <= lo <= hi <= 1.0 and hi == pytest.approx(1.0)
    flipped, _, _ = metric.bootstrap_spearman(verdicts, sums, counts, subset, higher_better=True, n_boot=10)
    assert flipped == pytest.approx(-1.0)


def test_parse_row_reads_windows_and_overrides():
    r = metric.parse_row("auto@16x96")
    assert (r.label, r.method, r.sink, r.recent, r.overrides) == ("auto@16x96", "auto", 16, 96, [])
    r = metric.parse_row("auto+ch32=auto,method.channel_block=32,method.recent=32,calibration=code")
    assert (r.label, r.method, r.sink, r.recent) == ("auto+ch32", "auto", 16, 32)
    assert r.overrides == ["method.channel_block=32", "calibration=code"]
    with pytest.raises(ValueError, match="SxW"):
        metric.parse_row("kivi2@16/32")


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar.config import compose
    from oscar.models.engine import Engine, rotations_in_code

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                         max_position_embeddings=512)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
    quarot = compose(["method=quarot", "method.clip=paper", "method.sink=2", "method.recent=4"]).method
    bf16 = compose(["method=bf16"]).method
    engines = {"bf16": Engine(model, None, bf16), "quarot": Engine(model, None, quarot, rotations_in_code(quarot, model))}
    rows = [metric.RowSpec("bf16", "bf16", 2, 4), metric.RowSpec("quarot", "quarot", 2, 4)]
    return model, engines, rows


def test_measure_on_the_decode_equivalent_cache(tiny, single_thread):
    model, engines, rows = tiny
    g = torch.Generator().manual_seed(1)
    long_ids = torch.randint(0, 96, (1, 40), generator=g)
    short_ids = torch.randint(0, 96, (1, 6), generator=g)  # no position reads quantized history (sink + recent = 6)
    seqs = [{"id": "p0", "ids": long_ids, "start": 15, "stop": 39}, {"id": "p1", "ids": short_ids, "start": 2, "stop": 5}]
    code = [torch.randint(0, 96, (300,), generator=g)]
    saved = []
    raw = metric.measure(model, None, rows, engines, seqs, code, save=lambda r: saved.append(len(r)))
    assert len(saved) == 3  # after each problem and each window
    b, q = raw["bf16"]["task"], raw["quarot"]["task"]
    assert b["p0"]["kl_sum"] == 0.0 and b["p0"]["top1_sum"] == b["p0"]["n"] == 24
    assert q["p0"]["kl_sum"] > 1e-4 and q["p0"]["attn"] > 1e-4 and 0 <= q["p0"]["top1_sum"] <= 24
    # decode-equivalent: a position whose history is all in the BF16 windows sees what BF16 sees
    assert q["p1"]["kl_sum"] == pytest.approx(0.0, abs=1e-9) and q["p1"]["attn"] == pytest.approx(0.0, abs=1e-12)
    assert q["p1"]["top1_sum"] == 3
    blocks = raw["quarot"]["code"]["w0"]
    assert sum(c for _, c in blocks) == 299 - 6 and all(c <= metric.BLOCK for _, c in blocks)
    assert all(s > 0 for s, _ in blocks)
    # kept measurements are not recomputed
    again = metric.measure(model, None, rows, engines, seqs, code, raw=raw, save=lambda r: saved.append(-1))
    assert again is raw and saved.count(-1) == 0


def test_summarize_pairs_metrics_with_pass_rates():
    problems = [f"P/{i}" for i in range(8)]
    subset = problems[::2]
    rows = [metric.RowSpec(x, x, 16, 64) for x in ("bf16", "good", "bad")]
    rates = {"bf16": 6, "good": 4, "bad": 1}  # problems passed, out of 8
    verdicts = {lab: {pid: {"correct": i < k, "prediction": f"{pid}-{lab if i >= k else 'ok'}"}
                      for i, pid in enumerate(problems)} for lab, k in rates.items()}
    kl = {"bf16": 0.0, "good": 0.01, "bad": 0.5}
    raw = {lab: {"task": {pid: {"kl_sum": kl[lab] * 10, "top1_sum": 10 * (1 - kl[lab]), "n": 10, "attn": kl[lab], "bits": 7.0}
                          for pid in subset},
                 "code": {"w0": [[kl[lab] * 2, 128.0], [kl[lab], 64.0]]}} for lab in rates}
    table, lines = metric.summarize(rows, raw, verdicts, problems, subset, n_boot=50)
    by = {e["row"]: e for e in table}
    assert by["good"]["pass_at_1"] == pytest.approx(0.5) and by["good"]["kl_task"] == pytest.approx(0.01)
    assert by["bad"]["kl_code2k"] == pytest.approx(1.5 / 192)
    rho = {ln["candidate"]: ln["spearman"] for ln in lines}
    assert rho["kl_task"] == pytest.approx(1.0) and rho["kl_code2k"] == pytest.approx(1.0)
    assert set(rho) == set(metric.CANDIDATES)


def _stats(seed: int = 0):
    from oscar.core.stats import CalibrationStats, attention_output

    h, hkv, t, d = 4, 2, 64, 64
    stats = CalibrationStats(1, h, hkv, d, max_samples=64)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, t, d, generator=gen, dtype=torch.float64) * torch.linspace(2.0, 0.2, d, dtype=torch.float64)
    k = torch.randn(1, hkv, t, d, generator=gen, dtype=torch.float64) * torch.linspace(0.3, 2.5, d, dtype=torch.float64) + 0.5
    v = torch.randn(1, hkv, t, d, generator=gen, dtype=torch.float64)
    stats.update(0, q, k, v, attention_output(q, k, v))
    stats.add_samples(0, k.float(), v.float())
    return stats


def test_select_by_hook_replaces_the_distortion_in_auto(single_thread):
    from oscar.core.clipfit import select_layer

    stats = _stats()
    grid = [0.8, 1.0]
    plain = select_layer(stats, 0, "key", grid, bits=2, group_size=64, channel_block=32)
    for s in plain:  # default: the least distortion, and the score is that distortion
        assert s.score == pytest.approx(min(e["distortion"] for e in s.table if bool(e.get("block")) == bool(s.candidate.block)))
    calls = []

    def select_by(layer, head, side):
        def score(cand, rho):
            calls.append((layer, head, side, cand.name, rho))
            return 0.0 if (cand.target, cand.block) == ("hadamard", 0) else 1.0
        return score

    chosen = select_layer(stats, 0, "key", grid, bits=2, group_size=64, channel_block=32, select_by=select_by)
    assert [s.candidate.target for s in chosen] == ["hadamard", "hadamard"]
    assert all(s.score == 0.0 and all("score" in e for e in s.table) for s in chosen)
    assert {c[1] for c in calls} == {0, 1} and all(c[4] in grid for c in calls)

    def per_channel(layer, head, side):
        return lambda cand, rho: 0.0 if cand.block else 1.0

    chosen = select_layer(stats, 0, "key", grid, bits=2, group_size=64, channel_block=32, select_by=per_channel)
    assert all(s.candidate.block == 32 for s in chosen)  # the layer's key format follows the score too

"""Fidelity diagnostics on a tiny random Llama: scoring modes, KL/perplexity, attention-level errors, tables."""

from __future__ import annotations

import json

import pytest
import torch

from oscar.eval import fidelity


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar.config import compose
    from oscar.models.engine import Engine, rotations_in_code

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                         max_position_embeddings=512)).eval()
    quarot = compose(["method=quarot", "method.clip=paper", "method.sink=2", "method.recent=4"]).method
    bf16 = compose(["method=bf16"]).method
    rot = rotations_in_code(quarot, model)
    return model, Engine(model, None, bf16), Engine(model, None, quarot, rot, fold_values=False), rot


def test_fake_quantize_identity_matches_quant_round_trip():
    from oscar.core import quant

    x = torch.randn(2, 10, 64)
    eye = torch.eye(64).expand(2, 64, 64)
    got = fidelity.fake_quantize(x, eye, None, None, 2, 64)
    assert torch.allclose(got, quant.dequantize(quant.quantize(x, 2, 64)), atol=1e-6)
    err2 = ((fidelity.fake_quantize(x, eye, None, None, 2, 64) - x) ** 2).mean()
    err4 = ((fidelity.fake_quantize(x, eye, None, None, 4, 64) - x) ** 2).mean()
    assert err4 < err2


def test_position_buckets_cover_the_window():
    b = fidelity.position_buckets(1000, first=64)
    assert b[0] == (0, 64) and b[-1][1] == 1000
    assert all(hi == nxt_lo for (_, hi), (nxt_lo, _) in zip(b, b[1:]))


def test_block_bootstrap_ci_brackets_the_mean():
    vals = [torch.linspace(0, 1, 256, dtype=torch.float64)]
    lo, hi = fidelity.block_bootstrap_ci(vals, block=16)
    assert lo <= 0.5 <= hi and hi - lo < 0.5


def test_serving_logits_of_bf16_match_a_full_pass(tiny):
    model, bf16, _, _ = tiny
    ids = torch.randint(0, 96, (24,))
    full = model(ids[None]).logits[0].float()
    got = fidelity.serving_logits(bf16, ids, prefill=16)
    assert got.shape == full.shape
    assert torch.allclose(got, full, atol=5e-2), float((got - full).abs().max())
    with pytest.raises(ValueError, match="prefill"):
        fidelity.serving_logits(bf16, ids, prefill=24)


def test_model_fidelity_zero_for_identical_and_positive_for_int2(tiny):
    _, bf16, quarot, _ = tiny
    windows = [torch.randint(0, 96, (32,)) for _ in range(2)]
    same, _ = fidelity.model_fidelity(bf16, bf16, windows, ["decode_equivalent"], prefill=24)
    assert same["kl.next_token.decode_equivalent"] == pytest.approx(0.0, abs=1e-9)
    assert same["ppl.decode_equivalent"] == pytest.approx(same["ppl.decode_equivalent.bf16"])
    got, curves = fidelity.model_fidelity(quarot, bf16, windows, ["serving", "decode_equivalent"], prefill=24)
    assert got["kl.next_token.decode_equivalent"] > 1e-6
    assert got["kl.next_token.serving"] > 0
    assert got["tokens.serving"] == 2 * 8 and got["tokens.decode_equivalent"] == 64
    lo, hi = got["kl.next_token.decode_equivalent.ci_lo"], got["kl.next_token.decode_equivalent.ci_hi"]
    assert lo <= got["kl.next_token.decode_equivalent"] <= hi
    assert got["kl.next_token.serving.ci_lo"] < got["kl.next_token.serving.ci_hi"]
    assert curves["serving"].shape == (8,)


def test_attention_fidelity_rows(tiny):
    model, _, _, rot = tiny
    windows = [torch.randint(0, 96, (40,))]
    rows = fidelity.attention_fidelity(model, windows, rot, bits=2, group_size=64)
    assert [r["layer"] for r in rows] == [0, 1]
    for r in rows:
        assert r["k_mse"] > 0 and r["v_mse"] > 0 and r["qk_mse"] > 0 and r["sv_mse"] > 0 and r["attn_kl"] >= 0
        assert "attn_kl@0-40" in r or "attn_kl@0-64" in r or any(k.startswith("attn_kl@") for k in r)
    rows4 = fidelity.attention_fidelity(model, windows, rot, bits=4, group_size=64)
    assert all(a["k_mse"] > b["k_mse"] for a, b in zip(rows, rows4))


def test_tables_pair_seeds_and_items(tmp_path):
    from oscar.config import compose
    from oscar.eval import runner, tables

    class Eng:
        tokenizer = None
        device = "cpu"

        def __init__(self, right):
            self.right = right

        def generate(self, prompts, **kw):  # noqa: ARG002
            return ["\\boxed{239}" if self.right else "\\boxed{0}" for _ in prompts]

    for method, right in (("bf16", True), ("quarot", False)):
        for seed in (0, 1):
            # the workflow's cell folder (ad-hoc runs without `output` go to results/adhoc, which no table reads)
            out = tmp_path / "eval" / "smollm2-135m" / method / "champ" / f"seed{seed}"
            cfg = compose([f"results_dir={tmp_path}", f"method={method}", "benchmark=champ", "benchmark.limit=3",
                           f"seed={seed}", f"output={out}"])
            runner.run_cell(cfg, Eng(right), progress=False)
    rows = tables.eval_rows(tmp_path, "smollm2-135m")
    by = {r["method"]: r for r in rows}
    assert by["quarot"]["mean"] == 0.0 and by["quarot"]["seeds"] == [0, 1]
    assert by["quarot"]["vs_baseline"]["n_pairs"] == 6
    assert by["quarot"]["vs_baseline"]["diff"] == pytest.approx(-by["bf16"]["mean"])
    text = tables.render_markdown(rows, [])
    assert "stand-in for aime25/math500" in text and "(baseline)" in text
    fid = tmp_path / "fidelity" / "smollm2-135m" / "quarot" / "paul_graham"
    fid.mkdir(parents=True)
    metrics = {"kl.next_token.decode_equivalent": 0.1, "kl.next_token.decode_equivalent.ci_lo": 0.05,
               "kl.next_token.decode_equivalent.ci_hi": 0.2, "ppl.decode_equivalent": 20.0,
               "ppl.decode_equivalent.bf16": 18.0, "tokens.decode_equivalent": 1024}
    (fid / "result.json").write_text(json.dumps({"method": "quarot", "settings": {}, "metrics": metrics}))
    assert "0.1000 [0.0500, 0.2000]" in tables.render_markdown([], tables.fidelity_rows(tmp_path, "smollm2-135m"))

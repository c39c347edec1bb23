"""lm-eval integration: the registered `oscar` model runs the local offline tasks through an OSCAR cache."""

from __future__ import annotations

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def tiny_engine():
    """A 2-layer random Llama with the SmolLM2 tokenizer (from the installed dense copy) and a QuaRot-INT2 cache."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from oscar.config import compose
    from oscar.models.engine import Engine
    from oscar.models.loading import dense_dir

    cfg = compose(["model=smollm2-135m", "method=quarot", "method.clip=paper", "method.sink=2", "method.recent=4"])
    tok_dir = dense_dir(cfg.model)
    if not (tok_dir / "tokenizer_config.json").exists():
        pytest.skip("SmolLM2 tokenizer not installed (python -m oscar install-model model=smollm2-135m)")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=64, max_position_embeddings=2048)).eval()
    return Engine(model, tokenizer, cfg.method), Engine(model, tokenizer, compose(["method=bf16"]).method)


def test_oscar_model_is_registered():
    import oscar.eval.lm_eval_model as mod
    from lm_eval.api.registry import get_model

    assert get_model("oscar") is mod.OscarLM


def test_model_call_uses_the_engine_cache(tiny_engine):
    from oscar.eval.lm_eval_model import OscarLM

    quarot, bf16 = tiny_engine
    ids = torch.randint(0, 1000, (1, 40))
    lm = OscarLM(engine=quarot, score_mode="decode_equivalent", batch_size=1)
    got = lm._model_call(ids)
    assert torch.equal(got, quarot.score(ids, mode="decode_equivalent"))
    ref = OscarLM(engine=bf16, score_mode="decode_equivalent", batch_size=1)._model_call(ids)
    assert not torch.allclose(got, ref), "INT2 cache with tiny windows must change decode-equivalent logits"
    with pytest.raises(ValueError, match="score_mode"):
        OscarLM(engine=quarot, score_mode="prefill")


@pytest.mark.slow
def test_simple_evaluate_on_local_mmlu_task(tiny_engine, tmp_path):
    from oscar.eval.lm_eval_model import OscarLM
    from oscar.eval.lm_eval_tasks import task_manager

    quarot, _ = tiny_engine
    lm = OscarLM(engine=quarot, score_mode="decode_equivalent", batch_size=2)
    tm = task_manager(tmp_path / "tasks")
    out = lm_eval.simple_evaluate(model=lm, tasks=["oscar_mmlu"], task_manager=tm, limit=4)
    acc = out["results"]["oscar_mmlu"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert len(out["samples"]["oscar_mmlu"]) == 4 if "samples" in out else True


@pytest.mark.slow
def test_generate_until_through_engine(tiny_engine, tmp_path):
    from oscar.eval.lm_eval_model import OscarLM
    from oscar.eval.lm_eval_tasks import task_manager

    quarot, _ = tiny_engine
    lm = OscarLM(engine=quarot, batch_size=2, max_length=2048)
    tm = task_manager(tmp_path / "tasks")
    out = lm_eval.simple_evaluate(model=lm, tasks=["oscar_champ"], task_manager=tm, limit=2,
                                  gen_kwargs="max_gen_toks=8")
    assert "exact_match,boxed" in out["results"]["oscar_champ"]

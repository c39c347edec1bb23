"""The best method served: an ``auto`` artifact with rope-centered keys through the plugin (SGLang Engine, CPU,
torch twins) against the embedded engine.

The model is a tiny random-weight Qwen2 whose ``k_proj`` bias is large against the key spread (as in
Qwen2.5-Coder): ``auto`` (``python -m oscar calibrate method=auto``, 128 tokens) picks rope-centered keys
(``center_k == "rope"``) for some heads, centering and per-head targets for others. Served with INT2 (S0=4,
W=8; and on 16-token pages with the prompt prefilled in chunks of 16, so that the later chunks attend over
the dequantized prefix with its offsets added back), teacher-forced along SGLang's own greedy tokens, the
embedded engine (``oscar.models.engine``, same artifact, value rotation folded) gives the same log-probabilities
within ``INT2_LOGPROB_TOL`` (median within ``INT2_MEDIAN_TOL``), the cross-engine tolerances of
docs/DESIGN.md "Cross-engine exactness": both subtract the same ``RoPE_p(m)`` from the same BF16-rounded rows
and quantize with the same twins; the float32 forwards differ in reduction order only.
"""

from __future__ import annotations

import json
import random

import pytest

from serve_helpers import check_teacher_forced, embedded_forced_logprobs, run_driver

NEW_TOKENS = 16
SINK, RECENT = 4, 8
SINK_P16 = 16
WORDS = "alpha beta gamma delta key value query cache token rotate quantize group head layer model text".split()


@pytest.fixture(scope="module")
def biased_qwen2(tmp_path_factory):
    """Tiny Qwen2 (2 layers, 4 q / 2 KV heads, head_dim 64) with k_proj biases of spread 2 (rows ~0.08 x 16)."""
    import torch
    from transformers import AutoModelForCausalLM

    from oscar.models.tiny import save_random_model

    path = save_random_model("qwen2", tmp_path_factory.mktemp("qwen2_bias"), num_heads=4, num_kv_heads=2,
                             head_dim=64, hidden_size=256)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.copy_(2.0 * torch.randn(layer.self_attn.k_proj.bias.shape, generator=gen))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def auto_artifact(biased_qwen2, tmp_path_factory):
    from oscar.commands.calibrate import run_calibrate
    from oscar.config import compose

    root = tmp_path_factory.mktemp("auto_rope")
    rng = random.Random(0)
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(rng.choice(WORDS) for _ in range(4000)))
    cfg = compose([
        "model=qwen2.5-coder-0.5b", f"model.hf_id={biased_qwen2}", "model.offline=false", "model.num_layers=2",
        "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=64", "model.hidden_size=256",
        "model.dtype=float32", "method=auto", "method.channel_block=0", "calibration.corpus=file",
        f"calibration.path={corpus}",
        "calibration.num_tokens=128", "calibration.seq_len=64", "calibration.holdout_tokens=64",
        f"results_dir={root / 'results'}", "device=cpu",
    ])
    return run_calibrate(cfg)[-1].path


def test_auto_chose_rope_centered_keys_and_more(auto_artifact):
    choices = json.loads((auto_artifact / "meta.json").read_text())["choices"]
    centers = {c["center_k"] for c in choices}
    assert "rope" in centers, [c["key_table"][:3] for c in choices]  # the path under test
    assert all(not c.get("key_block") for c in choices)  # per-token keys (method.channel_block=0)


@pytest.fixture(scope="module")
def served(biased_qwen2, auto_artifact, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto_served")
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (11, 41)]
    sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    logprobs = {"return_logprob": True, "top_logprobs_num": 2}
    common = {"model_path": str(biased_qwen2), "attention_backend": "oscar", "dtype": "float32"}
    runs = [
        {"name": "auto", "engine_args": common, "env": {"OSCAR_ARTIFACT": str(auto_artifact), "OSCAR_SINK": SINK,
                                                        "OSCAR_RECENT": RECENT},
         "input_ids": prompts, "sampling": sampling, "generate_args": logprobs},
        {"name": "auto_p16_chunked", "engine_args": {**common, "page_size": 16, "chunked_prefill_size": 16},
         "env": {"OSCAR_ARTIFACT": str(auto_artifact), "OSCAR_SINK": SINK_P16, "OSCAR_RECENT": RECENT},
         "input_ids": prompts, "sampling": sampling, "generate_args": logprobs},
    ]
    results, log = run_driver(runs, tmp)
    return results, log, prompts


@pytest.mark.parametrize("run,sink", [("auto", SINK), ("auto_p16_chunked", SINK_P16)])
def test_auto_rope_teacher_forced_agrees_with_embedded_engine(served, biased_qwen2, auto_artifact, run, sink):
    from transformers import AutoModelForCausalLM

    results, log, prompts = served
    assert "OSCAR KV pool: INT2" in log
    model = AutoModelForCausalLM.from_pretrained(str(biased_qwen2), dtype="float32").eval()
    got = results[run]
    assert [len(t) for t in got["output_ids"]] == [NEW_TOKENS] * len(prompts)
    forced = embedded_forced_logprobs(model, "auto", auto_artifact, sink, RECENT, prompts, got["output_ids"],
                                      overrides=("method.channel_block=0",))
    check_teacher_forced(got, forced)

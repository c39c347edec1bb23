"""The plugin on a tiny random-weight Llama through SGLang's offline Engine (CPU, torch twins).

- BF16-equivalent settings (sink + recent cover every position, identity artifact): the oscar backend's
  greedy tokens equal SGLang's own ``torch_native`` backend token for token. Exact: both run SDPA on the
  same BF16 rows (identity fold and identity rotations change no bit).
- The same with chunked prefill (chunks of 16 tokens): the later chunks attend over the earlier chunks'
  cached rows; still token for token (BF16 windows: the same SDPA over the same rows).
- INT2 settings (quarot artifact, S0=4, W=8, float32 model): teacher-forced along SGLang's greedy tokens,
  the embedded engine (``oscar.models.engine`` with the same artifact, value rotation folded) gives the same
  log-probabilities within ``INT2_LOGPROB_TOL`` and the same token wherever its top-2 margin exceeds twice
  that (``check_teacher_forced``). Both quantize the same BF16-rounded rows with the same twins and attend
  over the same segments; the remaining differences are float32 reduction orders (SGLang's fused qkv/MLP),
  which differ between CPUs, so token-for-token equality is not asserted.
- INT2 on SGLang pages of 16 tokens (``--page-size 16``, sink 16): the same teacher-forced agreement.
"""

from __future__ import annotations

import random

import pytest

from serve_helpers import check_teacher_forced, embedded_forced_logprobs, run_driver, save_in_code_artifact

NEW_TOKENS = 24
SINK, RECENT = 4, 8
SINK_P16 = 16  # with --page-size 16 the sink fills whole pages


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    rng = random.Random(0)
    # lengths: inside the windows, across the sink+recent boundary during decode, quantized at prefill
    return [[rng.randrange(1, 300) for _ in range(n)] for n in (5, 11, 37)]


@pytest.fixture(scope="module")
def served(tiny_llama, prompts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny_served")
    int2 = save_in_code_artifact(tiny_llama, "int2", tmp / "int2")
    quarot = save_in_code_artifact(tiny_llama, "quarot", tmp / "quarot")
    sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    common = {"model_path": str(tiny_llama)}
    runs = [
        {"name": "native", "engine_args": {**common, "attention_backend": "torch_native", "dtype": "bfloat16"},
         "input_ids": prompts, "sampling": sampling},
        {"name": "oscar_bf16eq", "engine_args": {**common, "attention_backend": "oscar", "dtype": "bfloat16"},
         "env": {"OSCAR_ARTIFACT": str(int2), "OSCAR_SINK": 64, "OSCAR_RECENT": 256},
         "input_ids": prompts, "sampling": sampling},
        {"name": "oscar_bf16eq_chunked", "engine_args": {**common, "attention_backend": "oscar", "dtype": "bfloat16",
                                                         "chunked_prefill_size": 16},
         "env": {"OSCAR_ARTIFACT": str(int2), "OSCAR_SINK": 64, "OSCAR_RECENT": 256},
         "input_ids": prompts, "sampling": sampling},
        {"name": "oscar_int2", "engine_args": {**common, "attention_backend": "oscar", "dtype": "float32"},
         "env": {"OSCAR_ARTIFACT": str(quarot), "OSCAR_SINK": SINK, "OSCAR_RECENT": RECENT},
         "input_ids": prompts, "sampling": sampling, "generate_args": {"return_logprob": True, "top_logprobs_num": 2}},
        {"name": "oscar_int2_p16", "engine_args": {**common, "attention_backend": "oscar", "dtype": "float32",
                                                   "page_size": 16},
         "env": {"OSCAR_ARTIFACT": str(quarot), "OSCAR_SINK": SINK_P16, "OSCAR_RECENT": RECENT},
         "input_ids": prompts, "sampling": sampling, "generate_args": {"return_logprob": True, "top_logprobs_num": 2}},
    ]
    results, log = run_driver(runs, tmp)
    return results, log, quarot


def test_bf16_equivalent_equals_sglang_native(served):
    results, _, _ = served
    assert results["oscar_bf16eq"]["output_ids"] == results["native"]["output_ids"]


def test_chunked_prefill_bf16_equivalent_equals_sglang_native(served):
    """The 37-token prompt is prefilled in chunks of 16: chunks 2 and 3 attend over the cached rows of the
    earlier chunks (BF16 windows here); SGLang's torch_native prefills it at once."""
    results, _, _ = served
    assert results["oscar_bf16eq_chunked"]["output_ids"] == results["native"]["output_ids"]


def test_int2_teacher_forced_agrees_with_embedded_engine(served, tiny_llama, prompts):
    from transformers import AutoModelForCausalLM

    results, _, quarot = served
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype="float32").eval()
    run = results["oscar_int2"]
    got = run["output_ids"]
    forced = embedded_forced_logprobs(model, "quarot", quarot, SINK, RECENT, prompts, got)
    check_teacher_forced(run, forced)  # a random 2-layer model is rarely decided by 2 nats: log-probabilities only
    # and the quantized cache matters here: the INT2 tokens differ from BF16 attention somewhere
    assert got != results["native"]["output_ids"]


def test_int2_on_pages_of_16_agrees_with_embedded_engine(served, tiny_llama, prompts):
    """SGLang's paged allocator (16-token pages): the kernel's page table is every 16th column of its
    req_to_token from the sink on; teacher-forced along SGLang's tokens, the embedded engine with the same
    windows gives the same log-probabilities within the measured cross-CPU tolerance (``check_teacher_forced``)."""
    from transformers import AutoModelForCausalLM

    results, _, quarot = served
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype="float32").eval()
    run = results["oscar_int2_p16"]
    forced = embedded_forced_logprobs(model, "quarot", quarot, SINK_P16, RECENT, prompts, run["output_ids"])
    check_teacher_forced(run, forced)


def test_pool_reports_int2_bytes(served, tiny_llama):
    import re

    from transformers import AutoConfig

    from oscar.cache.formats import RotatedFormat

    _, log, _ = served
    cfg = AutoConfig.from_pretrained(str(tiny_llama))
    expect = RotatedFormat(bits=2, group_size=64, recent=1).bytes_per_token(cfg.num_hidden_layers,
                                                                           cfg.num_key_value_heads, cfg.head_dim)
    lines = re.findall(r"OSCAR KV pool: INT(\d), group (\d+), sink (\d+), recent (\d+), pages of (\d+) tokens "
                       r"\(\w+ layout\): (\d+) bytes/token \(BF16 KV: (\d+), ([\d.]+)x more tokens per byte\); "
                       r"#tokens (\d+), pages (\d+) bytes", log)
    assert lines, "the pool did not log its size"
    int2 = [x for x in lines if x[0] == "2" and int(x[3]) == RECENT]  # the INT2 runs (not the BF16-equivalent)
    assert {(int(x[2]), int(x[4])) for x in int2} == {(SINK, 1), (SINK_P16, 16)}  # both INT2 runs logged
    for bits, group, sink, recent, page, bpt, bf16, ratio, tokens, held in int2:
        assert (int(group), int(recent)) == (64, RECENT)
        assert int(bpt) == expect
        assert int(bf16) == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
        assert float(ratio) > 6
        assert int(held) == (int(tokens) + int(page)) * expect  # SGLang's pages plus its padding page

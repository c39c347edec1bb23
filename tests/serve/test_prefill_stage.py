"""Chunked prefill reads the prompt as one prefill would (``OSCAR_PREFILL_STAGE_MIB``, oscar.serve.backend._Stage).

A tiny random-weight Llama (2 layers, head_dim 64) with an INT2 artifact (QuaRot, sink 4, window 8, float32 model)
on SGLang's CPU engine: a 37-token prompt prefilled at once, in chunks of 16 with the stage (the default), and in
chunks of 16 without it (``OSCAR_PREFILL_STAGE_MIB=0``: the later chunks read the earlier chunks' INT2 pages). With
the stage every chunk attends over the same BF16 rows as the one-shot prefill, so the first generated token's
log-probabilities agree up to float32 reduction order (chunked SDPA against one SDPA) and the pool receives the
same rows; without it they move by what reading INT2 costs (measured here to be far larger than the reduction
order, so the comparison has power). The 5- and 11-token prompts are one chunk in every run.
"""

from __future__ import annotations

import random

import pytest

from serve_helpers import run_driver, save_in_code_artifact

SINK, RECENT, CHUNK = 4, 8, 16
REDUCTION_TOL = 2e-3  # nats: chunked against one-shot SDPA in float32 over the same rows (measured ~1e-5)


@pytest.fixture(scope="module")
def staged(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefill_stage")
    quarot = save_in_code_artifact(tiny_llama, "quarot", tmp / "quarot")
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (5, 11, 37)]
    sampling = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    env = {"OSCAR_ARTIFACT": str(quarot), "OSCAR_SINK": SINK, "OSCAR_RECENT": RECENT}
    base = {"model_path": str(tiny_llama), "attention_backend": "oscar", "dtype": "float32"}
    logprobs = {"return_logprob": True, "top_logprobs_num": 5}
    runs = [{"name": "one_shot", "engine_args": base, "env": env, "input_ids": prompts, "sampling": sampling,
             "generate_args": logprobs},
            {"name": "chunked", "engine_args": {**base, "chunked_prefill_size": CHUNK}, "env": env,
             "input_ids": prompts, "sampling": sampling, "generate_args": logprobs},
            {"name": "chunked_no_stage", "engine_args": {**base, "chunked_prefill_size": CHUNK},
             "env": {**env, "OSCAR_PREFILL_STAGE_MIB": 0}, "input_ids": prompts, "sampling": sampling,
             "generate_args": logprobs}]
    results, _ = run_driver(runs, tmp)
    return results


def _first_top(run: dict, i: int) -> dict[int, float]:
    """Prompt i's first generated token: its top-5 as {token id: log-probability}."""
    return {int(t[1]): float(t[0]) for t in run["logprobs"][i]["output_top_logprobs"][0]}


def _gap(a: dict[int, float], b: dict[int, float]) -> float:
    common = a.keys() & b.keys()
    assert len(common) >= 3, (a, b)
    return max(abs(a[t] - b[t]) for t in common)


def test_chunked_prefill_reads_what_one_prefill_reads(staged):
    one, chunked, off = staged["one_shot"], staged["chunked"], staged["chunked_no_stage"]
    for i in (0, 1):  # one chunk in every run: the same computation
        assert _gap(_first_top(one, i), _first_top(chunked, i)) <= REDUCTION_TOL
        assert _gap(_first_top(one, i), _first_top(off, i)) <= REDUCTION_TOL
    with_stage = _gap(_first_top(one, 2), _first_top(chunked, 2))
    without = _gap(_first_top(one, 2), _first_top(off, 2))
    print(f"first-token top-5 gap to the one-shot prefill: staged {with_stage:.2e}, unstaged {without:.2e} nats")
    assert with_stage <= REDUCTION_TOL, with_stage
    assert without > 10 * REDUCTION_TOL, without  # the later chunks read INT2 pages: the test can tell

"""The plugin across ranks end to end: SGLang's offline Engine at ``--tp-size 2`` and ``--dp-size 2`` against TP=1.

A tiny random-weight Llama (4 query heads, 2 KV heads: one KV head per rank) with an artifact of seeded random
rotations per (layer, KV head) and value/key means (so a wrong head slice, a wrong fold column block or a bias
term summed wrongly over the ranks changes the outputs), INT2, sink 4 and recent 8 so that the prompts are
quantized at prefill and during decode. SGLang's CPU engine runs two scheduler processes (gloo collectives;
``cpu_tp/sitecustomize.py`` turns off the CUDA-only PyNccl groups, ``SGLANG_CPU_OMP_THREADS_BIND`` gives each rank
a core). Checks:

- each rank logs its heads and folds its own ``o_proj`` shard (the per-rank path ran);
- TP=2 and TP=1 are each teacher-forced against the embedded engine (the unsharded computation, same artifact,
  value rotation folded) within the INT2 tolerances of ``check_teacher_forced``;
- TP=2 against TP=1 directly: along their common greedy prefix the log-probabilities SGLang reports agree within
  ``INT2_LOGPROB_TOL`` (two INT2 forwards whose float32 reduction orders differ: the row-parallel all-reduce sums
  two partial products), and a token differs only where TP=1's top-2 margin is within twice that;
- DP=2 (two replicas, each with its own pool; the requests split between them) against TP=1 the same way, and the
  sizing log states the tokens per replica.

Three engine start-ups of SGLang, two of them with two processes, on the shared CPU: slow. ``OSCAR_TP_DEVICE=cuda`` runs the same
engines on two GPUs (BF16 model, pages of 16, sink and recent 16, decode CUDA graphs; the embedded comparison is
skipped there: the float32 embedded engine against a BF16 model is the GPU correctness report's business).
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest
import torch

from serve_helpers import INT2_LOGPROB_TOL, INT2_MEDIAN_TOL, check_teacher_forced, run_driver

pytestmark = pytest.mark.slow

DEVICE = os.environ.get("OSCAR_TP_DEVICE", "cpu")
NEW_TOKENS = 12
SINK, RECENT = (4, 8) if DEVICE == "cpu" else (16, 16)
SHIM = Path(__file__).with_name("cpu_tp")


def _random_artifact(model_dir: Path, out: Path) -> Path:
    """Seeded random orthogonal R_K, R_V per (layer, KV head), nonzero means, INT2, one group per row."""
    from transformers import AutoConfig

    from oscar.core.artifact import CalibrationArtifact, build_meta, config_hash_of, model_config_fields, save_artifact
    from oscar.core.rotation import random_orthogonal

    hf = AutoConfig.from_pretrained(str(model_dir))
    f = model_config_fields(hf)
    L, hkv, d = f["num_layers"], f["num_kv_heads"], f["head_dim"]
    gen = torch.Generator().manual_seed(0)
    rots = lambda layer, extra: torch.stack([random_orthogonal(d, seed=100 * layer + 10 * h + extra)  # noqa: E731
                                             for h in range(hkv)]).float()
    art = CalibrationArtifact(
        R_K=[rots(layer, 0) for layer in range(L)], R_V=[rots(layer, 5) for layer in range(L)],
        mu_K=[0.1 * torch.randn(hkv, d, generator=gen) for _ in range(L)],
        mu_V=[0.1 * torch.randn(hkv, d, generator=gen) for _ in range(L)],
        rho_K=[torch.ones(hkv) for _ in range(L)], rho_V=[torch.ones(hkv) for _ in range(L)],
        meta=build_meta(method={"name": "tp-test-random", "kind": "rotated", "bits": 2, "group_size": d, "sink": SINK,
                                "recent": RECENT}, model_id=str(model_dir),
                        config_hash=config_hash_of(hf), num_layers=L, num_kv_heads=hkv, head_dim=d, group_size=d,
                        bits=2))
    save_artifact(art, str(out))
    return out


def _embedded_forced(model_dir: Path, artifact: Path, prompts: list[list[int]], forced: list[list[int]]) -> list:
    """Teacher-forced log-probabilities of the embedded engine (unsharded, value rotation folded)."""
    from transformers import AutoModelForCausalLM

    from oscar.config import compose
    from oscar.core.artifact import load_artifact
    from oscar.models.engine import Engine, layer_rotations
    from oscar.models.generate import forced_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    cfg = compose(["method=quarot", "method.clip=paper", f"method.sink={SINK}", f"method.recent={RECENT}"])
    rotations = layer_rotations(load_artifact(artifact, model=model))
    engine = Engine(model, None, cfg.method, rotations, fold_values=True)
    try:
        return [forced_logprobs(model, ids, toks, engine.new_cache) for ids, toks in zip(prompts, forced)]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_served")
    artifact = _random_artifact(tiny_llama, tmp / "random")
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (6, 29)]
    sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    env = {"OSCAR_ARTIFACT": str(artifact), "OSCAR_SINK": SINK, "OSCAR_RECENT": RECENT}
    common = {"model_path": str(tiny_llama), "attention_backend": "oscar", "dtype": "float32"}
    tp2_env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "PYTHONPATH": f"{SHIM}:{Path(__file__).resolve().parents[2]}"}
    if DEVICE == "cuda":
        env["SGLANG_USE_CPU_ENGINE"] = "0"
        common.update(device="cuda", dtype="bfloat16", page_size=16, disable_cuda_graph=False,
                      disable_prefill_cuda_graph=True)
        tp2_env = {}
    logprobs = {"return_logprob": True, "top_logprobs_num": 2}
    runs = [
        {"name": "tp1", "engine_args": common, "env": env, "input_ids": prompts, "sampling": sampling,
         "generate_args": logprobs},
        {"name": "tp2", "engine_args": {**common, "tp_size": 2}, "input_ids": prompts, "sampling": sampling,
         "env": {**env, **tp2_env}, "generate_args": logprobs},
        {"name": "dp2", "engine_args": {**common, "dp_size": 2}, "input_ids": prompts, "sampling": sampling,
         "env": {**env, **tp2_env}, "generate_args": logprobs},
    ]
    results, log = run_driver(runs, tmp)
    return results, log, artifact, prompts


def test_each_rank_cuts_its_state_and_folds_its_shard(served):
    _, log, _, _ = served
    for rank, heads in ((0, "query heads 0..1 of 4, KV heads 0..0 of 2"), (1, "query heads 2..3 of 4, KV heads 1..1 of 2")):
        assert re.search(rf"TP{rank}\] OSCAR: value rotation folded into o_proj of 2 layers \(TP rank {rank} of 2: "
                         rf"{re.escape(heads)}\)", log), heads
    assert "tokens per replica" in log and "--dp-size 2: 2 replica(s), each with its own pool" in log


def test_tp2_and_tp1_teacher_forced_against_the_unsharded_engine(served, tiny_llama):
    if DEVICE != "cpu":
        pytest.skip("BF16 model on the GPU; the float32 embedded engine is compared in reports/serving/gpu_correctness")
    results, _, artifact, prompts = served
    for name in ("tp1", "tp2"):
        forced = _embedded_forced(tiny_llama, artifact, prompts, results[name]["output_ids"])
        worst, median, decided = check_teacher_forced(results[name], forced)
        print(f"{name} vs embedded: largest {worst:.2e} nats, median {median:.2e}, {decided} decided steps")


@pytest.mark.parametrize("name", ["tp2", "dp2"])
def test_against_tp1(served, name):
    """Along the common greedy prefix: every reported log-probability within ``INT2_LOGPROB_TOL``, the median of
    the per-step largest difference within ``INT2_MEDIAN_TOL`` (on this model a rank's bias term left out of the
    sum moves the per-step largest difference by 1.5 nats in the median, a rank folded with the other KV head's
    ``R_V`` by 2.3: measured with the embedded engine, reports/serving/tp2.md)."""
    import statistics

    results, _, _, _ = served
    per_step = []
    for p, (a, b) in enumerate(zip(results["tp1"]["logprobs"], results[name]["logprobs"])):
        toks1, toks2 = results["tp1"]["output_ids"][p], results[name]["output_ids"][p]
        for i, (t1, t2) in enumerate(zip(toks1, toks2)):
            top1 = {int(e[1]): float(e[0]) for e in a["output_top_logprobs"][i]}
            top2 = {int(e[1]): float(e[0]) for e in b["output_top_logprobs"][i]}
            top1[t1], top2[t2] = float(a["output_token_logprobs"][i][0]), float(b["output_token_logprobs"][i][0])
            diffs = [abs(top1[tok] - top2[tok]) for tok in set(top1) & set(top2)]
            assert diffs and max(diffs) <= INT2_LOGPROB_TOL, (p, i, top1, top2)
            per_step.append(max(diffs))
            if t1 != t2:  # the runs part ways: allowed only where TP=1 itself was nearly undecided
                values = sorted(top1.values(), reverse=True)
                assert values[0] - values[1] <= 2 * INT2_LOGPROB_TOL, (p, i, top1, top2)
                break
    assert len(per_step) >= 2 and statistics.median(per_step) <= INT2_MEDIAN_TOL, per_step
    print(f"{name} vs tp1: {len(per_step)} steps, largest {max(per_step):.2e} nats, median {statistics.median(per_step):.2e}")

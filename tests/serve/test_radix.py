"""The radix (prefix) cache with quantized pages: reuse, the windows across a hit, the sink store's memory (CPU).

Without an engine (the pool and backend on SGLang pages of 16 tokens, the torch twins):

- A request that hits a prefix another request computed (its request slot changed hands: SGLang's
  ``req_generation``) gets exactly the donor's BF16 sink rows from the sink store, its own rows in the ring
  (the match is capped so that the extend covers the window), reads the donor's quantized pages for the rest
  of the prefix, and its extend output is attention over exactly those rows (float reduction order only).
- The sink store's rows return when SGLang's own allocator frees the pages, in every way it frees them
  (``free``, ``free_segment``, a deferred free group, ``clear``), through the plugin's hooks: no leak.
- The match cap leaves the last ``W`` prompt tokens to compute (and is inert without the oscar backend); the
  sink store exists only with the radix cache on, sized as pool sizing reserves it.

Through SGLang's offline Engine with the radix cache on (tiny random Llama, ``--page-size 16``), a first
round leaves its prompt in the tree, a second round hits it (the log's ``#cached-token``):

- BF16-equivalent windows (identity artifact, sink + recent cover every position, chunked prefill of 32):
  the hits reuse 48 cached sink tokens and give SGLang ``torch_native``'s greedy tokens for each prompt
  computed alone (the same BF16 rows in the same positions; as the chunked-prefill test, float32/BF16
  reduction orders of other extend shapes are within the margins here).
- INT2 (quarot, S0 = W = 16): every request, hit or not, agrees with the embedded engine computing it alone
  within the teacher-forced tolerances (``check_teacher_forced``). A hit's extend attends over the cached
  prefix as the cache holds it (quantized past the sink) where a prefill alone sees BF16 rows; measured here
  0.21 nats at most, median 0.048 (the donor: 2e-6).
"""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest
import torch

from serve_helpers import check_teacher_forced, embedded_forced_logprobs, run_driver, save_in_code_artifact
from test_pool_paged import D, H, HKV, PAGE, _backend, _extend, _history, _req_to_token, _state

# -- without an engine -------------------------------------------------------------------------------


def _prefix_pool(sink: int, recent: int):
    """The pool of ``test_pool_paged`` with the radix cache on (its sink store allocated)."""
    from oscar.serve.pool import OscarTokenToKVPool

    state = {**_state(sink, recent), "prefix_cache": True}
    pool = OscarTokenToKVPool(512, PAGE, torch.bfloat16, HKV, D, 1, "cpu", False, oscar_state=state)
    pool.bind_requests(4)
    return pool


def _layer():
    return SimpleNamespace(layer_id=0, tp_q_head_num=H, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                           scaling=D**-0.5, sliding_window_size=-1, logit_cap=0)


def test_hit_gets_the_donors_sink_its_own_ring_and_the_cached_pages():
    gen = torch.Generator().manual_seed(5)
    S0, W, shared, n_donor, n_new = 32, 16, 64, 80, 26  # the hit extends 26 >= W tokens
    pool = _prefix_pool(S0, W)
    assert pool.sink_store_nbytes() > 0 and pool.sink_pages_in_use() == 0
    r2t = _req_to_token({1: n_donor, 2: shared + n_new})
    r2t[2, :shared] = r2t[1, :shared]  # the hit's row points at the donor's cached pages
    be = _backend(pool, r2t)
    be.req_to_token_pool.req_generation = torch.tensor([0, 1, 1, 0])
    layer = _layer()
    q = torch.randn(n_donor + n_new, H * D, generator=gen).to(torch.bfloat16)
    k, v = (t.reshape(-1, HKV * D) for t in _history(n_donor + n_new, gen))
    _extend(be, layer, q[:n_donor], k[:n_donor], v[:n_donor], 1, 0, n_donor, r2t)
    assert pool.store_sink(r2t, 1, n_donor) == S0 // PAGE  # the tree takes the donor's pages
    assert pool.store_sink(r2t, 1, n_donor) == 0  # already held
    donor_k, donor_v = pool.cached_rows(0, r2t, 1, shared, ring=False)
    # slot 2 was another request's: its windows hold garbage for this one
    pool.win_k[0][2].fill_(7.0)
    pool.win_v[0][2].fill_(-7.0)
    pool.slot_generation[2] = 0
    ks, vs = k[n_donor:], v[n_donor:]
    out = _extend(be, layer, q[n_donor:], ks, vs, 2, shared, n_new, r2t).float()
    assert be.meta.hit == [True]
    L = shared + n_new
    ck, cv = pool.cached_rows(0, r2t, 2, L)
    # exact: the donor's BF16 sink rows, the request's own BF16 ring rows
    assert torch.equal(ck[:, :S0], k[:S0].reshape(-1, HKV, D).transpose(0, 1).float())
    assert torch.equal(cv[:, :S0], v[:S0].reshape(-1, HKV, D).transpose(0, 1).float())
    own_k = ks.reshape(-1, HKV, D).transpose(0, 1).float()
    assert torch.equal(ck[:, L - W :], own_k[:, n_new - W :])
    # the shared quantized rows are the donor's pages (exact: the same codes, dequantized the same way)
    assert torch.equal(ck[:, S0:shared], donor_k[:, S0:shared])
    # the extend attends over: donor sink (BF16), donor pages (dequantized), its own rows (causal)
    keys = torch.cat([donor_k, own_k], dim=1)
    vals = torch.cat([donor_v, vs.reshape(-1, HKV, D).transpose(0, 1).float()], dim=1)
    qs = q[n_donor:].float().reshape(-1, HKV, H // HKV, D)
    mask = torch.ones(n_new, L, dtype=torch.bool).tril(shared)
    s = torch.einsum("nhrd,htd->nhrt", qs, keys) * D**-0.5
    ref = torch.einsum("nhrt,htd->nhrd", torch.softmax(s.masked_fill(~mask[:, None, None, :], float("-inf")), -1),
                       vals).reshape(n_new, H * D)
    rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 2e-2, rel  # bf16 outputs
    # a later chunk of the same request (same slot, same generation) is not a hit
    be.init_forward_metadata(SimpleNamespace(
        forward_mode=SimpleNamespace(is_decode=lambda: False, is_idle=lambda: False),
        req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([L + 1]), seq_lens_cpu=torch.tensor([L + 1]),
        extend_seq_lens_cpu=[1], extend_prefix_lens_cpu=[L], out_cache_loc=r2t[2, L : L + 1].long()))
    assert be.meta.hit == [False]


def test_sink_store_rows_return_with_sglangs_allocator_frees():
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.plugins.hook_registry import HookRegistry

    from oscar.serve import plugin

    plugin.register()
    HookRegistry.apply_hooks()
    pool = _prefix_pool(32, 16)
    alloc = PagedTokenToKVPoolAllocator(pool.size, PAGE, torch.bfloat16, "cpu", pool, False)
    total = len(pool._sink_free)
    rows = torch.zeros(4, 256, dtype=torch.int64)
    for r in range(4):
        rows[r, :96] = alloc.alloc(96)
        pool.win_k[0][r].normal_()
        assert pool.store_sink(rows, r, 96) == 2
    assert pool.sink_pages_in_use() == 8
    alloc.free(rows[0, :96])  # plain free
    assert pool.sink_pages_in_use() == 6
    alloc.free_group_begin()  # a deferred group: released at its end
    alloc.free_segment(rows[1, :96], start_pos=0)
    alloc.free(rows[2, 32:96])  # pages past the sink: nothing to release
    alloc.free_group_end()
    assert pool.sink_pages_in_use() == 4
    alloc.free(rows[2, :32])
    assert pool.sink_pages_in_use() == 2
    again = alloc.alloc(64)  # the freed pages come back to a new request; its sink is stored again
    pool.slot_generation[0] = 1  # (its extend recorded the slot's new generation)
    assert pool.store_sink(again[None], 0, 64) == 2 and pool.sink_pages_in_use() == 4
    alloc.clear()  # SGLang's flush_cache
    assert pool.sink_pages_in_use() == 0 and len(pool._sink_free) == total


# -- through SGLang's Engine ---------------------------------------------------------------------------

NEW = 24


@pytest.fixture(scope="module")
def radix_served(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("radix_served")
    int2 = save_in_code_artifact(tiny_llama, "int2", tmp / "int2")
    quarot = save_in_code_artifact(tiny_llama, "quarot", tmp / "quarot")
    rng = random.Random(1)
    tok = lambda n: [rng.randrange(1, 300) for _ in range(n)]  # noqa: E731
    bf_prefix, q_prefix = tok(64), tok(96)
    bf = [bf_prefix + tok(26) for _ in range(3)]  # 90 + 24 new <= S0 + W = 128: BF16 windows cover
    q = [q_prefix + tok(20) for _ in range(3)]
    sampling = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    radix = {"model_path": str(tiny_llama), "attention_backend": "oscar", "page_size": 16,
             "disable_radix_cache": False}
    runs = [
        {"name": "native", "engine_args": {"model_path": str(tiny_llama), "attention_backend": "torch_native",
                                           "dtype": "bfloat16"}, "input_ids": bf, "sampling": sampling},
        {"name": "bf16eq", "engine_args": {**radix, "dtype": "bfloat16", "chunked_prefill_size": 32},
         "env": {"OSCAR_ARTIFACT": str(int2), "OSCAR_SINK": 96, "OSCAR_RECENT": 32, "OSCAR_PREFIX_REUSE": "quantized"},
         "rounds": [bf[:1], bf[1:]], "sampling": sampling},
        {"name": "int2", "engine_args": {**radix, "dtype": "float32"},
         "env": {"OSCAR_ARTIFACT": str(quarot), "OSCAR_SINK": 16, "OSCAR_RECENT": 16, "OSCAR_PREFIX_REUSE": "quantized"},
         "rounds": [q[:1], q[1:]], "sampling": sampling,
         "generate_args": {"return_logprob": True, "top_logprobs_num": 2}},
        # the default reuse (exact): the same prompts hit only the 16-token sink; teacher-forced as the cold run
        {"name": "int2_exact", "engine_args": {**radix, "dtype": "float32"},
         "env": {"OSCAR_ARTIFACT": str(quarot), "OSCAR_SINK": 16, "OSCAR_RECENT": 16},
         "rounds": [q[:1], q[1:]], "sampling": sampling,
         "generate_args": {"return_logprob": True, "top_logprobs_num": 2}},
    ]
    results, log = run_driver(runs, tmp)
    return results, log, quarot, q


def _cached_tokens(log: str) -> list[int]:
    return [int(x) for x in re.findall(r"#cached-token: (\d+)", log)]


def test_bf16_equivalent_hits_equal_sglang_native_alone(radix_served):
    results, log, _, _ = radix_served
    # 90-token prompts, window 32: a hit is capped at 90 - 32 = 58 -> 48 (whole pages), all sink
    assert 2 * 48 in _cached_tokens(log) or _cached_tokens(log).count(48) >= 2, _cached_tokens(log)
    assert results["bf16eq"]["output_ids"] == results["native"]["output_ids"]


def test_int2_hits_agree_with_the_embedded_engine_alone(radix_served, tiny_llama):
    from transformers import AutoModelForCausalLM

    results, log, quarot, prompts = radix_served
    assert 2 * 96 in _cached_tokens(log), _cached_tokens(log)  # both hit the whole 96-token prefix
    run = results["int2"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype="float32").eval()
    forced = embedded_forced_logprobs(model, "quarot", quarot, 16, 16, prompts, run["output_ids"])
    check_teacher_forced(run, forced)
    assert "sink store of the prefix cache grew" not in log


def test_exact_reuse_hits_only_the_sink_and_agrees_with_the_embedded_engine(radix_served, tiny_llama):
    """The default reuse (exact): the second round hits only the 16-token BF16 sink of the cached 96-token prefix, so
    its extend reads what a cold prefill reads; teacher-forced against the embedded engine (each prompt alone, cold)
    within the same bounds as the quantized hits."""
    from transformers import AutoModelForCausalLM

    results, _, quarot, prompts = radix_served
    exact, quantized = results["int2_exact"], results["int2"]
    assert exact["cached_tokens"] == [0, 16, 16], exact["cached_tokens"]  # the first round is cold
    assert quantized["cached_tokens"] == [0, 96, 96], quantized["cached_tokens"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype="float32").eval()
    check_teacher_forced(exact, embedded_forced_logprobs(model, "quarot", quarot, 16, 16, prompts, exact["output_ids"]))


@pytest.mark.parametrize("reuse", ["quantized", "exact"])
def test_match_cap_leaves_the_recent_window_to_compute(monkeypatch, reuse):
    from oscar.serve import plugin, state
    from oscar.serve.settings import ServeSettings

    settings = ServeSettings.from_env({"OSCAR_ARTIFACT": "/a", "OSCAR_PREFIX_REUSE": reuse})
    monkeypatch.setattr(state, "_STATE", {**_state(16, 48), "settings": settings})
    state.set_active(True)
    try:
        # SGLang's own cap was input_len - 1; quantized: every cached page up to the recent window; exact: the sink
        # (16 tokens, BF16 in the sink store), so that the hit's extend reads what a cold prefill reads
        assert plugin.cap_prefix_after(199, None, 200) == (200 - 48 if reuse == "quantized" else 16)
        assert plugin.cap_prefix_after(10, None, 200) == 10  # a tighter cap of SGLang's (logprob_start_len) stays
        assert plugin.cap_prefix_after(30, None, 40) == 0  # a prompt shorter than the window: no reuse
    finally:
        state.set_active(False)
    assert plugin.cap_prefix_after(199, None, 200) == 199  # inert without --attention-backend oscar


def test_prefix_reuse_setting_defaults_to_exact_and_refuses_others_by_name():
    from oscar.serve.settings import OscarServeError, ServeSettings

    assert ServeSettings.from_env({"OSCAR_ARTIFACT": "/a"}).prefix_reuse == "exact"
    assert ServeSettings.from_env({"OSCAR_ARTIFACT": "/a", "OSCAR_PREFIX_REUSE": "quantized"}).prefix_reuse == "quantized"
    with pytest.raises(OscarServeError, match=r"OSCAR_PREFIX_REUSE='int2' is not valid; choose one of exact, quantized"):
        ServeSettings.from_env({"OSCAR_ARTIFACT": "/a", "OSCAR_PREFIX_REUSE": "int2"})


def test_sink_store_only_with_the_radix_cache():
    from oscar.serve.pool import OscarTokenToKVPool, sink_store_pages

    with_radix = _prefix_pool(32, 16)
    assert len(with_radix._sink_free) == sink_store_pages(4, 32, PAGE) == 2 * 4 * 2
    assert with_radix.sink_store_nbytes() == 2 * 4 * 2 * HKV * PAGE * D * 2 * 2  # pages x K,V x bf16, one layer
    off = OscarTokenToKVPool(512, PAGE, torch.bfloat16, HKV, D, 1, "cpu", False, oscar_state=_state(32, 16))
    off.bind_requests(4)
    assert off.sink_store_nbytes() == 0 and off.store_sink(torch.zeros(4, 64, dtype=torch.int64), 0, 64) == 0

"""Continuous batching through the OSCAR cache: rows join (`batch_extend`) and leave (`batch_select_indices`)
a running cache, and `generate_continuous` schedules requests over it.

What is exact and what is not: a row's stored tokens, lengths and windows are exact (same inputs, same
arithmetic); its logits are computed in other batch shapes than the same request alone, so float sums
may round differently and the INT2 codes of a K/V row can flip by one step where a value sits on a
rounding edge. Logits are therefore compared within a measured tolerance, and tokens only where the
request's own top-2 margin is large.
"""

from __future__ import annotations

import pytest
import torch

from oscar.cache.attention import enable
from oscar.cache.torch_cache import spec_for_model
from oscar.models.engine import new_cache
from oscar.models.generate import SamplingParams, generate_continuous, generate_tokens

from test_cache import random_rotations, tiny_llama

KINDS = ("rotated", "bf16", "kivi", "turboquant")
# Largest |logit difference| of a row decoded in a merged / shrunk batch against the same request alone,
# over the 4 kinds x 3 requests x 7 steps below (logits of magnitude ~1): measured 1.4e-6 (fp32 tiny
# Llama, every kind; no INT2 code flipped). 1e-4 leaves room for another CPU's reduction order, and is far
# below what one wrong row would cost (a misplaced or missing row moves these logits by > 1e-2).
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    m = tiny_llama()
    enable(m)
    return m


def _spec(model, kind: str):
    kw = dict(kind=kind, sink=2, recent=4, group_size=8, page_size=4)
    if kind == "rotated":
        kw["rotations"] = random_rotations(model)
    if kind == "kivi":
        kw["sink"] = 0
    return spec_for_model(model, **kw)


def _alone(model, spec, prompt: list[int], teacher: list[int]) -> torch.Tensor:
    """Last-position logits of the prefill and of each teacher-forced decode step, one request alone."""
    cache = new_cache(model, spec)
    with torch.no_grad():
        out = [model(torch.tensor([prompt]), cache=cache).logits[0, -1]]
        for i, t in enumerate(teacher):
            pos = torch.tensor([[len(prompt) + i]])
            out.append(model(torch.tensor([[t]]), position_ids=pos, cache=cache).logits[0, -1])
    return torch.stack(out)


def _prefill(model, spec, prompts: list[list[int]]):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = new_cache(model, spec)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=pos, cache=cache).logits[:, -1]
    return cache, logits


def _step(model, cache, tokens: list[int], positions: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(tokens)[:, None], position_ids=torch.tensor(positions)[:, None], cache=cache).logits[:, -1]


@pytest.mark.parametrize("kind", KINDS)
def test_rows_that_join_and_leave_decode_like_the_request_alone(model, kind: str) -> None:
    """Requests 0 and 1 start together, request 2 joins after 3 steps, request 1 leaves after 5: every row's
    logits at every step match the same request decoded alone, and its stored tokens are exact."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (13, 5, 9)]
    teacher = [torch.randint(3, 96, (7,), generator=gen).tolist() for _ in prompts]
    spec = _spec(model, kind)
    ref = [_alone(model, spec, p, t) for p, t in zip(prompts, teacher)]

    cache, logits = _prefill(model, spec, prompts[:2])
    got = {0: [logits[0]], 1: [logits[1]], 2: []}
    rows, step = [0, 1], {0: 0, 1: 0}
    for k in range(7):
        if k == 3:  # request 2 joins: its own prefill, merged into the running cache
            fresh, lg = _prefill(model, spec, prompts[2:])
            cache.batch_extend(fresh)
            rows.append(2)
            step[2] = 0
            got[2].append(lg[0])
        if k == 5:  # request 1 leaves
            cache.batch_select_indices(torch.tensor([r for r, q in enumerate(rows) if q != 1]))
            rows.remove(1)
        toks = [teacher[q][step[q]] for q in rows]
        pos = [len(prompts[q]) + step[q] for q in rows]
        lg = _step(model, cache, toks, pos)
        for r, q in enumerate(rows):
            step[q] += 1
            got[q].append(lg[r])
    for q in range(3):
        mine = torch.stack(got[q])
        assert (mine - ref[q][: len(mine)]).abs().max() < LOGIT_TOL, (kind, q)
    expect = {0: len(prompts[0]) + 7, 2: len(prompts[2]) + 4}  # request 2 joined late and had 4 steps
    for layer in cache.layers:
        assert layer.batch == 2 and layer.lengths() == [expect[0], expect[2]]


def test_a_merged_row_keeps_its_own_windows_and_pages(model) -> None:
    """After a merge and a selection, each row's sink, recent window and INT pages are exactly those of the
    request alone (the same rows, in the same order: stored bits are equal, not close)."""
    spec = _spec(model, "rotated")
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randint(3, 96, (n,), generator=gen).tolist() for n in (21, 11))
    big, _ = _prefill(model, spec, [a])
    small, _ = _prefill(model, spec, [b])
    big.batch_extend(small)
    big.batch_select_indices([1, 0])
    alone, _ = _prefill(model, spec, [b])
    for merged, ref in zip(big.layers, alone.layers):
        assert merged.sink_len[0] == ref.sink_len[0] and merged.recent_len[0] == ref.recent_len[0]
        assert torch.equal(merged.sink_k[0], ref.sink_k[0]) and torch.equal(merged.recent_v[0, :, :4], ref.recent_v[0, :, :4])
        for ms, rs in ((merged.k_store, ref.k_store), (merged.v_store, ref.v_store)):
            assert ms.lengths[0] == rs.lengths[0]
            mine = ms.codes[ms.pages[0]]
            assert torch.equal(mine, rs.codes[rs.pages[0]]) and torch.equal(ms.scale[ms.pages[0]], rs.scale[rs.pages[0]])
        assert merged.k_store.num_pages == sum(len(p) for p in merged.k_store.pages)  # freed pages are compacted
    assert big.bits_per_element([0]) == pytest.approx(alone.bits_per_element())


def test_row_operations_refuse_bad_input(model) -> None:
    spec = _spec(model, "rotated")
    cache, _ = _prefill(model, spec, [[5, 6, 7]])
    with pytest.raises(ValueError, match=r"row indices \[3\]"):
        cache.batch_select_indices([3])
    other, _ = _prefill(model, _spec(model, "bf16"), [[5, 6, 7]])
    with pytest.raises(ValueError, match="cannot merge"):
        cache.batch_extend(other)
    with pytest.raises(ValueError, match="max_batch=0"):
        generate_continuous(model, [[5]], SamplingParams(max_new_tokens=2), lambda: new_cache(model, spec), max_batch=0)


@pytest.mark.parametrize("kind", ("rotated", "kivi"))
def test_continuous_generation_matches_each_request_alone(model, kind: str) -> None:
    """Seven requests through 3 slots (rows leave at EOS, new ones join): each request's tokens are its
    greedy tokens alone wherever its own top-2 margin is clear of the measured logit noise; `on_done` reports
    every request once with its tokens and measured bits; one slot is the same arithmetic as alone: equal."""
    spec = _spec(model, kind)
    factory = lambda: new_cache(model, spec)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (int(n),), generator=gen).tolist() for n in torch.randint(2, 20, (7,), generator=gen)]
    params = SamplingParams(max_new_tokens=12)
    eos = [7]
    done: dict[int, tuple[list[int], dict]] = {}
    out = generate_continuous(model, prompts, params, factory, eos_token_ids=eos, max_batch=3,
                              on_done=lambda i, t, info: done.__setitem__(i, (list(t), info)))
    assert sorted(done) == list(range(7)) and all(done[i][0] == out[i] for i in done)
    assert all(0 < info["kv_bits_per_element"] <= 16 * 4 for _, info in done.values())  # pages are allocated whole
    compared = 0
    for prompt, mine in zip(prompts, out):
        alone = generate_tokens(model, [prompt], params, factory, eos_token_ids=eos)[0]
        ref = _alone(model, spec, prompt, alone)
        top2 = ref.topk(2, dim=-1).values
        for i, (x, y) in enumerate(zip(mine + [eos[0]], alone + [eos[0]])):
            if top2[i, 0] - top2[i, 1] < 10 * LOGIT_TOL:
                break  # a near tie: the request alone could take either token; stop comparing it
            assert x == y
            compared += 1
    assert compared >= 40
    one = generate_continuous(model, prompts[:3], params, factory, eos_token_ids=eos, max_batch=1)
    assert one == [generate_tokens(model, [p], params, factory, eos_token_ids=eos)[0] for p in prompts[:3]]


def test_sampling_follows_one_generator_per_request(model) -> None:
    """A request's sampled tokens come from its own seeded generator: the same request alone at index 0 and
    first in a batch of three, with one slot, draws the same tokens (same arithmetic); another seed differs."""
    spec = _spec(model, "rotated")
    factory = lambda: new_cache(model, spec)  # noqa: E731
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=4)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    a = generate_continuous(model, prompts, params, factory, max_batch=1)
    b = generate_continuous(model, prompts[:1], params, factory, max_batch=1)
    c = generate_continuous(model, prompts[:1], SamplingParams(max_new_tokens=10, temperature=1.0, seed=5), factory)
    assert a[0] == b[0] and a[0] != c[0]

"""The teacher-forced comparison of the correctness table: the batched forced log-probabilities."""

from __future__ import annotations

import torch

from oscar.bench.serve_compare import forced_logprobs_batch
from oscar.cache.attention import enable
from oscar.cache.torch_cache import spec_for_model
from oscar.models.engine import new_cache
from oscar.models.generate import forced_logprobs

from test_cache import random_rotations, tiny_llama


def test_batched_forced_logprobs_equal_one_prompt_at_a_time_to_rounding() -> None:
    """All prompts left-padded in one batch, one forward per step, against `forced_logprobs` prompt by prompt
    through an INT2 cache whose quantized segment is reached at prefill and by demotion (sink 2, recent 4):
    the same arithmetic in another batch shape, so within float32 rounding (measured: 9.5e-7 at most, 2026-12-03)
    except where a rounding difference flips an INT2 code (then one step may part: 90% of steps are required);
    forced tokens of unequal lengths keep their own rows."""
    model = tiny_llama()
    enable(model)
    rots = random_rotations(model)
    factory = lambda: new_cache(model, spec_for_model(model, kind="rotated", rotations=rots, sink=2, recent=4,  # noqa: E731
                                                      group_size=8))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (11, 3, 7)]
    tokens = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (9, 9, 5)]
    batched = forced_logprobs_batch(model, prompts, tokens, factory)
    assert [tuple(b.shape) for b in batched] == [(9, 96), (9, 96), (5, 96)]
    diffs = torch.cat([(b - forced_logprobs(model, p, t, factory)).abs().amax(-1)
                       for b, p, t in zip(batched, prompts, tokens)])
    assert float(diffs.median()) < 1e-4, diffs
    assert float((diffs < 1e-4).float().mean()) >= 0.9, diffs

"""Segment attention math: LSE merge, rotated-frame INT segment, the registered "oscar" attention."""

from __future__ import annotations

import pytest
import torch

from oscar.cache.attention import (
    group_queries,
    int_segment,
    merge_segments,
    oscar_mask,
    rotate_per_kv_head,
    segment_attention,
    ungroup,
)
from oscar.core.rotation import random_orthogonal


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain softmax attention with repeated KV heads, `q` `[B, H, n, d]`."""
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    p = torch.softmax(q @ kr.transpose(-1, -2) * scale, dim=-1)
    return p @ vr


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_split_segments_merge_to_full_attention(heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    b, n, length, d = 2, 3, 37, 16
    q = torch.randn(b, heads, n, d, dtype=torch.float64)
    k = torch.randn(b, kv_heads, length, d, dtype=torch.float64)
    v = torch.randn(b, kv_heads, length, d, dtype=torch.float64)
    scale = d**-0.5
    qg = group_queries(q, kv_heads)
    parts = [segment_attention(qg, k[:, :, a:e], v[:, :, a:e], None, scale) for a, e in ((0, 5), (5, 11), (11, length))]
    out = ungroup(merge_segments(parts))
    torch.testing.assert_close(out, _reference(q, k, v, scale), rtol=1e-12, atol=1e-12)


def test_empty_segment_contributes_nothing() -> None:
    torch.manual_seed(1)
    q = torch.randn(1, 2, 1, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    full = segment_attention(q, k, v, None, 0.3)
    hidden = torch.zeros(1, 1, 1, 2, 6, dtype=torch.bool)
    empty_o, empty_lse = segment_attention(q, k, v, hidden, 0.3)
    assert torch.isneginf(empty_lse).all() and torch.equal(empty_o, torch.zeros_like(empty_o))
    assert torch.equal(merge_segments([full, (empty_o, empty_lse)]), full[0])


def test_rotated_frame_with_means_equals_original_frame() -> None:
    """(q R).((k - mu) R) + q.mu = q.k and o_rot R^T + mu = o: exact algebra, float64."""
    torch.manual_seed(2)
    b, heads, kv_heads, n, length, d = 1, 6, 2, 4, 19, 16
    q = torch.randn(b, heads, n, d, dtype=torch.float64)
    k = torch.randn(b, kv_heads, length, d, dtype=torch.float64) + 3.0
    v = torch.randn(b, kv_heads, length, d, dtype=torch.float64) - 2.0
    r_k = torch.stack([random_orthogonal(d, seed=s) for s in range(kv_heads)])
    r_v = torch.stack([random_orthogonal(d, seed=10 + s) for s in range(kv_heads)])
    mu_k = torch.randn(kv_heads, d, dtype=torch.float64)
    mu_v = torch.randn(kv_heads, d, dtype=torch.float64)
    k_rot = rotate_per_kv_head(k - mu_k[None, :, None], r_k)
    v_rot = rotate_per_kv_head(v - mu_v[None, :, None], r_v)
    qg = group_queries(q, kv_heads)
    o_rot, _, mass = int_segment(qg, k_rot, v_rot, None, d**-0.5, r_k, mu_k)
    o = rotate_per_kv_head(o_rot, r_v.transpose(-1, -2)) + mass.unsqueeze(-1) * mu_v[None, :, None, None]
    torch.testing.assert_close(ungroup(o), _reference(q, k, v, d**-0.5), rtol=1e-11, atol=1e-11)


def test_mask_passes_padding_through_and_drops_full_masks() -> None:
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    out = oscar_mask(2, 1, 4, attention_mask=mask)
    assert out is not None and out.dtype == torch.bool and torch.equal(out, mask.bool())
    assert oscar_mask(2, 1, 3, attention_mask=torch.ones(2, 3)) is None
    with pytest.raises(ValueError, match="covers 2 tokens"):
        oscar_mask(1, 1, 3, attention_mask=torch.ones(1, 2))


def test_oscar_attention_without_cache_matches_sdpa() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar.cache.attention import enable

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, use_cache=False).logits
        enable(model)
        out = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(out[0, 3:], ref[0, 3:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)

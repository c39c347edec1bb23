"""The plugin's pool layout (``oscar.cache.paged`` pages of one token, SGLang token slots as page indices, scattered
like SGLang's allocator hands them out) read by the Triton decode kernel: interpreted on CPU
(``TRITON_INTERPRET=1``, set by tests/conftest.py without a GPU), compared with the torch twin that the CPU
plugin uses. Same tolerance as tests/test_kernels_decode.py (1.5e-2 relative): both dequantize the same codes and differ
in float32 reduction order, and both round the output to the query's BF16 (2^-8 relative per element)."""

from __future__ import annotations

import math

import pytest
import torch

from oscar.cache import paged

pytest.importorskip("triton")


def _orth(h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=gen))
    return q


def test_one_token_pages_with_scattered_slots_triton_equals_torch():
    gen = torch.Generator().manual_seed(0)
    B, H, hkv, d, S0, W = 2, 4, 2, 64, 2, 4
    int_lens = [13, 5]
    size = 64
    kt = paged.HeadTransform(_orth(hkv, d, gen), 0.1 * torch.randn(hkv, d, generator=gen), None)
    vt = paged.HeadTransform(_orth(hkv, d, gen), 0.1 * torch.randn(hkv, d, generator=gen), None)
    k_pages = paged.QuantPages.empty(size + 1, hkv, 1, d, 2, 64)
    v_pages = paged.QuantPages.empty(size + 1, hkv, 1, d, 2, 64)
    slots = torch.randperm(size, generator=gen)[: sum(int_lens)] + 1  # slot 0 is SGLang's padding slot
    rows_k = torch.randn(len(slots), hkv, d, generator=gen).to(torch.bfloat16)
    rows_v = torch.randn(len(slots), hkv, d, generator=gen).to(torch.bfloat16)
    paged.rotate_quantize_pack_kv(rows_k, rows_v, slots, k_pages, v_pages, kt, vt, backend="torch")
    page_table = torch.zeros(B, max(int_lens), dtype=torch.int32)
    page_table[0, : int_lens[0]] = slots[: int_lens[0]].to(torch.int32)
    page_table[1, : int_lens[1]] = slots[int_lens[0] :].to(torch.int32)
    segs = dict(sink_k=torch.randn(B, hkv, S0, d, generator=gen).to(torch.bfloat16),
                sink_v=torch.randn(B, hkv, S0, d, generator=gen).to(torch.bfloat16),
                sink_len=torch.tensor([S0, S0], dtype=torch.int32),
                recent_k=torch.randn(B, hkv, W, d, generator=gen).to(torch.bfloat16),
                recent_v=torch.randn(B, hkv, W, d, generator=gen).to(torch.bfloat16),
                recent_len=torch.tensor([W, 3], dtype=torch.int32), sm_scale=1 / math.sqrt(d))
    q = torch.randn(B, H, d, generator=gen).to(torch.bfloat16)
    int_len = torch.tensor(int_lens, dtype=torch.int32)
    sm_scale = segs.pop("sm_scale")
    segments = paged.Segments(page_table, int_len, **segs)
    for frame in ("original", "rotated"):
        ref = paged.decode_attention(q, k_pages, v_pages, segments, kt, vt, sm_scale=sm_scale, output_frame=frame,
                                     backend="torch").float()
        out = paged.decode_attention(q, k_pages, v_pages, segments, kt, vt, sm_scale=sm_scale, output_frame=frame,
                                     backend="triton").float()
        rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).max().item()
        assert 0 < rel < 1.5e-2, (frame, rel)  # > 0: the kernel ran (not the twin twice)

"""Extend attention over a cached quantized prefix: ``n`` new queries of one request over its pages as they are.

An extend whose request already has a prefix in the cache (a later chunk of a chunked prefill, a radix-cache hit)
attends over three kinds of rows: the BF16 sink, the quantized pages ``[S0, S0 + int_len)`` and a BF16 tail (the
prefix's rows still in the recent window, then the chunk's own rows, causal). The work is done in the pages'
rotated frame, so that no prefix row is rotated back or materialized in float: the queries become
``q_rot = q @ R_K`` (``n`` rows; ``q . mu_K`` is the same for every key of a query, so the softmax drops it), the
BF16 rows ``(k - mu_K) @ R_K`` and ``(v - mu_V) @ R_V`` (``S0 + W + n`` rows), and the pages are read by ``oscar.kernels.extend_paged`` (Triton; the tile's codes unpacked
in registers once for all the queries of a block) or by its twin ``extend_paged_attention_torch`` (the
specification). The cost is the attention itself, ``O(n x prefix)``, plus ``O((n + S0 + W) d^2)`` of transforms;
the old path dequantized, un-rotated and copied the whole prefix into a dense float tensor per layer.

``DEQUANTIZED_ROWS`` counts the prefix rows the torch twin dequantizes into memory (the Triton path: none), so
tests can assert what is computed rather than time it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention

from oscar.cache import paged
from oscar.core import quant
from oscar.kernels.segments import HeadTransform, Pages

DEQUANTIZED_ROWS = [0]  # prefix rows (per KV head, K and V counted once) the torch twin has dequantized into memory


def extend_paged_attention_torch(
    q_rot: torch.Tensor,
    k_pages: Pages,
    v_pages: Pages,
    page_table: torch.Tensor,
    int_len: int,
    bf_k: torch.Tensor,
    bf_v: torch.Tensor,
    n_fixed: int,
    *,
    sm_scale: float,
    token_maps: tuple = (None, None),
    num_splits: Optional[int] = None,
    rope: Optional[tuple[torch.Tensor, HeadTransform, int]] = None,
) -> torch.Tensor:
    """Torch twin of ``oscar.kernels.extend_paged.extend_paged_attention`` (same arguments; ``token_maps`` and
    ``num_splits`` are the kernel's and ignored): float32 ``[n, H, d]`` in the rotated frame, the softmax over
    ``sm_scale * q_rot . k'`` of the ``int_len`` dequantized page rows (page table ``[M]``) and the BF16 rows
    ``j <= n_fixed + i`` of ``bf_k`` for query ``i``. ``rope`` = ``(q, kt, pos0)`` adds ``q . RoPE_p(kt.rope_mu)``
    to the logit of page row ``t`` (position ``p = pos0 + t``: rope-centered keys)."""
    n, H, d = q_rot.shape
    hkv = int(k_pages.codes.shape[1])
    table = page_table.reshape(1, -1)
    kh = paged.gather_dequantize(k_pages, table, 0, int_len)  # [Hkv, int_len, d], rotated frame
    vh = paged.gather_dequantize(v_pages, table, 0, int_len)
    DEQUANTIZED_ROWS[0] += int_len
    keys = torch.cat([kh, bf_k.float()], dim=1)  # [Hkv, int_len + T, d]
    vals = torch.cat([vh, bf_v.float()], dim=1)
    T = int(bf_k.shape[1])
    dev = q_rot.device
    visible = torch.cat([torch.ones(n, int_len, dtype=torch.bool, device=dev),
                         torch.arange(T, device=dev)[None, :] <= n_fixed + torch.arange(n, device=dev)[:, None]], 1)
    mask: torch.Tensor = visible
    if rope is not None and int_len:
        q, kt, pos0 = rope
        offs = paged.rope_offsets(kt, pos0 + torch.arange(int_len, device=dev))  # [int_len, Hkv, d]
        bias = torch.einsum("nhrd,thd->hrnt", q.float().reshape(n, hkv, H // hkv, d), offs) * sm_scale
        mask = torch.zeros(H, n, int_len + T, dtype=torch.float32, device=dev).masked_fill(~visible, float("-inf"))
        mask[..., :int_len] += bias.reshape(H, n, int_len)
    o = scaled_dot_product_attention(q_rot.float().movedim(0, 1)[None], keys[None], vals[None], attn_mask=mask,
                                     scale=sm_scale, enable_gqa=H != hkv)
    return o[0].movedim(1, 0)


def extend_attention(
    q: torch.Tensor,
    k_pages: paged.QuantPages,
    v_pages: paged.QuantPages,
    page_table: torch.Tensor,
    int_len: int,
    bf_k: torch.Tensor,
    bf_v: torch.Tensor,
    n_fixed: int,
    kt: HeadTransform,
    vt: HeadTransform,
    *,
    sm_scale: Optional[float] = None,
    output_frame: str = "original",
    int_pos0: int = 0,
    backend: str = "torch",
    route: str = "pages",
) -> torch.Tensor:
    """Attention ``[n, H, d]`` (``q.dtype``) of one request's ``n`` extend queries ``q`` ``[n, H, d]`` over its
    quantized pages (``page_table`` int ``[M]``, ``int_len`` tokens, the first at position ``int_pos0``) and BF16
    rows ``bf_k``/``bf_v`` ``[Hkv, T, d]`` in the original frame: the first ``n_fixed`` (sink, ring) seen by every
    query, then the queries' own rows (query ``i`` sees own rows ``0..i``). ``output_frame="rotated"`` returns
    ``(o - mu_V) @ R_V`` (the folded ``o_proj``'s frame). ``backend="triton"``: ``oscar.kernels.extend_paged``
    (rope-centered keys and per-channel key pages go to the twin, which adds the offsets and reads the blocks).
    ``route="dequant"`` (Triton backend): the pages are dequantized once into ``[Hkv, int_len, d]`` rows
    (``oscar.kernels.extend_paged.dequantize_pages``, FP16 on CUDA: the kernel's operand type) and a dense SDPA over
    them and the BF16 rows follows (flash on CUDA, the queries in FP16), instead of the kernel that unpacks the codes
    in every query block's program; the same rows and frame, so it agrees with ``"pages"`` to FP16 rounding."""
    paged._check_backend(backend)
    if route not in ("pages", "dequant"):
        raise ValueError(f"route={route!r} must be 'pages' (read in place) or 'dequant' (dequantize once, then SDPA)")
    if output_frame not in ("original", "rotated"):
        raise ValueError(f"output_frame={output_frame!r} must be 'original' or 'rotated'")
    n, H, d = q.shape
    hkv = int(k_pages.codes.shape[1])
    if H % hkv:
        raise ValueError(f"query heads H={H} must be a multiple of KV heads Hkv={hkv}")
    rep = H // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    q32 = q.float().reshape(n, hkv, rep, d)
    q_rot = q32 if kt.R is None else torch.einsum("nhrd,hde->nhre", q32, kt.R.to(q.device, torch.float32))
    bk, bv = _rotate_rows(bf_k, kt), _rotate_rows(bf_v, vt)
    args = (q_rot.reshape(n, H, d).contiguous(), k_pages, v_pages,
            page_table.to(torch.int32).contiguous(), int(int_len), bk, bv, int(n_fixed))
    if backend == "triton" and not kt.rope_centered and not getattr(k_pages, "block", 0):
        maps = tuple(None if p.layout == "rows" else quant.mma_token_map(p.head_dim, p.layout, p.bits)
                     for p in (k_pages, v_pages))
        if route == "dequant":
            o = _attend_dequantized(*args, sm_scale=scale, token_maps=maps)
        else:
            from oscar.kernels.extend_paged import extend_paged_attention  # local: keeps triton out of import time

            o = extend_paged_attention(*args, sm_scale=scale, token_maps=maps)
    else:
        rope = (q.float(), kt, int(int_pos0)) if kt.rope_centered else None
        o = extend_paged_attention_torch(*args, sm_scale=scale, rope=rope)
    if output_frame == "original":
        o = o.reshape(n, hkv, rep, d)
        if vt.R is not None:
            o = torch.einsum("nhre,hde->nhrd", o, vt.R.to(q.device, torch.float32))
        if vt.mu is not None:
            o = o + vt.mu.to(q.device, torch.float32)[None, :, None, :]
        o = o.reshape(n, H, d)
    return o.to(q.dtype)


def _attend_dequantized(q_rot: torch.Tensor, k_pages: Pages, v_pages: Pages, page_table: torch.Tensor, int_len: int,
                        bf_k: torch.Tensor, bf_v: torch.Tensor, n_fixed: int, *, sm_scale: float,
                        token_maps: tuple) -> torch.Tensor:
    """``route="dequant"`` of `extend_attention` (the arguments of ``extend_paged_attention``): the pages dequantized
    once (Triton), then one SDPA over ``[pages, BF16 rows]`` with the queries' own rows causal (bottom-right aligned:
    query ``i`` sees every page row and BF16 rows ``0..n_fixed + i``); float32 ``[n, H, d]``, rotated frame."""
    from oscar.kernels.extend_paged import dequantize_pages  # local: keeps triton out of import time

    n, H, d = q_rot.shape
    hkv = int(k_pages.codes.shape[1])
    dt = torch.float16 if q_rot.is_cuda else torch.float32
    kd = dequantize_pages(k_pages, page_table, int_len, token_map=token_maps[0], dtype=dt)
    vd = dequantize_pages(v_pages, page_table, int_len, token_map=token_maps[1], dtype=dt)
    if int(bf_k.shape[1]) < n_fixed + n:
        raise ValueError(f"n_fixed={n_fixed} plus the {n} queries' own rows exceed the {int(bf_k.shape[1])} BF16 rows")
    keys = torch.cat([kd, bf_k[:, : n_fixed + n].to(dt)], dim=1)  # [Hkv, int_len + n_fixed + n, d]
    del kd
    vals = torch.cat([vd, bf_v[:, : n_fixed + n].to(dt)], dim=1)
    del vd
    total = int(keys.shape[1])
    mask = causal_lower_right(n, total) if q_rot.is_cuda else \
        torch.ones(n, total, dtype=torch.bool, device=q_rot.device).tril(total - n)
    return gqa_attention(q_rot.to(dt), keys, vals, mask, sm_scale).float()


def gqa_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: Any, scale: float) -> torch.Tensor:
    """SDPA of queries ``[n, H, d]`` over ``[Hkv, T, d]`` keys and values (GQA), one KV head at a time: ``[n, H, d]``.
    The flash and cuDNN kernels take equal head counts (``enable_gqa`` falls back to the math kernel), and repeating
    every KV head's rows at once held ``H / Hkv`` copies of a long prefix (2.3 GiB at 100k tokens, 8 KV heads, d 128:
    the out-of-memory of a 100k prefill at ``--mem-fraction-static 0.85`` on an 80 GB H100); per head one copy of one
    head's rows is alive. ``mask``: a boolean ``[n, T]`` or a ``causal_lower_right`` bias (None: no mask)."""
    n, H, d = q.shape
    hkv, total = int(keys.shape[0]), int(keys.shape[1])
    rep = H // hkv
    qh = q.movedim(0, 1).reshape(hkv, rep, n, d)
    out = torch.empty(hkv, rep, n, d, dtype=q.dtype, device=q.device)
    for h in range(hkv):
        kh, vh = keys[h][None].expand(rep, total, d), vals[h][None].expand(rep, total, d)
        if q.is_cuda and rep > 1:  # flash / cuDNN want dense heads
            kh, vh = kh.contiguous(), vh.contiguous()
        out[h] = scaled_dot_product_attention(qh[h][None], kh[None], vh[None], attn_mask=mask, scale=scale)[0]
    return out.reshape(H, n, d).movedim(1, 0)


def _rotate_rows(x: torch.Tensor, t: HeadTransform) -> torch.Tensor:
    """BF16 rows ``[Hkv, T, d]`` (original frame) -> float32 ``(x - mu) @ R``, contiguous (the pages' frame)."""
    y = x.float()
    if t.mu is not None:
        y = y - t.mu.to(x.device, torch.float32)[:, None, :]
    if t.R is not None:
        y = torch.einsum("htd,hde->hte", y, t.R.to(x.device, torch.float32))
    return y.contiguous()


__all__ = ["DEQUANTIZED_ROWS", "extend_attention", "extend_paged_attention_torch", "gqa_attention"]

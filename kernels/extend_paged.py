"""Triton extend attention over a cached quantized prefix: many queries of one request read the INT pages in place.

The extend of a request whose prefix is cached (a chunked prefill's later chunk, a radix-cache hit) attends
``n`` new queries over the prefix's quantized rows (pages, any page table order) plus a BF16 segment (the sink,
the ring rows of the prefix still in the window, and the chunk's own rows, causal). Everything is in the rotated
frame of the pages: queries ``q_rot = q @ R_K``, keys ``k'`` the dequantized code rows or ``(k - mu_K) @ R_K`` for
a BF16 row (``q . k = q_rot . k' + q . mu_K``: the last term is the same for every key of a query, so the softmax
drops it) and values ``(v - mu_V) @ R_V``, so one accumulator serves both segments and the output is
``(o - mu_V) @ R_V``.

A program takes ``BLOCK_M`` query rows (query ``i``, head ``r`` of the KV head's group, flattened ``i * REP + r``)
of one KV head and a range of the quantized tokens (split-K), unpacks each ``BLOCK_N``-token tile of codes once
for all its rows (byte and shift of every channel from a per-layout map: token rows, or the fragment order of
``oscar.core.quant.mma_token_map``), and keeps an online softmax; split 0 also takes the BF16 segment (key
``j`` visible to query ``i`` when ``j <= n_fixed + i``). Partial results ``(o, m, l)`` per split are merged by
log-sum-exp in the launcher. No prefix row is dequantized outside registers, and none is rotated back.

The torch twin with the same arguments is ``oscar.cache.extend.extend_paged_attention_torch`` (the
specification); ``oscar.cache.extend.extend_attention`` chooses between them and does the query and BF16-row
transforms.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from oscar.kernels._runtime import check, launchable, next_pow2
from oscar.kernels.segments import Pages


@triton.jit
def _extend_kernel(
    q_ptr, o_ptr, m_ptr, l_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    kmap_ptr, vmap_ptr,
    pt_ptr, bk_ptr, bv_ptr,
    n_q, int_len, n_bf, n_fixed, tokens_per_split, sm_scale,
    stride_cp, stride_ch, stride_mp, stride_mh, stride_mt,
    stride_bh, stride_bt,
    H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, G: tl.constexpr, WB: tl.constexpr,
    PAGE: tl.constexpr, MAPB: tl.constexpr, BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F16: tl.constexpr,
):
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (query, head of the group)
    qi = rows // REP
    head = kvh * REP + rows % REP
    rmask = qi < n_q
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + (qi * H + head)[:, None] * D + cols[None, :], mask=rmask[:, None], other=0.0)
    if DOT_F16:  # tensor-core products on FP16 operands (as the decode kernels' codes), float32 accumulation
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    MASK: tl.constexpr = (1 << BITS) - 1
    grp = cols // G
    t_lo = split * tokens_per_split
    t_hi = tl.minimum(int_len, t_lo + tokens_per_split)
    for t0 in range(t_lo, t_hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < t_hi
        page = tl.load(pt_ptr + t // PAGE, mask=tmask, other=0).to(tl.int64)
        off = t % PAGE
        tb = off % MAPB
        base = page * stride_cp + kvh * stride_ch + (off - tb) * WB
        mbase = page * stride_mp + kvh * stride_mh + off * stride_mt
        mi = tb[:, None] * D + cols[None, :]
        km = tl.load(kmap_ptr + mi)  # byte * 8 + shift
        kb = tl.load(kc_ptr + base[:, None] + (km >> 3), mask=tmask[:, None], other=0)
        kcode = (kb.to(tl.int32) >> (km & 7)) & MASK
        ksc = tl.load(ks_ptr + mbase[:, None] + grp[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        kze = tl.load(kz_ptr + mbase[:, None] + grp[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        k = kcode.to(tl.float32) * ksc + kze
        if DOT_F16:
            k = k.to(tl.float16)
        s = tl.dot(q, tl.trans(k)) * sm_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vm = tl.load(vmap_ptr + mi)
        vb = tl.load(vc_ptr + base[:, None] + (vm >> 3), mask=tmask[:, None], other=0)
        vcode = (vb.to(tl.int32) >> (vm & 7)) & MASK
        vsc = tl.load(vs_ptr + mbase[:, None] + grp[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        vze = tl.load(vz_ptr + mbase[:, None] + grp[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        v = vcode.to(tl.float32) * vsc + vze
        if DOT_F16:
            v = v.to(tl.float16)
            p = p.to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    if split == 0:  # the BF16 segment (sink, ring rows of the prefix, the chunk's own rows: causal)
        q_hi = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, n_q * REP - 1) // REP
        j_hi = tl.minimum(n_bf, n_fixed + q_hi + 1)
        for j0 in range(0, j_hi, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            jmask = j < j_hi
            bptr = kvh * stride_bh + j[:, None] * stride_bt + cols[None, :]
            k = tl.load(bk_ptr + bptr, mask=jmask[:, None], other=0.0)
            if DOT_F16:
                k = k.to(tl.float16)
            s = tl.dot(q, tl.trans(k)) * sm_scale
            visible = jmask[None, :] & (j[None, :] <= n_fixed + qi[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))
            p = tl.where(visible, tl.exp(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(bv_ptr + bptr, mask=jmask[:, None], other=0.0)
            if DOT_F16:
                v = v.to(tl.float16)
                p = p.to(tl.float16)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m_i = m_new
    out = (split * n_q * H + qi * H + head)
    tl.store(o_ptr + out[:, None] * D + cols[None, :], acc, mask=rmask[:, None])
    tl.store(m_ptr + out, m_i, mask=rmask)
    tl.store(l_ptr + out, l_i, mask=rmask)


@triton.jit
def _dequant_kernel(
    c_ptr, s_ptr, z_ptr, map_ptr, pt_ptr, o_ptr,
    int_len, stride_cp, stride_ch, stride_mp, stride_mh, stride_mt, stride_oh, stride_ot,
    D: tl.constexpr, G: tl.constexpr, WB: tl.constexpr, PAGE: tl.constexpr, MAPB: tl.constexpr, BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    tmask = t < int_len
    cols = tl.arange(0, D)
    page = tl.load(pt_ptr + t // PAGE, mask=tmask, other=0).to(tl.int64)
    off = t % PAGE
    tb = off % MAPB
    base = page * stride_cp + h * stride_ch + (off - tb) * WB
    mbase = page * stride_mp + h * stride_mh + off * stride_mt
    cm = tl.load(map_ptr + tb[:, None] * D + cols[None, :])  # byte * 8 + shift
    byte = tl.load(c_ptr + base[:, None] + (cm >> 3), mask=tmask[:, None], other=0)
    code = (byte.to(tl.int32) >> (cm & 7)) & ((1 << BITS) - 1)
    grp = cols // G
    sc = tl.load(s_ptr + mbase[:, None] + grp[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    ze = tl.load(z_ptr + mbase[:, None] + grp[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    x = code.to(tl.float32) * sc + ze
    tl.store(o_ptr + h.to(tl.int64) * stride_oh + t[:, None].to(tl.int64) * stride_ot + cols[None, :],
             x.to(o_ptr.dtype.element_ty), mask=tmask[:, None])


_MAPS: dict[tuple, torch.Tensor] = {}


def code_map(d: int, bits: int, group_size: int, token_map: Optional[tuple[torch.Tensor, torch.Tensor]],
             device: torch.device) -> torch.Tensor:
    """int32 ``[MAPB, d]`` holding ``byte * 8 + shift``: channel ``c`` of the token at position ``tb`` of its block
    (``MAPB`` = 1 for token rows, 16 for the fragment-order layouts) is bits ``shift`` of byte ``byte`` counted
    from the block's first byte. Token rows: ``oscar.core.quant.pack_codes`` (planar within each group); the
    fragment order: ``token_map`` = ``oscar.core.quant.mma_token_map`` (the storage contract, passed in)."""
    key = (d, bits, group_size, None if token_map is None else id(token_map[0]), str(device))
    if key not in _MAPS:
        per = 8 // bits
        c = torch.arange(d)
        if token_map is None:  # planar: byte g*G/per + j % (G/per) holds channel j (of group g) in part j // (G/per)
            j, gb = c % group_size, group_size // per
            byte, shift = (c // group_size * gb + j % gb)[None], (bits * (j // gb))[None]
        else:
            order, byte_index = token_map
            byte = torch.empty_like(order)
            shift = torch.empty_like(order)
            slot = torch.arange(d)
            byte.scatter_(1, order, byte_index[:, slot // per])
            shift.scatter_(1, order, (bits * (slot % per)).expand_as(order).contiguous())
        _MAPS[key] = (byte * 8 + shift).to(device, torch.int32).contiguous()
    return _MAPS[key]


def _check_pages(pages: Pages, name: str, hkv: int, d: int) -> None:
    check(pages.codes.dtype == torch.uint8 and pages.codes.dim() == 4,
          lambda: f"{name}.codes must be uint8 [P, Hkv, page_size, d*bits/8], got {pages.codes.dtype} "
          f"{tuple(pages.codes.shape)}")
    check(int(pages.codes.shape[1]) == hkv and int(pages.codes.shape[3]) * 8 // pages.bits == d,
          lambda: f"{name}.codes {tuple(pages.codes.shape)} do not hold Hkv={hkv} heads of d={d} channels at INT{pages.bits}")
    check(pages.codes.is_contiguous(), lambda: f"{name}.codes must be contiguous")
    check(not getattr(pages, "block", 0),
          lambda: f"{name} holds per-channel key blocks (block={getattr(pages, 'block', 0)}); "
          "this kernel reads per-token scale/zero pages (the twin reads both)")
    for t, what in ((pages.scale, "scale"), (pages.zero, "zero")):
        check(tuple(t.shape) == (*pages.codes.shape[:3], d // pages.group_size) and t.stride() == pages.scale.stride(),
              lambda: f"{name}.{what} must be [P, Hkv, page_size, d/G] with the strides of {name}.scale, got "
              f"{tuple(t.shape)}")


def default_splits(n_q: int, rep: int, hkv: int, int_len: int, block_m: int, block_n: int, num_sms: int) -> int:
    """Split-K over the quantized tokens so that a short extend (a hit's recent window) fills the GPU: about
    four programs per SM, each at least eight token blocks."""
    programs = triton.cdiv(n_q * rep, block_m) * hkv
    return max(1, min(triton.cdiv(4 * num_sms, programs), int_len // (8 * block_n), 64))


def extend_paged_attention(
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
    block_m: int = 64,
    block_n: int = 32,
    num_warps: Optional[int] = None,
    dot_f16: Optional[bool] = None,
) -> torch.Tensor:
    """Extend attention of ``n`` queries over one request's quantized prefix and BF16 segment, in the rotated
    frame: returns float32 ``[n, H, d]`` = ``sum_j p_j v'_j`` (see the module docstring).

    ``q_rot`` float32 ``[n, H, d]``; ``k_pages``/``v_pages``: ``QuantPages`` (rows or
    mma layouts; INT2/INT4); ``page_table`` int32 ``[M]``: quantized token ``t`` at page ``page_table[t // P]``;
    ``int_len`` quantized tokens; ``bf_k``/``bf_v`` float32 ``[Hkv, T, d]`` rotated BF16 rows, the first
    ``n_fixed`` visible to every query, row ``n_fixed + i`` the ``i``-th query's own; rope-centered keys are not
    read here (the twin adds their offsets). ``token_maps``: ``(None, None)`` for row-layout pages, else the K and
    V maps of ``oscar.core.quant.mma_token_map``; ``num_splits``: split-K programs over the quantized tokens
    (default ``default_splits``); ``block_m`` query rows and ``block_n`` tokens per tile; ``num_warps`` (default 4,
    8 at d >= 128); ``dot_f16``: products on FP16 operands (11-bit significands; the BF16 SDPA this replaces had 8) with
    float32 accumulation, default on CUDA; float32 operands elsewhere.
    """
    check(q_rot.dim() == 3 and q_rot.dtype == torch.float32 and q_rot.is_contiguous(),
          lambda: f"q_rot must be contiguous float32 [n, H, d], got {q_rot.dtype} {tuple(q_rot.shape)}")
    n, H, d = (int(s) for s in q_rot.shape)
    hkv = int(k_pages.codes.shape[1])
    check(H % hkv == 0, lambda: f"query heads H={H} must be a multiple of KV heads Hkv={hkv}")
    check(d >= 16 and d == next_pow2(d), lambda: f"head_dim d={d} must be a power of two >= 16")
    _check_pages(k_pages, "k_pages", hkv, d)
    _check_pages(v_pages, "v_pages", hkv, d)
    check(k_pages.codes.shape == v_pages.codes.shape and k_pages.bits == v_pages.bits
          and k_pages.group_size == v_pages.group_size and k_pages.scale.stride() == v_pages.scale.stride(),
          "k_pages and v_pages must have one shape, bits and group size")
    page = int(k_pages.codes.shape[2])
    check(page_table.dim() == 1 and page_table.dtype == torch.int32 and page_table.numel() * page >= int_len,
          lambda: f"page_table must be int32 [>= ceil(int_len / page_size) = {math.ceil(int_len / page)}], got "
          f"{page_table.dtype} {tuple(page_table.shape)}")
    check(bf_k.dim() == 3 and tuple(bf_k.shape) == tuple(bf_v.shape) and bf_k.shape[0] == hkv and bf_k.shape[2] == d
          and bf_k.dtype == bf_v.dtype == torch.float32 and bf_k.stride() == bf_v.stride() and bf_k.stride(2) == 1,
          lambda: f"bf_k/bf_v must be float32 [Hkv={hkv}, T, d={d}] of one shape and strides, got {tuple(bf_k.shape)} "
          f"{bf_k.dtype}, {tuple(bf_v.shape)} {bf_v.dtype}")
    check(0 <= n_fixed and n_fixed + n <= int(bf_k.shape[1]),
          lambda: f"n_fixed={n_fixed} plus the {n} queries' own rows exceed the {int(bf_k.shape[1])} BF16 rows")
    dev = q_rot.device
    layout = "rows" if k_pages.layout == "rows" else "mma"
    check((k_pages.layout, v_pages.layout) in (("rows", "rows"), ("mma_k", "mma_v")),
          lambda: f"K/V page layouts {(k_pages.layout, v_pages.layout)} are not a pair: ('rows', 'rows') or ('mma_k', 'mma_v')")
    check((token_maps[0] is None) == (layout == "rows") and (token_maps[1] is None) == (layout == "rows"),
          "token_maps: (None, None) for row-layout pages, the K and V token maps (oscar.core.quant.mma_token_map) "
          "for the fragment-order layouts")
    kmap = code_map(d, k_pages.bits, k_pages.group_size, token_maps[0], dev)
    vmap = code_map(d, v_pages.bits, v_pages.group_size, token_maps[1], dev)
    rep = H // hkv
    num_warps = (8 if d >= 128 else 4) if num_warps is None else num_warps
    dot_f16 = dev.type == "cuda" if dot_f16 is None else bool(dot_f16)
    if num_splits is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        num_splits = default_splits(n, rep, hkv, int_len, block_m, block_n, sms)
    per_split = triton.cdiv(max(int_len, 1), num_splits)
    per_split = triton.cdiv(per_split, block_n) * block_n
    num_splits = max(1, triton.cdiv(int_len, per_split))
    o = torch.empty(num_splits, n, H, d, dtype=torch.float32, device=dev)
    m = torch.empty(num_splits, n, H, dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    if n == 0:
        return o[0]
    grid = (triton.cdiv(n * rep, block_m), hkv, num_splits)
    kp, vp = k_pages, v_pages
    launchable(_extend_kernel, dev)[grid](
        q_rot, o, m, lsum,
        kp.codes, kp.scale, kp.zero, vp.codes, vp.scale, vp.zero,
        kmap, vmap,
        page_table, bf_k, bf_v,
        n, int_len, int(bf_k.shape[1]), n_fixed, per_split, float(sm_scale),
        kp.codes.stride(0), kp.codes.stride(1), kp.scale.stride(0), kp.scale.stride(1), kp.scale.stride(2),
        bf_k.stride(0), bf_k.stride(1),
        H=H, REP=rep, D=d, G=kp.group_size, WB=int(kp.codes.shape[3]), PAGE=page,
        MAPB=1 if layout == "rows" else 16, BITS=kp.bits, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_F16=dot_f16, num_warps=num_warps,
    )
    if num_splits == 1:
        return o[0] / lsum[0, ..., None]
    mx = m.max(dim=0).values
    w = torch.exp(m - mx)  # a split without tokens: m = -inf, weight 0
    return (w[..., None] * o).sum(0) / (w * lsum).sum(0)[..., None]

def dequantize_pages(pages: Pages, page_table: torch.Tensor, int_len: int, *, token_map: Optional[tuple] = None,
                     dtype: torch.dtype = torch.float32, block_t: int = 64) -> torch.Tensor:
    """The first ``int_len`` quantized rows of one request, ``[Hkv, int_len, d]`` in ``dtype`` (rotated frame):
    ``code * scale + zero`` in float32, cast once. ``page_table`` int32 ``[M]``; ``token_map``: None for row-layout
    pages, else the layout's ``oscar.core.quant.mma_token_map``. The twin: ``oscar.cache.paged.gather_dequantize``
    (float32). One pass over the codes, for an extend that attends over them with a dense kernel afterwards."""
    _check_pages(pages, "pages", int(pages.codes.shape[1]), int(pages.codes.shape[3]) * 8 // pages.bits)
    hkv, page, wb = int(pages.codes.shape[1]), int(pages.codes.shape[2]), int(pages.codes.shape[3])
    d = wb * 8 // pages.bits
    check((token_map is None) == (pages.layout == "rows"),
          lambda: f"token_map: None for row-layout pages, the layout's map for {pages.layout!r} pages")
    check(page_table.dim() == 1 and page_table.dtype == torch.int32 and page_table.numel() * page >= int_len,
          lambda: f"page_table must be int32 [>= ceil(int_len / page_size) = {math.ceil(int_len / page)}], got "
          f"{page_table.dtype} {tuple(page_table.shape)}")
    dev = pages.codes.device
    out = torch.empty(hkv, int_len, d, dtype=dtype, device=dev)
    if int_len == 0:
        return out
    cmap = code_map(d, pages.bits, pages.group_size, token_map, dev)
    launchable(_dequant_kernel, dev)[(triton.cdiv(int_len, block_t), hkv)](
        pages.codes, pages.scale, pages.zero, cmap, page_table, out,
        int_len, pages.codes.stride(0), pages.codes.stride(1), pages.scale.stride(0), pages.scale.stride(1),
        pages.scale.stride(2), out.stride(0), out.stride(1),
        D=d, G=pages.group_size, WB=wb, PAGE=page, MAPB=1 if pages.layout == "rows" else 16, BITS=pages.bits,
        BLOCK_T=block_t, num_warps=4,
    )
    return out


__all__ = ["code_map", "default_splits", "dequantize_pages", "extend_paged_attention"]

"""Fused rotate-clip-quantize-pack into the paged INT2/INT4 pool (prefill writes and demotion).

One program quantizes `BLOCK_T` rows of one KV head: `x = (row - mu) @ R`, percentile clip with
`torch.quantile` linear semantics, per-group asymmetric INT-b codes from the bf16-rounded scale
and zero, planar packing within each group, and stores codes, scale and zero at the row's slot
(`page * page_size + offset`). The torch twin is `oscar.cache.paged.rotate_quantize_pack_torch`, which
calls `oscar.core.quant`; with no rotation the codes match it bit for bit (IEEE divisions,
`tl.math.div_rn`); with a rotation the float32 matrix product sums in another order than torch's,
so a few codes at rounding boundaries may differ by one (on the GPU the product runs as 3xTF32,
about float32 accuracy; exact float32 FMA tiles were measured to spill).

Launchers: ``rotate_quantize_pack``, ``rotate_quantize_pack_pair`` (K and V in one launch); launch settings:
``oscar.kernels.launch.QuantizeLaunch``. Launches of up to ``ROW_PATH_MAX_ROWS`` rows (a decode step's demotion)
take the row path: one program per row, head and tensor on one warp, the rotation as float32 FMAs
with each lane owning output columns, and the clip threshold from the order statistics found by
extracting extremes from the nearer end (about ``D * (1 - rho)`` steps of two warp reductions) instead
of the 31-step radix search of the block path: 8.8 us instead of 23.2 us per layer (K and V, one row) on the H200.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

from ._runtime import check, is_pow2, launchable
from .launch import QuantizeLaunch
from .segments import HeadTransform, Pages


@triton.jit
def _round_bf16(v):
    """float32 -> nearest bf16 (ties to even), returned as the exactly representable float32."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _rotate_quantize_kernel(
    x_ptr,
    src_ptr,
    slot_ptr,
    n_rows,
    stride_xn,
    stride_xh,
    stride_xt,
    r_ptr,
    mu_ptr,
    rho_ptr,
    codes_ptr,
    scale_ptr,
    zero_ptr,
    x2_ptr,
    r2_ptr,
    mu2_ptr,
    rho2_ptr,
    codes2_ptr,
    scale2_ptr,
    zero2_ptr,
    bidx_ptr,
    bidx2_ptr,
    stride_cp,
    stride_ch,
    stride_cs,
    stride_sp,
    stride_sh,
    stride_ss,
    PAGE_SIZE: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_SRC: tl.constexpr,
    HAS_ROT: tl.constexpr,
    HAS_MU: tl.constexpr,
    CLIP: tl.constexpr,
    PRECISION: tl.constexpr,
    ROW_PATH: tl.constexpr = False,
    MMA: tl.constexpr = False,
):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    if tl.program_id(2) == 1:  # second tensor of a pair (V of a K/V demotion): same shapes and strides
        x_ptr = x2_ptr
        r_ptr = r2_ptr
        mu_ptr = mu2_ptr
        rho_ptr = rho2_ptr
        codes_ptr = codes2_ptr
        scale_ptr = scale2_ptr
        zero_ptr = zero2_ptr
        bidx_ptr = bidx2_ptr
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < n_rows
    cols = tl.arange(0, D)
    if HAS_SRC:
        t_src = tl.load(src_ptr + rows, mask=rmask, other=0).to(tl.int64)
    else:
        t_src = tl.zeros([BLOCK_T], dtype=tl.int64)
    x_row = rows.to(tl.int64)[:, None] * stride_xn + h * stride_xh + t_src[:, None] * stride_xt
    if ROW_PATH and HAS_ROT:
        # one row (demotion): the product on the FMA units in chunks of KC input channels, each
        # lane owning output columns and summing its chunk rows in registers (no 16-row tensor-core
        # padding, no 64 KB rotation tile held at once)
        KC: tl.constexpr = 32 if D >= 32 else D
        if HAS_SRC:
            src0 = tl.load(src_ptr + pid_t).to(tl.int64)
        else:
            src0 = 0
        row0 = pid_t.to(tl.int64) * stride_xn + h * stride_xh + src0 * stride_xt
        xr = tl.zeros([D], tl.float32)
        for c0 in tl.static_range(0, D, KC):
            kc = c0 + tl.arange(0, KC)
            xc = tl.load(x_ptr + row0 + kc).to(tl.float32)
            if HAS_MU:
                xc = xc - tl.load(mu_ptr + h * D + kc)
            rc = tl.load(r_ptr + h * D * D + kc[:, None] * D + cols[None, :])
            xr += tl.sum(xc[:, None] * rc, axis=0)
        x = xr[None, :]
    else:
        x = tl.load(x_ptr + x_row + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        if HAS_MU:
            x = x - tl.load(mu_ptr + h * D + cols)[None, :]
        if HAS_ROT:
            rot = tl.load(r_ptr + h * D * D + cols[:, None] * D + cols[None, :])
            x = tl.dot(x, rot, input_precision=PRECISION)
    if CLIP and ROW_PATH:
        # order statistics lo and hi of |x| by extracting extremes one at a time from the nearer end
        # (the top for rho > 1/2: about D * (1 - rho) steps of two warp reductions), removing one
        # element per step (the first index among equal values), so ties count like torch.quantile's sort
        a = tl.abs(x)
        pos = tl.load(rho_ptr + h).to(tl.float32) * (D - 1)  # float32 product, as oscar.core.quant
        lo_f = tl.floor(pos)
        w = pos - lo_f
        lo = lo_f.to(tl.int32)
        hi = tl.ceil(pos).to(tl.int32)
        top = (D - lo) <= (hi + 1)
        n_iter = tl.where(top, D - lo, hi + 1)
        bvals = tl.where(top, a, -a)
        idx = tl.arange(0, D)[None, :]
        s_lo = tl.zeros([BLOCK_T], tl.float32)
        s_hi = tl.zeros([BLOCK_T], tl.float32)
        for j in range(n_iter):
            m = tl.max(bvals, axis=1)
            first = tl.min(tl.where(bvals == m[:, None], idx, D), axis=1)
            rank = tl.where(top, D - 1 - j, j)  # ascending rank of the element taken at this step
            s_lo = tl.where(rank == lo, tl.abs(m), s_lo)
            s_hi = tl.where(rank == hi, tl.abs(m), s_hi)
            bvals = tl.where(idx == first[:, None], float("-inf"), bvals)
        tau = tl.where(w < 0.5, s_lo + w * (s_hi - s_lo), s_hi - (s_hi - s_lo) * (1.0 - w))
        x = tl.minimum(tl.maximum(x, -tau[:, None]), tau[:, None])
    elif CLIP:
        # k-th smallest |x| by a radix select on the float bits (non-negative floats order like
        # their bit patterns): fast on the GPU and in the interpreter, unlike a full sort.
        abits = tl.abs(x).to(tl.int32, bitcast=True)
        pos = tl.load(rho_ptr + h).to(tl.float32) * (D - 1)  # float32 product, as oscar.core.quant
        lo_f = tl.floor(pos)
        w = pos - lo_f
        lo = lo_f.to(tl.int32)
        hi = tl.ceil(pos).to(tl.int32)
        ans_lo = tl.zeros([BLOCK_T], dtype=tl.int32)
        ans_hi = tl.zeros([BLOCK_T], dtype=tl.int32)
        for i in range(31):  # one bit per step (a 16-ary search was measured 3x slower: 16x the compares)
            bit = 1 << (30 - i)
            c_lo = ans_lo | bit
            c_hi = ans_hi | bit
            n_lo = tl.sum((abits < c_lo[:, None]).to(tl.int32), axis=1)
            n_hi = tl.sum((abits < c_hi[:, None]).to(tl.int32), axis=1)
            ans_lo = tl.where(n_lo <= lo, c_lo, ans_lo)
            ans_hi = tl.where(n_hi <= hi, c_hi, ans_hi)
        s_lo = ans_lo.to(tl.float32, bitcast=True)
        s_hi = ans_hi.to(tl.float32, bitcast=True)
        tau = tl.where(w < 0.5, s_lo + w * (s_hi - s_lo), s_hi - (s_hi - s_lo) * (1.0 - w))
        x = tl.minimum(tl.maximum(x, -tau[:, None]), tau[:, None])

    NG: tl.constexpr = D // G
    PER: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    xg = tl.reshape(x, (BLOCK_T, NG, G))
    mn = tl.min(xg, axis=2)
    mx = tl.max(xg, axis=2)
    # bf16 round-to-nearest-even done on the bits: the interpreter's float32->bf16 cast truncates.
    scale = _round_bf16(tl.math.div_rn(mx - mn, tl.full([BLOCK_T, NG], QMAX, tl.float32)))
    zero = _round_bf16(mn)
    scale_bf = scale.to(tl.bfloat16)
    zero_bf = zero.to(tl.bfloat16)
    nonzero = scale != 0.0
    safe = tl.where(nonzero, scale, 1.0)
    code = tl.floor(tl.math.div_rn(xg - zero[:, :, None], tl.broadcast_to(safe[:, :, None], (BLOCK_T, NG, G))) + 0.5)
    code = tl.minimum(tl.maximum(code, 0.0), QMAX * 1.0)
    code = tl.where(nonzero[:, :, None], code, 0.0)
    planes = tl.reshape(code.to(tl.int32), (BLOCK_T, NG, PER, G // PER))
    shifts = tl.arange(0, PER) * BITS
    packed = tl.sum(planes << shifts[None, None, :, None], axis=2)
    packed = tl.reshape(packed, (BLOCK_T, D // PER)).to(tl.uint8)

    slot = tl.load(slot_ptr + rows, mask=rmask, other=0).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    bcols = tl.arange(0, D // PER)
    if MMA:  # fragment-order pages (oscar.core.quant.mma_token_map): the row's bytes go to its token's places
        tb = off % 16
        boff = tl.load(bidx_ptr + tb[:, None] * (D // PER) + bcols[None, :], mask=rmask[:, None], other=0)
        c_off = page[:, None] * stride_cp + h * stride_ch + (off - tb)[:, None] * stride_cs + boff
    else:
        c_off = page[:, None] * stride_cp + h * stride_ch + off[:, None] * stride_cs + bcols[None, :]
    tl.store(codes_ptr + c_off, packed, mask=rmask[:, None])
    gcols = tl.arange(0, NG)
    s_off = page[:, None] * stride_sp + h * stride_sh + off[:, None] * stride_ss + gcols[None, :]
    tl.store(scale_ptr + s_off, scale_bf, mask=rmask[:, None])
    tl.store(zero_ptr + s_off, zero_bf, mask=rmask[:, None])


@triton.jit
def _channel_quantize_store(
    x, slot, s0, h,
    r_ptr, mu_ptr, rho_ptr, perm_ptr, bidx_ptr,
    codes_ptr, scale_ptr, zero_ptr,
    stride_cp, stride_ch, stride_cs, stride_sp, stride_sh, stride_ss,
    PAGE_SIZE: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, T: tl.constexpr,
    HAS_ROT: tl.constexpr, HAS_MU: tl.constexpr, CLIP: tl.constexpr, PRECISION: tl.constexpr, MMA: tl.constexpr,
):
    """One block of ``T`` rows ``x`` ``[T, D]`` (float32, original frame, rope-centered offsets already off) of KV
    head ``h`` quantized per channel: ``x = (row - mu) @ R`` (columns in the layout's channel order), per-channel
    clip over the block's ``T`` values, per-channel bf16 scale/zero, per-token packed codes at the rows' slots
    ``slot`` ``[T]`` (int64), scale/zero at the block's row of its page (``s0``: the block's first slot; actual
    channel index ``perm[k]`` of kernel column ``k``)."""
    cols = tl.arange(0, D)
    if HAS_MU:
        x = x - tl.load(mu_ptr + h * D + cols)[None, :]
    if HAS_ROT:
        rot = tl.load(r_ptr + h * D * D + cols[:, None] * D + cols[None, :])
        if T >= 16:
            x = tl.dot(x, rot, input_precision=PRECISION)
        else:  # tl.dot takes M >= 16: small blocks as broadcast sums
            x = tl.sum(x[:, :, None] * rot[None, :, :], axis=1)
    if CLIP:  # per channel: the rho-quantile of |x| over the block's T values (radix select, torch.quantile linear)
        abits = tl.abs(x).to(tl.int32, bitcast=True)
        pos = tl.load(rho_ptr + h).to(tl.float32) * (T - 1)
        lo_f = tl.floor(pos)
        w = pos - lo_f
        lo = lo_f.to(tl.int32)
        hi = tl.ceil(pos).to(tl.int32)
        ans_lo = tl.zeros([D], dtype=tl.int32)
        ans_hi = tl.zeros([D], dtype=tl.int32)
        for i in range(31):
            bit = 1 << (30 - i)
            c_lo = ans_lo | bit
            c_hi = ans_hi | bit
            n_lo = tl.sum((abits < c_lo[None, :]).to(tl.int32), axis=0)
            n_hi = tl.sum((abits < c_hi[None, :]).to(tl.int32), axis=0)
            ans_lo = tl.where(n_lo <= lo, c_lo, ans_lo)
            ans_hi = tl.where(n_hi <= hi, c_hi, ans_hi)
        s_lo = ans_lo.to(tl.float32, bitcast=True)
        s_hi = ans_hi.to(tl.float32, bitcast=True)
        tau = tl.where(w < 0.5, s_lo + w * (s_hi - s_lo), s_hi - (s_hi - s_lo) * (1.0 - w))
        x = tl.minimum(tl.maximum(x, -tau[None, :]), tau[None, :])
    PER: tl.constexpr = 8 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    NG: tl.constexpr = D // G
    mn = tl.min(x, axis=0)
    mx = tl.max(x, axis=0)
    scale = _round_bf16(tl.math.div_rn(mx - mn, tl.full([D], QMAX, tl.float32)))
    zero = _round_bf16(mn)
    nonzero = scale != 0.0
    safe = tl.where(nonzero, scale, 1.0)
    code = tl.floor(tl.math.div_rn(x - zero[None, :], tl.broadcast_to(safe[None, :], (T, D))) + 0.5)
    code = tl.minimum(tl.maximum(code, 0.0), QMAX * 1.0)
    code = tl.where(nonzero[None, :], code, 0.0)
    planes = tl.reshape(code.to(tl.int32), (T, NG, PER, G // PER))
    shifts = tl.arange(0, PER) * BITS
    packed = tl.sum(planes << shifts[None, None, :, None], axis=2)
    packed = tl.reshape(packed, (T, D // PER)).to(tl.uint8)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    bcols = tl.arange(0, D // PER)
    if MMA:
        tb = off % 16
        boff = tl.load(bidx_ptr + tb[:, None] * (D // PER) + bcols[None, :])
        c_off = page[:, None] * stride_cp + h * stride_ch + (off - tb)[:, None] * stride_cs + boff
    else:
        c_off = page[:, None] * stride_cp + h * stride_ch + off[:, None] * stride_cs + bcols[None, :]
    tl.store(codes_ptr + c_off, packed)
    chan = tl.load(perm_ptr + cols)
    m_off = (s0 // PAGE_SIZE) * stride_sp + h * stride_sh + ((s0 % PAGE_SIZE) // T) * stride_ss + chan
    tl.store(scale_ptr + m_off, scale.to(tl.bfloat16))
    tl.store(zero_ptr + m_off, zero.to(tl.bfloat16))


@triton.jit
def _channel_quantize_kernel(
    x_ptr, slot_ptr, stride_xn, stride_xh,
    r_ptr, mu_ptr, rho_ptr, perm_ptr, bidx_ptr,
    codes_ptr, scale_ptr, zero_ptr,
    stride_cp, stride_ch, stride_cs, stride_sp, stride_sh, stride_ss,
    PAGE_SIZE: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, T: tl.constexpr,
    HAS_ROT: tl.constexpr, HAS_MU: tl.constexpr, CLIP: tl.constexpr, PRECISION: tl.constexpr, MMA: tl.constexpr,
):
    """Program ``(block, KV head)``: ``T`` consecutive rows quantized per channel (docs/DESIGN.md "Per-channel key
    pages"; ``_channel_quantize_store``)."""
    blk = tl.program_id(0)
    h = tl.program_id(1)
    rows = blk * T + tl.arange(0, T)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xn + h * stride_xh + cols[None, :]).to(tl.float32)
    slot = tl.load(slot_ptr + rows).to(tl.int64)
    s0 = tl.load(slot_ptr + blk * T).to(tl.int64)
    _channel_quantize_store(x, slot, s0, h, r_ptr, mu_ptr, rho_ptr, perm_ptr, bidx_ptr, codes_ptr, scale_ptr, zero_ptr,
                            stride_cp, stride_ch, stride_cs, stride_sp, stride_sh, stride_ss, PAGE_SIZE, D, G, BITS, T,
                            HAS_ROT, HAS_MU, CLIP, PRECISION, MMA)


@triton.jit
def _channel_ring_kernel(
    new_ptr, stride_nb, stride_nh,
    wk_ptr, wv_ptr, stride_wr, stride_wh, stride_ws,
    req_ptr, done_ptr, src_ptr, slot0_ptr, move_ptr, dst_ptr, tail,
    off_ptr, stride_ob, stride_ot, stride_oh,
    r_ptr, mu_ptr, rho_ptr, perm_ptr, bidx_ptr,
    codes_ptr, scale_ptr, zero_ptr,
    stride_cp, stride_ch, stride_cs, stride_sp, stride_sh, stride_ss,
    PAGE_SIZE: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, T: tl.constexpr,
    HAS_ROT: tl.constexpr, HAS_MU: tl.constexpr, CLIP: tl.constexpr, PRECISION: tl.constexpr, MMA: tl.constexpr,
    HAS_OFF: tl.constexpr,
):
    """Program ``(batch entry b, KV head h)`` of a decode step (``quantize_key_blocks_from_ring``): nothing unless
    ``done[b]`` (the step's new row completes a key block); then the block's ``T`` rows (``T - 1`` from the window
    buffer of request slot ``req[b]`` at columns ``src[b] ..``, the new row last; minus their rope-centered offsets
    ``off[b]`` when given) are quantized per channel into slots ``slot0[b] ..``, and the ``T - 1`` rows of request
    slot ``move[b]`` at columns ``tail ..`` of both window buffers move to columns ``dst[b] ..`` (the ring's tail
    into the block that left the window; ``move[b]`` is the padding slot where nothing moves)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    if tl.load(done_ptr + b) != 0:
        t = tl.arange(0, T)
        cols = tl.arange(0, D)
        keep = (t < T - 1)[:, None]
        r = tl.load(req_ptr + b).to(tl.int64)
        s = tl.load(src_ptr + b).to(tl.int64)
        ring = tl.load(wk_ptr + r * stride_wr + h * stride_wh + (s + t)[:, None] * stride_ws + cols[None, :],
                       mask=keep, other=0.0).to(tl.float32)
        new = tl.load(new_ptr + b * stride_nb + h * stride_nh + cols).to(tl.float32)
        x = tl.where(keep, ring, tl.broadcast_to(new[None, :], (T, D)))
        if HAS_OFF:
            x = x - tl.load(off_ptr + b * stride_ob + t[:, None] * stride_ot + h * stride_oh + cols[None, :])
        s0 = tl.load(slot0_ptr + b).to(tl.int64)
        _channel_quantize_store(x, s0 + t, s0, h, r_ptr, mu_ptr, rho_ptr, perm_ptr, bidx_ptr, codes_ptr, scale_ptr,
                                zero_ptr, stride_cp, stride_ch, stride_cs, stride_sp, stride_sh, stride_ss, PAGE_SIZE, D,
                                G, BITS, T, HAS_ROT, HAS_MU, CLIP, PRECISION, MMA)
        mv = tl.load(move_ptr + b).to(tl.int64)
        dst = tl.load(dst_ptr + b).to(tl.int64)
        src_off = mv * stride_wr + h * stride_wh + (tail + t)[:, None] * stride_ws + cols[None, :]
        dst_off = mv * stride_wr + h * stride_wh + (dst + t)[:, None] * stride_ws + cols[None, :]
        tk = tl.load(wk_ptr + src_off, mask=keep)
        tv = tl.load(wv_ptr + src_off, mask=keep)
        tl.store(wk_ptr + dst_off, tk, mask=keep)
        tl.store(wv_ptr + dst_off, tv, mask=keep)


_MMA_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _mma_tables(mma_map: tuple[torch.Tensor, torch.Tensor], d: int, dev: torch.device,
                bits: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(byte_index int32 [16, d*bits/8], channel permutation [d]) of a fragment-order layout given by its token map
    (``oscar.core.quant.mma_token_map``: channel order [16, d], byte index [16, d*bits/8]): the permutation puts the
    channels of token byte k, slot s at planar position k + (d*bits/8) s, so the planar packing of the permuted
    row is the token's bytes in order."""
    order, byte_index = mma_map
    nb, per = d * bits // 8, 8 // bits
    key = (id(order), id(byte_index), dev, bits)
    if key not in _MMA_TABLES:
        check(tuple(order.shape) == (16, d) and tuple(byte_index.shape) == (16, nb),
              lambda: f"mma_map must be (channel order [16, {d}], byte index [16, {nb}])")
        check(bool((order == order[0]).all()), "mma layouts keep one channel order for every token of a block")
        perm = order[0].reshape(nb, per).t().reshape(d)  # perm[k + nb s] = order[per k + s]
        _MMA_TABLES[key] = (byte_index.to(device=dev, dtype=torch.int32).contiguous(), perm.to(dev))
    return _MMA_TABLES[key]


_PERMUTED: dict[tuple, tuple] = {}


def _permuted_rotation(R: Optional[torch.Tensor], perm: torch.Tensor, hkv: int, d: int,
                       dev: torch.device) -> torch.Tensor:
    """``R[:, :, perm]`` (or the permutation matrix when ``R`` is None), once per tensor and version."""
    key = (id(R), R._version if R is not None else 0, hkv, d, dev, id(perm))
    hit = _PERMUTED.get(key)
    if hit is not None and (R is None or hit[0]() is R):
        return hit[1]
    if R is None:
        out = torch.eye(d, device=dev, dtype=torch.float32)[:, perm].expand(hkv, d, d).contiguous()
    else:
        out = R.to(device=dev, dtype=torch.float32)[:, :, perm].contiguous()
    for k in [k for k, v in _PERMUTED.items() if v[0] is not None and v[0]() is None]:
        del _PERMUTED[k]
    _PERMUTED[key] = (weakref.ref(R) if R is not None else None, out)
    return out


def _kernel_args(x, slots, pages: Pages, transform: HeadTransform, src_index, token_map):
    """Validate one tensor's inputs; return (pointer args, stride args, constexpr flags, (rows, Hkv))."""
    codes, scale, zero, bits, group_size = pages.codes, pages.scale, pages.zero, pages.bits, pages.group_size
    check(not transform.rope_centered, "the Triton writer takes rows whose rope-centered offsets are already "
          "subtracted: pass the transform without rope_mu (oscar.cache.paged.rotate_quantize_pack does both)")
    R, mu, rho = transform.R, transform.mu, transform.rho
    check(bits in (2, 4), lambda: f"bits={bits} is not supported; valid values are 2 and 4")
    check((pages.layout == "rows") == (token_map is None),
          lambda: f"pages in the {pages.layout!r} layout need " + ("no token_map" if pages.layout == "rows" else
                                                         "its token_map (oscar.core.quant.mma_token_map)"))
    d = int(x.shape[-1])
    check(x.dim() == (4 if src_index is not None else 3),
          lambda: f"x must be [N, Hkv, d] (or [N, Hkv, T, d] with src_index), got shape {tuple(x.shape)}")
    n, hkv = int(x.shape[0]), int(x.shape[1])
    check(is_pow2(d) and is_pow2(group_size) and group_size <= d,
          lambda: f"head_dim={d} and group_size={group_size} must be powers of two with group_size <= head_dim")
    check(group_size % (8 // bits) == 0,
          lambda: f"group_size={group_size} must be a multiple of {8 // bits} for INT{bits}")
    check(x.stride(-1) == 1, lambda: f"x must be contiguous in its last dim, got strides {x.stride()}")
    check(x.dtype in (torch.float32, torch.float16, torch.bfloat16),
          lambda: f"x dtype {x.dtype} must be float32/float16/bfloat16")
    npages, hkv_c, page_size, nbytes = codes.shape
    check(codes.dtype == torch.uint8 and nbytes == d * bits // 8 and hkv_c == hkv,
          lambda: f"codes must be uint8 [P, {hkv}, page_size, {d * bits // 8}], got {codes.dtype} {tuple(codes.shape)}")
    check(tuple(scale.shape) == (npages, hkv, page_size, d // group_size) and scale.shape == zero.shape
          and scale.dtype == torch.bfloat16 and zero.dtype == torch.bfloat16,
          lambda: f"scale/zero must be bf16 [{npages}, {hkv}, {page_size}, {d // group_size}], got "
          f"{scale.dtype} {tuple(scale.shape)} and {zero.dtype} {tuple(zero.shape)}")
    check(codes.stride(-1) == 1 and scale.stride(-1) == 1 and zero.stride() == scale.stride(),
          "codes/scale/zero must be contiguous in their last dim, scale and zero with equal strides")
    check(is_pow2(page_size), lambda: f"page_size={page_size} must be a power of two")
    check(slots.shape == (n,), lambda: f"slots must be [N={n}], got {tuple(slots.shape)}")
    dev = x.device
    for name, t in (("slots", slots), ("codes", codes), ("scale", scale), ("zero", zero)):
        check(t.device == dev, lambda: f"{name} is on {t.device} but x is on {dev}")
    if R is not None:
        check(tuple(R.shape) == (hkv, d, d), lambda: f"R must be [{hkv}, {d}, {d}], got {tuple(R.shape)}")
    bidx = None
    if token_map is not None:
        check(bits in (2, 4) and group_size == d and d in (64, 128) and page_size % 16 == 0,
              lambda: f"the mma layouts need INT2/INT4, one group per row, d 64/128 and pages of 16k slots; got bits={bits}, "
              f"group_size={group_size}, d={d}, page_size={page_size}")
        bidx, perm = _mma_tables(token_map, d, dev, bits)
        R = _permuted_rotation(R, perm, hkv, d, dev)  # channels come out in the token's byte order
    elif R is not None:
        R = R.to(device=dev, dtype=torch.float32).contiguous()
    if mu is not None:
        check(tuple(mu.shape) == (hkv, d), lambda: f"mu must be [{hkv}, {d}], got {tuple(mu.shape)}")
        mu = mu.to(device=dev, dtype=torch.float32).contiguous()
    if rho is not None:
        check(tuple(rho.shape) == (hkv,), lambda: f"rho must be [{hkv}], got {tuple(rho.shape)}")
        rho = rho.to(device=dev, dtype=torch.float32).contiguous()
    if src_index is not None:
        check(src_index.shape == (n,), lambda: f"src_index must be [N={n}], got {tuple(src_index.shape)}")
    dummy = slots
    ptrs = (x, R if R is not None else dummy, mu if mu is not None else dummy, rho if rho is not None else dummy,
            codes, scale, zero, bidx if bidx is not None else dummy)
    strides = (x.stride(0), x.stride(1), x.stride(2) if src_index is not None else 0,
               codes.stride(0), codes.stride(1), codes.stride(2), scale.stride(0), scale.stride(1), scale.stride(2))
    flags = dict(PAGE_SIZE=page_size, D=d, G=group_size, BITS=bits, HAS_SRC=src_index is not None,
                 HAS_ROT=R is not None, HAS_MU=mu is not None, CLIP=rho is not None, MMA=bidx is not None)
    return ptrs, strides, flags, (n, hkv)


# Up to this many rows (a demotion step): one program per row and head, the row path (measured faster than
# the block path up to 128 rows on the H200: reports/kernels/bench_demote.csv).
ROW_PATH_MAX_ROWS = 128


def _launch(first, second, slots, src_index, launch: Optional[QuantizeLaunch]) -> None:
    launch = QuantizeLaunch() if launch is None else launch
    check(isinstance(launch, QuantizeLaunch),
          lambda: f"launch={launch!r} is not a QuantizeLaunch (the writer's settings)")
    ptrs, strides, flags, (n, hkv) = first
    row_path = n <= ROW_PATH_MAX_ROWS if launch.row_path is None else launch.row_path
    # row path: one row per program on one warp (2 or 4 warps were measured slower), FMA rotation in chunks,
    # clip threshold by ranks
    block_t, num_warps = (1, 1) if row_path else (launch.block_t, launch.warps)
    if second is not None:
        check(second[1] == strides and second[2] == flags and second[3] == (n, hkv),
              "the two tensors of a pair must have equal shapes, strides, transform flags and kinds of layout")
        ptrs2 = second[0]
    else:
        ptrs2 = ptrs
    if n == 0:
        return
    x, r, mu, rho, codes, scale, zero, bidx = ptrs
    dev = x.device
    grid = (triton.cdiv(n, block_t), hkv, 1 if second is None else 2)
    launchable(_rotate_quantize_kernel, dev)[grid](
        x, src_index if src_index is not None else slots, slots, n,
        strides[0], strides[1], strides[2], r, mu, rho, codes, scale, zero, *ptrs2[:7], bidx, ptrs2[7],
        *strides[3:], BLOCK_T=block_t, PRECISION="ieee" if dev.type != "cuda" else "tf32x3",
        num_warps=num_warps, ROW_PATH=row_path, **flags,
    )


def rotate_quantize_pack(
    x: torch.Tensor,
    slots: torch.Tensor,
    pages: Pages,
    transform: HeadTransform,
    *,
    src_index: Optional[torch.Tensor] = None,
    token_map: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    launch: Optional[QuantizeLaunch] = None,
) -> None:
    """Quantize rows into pool slots in place (Triton); the torch twin is
    ``oscar.cache.paged.rotate_quantize_pack_torch``.

    ``x`` ``[N, Hkv, d]`` rows in the original frame, or ``[N, Hkv, T, d]`` with ``src_index`` ``[N]``
    choosing row ``x[n, :, src_index[n]]`` (demotion out of a recent window). ``slots`` ``[N]`` int
    (``page * page_size + offset``). ``pages``: ``oscar.cache.paged.QuantPages`` (codes
    ``[P, Hkv, page_size, d*bits//8]`` uint8, scale/zero ``[P, Hkv, page_size, d//G]`` bf16). ``transform``: ``R``
    ``[Hkv, d, d]``, ``mu`` ``[Hkv, d]``, ``rho`` ``[Hkv]``, each optional, without rope-centered offsets (take them
    off the rows first). ``token_map``: for pages in a fragment-order layout, its map
    (``oscar.core.quant.mma_token_map``).
    """
    args = _kernel_args(x, slots, pages, transform, src_index, token_map)
    _launch(args, None, slots, src_index, launch)


def rotate_quantize_pack_pair(
    xk: torch.Tensor,
    xv: torch.Tensor,
    slots: torch.Tensor,
    k_pages: Pages,
    v_pages: Pages,
    k_transform: HeadTransform,
    v_transform: HeadTransform,
    *,
    src_index: Optional[torch.Tensor] = None,
    token_maps: tuple[Optional[tuple[torch.Tensor, torch.Tensor]], Optional[tuple[torch.Tensor, torch.Tensor]]] = (
        None, None),
    launch: Optional[QuantizeLaunch] = None,
) -> None:
    """K and V rows into their pages in one launch (same slots); the twin is two calls of
    ``oscar.cache.paged.rotate_quantize_pack_torch``. Both tensors need the same shapes, strides and kinds of
    transform and layout; ``token_maps``: ``(K map, V map)`` for fragment-order pages (the codes are then stored
    in that layout, the rotation running with the layout's channel permutation folded in)."""
    a = _kernel_args(xk, slots, k_pages, k_transform, src_index, token_maps[0])
    b = _kernel_args(xv, slots, v_pages, v_transform, src_index, token_maps[1])
    _launch(a, b, slots, src_index, launch)


_IDENTITY_PERMS: dict[tuple, torch.Tensor] = {}


def rotate_quantize_pack_channels(
    x: torch.Tensor,
    slots: torch.Tensor,
    pages: Pages,
    transform: HeadTransform,
    *,
    token_map: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    launch: Optional[QuantizeLaunch] = None,
) -> None:
    """Quantize whole blocks of rows per channel into per-channel key pages (``pages.block = T``) in place (Triton);
    the torch twin is ``oscar.cache.paged.rotate_quantize_pack_torch`` on the same pages.

    ``x`` ``[N, Hkv, d]`` rows in the original frame, ``N % T == 0``, rows ``i*T .. i*T + T - 1`` one block in token
    order; ``slots`` ``[N]`` int, each block's ``T`` slots consecutive from a multiple of ``T`` (not checked here:
    ``oscar.cache.paged.check_whole_blocks``). ``transform`` without rope-centered offsets. ``token_map``: for
    ``mma_k`` pages, their map (``oscar.core.quant.mma_token_map``). ``launch`` is accepted for symmetry (one program
    per block and head)."""
    check(launch is None or isinstance(launch, QuantizeLaunch), lambda: f"launch={launch!r} is not a QuantizeLaunch")
    check(x.dim() == 3, lambda: f"x must be [N, Hkv, d], got shape {tuple(x.shape)}")
    n, hkv, d = (int(v) for v in x.shape)
    T = _check_channel_pages(pages, transform, hkv, d, x.device, token_map)
    check(n % T == 0, lambda: f"per-channel key pages take whole blocks of {T} rows; got N={n}")
    codes, scale, zero, bits, group_size = pages.codes, pages.scale, pages.zero, pages.bits, pages.group_size
    page_size = int(codes.shape[2])
    check(x.stride(-1) == 1 and x.dtype in (torch.float32, torch.float16, torch.bfloat16),
          lambda: f"x must be float32/float16/bfloat16 contiguous in d, got {x.dtype} strides {x.stride()}")
    check(slots.shape == (n,), lambda: f"slots must be [N={n}], got {tuple(slots.shape)}")
    dev = x.device
    check(slots.device == dev, lambda: f"slots is on {slots.device} but x is on {dev}")
    R, mu, rho, perm32, bidx = _channel_tables(pages, transform, hkv, d, dev, token_map)
    if n == 0:
        return
    dummy = perm32
    launchable(_channel_quantize_kernel, dev)[(n // T, hkv)](
        x, slots, x.stride(0), x.stride(1),
        R if R is not None else dummy, mu if mu is not None else dummy, rho if rho is not None else dummy, perm32,
        bidx if bidx is not None else dummy,
        codes, scale, zero, codes.stride(0), codes.stride(1), codes.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        PAGE_SIZE=page_size, D=d, G=group_size, BITS=bits, T=T, HAS_ROT=R is not None, HAS_MU=mu is not None,
        CLIP=rho is not None, PRECISION="ieee" if dev.type != "cuda" else "tf32x3", MMA=bidx is not None,
        num_warps=4,
    )


def _check_channel_pages(pages: Pages, transform: HeadTransform, hkv: int, d: int, dev: torch.device,
                         token_map: Optional[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Refuse, by name, per-channel key pages (and a transform) that the per-channel writers cannot fill with rows
    ``[*, hkv, d]`` on ``dev``; returns the pages' block ``T``."""
    T = int(pages.block)
    check(T > 0 and is_pow2(T), lambda: f"per-channel pages need a power-of-two block, got block={T}")
    check(not transform.rope_centered, "the Triton writer takes rows whose rope-centered offsets are already "
          "subtracted: pass the transform without rope_mu (oscar.cache.paged.rotate_quantize_pack does both; the "
          "decode writer takes them as offsets=)")
    codes, scale, zero, bits, group_size = pages.codes, pages.scale, pages.zero, pages.bits, pages.group_size
    check(bits in (2, 4), lambda: f"bits={bits} is not supported; valid values are 2 and 4")
    check(is_pow2(d) and is_pow2(group_size) and group_size <= d and group_size % (8 // bits) == 0,
          lambda: f"head_dim={d} and group_size={group_size} must be powers of two, group_size <= head_dim and a multiple of "
          f"{8 // bits}")
    npages, hkv_c, page_size, nbytes = (int(v) for v in codes.shape)
    check(codes.dtype == torch.uint8 and nbytes == d * bits // 8 and hkv_c == hkv,
          lambda: f"codes must be uint8 [P, {hkv}, page_size, {d * bits // 8}], got {codes.dtype} {tuple(codes.shape)}")
    check(page_size % T == 0, lambda: f"block={T} must divide page_size={page_size}")
    meta = (npages, hkv, page_size // T, d)
    check(tuple(scale.shape) == meta and zero.shape == scale.shape and scale.dtype == torch.bfloat16
          and zero.dtype == torch.bfloat16 and scale.stride() == zero.stride() and scale.stride(-1) == 1,
          lambda: f"scale/zero must be bf16 {list(meta)} with equal strides, got {scale.dtype} {tuple(scale.shape)} and "
          f"{zero.dtype} {tuple(zero.shape)}")
    check(codes.stride(-1) == 1, "codes must be contiguous in their last dim")
    for name, t in (("codes", codes), ("scale", scale), ("zero", zero)):
        check(t.device == dev, lambda: f"{name} is on {t.device} but the rows are on {dev}")
    check((pages.layout == "rows") == (token_map is None),
          lambda: f"pages in the {pages.layout!r} layout need " + ("no token_map" if pages.layout == "rows" else "its token_map"))
    return T


def _channel_tables(pages: Pages, transform: HeadTransform, hkv: int, d: int, dev: torch.device,
                    token_map: Optional[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
    """(R, mu, rho, perm32, bidx) of a per-channel writer: the rotation with the layout's channel permutation folded
    in (fragment-order pages) and the byte index of that layout, built once per tensor (``_mma_tables``,
    ``_permuted_rotation``)."""
    R, mu, rho = transform.R, transform.mu, transform.rho
    if R is not None:
        check(tuple(R.shape) == (hkv, d, d), lambda: f"R must be [{hkv}, {d}, {d}], got {tuple(R.shape)}")
    bidx = None
    if token_map is not None:
        check(pages.group_size == d and d in (64, 128) and pages.codes.shape[2] % 16 == 0,
              lambda: f"the mma layouts need one group per row, d 64/128 and pages of 16k slots; got "
              f"group_size={pages.group_size}, d={d}, page_size={pages.codes.shape[2]}")
        bidx, perm = _mma_tables(token_map, d, dev, pages.bits)
        R = _permuted_rotation(R, perm, hkv, d, dev)
        perm32 = perm.to(device=dev, dtype=torch.int32).contiguous()
    else:
        if R is not None:
            R = R.to(device=dev, dtype=torch.float32).contiguous()
        key = (d, dev)
        if key not in _IDENTITY_PERMS:
            _IDENTITY_PERMS[key] = torch.arange(d, dtype=torch.int32, device=dev)
        perm32 = _IDENTITY_PERMS[key]
    if mu is not None:
        check(tuple(mu.shape) == (hkv, d), lambda: f"mu must be [{hkv}, {d}], got {tuple(mu.shape)}")
        mu = mu.to(device=dev, dtype=torch.float32).contiguous()
    if rho is not None:
        check(tuple(rho.shape) == (hkv,), lambda: f"rho must be [{hkv}], got {tuple(rho.shape)}")
        rho = rho.to(device=dev, dtype=torch.float32).contiguous()
    return R, mu, rho, perm32, bidx


def quantize_key_blocks_from_ring(
    new: torch.Tensor,
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    req: torch.Tensor,
    done: torch.Tensor,
    src: torch.Tensor,
    slot0: torch.Tensor,
    move_row: torch.Tensor,
    move_dst: torch.Tensor,
    tail: int,
    pages: Pages,
    transform: HeadTransform,
    *,
    offsets: Optional[torch.Tensor] = None,
    token_map: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> None:
    """A decode step's per-channel key blocks in one launch (Triton; fixed shapes, no host sync: CUDA-graph
    capturable): for each batch entry ``b`` whose new row completes a block (``done[b]``), the block's ``T`` keys
    (``T - 1`` rows of ``win_k[req[b], :, src[b] : src[b] + T - 1]``, then ``new[b]``) quantized per channel into
    slots ``slot0[b] .. slot0[b] + T - 1`` of ``pages`` (``rotate_quantize_pack_channels`` of those rows, the same
    math), and the ``T - 1`` rows at columns ``tail ..`` of request slot ``move_row[b]`` moved to columns
    ``move_dst[b] ..`` in both window buffers; entries not ``done`` do nothing. The twin is the pool's gather,
    ``oscar.cache.paged.rotate_quantize_pack_torch`` and the window moves (``OscarTokenToKVPool._write_decode_blocks``).

    ``new`` ``[B, Hkv, d]``; ``win_k``/``win_v`` ``[R, Hkv, S, d]`` with equal strides; ``req``, ``src``, ``slot0``,
    ``move_row``, ``move_dst`` ``[B]`` int; ``done`` ``[B]`` bool; ``offsets``: rope-centered keys' offsets ``[B, T,
    Hkv, d]`` float32 of the block's positions (then ``transform`` without them), else None."""
    check(new.dim() == 3 and win_k.dim() == 4 and win_k.shape == win_v.shape and win_k.stride() == win_v.stride(),
          lambda: f"new must be [B, Hkv, d] and the window buffers [R, Hkv, S, d] alike; got {tuple(new.shape)}, "
          f"{tuple(win_k.shape)} and {tuple(win_v.shape)}")
    bsz, hkv, d = (int(v) for v in new.shape)
    T = _check_channel_pages(pages, transform, hkv, d, new.device, token_map)
    check(T > 1, lambda: f"the decode writer takes blocks of more than one row, got block={T}")
    check(tuple(win_k.shape[1:2]) == (hkv,) and win_k.shape[3] == d and new.stride(-1) == 1 and win_k.stride(-1) == 1,
          lambda: f"window buffers [R, {hkv}, S, {d}] contiguous in d expected, got {tuple(win_k.shape)}")
    check(0 < tail and tail + T - 1 <= win_k.shape[2], lambda: f"tail={tail} leaves no {T - 1} rows in windows of "
          f"{win_k.shape[2]} columns")
    for name, t in (("req", req), ("done", done), ("src", src), ("slot0", slot0), ("move_row", move_row),
                    ("move_dst", move_dst)):
        check(t.shape == (bsz,) and t.device == new.device, lambda: f"{name} must be [B={bsz}] on {new.device}, got "
              f"{tuple(t.shape)} on {t.device}")
    codes, scale, zero, bits, group_size = pages.codes, pages.scale, pages.zero, pages.bits, pages.group_size
    if offsets is not None:
        check(tuple(offsets.shape) == (bsz, T, hkv, d) and offsets.dtype == torch.float32 and offsets.stride(-1) == 1,
              lambda: f"offsets must be float32 [B={bsz}, T={T}, {hkv}, {d}], got {offsets.dtype} {tuple(offsets.shape)}")
    dev = new.device
    R, mu, rho, perm32, bidx = _channel_tables(pages, transform, hkv, d, dev, token_map)
    if bsz == 0:
        return
    dummy = perm32
    off = offsets if offsets is not None else dummy
    ostr = offsets.stride()[:3] if offsets is not None else (0, 0, 0)
    launchable(_channel_ring_kernel, dev)[(bsz, hkv)](
        new, new.stride(0), new.stride(1), win_k, win_v, win_k.stride(0), win_k.stride(1), win_k.stride(2),
        req, done, src, slot0, move_row, move_dst, int(tail), off, *ostr,
        R if R is not None else dummy, mu if mu is not None else dummy, rho if rho is not None else dummy, perm32,
        bidx if bidx is not None else dummy,
        codes, scale, zero, codes.stride(0), codes.stride(1), codes.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        PAGE_SIZE=int(codes.shape[2]), D=d, G=group_size, BITS=bits, T=T, HAS_ROT=R is not None, HAS_MU=mu is not None,
        CLIP=rho is not None, PRECISION="ieee" if dev.type != "cuda" else "tf32x3", MMA=bidx is not None,
        HAS_OFF=offsets is not None, num_warps=4,
    )


__all__ = ["ROW_PATH_MAX_ROWS", "quantize_key_blocks_from_ring", "rotate_quantize_pack", "rotate_quantize_pack_channels",
           "rotate_quantize_pack_pair"]

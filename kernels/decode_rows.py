"""Paged INT2/INT4 decode attention over row-layout pages (Triton), split-K, GQA-aware, merged with the BF16
sink and recent windows. Launcher: ``paged_decode_attention_rows``; launch settings:
``oscar.kernels.launch.RowsLaunch``; torch twin (the specification): ``oscar.cache.paged.decode_attention_torch``.

Two paths, both with fixed grids (lengths and page tables are read from device tensors, so a call can
be captured in a CUDA graph).

Bit-plane path (v8; the default where one group spans the row and a row has >= 32 bytes, e.g. d=128
INT2 or d=64 INT4), two or three launches:

1. ``_planes_kernel`` ``(B * Hkv, num_splits [+ BF16 chunks])``: each program scales and rotates its
   group's query itself (fp16 ``R_K``, float32 sums) and walks a page-aligned range of tokens. Byte
   ``j`` of a row holds channel ``p*W + j`` in plane ``p`` (``W = d*bits/8``), so a plane is a plain
   ``[BLOCK_N, W]`` operand. Scores: int8 tensor cores against the rotated query in two int8 levels
   (exact integer sums), ``s = scale * (q . c) + zero * sum(q) + q . mu_K``. Output: fp16 planes
   ``2^(bits*p) c`` times ``p * scale`` (heads in M), scaled back once at the end, then, in the
   original frame, rotated back (``o R_V^T + mu_V``) in the program. Plane extraction is inline PTX on
   the GPU (sources from ``plane_sources``), plain Triton in the interpreter. With ``fuse_bf16`` the
   BF16 chunks are extra programs of this launch.
2. ``_bf16_partial_kernel`` (unless fused): the BF16 sink and recent window in chunks of 64 tokens.
3. ``_merge_cols_kernel`` ``(B * Hkv, d / 32)``: log-sum-exp merge of all partials, which are in one
   frame, parallel over column chunks (in the rotated output frame: ``_merge_kernel`` instead).

Word path (v7; d=64 INT2, several groups per row, ``RowsLaunch(planes=False)``), three or four launches:

1. ``_prep_kernel`` ``(B * Hkv,)``: the query scaled into the log2 domain, rotated once
   (``q @ R_K``, 3xTF32 on the GPU) and ``q . mu_K``.
2. ``_partial_kernel`` ``(B * Hkv, num_splits)``: each program walks a page-aligned range of
   quantized tokens of one sequence and one KV head, page by page (contiguous int32-word loads of
   the next block issued before the current block is computed), reading each page once for all
   ``H / Hkv`` query heads of the group. Tokens sit in the M dimension of the products (scores
   ``K q^T`` ``[BLOCK_N, heads]``, output ``V^T p`` ``[d, heads]``).
   Codes become exact fp16 by the magic number (``0x6400 | c`` is ``1024 + c``), in a channel
   order that needs no shuffles (the query and the output are permuted instead); on the GPU the
   field extraction of INT2 is inline PTX. With one group per row
   (``G == d``) dequantization is folded into the products: ``s = scale * (q . c) + zero *
   sum(q)`` and ``o = sum (p * scale) c + sum p * zero``; with several groups the codes are
   dequantized to fp16 before the product.
3. ``_bf16_partial_kernel`` ``(B * Hkv, chunks)``: the BF16 sink and recent window in chunks of
   64 tokens (bf16 tensor-core products on the GPU; float32 under the interpreter, whose bf16
   products are wrong).
4. ``_merge_kernel`` ``(B * Hkv,)``: log-sum-exp merge of the quantized partials, change of
   frame (``o_rot @ R_V^T + mu_V``, or the BF16 part into the rotated frame), merge with the
   BF16 partials, cast to the query dtype.

Every partial is a normalized output and its log-sum-exp (base 2). The torch twin is
``oscar.cache.paged.decode_attention_torch`` (float32 dequantize-then-attend).
"""

from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

from ._runtime import check, is_pow2, launchable, next_pow2
from .launch import RowsLaunch
from .segments import HeadTransform, Pages, Segments

LOG2E = 1.4426950408889634


@triton.jit
def _magic_fp16(w, shift: tl.constexpr, MASK: tl.constexpr):
    """Field ``(w >> shift) & MASK`` of int32 words as an exact fp16 (``0x6400 | c`` is ``1024 + c``)."""
    return (((w >> shift) & MASK) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _quad(a, b, c, d):
    """Four same-shape tensors -> one with a new last axis of 4, in the order a, b, c, d."""
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), a.shape + [4])


@triton.jit
def _unpack_fp16(words, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """int32 words ``[BLOCK_N, D*BITS/32]`` of planar-packed codes -> exact fp16 codes ``[BLOCK_N, D]``.

    Channels come out in the kernel order ``c' = j*PER + p`` within each group (byte ``j`` of the
    group, plane ``p``), i.e. actual channel ``_channel_perm(c')``: no shuffles, the query and the
    output are permuted instead. Byte ``i`` of a word is byte ``4*word + i`` of the row.
    """
    MASK: tl.constexpr = (1 << BITS) - 1
    # per plane p: the four bytes of each word on a new last axis; then the planes on the last axis
    f0 = _quad(_magic_fp16(words, 0, MASK), _magic_fp16(words, 8, MASK),
               _magic_fp16(words, 16, MASK), _magic_fp16(words, 24, MASK))
    f1 = _quad(_magic_fp16(words, BITS, MASK), _magic_fp16(words, 8 + BITS, MASK),
               _magic_fp16(words, 16 + BITS, MASK), _magic_fp16(words, 24 + BITS, MASK))
    if BITS == 2:
        f2 = _quad(_magic_fp16(words, 4, MASK), _magic_fp16(words, 12, MASK),
                   _magic_fp16(words, 20, MASK), _magic_fp16(words, 28, MASK))
        f3 = _quad(_magic_fp16(words, 6, MASK), _magic_fp16(words, 14, MASK),
                   _magic_fp16(words, 22, MASK), _magic_fp16(words, 30, MASK))
        out = _quad(f0, f1, f2, f3)
    else:
        out = tl.join(f0, f1)
    return tl.reshape(out, (BLOCK_N, D))


@triton.jit
def _channel_perm(D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr):
    """Actual channel of each kernel-order channel ``c' = g*G + j*PER + p``: ``g*G + p*(G/PER) + j``."""
    PER: tl.constexpr = 8 // BITS
    cp = tl.arange(0, D)
    r = cp % G
    return (cp // G) * G + (r % PER) * (G // PER) + r // PER


def _asm_byte_source(i: int) -> str:
    """PTX for ``_asm_byte``: byte ``i`` of two words into fp16x2 registers, one per INT2 plane."""
    sel = ((4 + i) << 12) | ((4 + i) << 8) | (i << 4) | i  # d = [a.i, a.i, b.i, b.i]
    lines = [".reg .b32 t, u, m;", "mov.b32 m, 0x64006400;", f"prmt.b32 t, $4, $5, {sel};"]
    for p in range(4):
        lines += [f"shr.b32 u, t, {2 * p};", "and.b32 u, u, 0x00030003;", "or.b32 u, u, m;", f"sub.f16x2 ${p}, u, m;"]
    return "{\n" + "\n".join(lines) + "\n}"


_ASM_B0 = tl.constexpr(_asm_byte_source(0))
_ASM_B1 = tl.constexpr(_asm_byte_source(1))
_ASM_B2 = tl.constexpr(_asm_byte_source(2))
_ASM_B3 = tl.constexpr(_asm_byte_source(3))


@triton.jit
def _asm_byte(words, SRC: tl.constexpr):
    """Inline PTX: the four INT2 planes of one byte of each int32 word as fp16, two words per instance."""
    return tl.inline_asm_elementwise(
        asm=SRC,
        constraints="=r,=r,=r,=r,r,r",
        args=[words],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def _unpack_fp16_asm(words, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """``_unpack_fp16`` for INT2 with the field extraction in inline PTX (GPU only): ~1.6 instructions a code."""
    a0, a1, a2, a3 = _asm_byte(words, _ASM_B0)
    b0, b1, b2, b3 = _asm_byte(words, _ASM_B1)
    c0, c1, c2, c3 = _asm_byte(words, _ASM_B2)
    d0, d1, d2, d3 = _asm_byte(words, _ASM_B3)
    out = _quad(_quad(a0, b0, c0, d0), _quad(a1, b1, c1, d1), _quad(a2, b2, c2, d2), _quad(a3, b3, c3, d3))
    return tl.reshape(out, (BLOCK_N, D))


@triton.jit
def _bf16_segment(k_ptr, v_ptr, start, n, stride_t, qT, m_i, l_i, acc,
                  BLOCK_N: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DOT_T: tl.constexpr):
    """Online-softmax pass over BF16 rows ``start..n-1`` of one head: returns updated ``(m, l, acc [D, HP])``."""
    cols = tl.arange(0, D)
    for t0 in range(start, n, BLOCK_N):
        toks = t0 + tl.arange(0, BLOCK_N)
        tmask = toks < n
        off = toks.to(tl.int64)[:, None] * stride_t + cols[None, :]
        k = tl.load(k_ptr + off, mask=tmask[:, None], other=0.0).to(DOT_T)
        s = tl.dot(k, qT)
        s = tl.where(tmask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        v = tl.load(v_ptr + off, mask=tmask[:, None], other=0.0).to(DOT_T)
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(DOT_T))
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _block_rows(pt_row, t, end, rows, kvh, stride_cp, stride_ch, stride_mp, stride_mh,
                PAGE_SIZE: tl.constexpr, NW: tl.constexpr, NG: tl.constexpr, ROW_GATHER: tl.constexpr):
    """Word offset of each row's codes, element offset of its scales, and the row mask, for block ``t``.

    Without ``ROW_GATHER`` the block lies in one page (one page-table read); with it (pages
    smaller than the block) every row looks its page up.
    """
    toks = t + rows
    if ROW_GATHER:
        pgs = tl.load(pt_row + toks // PAGE_SIZE, mask=toks < end, other=0).to(tl.int64)
        slot = toks % PAGE_SIZE
        cvec = pgs * stride_cp + kvh * stride_ch + slot * NW
        mvec = pgs * stride_mp + kvh * stride_mh + slot * NG
    else:
        pg = tl.load(pt_row + t // PAGE_SIZE, mask=t < end, other=0).to(tl.int64)
        cvec = pg * stride_cp + kvh * stride_ch + (t % PAGE_SIZE) * NW + rows * NW
        mvec = pg * stride_mp + kvh * stride_mh + (t % PAGE_SIZE) * NG + rows * NG
    return cvec, mvec, toks < end


@triton.jit
def _kblock_rows(pt_row, t, end, grows, kvh, stride_kmp, stride_kmh,
                 PAGE_SIZE: tl.constexpr, D: tl.constexpr, KBLOCK: tl.constexpr):
    """Element offset of the per-channel key block (``[page, h, slot // KBLOCK, 0]``) of each row group of tile ``t``
    (groups start at rows ``grows``; a group lies in one key block: tiles start at multiples of the tile size and
    both sizes are powers of two), and the groups' mask."""
    toks = t + grows
    gmask = toks < end
    pgs = tl.load(pt_row + toks // PAGE_SIZE, mask=gmask, other=0).to(tl.int64)
    return pgs * stride_kmp + kvh * stride_kmh + ((toks % PAGE_SIZE) // KBLOCK) * D, gmask


@triton.jit
def _load_block(kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, cvec, mvec, nmask, wcols, gcols, NG: tl.constexpr,
                kvec=None, kmask=None, cperm=None, KBLOCK: tl.constexpr = 0):
    """Codes (int32 words) and scales/zeros of K and V for one block of rows; per-channel keys (``KBLOCK``): the
    K scales/zeros ``[row groups, D]`` of each row group's key block, in the kernel's channel order ``cperm``."""
    c_off = cvec[:, None] + wcols[None, :]
    kc = tl.load(kc_ptr + c_off, mask=nmask[:, None], other=0)
    vc = tl.load(vc_ptr + c_off, mask=nmask[:, None], other=0)
    if NG == 1:
        vs = tl.load(vs_ptr + mvec, mask=nmask, other=0.0)
        vz = tl.load(vz_ptr + mvec, mask=nmask, other=0.0)
        if KBLOCK == 0:
            ks = tl.load(ks_ptr + mvec, mask=nmask, other=0.0)
            kz = tl.load(kz_ptr + mvec, mask=nmask, other=0.0)
    else:
        m_off = mvec[:, None] + gcols[None, :]
        vs = tl.load(vs_ptr + m_off, mask=nmask[:, None], other=0.0)
        vz = tl.load(vz_ptr + m_off, mask=nmask[:, None], other=0.0)
        if KBLOCK == 0:
            ks = tl.load(ks_ptr + m_off, mask=nmask[:, None], other=0.0)
            kz = tl.load(kz_ptr + m_off, mask=nmask[:, None], other=0.0)
    if KBLOCK > 0:
        k_off = kvec[:, None] + cperm[None, :]
        ks = tl.load(ks_ptr + k_off, mask=kmask[:, None], other=0.0)
        kz = tl.load(kz_ptr + k_off, mask=kmask[:, None], other=0.0)
    return kc, vc, ks, kz, vs, vz


@triton.jit
def _int_split(
    pid, split,
    qr_ptr, qmu_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    stride_cp, stride_ch,
    stride_mp, stride_mh,
    pt_ptr, stride_ptb, len_ptr,
    o_ptr, lse_ptr,
    tokens_per_split, s_total,
    HKV: tl.constexpr, REP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    BITS: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FAST_UNPACK: tl.constexpr,
    ROW_GATHER: tl.constexpr, stride_kmp=0, stride_kmh=0, KBLOCK: tl.constexpr = 0, TT: tl.constexpr = 1,
):
    """One split of the quantized segment for one (sequence, KV head): normalized output + LSE. Per-channel keys
    (``KBLOCK`` > 0, K scale/zero ``[P, Hkv, page/KBLOCK, D]`` with strides ``stride_kmp``, ``stride_kmh``): each
    row's codes are dequantized with its block's per-channel scale and zero before the product."""
    b = pid // HKV
    kvh = pid % HKV
    H: tl.constexpr = HKV * REP
    NG: tl.constexpr = D // G
    NW: tl.constexpr = D * BITS // 32  # int32 words per row
    heads = tl.arange(0, HP)
    hmask = heads < REP
    hq = kvh * REP + heads
    cperm = _channel_perm(D, G, BITS)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([D, HP], tl.float32)
    n = tl.load(len_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, n)
    q16 = tl.load(qr_ptr + (b * H + hq)[:, None] * D + cperm[None, :], mask=hmask[:, None], other=0.0).to(tl.float16)
    q16T = tl.trans(q16)
    qmu = tl.load(qmu_ptr + b * H + hq, mask=hmask, other=0.0)
    qsum = tl.sum(q16.to(tl.float32), axis=1)
    accz = tl.zeros([HP], tl.float32)
    wcols = tl.arange(0, NW)
    gcols = tl.arange(0, NG)
    rows = tl.arange(0, BLOCK_N)
    # Page-major walk: a block is BLOCK_N consecutive slots of one page (BLOCK_N <= PAGE_SIZE,
    # split starts aligned to pages), so its codes are one contiguous run of bytes (pages smaller
    # than a block: ROW_GATHER, each row finds its page); the next block's page ids, codes and
    # scales are loaded before this block is computed (by hand: measured faster than Triton's
    # software pipelining of plain loads, which does not help an elementwise-unpacked operand).
    pt_row = pt_ptr + b * stride_ptb
    cvec, mvec, nmask = _block_rows(pt_row, start, end, rows, kvh, stride_cp, stride_ch, stride_mp, stride_mh,
                                    PAGE_SIZE, NW, NG, ROW_GATHER)
    # per-channel keys: rows in groups of TT consecutive rows of one key block, one scale/zero row per group
    NBK: tl.constexpr = BLOCK_N // TT
    grows = tl.arange(0, NBK) * TT
    kvec = None
    kmask = None
    if KBLOCK > 0:
        kvec, kmask = _kblock_rows(pt_row, start, end, grows, kvh, stride_kmp, stride_kmh, PAGE_SIZE, D, KBLOCK)
    kc_n, vc_n, ks_n, kz_n, vs_n, vz_n = _load_block(kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, cvec, mvec,
                                                     nmask, wcols, gcols, NG, kvec, kmask, cperm, KBLOCK)
    for t0 in range(start, end, BLOCK_N):
        # this block was loaded one iteration ago; issue the next one now
        kc = kc_n
        vc = vc_n
        ks = ks_n.to(tl.float32)
        kz = kz_n.to(tl.float32)
        vs = vs_n.to(tl.float32)
        vz = vz_n.to(tl.float32)
        tmask = nmask
        cvec, mvec, nmask = _block_rows(pt_row, t0 + BLOCK_N, end, rows, kvh, stride_cp, stride_ch, stride_mp,
                                        stride_mh, PAGE_SIZE, NW, NG, ROW_GATHER)
        if KBLOCK > 0:
            kvec, kmask = _kblock_rows(pt_row, t0 + BLOCK_N, end, grows, kvh, stride_kmp, stride_kmh, PAGE_SIZE, D,
                                       KBLOCK)
        kc_n, vc_n, ks_n, kz_n, vs_n, vz_n = _load_block(kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, cvec,
                                                         mvec, nmask, wcols, gcols, NG, kvec, kmask, cperm, KBLOCK)
        if FAST_UNPACK:
            kcode = _unpack_fp16_asm(kc, BLOCK_N, D, BITS)
        else:
            kcode = _unpack_fp16(kc, BLOCK_N, D, BITS)
        if KBLOCK > 0:  # per-channel keys: dequantize each row group with its block's scale/zero (kernel order)
            k3 = tl.reshape(kcode.to(tl.float32), (NBK, TT, D)) * ks[:, None, :] + kz[:, None, :]
            s = tl.dot(tl.reshape(k3, (BLOCK_N, D)).to(tl.float16), q16T)
        elif NG == 1:
            s = tl.dot(kcode, q16T) * ks[:, None] + kz[:, None] * qsum[None, :]
        else:
            k3 = tl.reshape(kcode, (BLOCK_N, NG, G)).to(tl.float32) * ks[:, :, None] + kz[:, :, None]
            s = tl.dot(tl.reshape(k3, (BLOCK_N, D)).to(tl.float16), q16T)
        s = s + qmu[None, :]
        s = tl.where(tmask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if FAST_UNPACK:
            vcode = _unpack_fp16_asm(vc, BLOCK_N, D, BITS)
        else:
            vcode = _unpack_fp16(vc, BLOCK_N, D, BITS)
        if NG == 1:
            acc = acc * alpha[None, :] + tl.dot(tl.trans(vcode), (p * vs[:, None]).to(tl.float16))
            accz = accz * alpha + tl.sum(p * vz[:, None], axis=0)
        else:
            v3 = tl.reshape(vcode, (BLOCK_N, NG, G)).to(tl.float32) * vs[:, :, None] + vz[:, :, None]
            acc = acc * alpha[None, :] + tl.dot(tl.trans(tl.reshape(v3, (BLOCK_N, D)).to(tl.float16)),
                                                p.to(tl.float16))
        m_i = m_new
    nonempty = l_i > 0.0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    row = (b * H + hq) * s_total + split
    o = (acc + accz[None, :]) / tl.where(nonempty, l_i, 1.0)[None, :]
    tl.store(o_ptr + row[None, :] * D + cperm[:, None], o, mask=hmask[None, :])  # kernel order -> actual
    tl.store(lse_ptr + row, lse, mask=hmask)


def _plane_asm_i8(p: int, bits: int) -> str:
    """PTX: plane ``p`` of four packed bytes as four int8 codes in one register (shift and mask)."""
    mask = 0x03030303 if bits == 2 else 0x0F0F0F0F
    if p == 0:
        return f"and.b32 $0, $1, {mask:#x};"
    return "{\n.reg .b32 t;\n" + f"shr.b32 t, $1, {bits * p};\nand.b32 $0, t, {mask:#x};\n" + "}"


def _plane_asm_f16(p: int, bits: int) -> str:
    """PTX: plane ``p`` of four packed bytes as four exact fp16 values ``2^(bits*p) * code`` (two registers).

    Bytes are widened to 16-bit lanes (``prmt``), masked to the plane and given the exponent of
    1024 (``lop3``: ``(t & m) | 0x6400``), then 1024 is subtracted (``sub.f16x2``). The plane is not
    shifted down: the kernel scales its accumulator by ``2^-(bits*p)`` once at the end.
    """
    m = ((1 << bits) - 1) << (bits * p)
    mask = m | (m << 16)
    lines = [".reg .b32 t, u, z;", "mov.b32 z, 0;", "mov.b32 u, 0x64006400;",
             "prmt.b32 t, $2, z, 0x4140;", f"lop3.b32 t, t, {mask:#x}, u, 0xEA;", "sub.f16x2 $0, t, u;",
             "prmt.b32 t, $2, z, 0x4342;", f"lop3.b32 t, t, {mask:#x}, u, 0xEA;", "sub.f16x2 $1, t, u;"]
    return "{\n" + "\n".join(lines) + "\n}"


def plane_sources(bits: int) -> dict[str, str]:
    """The inline-PTX sources of every plane, as the plane kernel's constexpr arguments ``AK0..AK3``
    (key planes, int8) and ``AV0..AV3`` (value planes, fp16); INT4 has two planes, the rest stay empty."""
    per = 8 // bits
    src = {f"AK{p}": _plane_asm_i8(p, bits) if p < per else "" for p in range(4)}
    src.update({f"AV{p}": _plane_asm_f16(p, bits) if p < per else "" for p in range(4)})
    return src


@triton.jit
def _plane_i8(b, p: tl.constexpr, BITS: tl.constexpr, FAST: tl.constexpr, SRC: tl.constexpr):
    """Plane ``p`` of packed bytes ``b`` (uint8) as int8 codes, same shape (``SRC``: its PTX, GPU only)."""
    if FAST:
        return tl.inline_asm_elementwise(asm=SRC, constraints="=r,r", args=[b], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return ((b >> (BITS * p)) & ((1 << BITS) - 1)).to(tl.int8)


@triton.jit
def _plane_f16(b, p: tl.constexpr, BITS: tl.constexpr, FAST: tl.constexpr, SRC: tl.constexpr):
    """Plane ``p`` of packed bytes ``b`` (uint8) as exact fp16 ``2^(BITS*p) * code``, same shape."""
    if FAST:
        return tl.inline_asm_elementwise(asm=SRC, constraints="=r,=r,r", args=[b], dtype=tl.float16, is_pure=True,
                                         pack=4)
    else:
        return (b & (((1 << BITS) - 1) << (BITS * p))).to(tl.float16)


@triton.jit
def _q_rot_plane(q16, q_ptr, qrow, hmask, scale, rk_ptr, kvh, p: tl.constexpr, W: tl.constexpr, D: tl.constexpr,
                 HAS_RK: tl.constexpr):
    """Channels ``p*W .. p*W+W-1`` of the scaled query in the rotated frame, float32 ``[HP, W]``.

    With a rotation: ``q16 @ R_K[:, p*W : p*W+W]`` (fp16 operands, float32 sums); without: the raw channels.
    """
    if HAS_RK:
        r = tl.load(rk_ptr + kvh * D * D + tl.arange(0, D)[:, None] * D + (p * W + tl.arange(0, W))[None, :])
        return tl.dot(q16, r)
    else:
        q = tl.load(q_ptr + qrow[:, None] * D + (p * W + tl.arange(0, W))[None, :], mask=hmask[:, None], other=0.0)
        return q.to(tl.float32) * scale


@triton.jit
def _q_levels(qp, inv_hi, sc_hi, inv_lo):
    """A query plane ``[HP, W]`` as the int8 products' operands ``[W, HP]``: two levels ``(hi, lo)``."""
    hi = tl.floor(qp * inv_hi[:, None] + 0.5)
    lo = tl.floor((qp - hi * sc_hi[:, None]) * inv_lo[:, None] + 0.5)
    return tl.trans(hi.to(tl.int8)), tl.trans(lo.to(tl.int8))


@triton.jit
def _o_plane_out(out, o_p, rv_ptr, kvh, p: tl.constexpr, W: tl.constexpr, D: tl.constexpr):
    """``out += o_p @ R_V[:, p*W : p*W+W]^T``: a rotated-frame output plane back to the original frame."""
    rt = tl.load(rv_ptr + kvh * D * D + tl.arange(0, D)[None, :] * D + (p * W + tl.arange(0, W))[:, None])
    return tl.dot(o_p.to(tl.float16), rt, out)


@triton.jit
def _qk_plane(kb, acc_hi, acc_lo, qh, ql, p: tl.constexpr, BITS: tl.constexpr, FAST: tl.constexpr,
              SRC_I8: tl.constexpr):
    """Exact int32 scores of key plane ``p`` against both int8 levels of the query."""
    c = _plane_i8(kb, p, BITS, FAST, SRC_I8)
    acc_hi = tl.dot(c, qh, acc_hi, out_dtype=tl.int32)
    acc_lo = tl.dot(c, ql, acc_lo, out_dtype=tl.int32)
    return acc_hi, acc_lo


@triton.jit
def _plane_block(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, pt_row, t0, end, rows, wcols, kvh,
                 stride_cp, stride_ch, stride_mp, stride_mh,
                 W: tl.constexpr, PAGE_SIZE: tl.constexpr, ROW_GATHER: tl.constexpr):
    """Packed K/V bytes ``[BLOCK_N, W]``, bf16 scales/zeros ``[BLOCK_N]`` and the row mask of the block at ``t0``."""
    toks = t0 + rows
    tmask = toks < end
    if ROW_GATHER:
        pgs = tl.load(pt_row + toks // PAGE_SIZE, mask=tmask, other=0).to(tl.int64)
        slot = toks % PAGE_SIZE
    else:
        pgs = tl.load(pt_row + t0 // PAGE_SIZE, mask=t0 < end, other=0).to(tl.int64)
        slot = (t0 % PAGE_SIZE) + rows
    cvec = pgs * stride_cp + kvh * stride_ch + slot * W
    mvec = pgs * stride_mp + kvh * stride_mh + slot
    c_off = cvec[:, None] + wcols[None, :]
    kb = tl.load(kc_ptr + c_off, mask=tmask[:, None], other=0)
    vb = tl.load(vc_ptr + c_off, mask=tmask[:, None], other=0)
    ks = tl.load(ks_ptr + mvec, mask=tmask, other=0.0)
    kz = tl.load(kz_ptr + mvec, mask=tmask, other=0.0)
    vs = tl.load(vs_ptr + mvec, mask=tmask, other=0.0)
    vz = tl.load(vz_ptr + mvec, mask=tmask, other=0.0)
    return kb, vb, ks, kz, vs, vz, tmask


@triton.jit
def _int_split_planes(
    pid, split,
    q_ptr, scale, rk_ptr, muk_ptr, rv_ptr, muv_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    stride_cp, stride_ch,
    stride_mp, stride_mh,
    pt_ptr, stride_ptb, len_ptr,
    o_ptr, lse_ptr,
    tokens_per_split, s_total,
    HKV: tl.constexpr, REP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
    BITS: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FAST_UNPACK: tl.constexpr,
    ROW_GATHER: tl.constexpr,
    HAS_RK: tl.constexpr, HAS_MUK: tl.constexpr, ROT_OUT: tl.constexpr, HAS_MUV: tl.constexpr,
    AK0: tl.constexpr, AK1: tl.constexpr, AK2: tl.constexpr, AK3: tl.constexpr,
    AV0: tl.constexpr, AV1: tl.constexpr, AV2: tl.constexpr, AV3: tl.constexpr,
):
    """One split of the quantized segment (one group per row) by bit planes: normalized output + LSE.

    Reads the raw query and rotates it itself (no preparation launch). Byte ``j`` of a row holds, in
    plane ``p``, channel ``p*W + j`` (``W = D*BITS/8``), so each plane is a plain ``[BLOCK_N, W]``
    operand for channels ``p*W..p*W+W-1``: no joins, no permutation. Scores run on int8 tensor cores
    against the rotated query split into two int8 levels (``q = s_hi q_hi + s_lo q_lo``, within 2^-15 of
    max|q|; one level was measured too coarse, ~3e-2), exact integer sums. Blocks are plain loads in the
    loop (a manual prefetch was measured 0-10% slower here: its registers cost occupancy). Output: fp16
    planes ``2^(BITS*p) c`` weighted by ``p * scale`` (heads in M), each plane's accumulator scaled back once
    at the end; with
    ``ROT_OUT`` the normalized partial goes back to the original frame here (``o R_V^T + mu_V``), so
    every partial of the merge is in one frame.
    """
    b = pid // HKV
    kvh = pid % HKV
    H: tl.constexpr = HKV * REP
    PER: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // PER  # bytes per row = channels per plane
    heads = tl.arange(0, HP)
    hmask = heads < REP
    hq = kvh * REP + heads
    qrow = b * H + hq
    n = tl.load(len_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, n)
    dcols = tl.arange(0, D)
    qs = tl.load(q_ptr + qrow[:, None] * D + dcols[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * scale
    if HAS_MUK:
        qmu = tl.sum(qs * tl.load(muk_ptr + kvh * D + dcols)[None, :], axis=1)
    else:
        qmu = tl.zeros([HP], tl.float32)
    q16 = qs.to(tl.float16)
    qp0 = _q_rot_plane(q16, q_ptr, qrow, hmask, scale, rk_ptr, kvh, 0, W, D, HAS_RK)
    qp1 = _q_rot_plane(q16, q_ptr, qrow, hmask, scale, rk_ptr, kvh, 1, W, D, HAS_RK)
    amax = tl.maximum(tl.max(tl.abs(qp0), axis=1), tl.max(tl.abs(qp1), axis=1))
    qsum = tl.sum(qp0, axis=1) + tl.sum(qp1, axis=1)
    if PER == 4:
        qp2 = _q_rot_plane(q16, q_ptr, qrow, hmask, scale, rk_ptr, kvh, 2, W, D, HAS_RK)
        qp3 = _q_rot_plane(q16, q_ptr, qrow, hmask, scale, rk_ptr, kvh, 3, W, D, HAS_RK)
        amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(qp2), axis=1), tl.max(tl.abs(qp3), axis=1)))
        qsum += tl.sum(qp2, axis=1) + tl.sum(qp3, axis=1)
    sc_hi = tl.where(amax > 0.0, amax / 127.0, 1.0)
    inv_hi = 1.0 / sc_hi
    sc_lo = sc_hi / 254.0
    inv_lo = 1.0 / sc_lo
    qh0, ql0 = _q_levels(qp0, inv_hi, sc_hi, inv_lo)
    qh1, ql1 = _q_levels(qp1, inv_hi, sc_hi, inv_lo)
    if PER == 4:
        qh2, ql2 = _q_levels(qp2, inv_hi, sc_hi, inv_lo)
        qh3, ql3 = _q_levels(qp3, inv_hi, sc_hi, inv_lo)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc0 = tl.zeros([HP, W], tl.float32)
    acc1 = tl.zeros([HP, W], tl.float32)
    acc2 = tl.zeros([HP, W], tl.float32)
    acc3 = tl.zeros([HP, W], tl.float32)
    accz = tl.zeros([HP], tl.float32)
    wcols = tl.arange(0, W)
    rows = tl.arange(0, BLOCK_N)
    pt_row = pt_ptr + b * stride_ptb
    for t0 in range(start, end, BLOCK_N):
        kb, vb, ks, kz, vs, vz, tmask = _plane_block(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, pt_row, t0,
                                                     end, rows, wcols, kvh, stride_cp, stride_ch, stride_mp,
                                                     stride_mh, W, PAGE_SIZE, ROW_GATHER)
        ks = ks.to(tl.float32)
        kz = kz.to(tl.float32)
        vs = vs.to(tl.float32)
        vz = vz.to(tl.float32)
        a_hi = tl.zeros([BLOCK_N, HP], tl.int32)
        a_lo = tl.zeros([BLOCK_N, HP], tl.int32)
        a_hi, a_lo = _qk_plane(kb, a_hi, a_lo, qh0, ql0, 0, BITS, FAST_UNPACK, AK0)
        a_hi, a_lo = _qk_plane(kb, a_hi, a_lo, qh1, ql1, 1, BITS, FAST_UNPACK, AK1)
        if PER == 4:
            a_hi, a_lo = _qk_plane(kb, a_hi, a_lo, qh2, ql2, 2, BITS, FAST_UNPACK, AK2)
            a_hi, a_lo = _qk_plane(kb, a_hi, a_lo, qh3, ql3, 3, BITS, FAST_UNPACK, AK3)
        qc = a_hi.to(tl.float32) * sc_hi[None, :]
        qc += a_lo.to(tl.float32) * sc_lo[None, :]
        s = qc * ks[:, None] + (kz[:, None] * qsum[None, :] + qmu[None, :])
        s = tl.where(tmask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        accz = accz * alpha + tl.sum(p * vz[:, None], axis=0)
        pvT = tl.trans((p * vs[:, None]).to(tl.float16))
        acc0 = tl.dot(pvT, _plane_f16(vb, 0, BITS, FAST_UNPACK, AV0), acc0 * alpha[:, None])
        acc1 = tl.dot(pvT, _plane_f16(vb, 1, BITS, FAST_UNPACK, AV1), acc1 * alpha[:, None])
        if PER == 4:
            acc2 = tl.dot(pvT, _plane_f16(vb, 2, BITS, FAST_UNPACK, AV2), acc2 * alpha[:, None])
            acc3 = tl.dot(pvT, _plane_f16(vb, 3, BITS, FAST_UNPACK, AV3), acc3 * alpha[:, None])
        m_i = m_new
    nonempty = l_i > 0.0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    inv_l = 1.0 / tl.where(nonempty, l_i, 1.0)
    row = (b * H + hq) * s_total + split
    o0 = (acc0 + accz[:, None]) * inv_l[:, None]
    o1 = (acc1 * (1.0 / (1 << BITS)) + accz[:, None]) * inv_l[:, None]
    if PER == 4:
        o2 = (acc2 * (1.0 / (1 << (2 * BITS))) + accz[:, None]) * inv_l[:, None]
        o3 = (acc3 * (1.0 / (1 << (3 * BITS))) + accz[:, None]) * inv_l[:, None]
    if ROT_OUT:
        out = tl.zeros([HP, D], tl.float32)
        out = _o_plane_out(out, o0, rv_ptr, kvh, 0, W, D)
        out = _o_plane_out(out, o1, rv_ptr, kvh, 1, W, D)
        if PER == 4:
            out = _o_plane_out(out, o2, rv_ptr, kvh, 2, W, D)
            out = _o_plane_out(out, o3, rv_ptr, kvh, 3, W, D)
        if HAS_MUV:
            out += tl.load(muv_ptr + kvh * D + dcols)[None, :]
        tl.store(o_ptr + row[:, None] * D + dcols[None, :], out, mask=hmask[:, None])
    else:
        obase = o_ptr + row[:, None] * D + wcols[None, :]
        tl.store(obase, o0, mask=hmask[:, None])
        tl.store(obase + W, o1, mask=hmask[:, None])
        if PER == 4:
            tl.store(obase + 2 * W, o2, mask=hmask[:, None])
            tl.store(obase + 3 * W, o3, mask=hmask[:, None])
    tl.store(lse_ptr + row, lse, mask=hmask)


@triton.jit
def _bf16_chunk(
    pid, chunk,
    qo_ptr,
    sk_ptr, sv_ptr, slen_ptr, stride_sb, stride_sh, stride_st,
    rk_ptr, rv_ptr, rlen_ptr, stride_rb, stride_rh, stride_rt, wrow_ptr,
    o_ptr, lse_ptr, num_splits, sink_chunks, num_bf, qscale,
    HKV: tl.constexpr, REP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, HAS_SINK: tl.constexpr, HAS_RECENT: tl.constexpr, DOT_T: tl.constexpr,
    WIN_ROWS: tl.constexpr,
):
    """One CHUNK of the BF16 sink (chunks ``0..sink_chunks-1``) or recent window (the rest): output + LSE.
    ``WIN_ROWS``: the windows of sequence ``b`` are row ``wrow_ptr[b]`` of the window tensors (else row ``b``)."""
    b = pid // HKV
    kvh = pid % HKV
    wb = b.to(tl.int64)
    if WIN_ROWS:
        wb = tl.load(wrow_ptr + b).to(tl.int64)
    H: tl.constexpr = HKV * REP
    heads = tl.arange(0, HP)
    hmask = heads < REP
    hq = kvh * REP + heads
    cols = tl.arange(0, D)
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([D, HP], tl.float32)
    qb = tl.load(qo_ptr + (b * H + hq)[:, None] * D + cols[None, :], mask=hmask[:, None], other=0.0)
    qb = (qb.to(tl.float32) * qscale).to(DOT_T)  # qscale: 1 for the prepared query, the softmax scale for a raw one
    qbT = tl.trans(qb)
    if chunk < sink_chunks:
        if HAS_SINK:
            n = tl.load(slen_ptr + b)
            base = wb * stride_sb + kvh * stride_sh
            m_i, l_i, acc = _bf16_segment(sk_ptr + base, sv_ptr + base, chunk * CHUNK,
                                          tl.minimum(n, (chunk + 1) * CHUNK), stride_st, qbT, m_i, l_i, acc,
                                          BLOCK_N, D, HP, DOT_T)
    else:
        if HAS_RECENT:
            n = tl.load(rlen_ptr + b)
            base = wb * stride_rb + kvh * stride_rh
            c = chunk - sink_chunks
            m_i, l_i, acc = _bf16_segment(rk_ptr + base, rv_ptr + base, c * CHUNK, tl.minimum(n, (c + 1) * CHUNK),
                                          stride_rt, qbT, m_i, l_i, acc, BLOCK_N, D, HP, DOT_T)
    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[None, :]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    row = (b * H + hq) * (num_splits + num_bf) + num_splits + chunk
    tl.store(o_ptr + row[None, :] * D + cols[:, None], o, mask=hmask[None, :])
    tl.store(lse_ptr + row, lse, mask=hmask)


@triton.jit
def _planes_kernel(
    q_ptr, scale, rk_ptr, muk_ptr, rv_ptr, muv_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    stride_cp, stride_ch,
    stride_mp, stride_mh,
    pt_ptr, stride_ptb, len_ptr,
    o_ptr, lse_ptr,
    tokens_per_split, s_total,
    sk_ptr, sv_ptr, slen_ptr, stride_sb, stride_sh, stride_st,
    recent_k_ptr, recent_v_ptr, rlen_ptr, stride_rb, stride_rh, stride_rt, wrow_ptr,
    num_splits, sink_chunks, num_bf,
    HKV: tl.constexpr, REP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
    BITS: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FAST_UNPACK: tl.constexpr,
    ROW_GATHER: tl.constexpr,
    HAS_RK: tl.constexpr, HAS_MUK: tl.constexpr, ROT_OUT: tl.constexpr, HAS_MUV: tl.constexpr,
    FUSE_BF16: tl.constexpr, BF_BLOCK: tl.constexpr, CHUNK: tl.constexpr, HAS_SINK: tl.constexpr,
    HAS_RECENT: tl.constexpr, DOT_T: tl.constexpr, WIN_ROWS: tl.constexpr,
    AK0: tl.constexpr, AK1: tl.constexpr, AK2: tl.constexpr, AK3: tl.constexpr,
    AV0: tl.constexpr, AV1: tl.constexpr, AV2: tl.constexpr, AV3: tl.constexpr,
):
    """Program ``(sequence * Hkv + KV head, split)`` of the bit-plane path; with ``FUSE_BF16`` the programs
    past ``num_splits`` take the BF16 chunks (from the raw query times ``scale``)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if FUSE_BF16 and split >= num_splits:
        _bf16_chunk(pid, split - num_splits, q_ptr,
                    sk_ptr, sv_ptr, slen_ptr, stride_sb, stride_sh, stride_st,
                    recent_k_ptr, recent_v_ptr, rlen_ptr, stride_rb, stride_rh, stride_rt, wrow_ptr,
                    o_ptr, lse_ptr, num_splits, sink_chunks, num_bf, scale,
                    HKV, REP, HP, D, BF_BLOCK, CHUNK, HAS_SINK, HAS_RECENT, DOT_T, WIN_ROWS)
    else:
        _int_split_planes(pid, split, q_ptr, scale, rk_ptr, muk_ptr, rv_ptr, muv_ptr,
                          kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                          stride_cp, stride_ch, stride_mp, stride_mh, pt_ptr, stride_ptb, len_ptr,
                          o_ptr, lse_ptr, tokens_per_split, s_total,
                          HKV, REP, HP, D, BITS, PAGE_SIZE, BLOCK_N, FAST_UNPACK, ROW_GATHER,
                          HAS_RK, HAS_MUK, ROT_OUT, HAS_MUV, AK0, AK1, AK2, AK3, AV0, AV1, AV2, AV3)


@triton.jit
def _merge_cols_kernel(o_ptr, lse_ptr, out_ptr, s_total,
                       HKV: tl.constexpr, REP: tl.constexpr, HPM: tl.constexpr, D: tl.constexpr,
                       DC: tl.constexpr, SP: tl.constexpr):
    """Program ``(sequence * Hkv + KV head, column chunk)``: log-sum-exp merge of all partials (one frame)."""
    pid = tl.program_id(0)
    c0 = tl.program_id(1) * DC
    b = pid // HKV
    kvh = pid % HKV
    H: tl.constexpr = HKV * REP
    heads = tl.arange(0, HPM)
    hmask = heads < REP
    hq = kvh * REP + heads
    o, _ = _merge_range(o_ptr, lse_ptr, (b * H + hq) * s_total, 0, s_total, hmask, HPM, D, SP, c0, DC)
    cols = c0 + tl.arange(0, DC)
    tl.store(out_ptr + (b * H + hq)[:, None] * D + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _partial_kernel(
    qr_ptr, qmu_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    stride_cp, stride_ch,
    stride_mp, stride_mh,
    pt_ptr, stride_ptb, len_ptr,
    o_ptr, lse_ptr,
    tokens_per_split, s_total,
    qo_ptr,
    sk_ptr, sv_ptr, slen_ptr, stride_sb, stride_sh, stride_st,
    rk_ptr, rv_ptr, rlen_ptr, stride_rb, stride_rh, stride_rt, wrow_ptr,
    num_splits, sink_chunks, num_bf,
    HKV: tl.constexpr, REP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
    BITS: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FAST_UNPACK: tl.constexpr,
    ROW_GATHER: tl.constexpr,
    FUSE_BF16: tl.constexpr, BF_BLOCK: tl.constexpr, CHUNK: tl.constexpr, HAS_SINK: tl.constexpr,
    HAS_RECENT: tl.constexpr, DOT_T: tl.constexpr, WIN_ROWS: tl.constexpr,
    stride_kmp=0, stride_kmh=0, KBLOCK: tl.constexpr = 0, TT: tl.constexpr = 1,
):
    """Program ``(sequence * Hkv + KV head, split)``: a quantized split; with ``FUSE_BF16`` the programs past
    ``num_splits`` take the BF16 chunks instead (one launch fewer)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if FUSE_BF16:
        if split >= num_splits:
            _bf16_chunk(pid, split - num_splits, qo_ptr,
                        sk_ptr, sv_ptr, slen_ptr, stride_sb, stride_sh, stride_st,
                        rk_ptr, rv_ptr, rlen_ptr, stride_rb, stride_rh, stride_rt, wrow_ptr,
                        o_ptr, lse_ptr, num_splits, sink_chunks, num_bf, 1.0,
                        HKV, REP, HP, D, BF_BLOCK, CHUNK, HAS_SINK, HAS_RECENT, DOT_T, WIN_ROWS)
        else:
            _int_split(pid, split, qr_ptr, qmu_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                       stride_cp, stride_ch, stride_mp, stride_mh, pt_ptr, stride_ptb, len_ptr,
                       o_ptr, lse_ptr, tokens_per_split, s_total,
                       HKV, REP, HP, D, G, BITS, PAGE_SIZE, BLOCK_N, FAST_UNPACK,
                       ROW_GATHER, stride_kmp, stride_kmh, KBLOCK, TT)
    else:
        _int_split(pid, split, qr_ptr, qmu_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                   stride_cp, stride_ch, stride_mp, stride_mh, pt_ptr, stride_ptb, len_ptr,
                   o_ptr, lse_ptr, tokens_per_split, s_total,
                   HKV, REP, HP, D, G, BITS, PAGE_SIZE, BLOCK_N, FAST_UNPACK,
                   ROW_GATHER, stride_kmp, stride_kmh, KBLOCK, TT)


@triton.jit
def _bf16_partial_kernel(
    qo_ptr,
    sk_ptr, sv_ptr, slen_ptr, stride_sb, stride_sh, stride_st,
    rk_ptr, rv_ptr, rlen_ptr, stride_rb, stride_rh, stride_rt, wrow_ptr,
    o_ptr, lse_ptr, num_splits, sink_chunks, num_bf, qscale,
    HKV: tl.constexpr, REP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr, HAS_SINK: tl.constexpr, HAS_RECENT: tl.constexpr, DOT_T: tl.constexpr,
    WIN_ROWS: tl.constexpr,
):
    """Program ``(sequence * Hkv + KV head, chunk)``: one BF16 chunk (launch of its own)."""
    _bf16_chunk(tl.program_id(0), tl.program_id(1), qo_ptr,
                sk_ptr, sv_ptr, slen_ptr, stride_sb, stride_sh, stride_st,
                rk_ptr, rv_ptr, rlen_ptr, stride_rb, stride_rh, stride_rt, wrow_ptr,
                o_ptr, lse_ptr, num_splits, sink_chunks, num_bf, qscale,
                HKV, REP, HP, D, BLOCK_N, CHUNK, HAS_SINK, HAS_RECENT, DOT_T, WIN_ROWS)


@triton.jit
def _prep_kernel(q_ptr, rk_ptr, muk_ptr, qr_ptr, qo_ptr, qmu_ptr, scale,
                 HKV: tl.constexpr, REP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
                 HAS_RK: tl.constexpr, HAS_MUK: tl.constexpr, PRECISION: tl.constexpr):
    """Scaled query (log2 domain), rotated query ``q @ R_K`` and ``q . mu_K`` for one (sequence, KV head)."""
    pid = tl.program_id(0)
    b = pid // HKV
    kvh = pid % HKV
    H: tl.constexpr = HKV * REP
    heads = tl.arange(0, HP)
    hmask = heads < REP
    rows = b * H + kvh * REP + heads
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + rows[:, None] * D + cols[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * scale
    tl.store(qo_ptr + rows[:, None] * D + cols[None, :], q, mask=hmask[:, None])
    if HAS_RK:
        rot = tl.load(rk_ptr + kvh * D * D + cols[:, None] * D + cols[None, :])
        qr = tl.dot(q, rot, input_precision=PRECISION)
    else:
        qr = q
    tl.store(qr_ptr + rows[:, None] * D + cols[None, :], qr, mask=hmask[:, None])
    if HAS_MUK:
        qmu = tl.sum(q * tl.load(muk_ptr + kvh * D + cols)[None, :], axis=1)
    else:
        qmu = tl.zeros([HP], tl.float32)
    tl.store(qmu_ptr + rows, qmu, mask=hmask)


@triton.jit
def _merge_range(o_ptr, lse_ptr, base, lo, hi, hmask, HP: tl.constexpr, D: tl.constexpr, SP: tl.constexpr,
                 c0, DC: tl.constexpr):
    """Log-sum-exp merge of partial rows ``lo..hi-1`` (per head ``base + s``), columns ``c0..c0+DC-1``:
    ``(o [HP, DC], lse [HP])``."""
    cols = c0 + tl.arange(0, DC)
    o_acc = tl.zeros([HP, DC], tl.float32)
    m_acc = tl.full([HP], float("-inf"), tl.float32)
    l_acc = tl.zeros([HP], tl.float32)
    for s0 in range(lo, hi, SP):
        sp = s0 + tl.arange(0, SP)
        smask = sp < hi
        lse = tl.load(lse_ptr + base[:, None] + sp[None, :], mask=hmask[:, None] & smask[None, :], other=float("-inf"))
        m_new = tl.maximum(m_acc, tl.max(lse, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_acc - m_safe)
        w = tl.exp2(lse - m_safe[:, None])
        l_acc = l_acc * alpha + tl.sum(w, axis=1)
        o3 = tl.load(o_ptr + (base[:, None, None] + sp[None, :, None]) * D + cols[None, None, :],
                     mask=(hmask[:, None] & smask[None, :])[:, :, None], other=0.0)
        o_acc = o_acc * alpha[:, None] + tl.sum(o3 * w[:, :, None], axis=1)
        m_acc = m_new
    has = l_acc > 0.0
    o_acc = o_acc / tl.where(has, l_acc, 1.0)[:, None]
    return o_acc, tl.where(has, m_acc + tl.log2(tl.where(has, l_acc, 1.0)), float("-inf"))


@triton.jit
def _merge_kernel(
    o_ptr, lse_ptr, out_ptr, rv_ptr, muv_ptr, num_splits, num_bf,
    HKV: tl.constexpr, REP: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
    SP: tl.constexpr, HAS_RV: tl.constexpr, HAS_MUV: tl.constexpr, OUT_ROTATED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // HKV
    kvh = pid % HKV
    H: tl.constexpr = HKV * REP
    heads = tl.arange(0, HP)
    hmask = heads < REP
    hq = kvh * REP + heads
    cols = tl.arange(0, D)
    base = (b * H + hq) * (num_splits + num_bf)
    o_int, lse_int = _merge_range(o_ptr, lse_ptr, base, 0, num_splits, hmask, HP, D, SP, 0, D)
    o_bf, lse_bf = _merge_range(o_ptr, lse_ptr, base, num_splits, num_splits + num_bf, hmask, HP, D, SP, 0, D)
    # frames
    if OUT_ROTATED:
        if HAS_MUV:
            o_bf = o_bf - tl.load(muv_ptr + kvh * D + cols)[None, :]
        if HAS_RV:
            rot = tl.load(rv_ptr + kvh * D * D + cols[:, None] * D + cols[None, :])
            o_bf = tl.dot(o_bf, rot, input_precision=PRECISION)
    else:
        if HAS_RV:
            rot_t = tl.load(rv_ptr + kvh * D * D + cols[None, :] * D + cols[:, None])
            o_int = tl.dot(o_int, rot_t, input_precision=PRECISION)
        if HAS_MUV:
            o_int = o_int + tl.load(muv_ptr + kvh * D + cols)[None, :]
    m = tl.maximum(lse_int, lse_bf)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_int = tl.exp2(lse_int - m_safe)
    w_bf = tl.exp2(lse_bf - m_safe)
    w_sum = w_int + w_bf
    o = (o_int * w_int[:, None] + o_bf * w_bf[:, None]) / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
    tl.store(out_ptr + (b * H + hq)[:, None] * D + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


SHORT_CONTEXT = 16384  # quantized capacity below which the short-context configuration is used
MERGE_STEP = 8  # partials per step of the word path's merge kernel (the v7 sweep's choice)
MERGE_WARPS = 8


def default_num_splits(batch: int, num_kv_heads: int, capacity_tokens: int, block_n: int, num_sms: int = 132) -> int:
    """Splits per (sequence, KV head): about two waves of programs, at least ``4 * block_n`` tokens each."""
    by_occupancy = max(1, (2 * num_sms) // max(1, batch * num_kv_heads))
    by_work = max(1, capacity_tokens // (4 * block_n))
    return int(min(by_occupancy, by_work, 256))


def default_config(batch: int, num_kv_heads: int, capacity_tokens: int, num_sms: int = 132,
                   planes: bool = False) -> dict:
    """Launch configuration measured fastest on the H200 (docs/KERNELS.md, v7 and v8 rounds).

    Bit-plane path (v8): blocks of 128 rows spanning pages, registers capped at 128 (4 programs of
    4 warps per SM), twice ``default_num_splits`` (about four waves: the programs hide each other's
    latency); with few programs at short context (batch x KV heads <= 16, under ``SHORT_CONTEXT``) blocks
    of 64 with the BF16 chunks fused into the split-K launch. Word path (v7): long contexts blocks of 128
    spanning pages, 4 warps, ``default_num_splits``; short contexts blocks of 64 within a page, the BF16
    chunks fused into the split-K launch and about 8 waves of splits.
    """
    if planes:
        if capacity_tokens < SHORT_CONTEXT and batch * num_kv_heads <= 16:  # few programs: fuse the BF16 chunks
            return {"block_n": 64, "span_pages": False, "fuse_bf16": True, "maxnreg": None, "split_factor": 2,
                    "num_splits": min(256, 2 * default_num_splits(batch, num_kv_heads, capacity_tokens, 64, num_sms))}
        return {"block_n": 128, "span_pages": True, "fuse_bf16": False, "maxnreg": 128, "split_factor": 2,
                "num_splits": min(256, 2 * default_num_splits(batch, num_kv_heads, capacity_tokens, 128, num_sms))}
    if capacity_tokens < SHORT_CONTEXT:
        by_occupancy = max(1, (8 * num_sms) // max(1, batch * num_kv_heads))
        splits = int(min(by_occupancy, max(1, capacity_tokens // 128), 256))
        return {"block_n": 64, "span_pages": False, "fuse_bf16": True, "num_splits": splits, "maxnreg": None,
                "split_factor": 1}
    return {"block_n": 128, "span_pages": True, "fuse_bf16": False, "maxnreg": None, "split_factor": 1,
            "num_splits": default_num_splits(batch, num_kv_heads, capacity_tokens, 128, num_sms)}


_FP16_COPIES: dict[int, tuple] = {}  # id(tensor) -> (weak reference, version, device, fp16 copy)


def _fp16_copy(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` as a contiguous fp16 tensor on ``dev``, converted once per tensor and version (no launch per call)."""
    if t.dtype == torch.float16 and t.device == dev and t.is_contiguous():
        return t
    hit = _FP16_COPIES.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == t._version and hit[2] == dev:
        return hit[3]
    copy = t.to(device=dev, dtype=torch.float16).contiguous()
    for key in [k for k, v in _FP16_COPIES.items() if v[0]() is None]:  # drop copies of freed tensors
        del _FP16_COPIES[key]
    _FP16_COPIES[id(t)] = (weakref.ref(t), t._version, dev, copy)
    return copy


def _check_pages(k_pages: Pages, v_pages: Pages, d: int) -> tuple[int, int, int]:
    """Refuse pages the row kernel does not read; return ``(Hkv, page_size, codes bytes per row)``."""
    check(k_pages.layout == "rows" and v_pages.layout == "rows",
          lambda: f"the Triton decode kernel reads row-layout pages, got K {k_pages.layout!r} and V {v_pages.layout!r} "
          "(fragment-order pages: oscar.kernels.decode_mma)")
    bits, group_size = k_pages.bits, k_pages.group_size
    check(bits in (2, 4), lambda: f"bits={bits} is not supported; valid values are 2 and 4")
    check(v_pages.bits == bits and v_pages.group_size == group_size,
          lambda: f"K and V pages need one format, got INT{bits} G={group_size} and INT{v_pages.bits} G={v_pages.group_size}")
    k_codes, k_scale, v_codes = k_pages.codes, k_pages.scale, v_pages.codes
    npages, hkv, page_size, nbytes = (int(s) for s in k_codes.shape)
    check(is_pow2(d) and 16 <= d <= 256 and d * bits >= 32,
          lambda: f"head_dim={d} must be a power of two in [16, 256] (at least one 32-bit word of codes per row)")
    check(is_pow2(group_size) and group_size <= d and group_size % (8 // bits) == 0,
          lambda: f"group_size={group_size} must be a power of two dividing head_dim={d}")
    check(nbytes == d * bits // 8 and k_codes.dtype == torch.uint8,
          lambda: f"codes must be uint8 [P, Hkv, page_size, {d * bits // 8}], got {k_codes.dtype} {tuple(k_codes.shape)}")
    check(v_codes.shape == k_codes.shape and v_codes.stride() == k_codes.stride(),
          lambda: f"V codes {tuple(v_codes.shape)} must match K codes {tuple(k_codes.shape)} in shape and strides")
    meta_shape = (npages, hkv, page_size, d // group_size)
    kblock = int(getattr(k_pages, "block", 0))
    check(int(getattr(v_pages, "block", 0)) == 0, "V pages are per token (block=0); per-channel blocks are for keys")
    check(kblock == 0 or (is_pow2(kblock) and page_size % kblock == 0),
          lambda: f"per-channel key block={kblock} must be a power of two dividing page_size={page_size}")
    k_meta = (npages, hkv, page_size // kblock, d) if kblock else meta_shape
    metas = (("k_scale", k_scale, k_meta), ("k_zero", k_pages.zero, k_meta), ("v_scale", v_pages.scale, meta_shape),
             ("v_zero", v_pages.zero, meta_shape))
    for name, t, shape in metas:
        ref = k_scale if name.startswith("k") else v_pages.scale
        check(tuple(t.shape) == shape and t.dtype == torch.bfloat16 and t.stride() == ref.stride() and t.stride(-1) == 1,
              lambda: f"{name} must be bf16 {shape} with the strides of {name[0]}_scale, got {t.dtype} {tuple(t.shape)}")
    check(kblock or k_scale.stride() == v_pages.scale.stride(), "K and V scales must have equal strides")
    check(k_codes.stride(-1) == 1 and k_codes.stride(-2) == nbytes and v_pages.scale.stride(-2) == d // group_size
          and (kblock or k_scale.stride(-2) == d // group_size) and (not kblock or k_scale.stride(-2) == d),
          "codes and scales must be contiguous within a page (slot stride = row size)")
    check(is_pow2(page_size), lambda: f"page_size={page_size} must be a power of two")
    return hkv, page_size, nbytes


def _window(name: str, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor, B: int, hkv: int, d: int,
            rows: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check(k.dim() == 4 and (k.shape[0] >= B or rows) and k.shape[1] == hkv and k.shape[3] == d,
          lambda: f"{name}_k must be [B, {hkv}, S, {d}] (or [R, {hkv}, S, {d}] with window_rows), got {tuple(k.shape)}")
    check(v.shape == k.shape and v.stride() == k.stride() and k.stride(-1) == 1,
          lambda: f"{name}_v {tuple(v.shape)} must match {name}_k in shape and strides, contiguous in d")
    check(n.dtype == torch.int32 and n.shape[0] >= B, lambda: f"{name}_len must be int32 [B], got {n.dtype}")
    return k, v, n


def paged_decode_attention_rows(
    q: torch.Tensor,
    k_pages: Pages,
    v_pages: Pages,
    segments: Segments,
    k_t: HeadTransform,
    v_t: HeadTransform,
    *,
    sm_scale: Optional[float] = None,
    output_frame: str = "original",
    launch: Optional[RowsLaunch] = None,
) -> torch.Tensor:
    """Triton decode attention of one query per sequence over row-layout pages; the torch twin
    ``oscar.cache.paged.decode_attention_torch`` takes the same arguments (less ``launch``) and defines the result.

    ``q`` ``[B, H, d]``; pages ``oscar.cache.paged.QuantPages`` in the ``"rows"`` layout (codes
    ``[P, Hkv, page_size, d*bits//8]`` uint8, scale/zero ``[P, Hkv, page_size, d//G]`` bf16); ``segments``: int32
    page table and lengths, BF16 windows (``oscar.kernels.segments.Segments``); ``k_t``/``v_t``: the pages'
    transforms (rope-centered keys are read by ``oscar.kernels.decode_mma`` only). Returns ``[B, H, d]`` in
    ``q.dtype``, in the original frame or, with ``output_frame="rotated"``, as ``(o - mu_V) R_V``. ``launch``:
    ``RowsLaunch`` (fields left at ``None`` follow ``default_config``).
    """
    launch = RowsLaunch() if launch is None else launch
    check(isinstance(launch, RowsLaunch),
          lambda: f"launch={launch!r} is not a RowsLaunch (the row-layout kernel's settings)")
    check(q.dim() == 3, lambda: f"q must be [B, H, d], got shape {tuple(q.shape)}")
    B, H, d = (int(s) for s in q.shape)
    hkv, page_size, _ = _check_pages(k_pages, v_pages, d)
    bits, group_size = k_pages.bits, k_pages.group_size
    check(not k_t.rope_centered, "rope-centered keys (k_t.rope_mu) are read by the mma-layout kernel only "
          "(oscar.kernels.decode_mma); row-layout pages take keys without the RoPE offset")
    check(H % hkv == 0, lambda: f"query heads H={H} must be a multiple of KV heads Hkv={hkv}")
    page_table, int_len, window_rows = segments.page_table, segments.int_len, segments.window_rows
    check(page_table.dim() == 2 and page_table.shape[0] >= B and page_table.dtype == torch.int32,
          lambda: f"page_table must be int32 [B={B}, M], got {page_table.dtype} {tuple(page_table.shape)}")
    check(int_len.shape[0] >= B and int_len.dtype == torch.int32,
          lambda: f"int_len must be int32 [B={B}], got {int_len.dtype}")
    check(output_frame in ("original", "rotated"),
          lambda: f"output_frame={output_frame!r} must be 'original' or 'rotated'")
    kblock = int(getattr(k_pages, "block", 0))
    planes = launch.planes
    check(not (planes and kblock), lambda: f"per-channel key pages (block={kblock}) are read by the word path; "
          "RowsLaunch(planes=True) is refused for them")
    if planes is None:  # bit-plane path where measured faster: one group per row, planes of >= 32 channels
        planes = group_size == d and d * bits // 8 >= 32 and not kblock
    check(not planes or (group_size == d and d * bits // 8 >= 32),
          lambda: f"the bit-plane path needs one group per row and at least 32 bytes per row (int8 scores), got "
          f"group_size={group_size}, d={d}, INT{bits}")
    dev = q.device
    fast_unpack = (bits == 2 or planes) and dev.type == "cuda"  # inline PTX wherever it runs
    rep = H // hkv
    hp = max(16, next_pow2(rep))
    scale = (1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)) * LOG2E
    precision = "ieee" if dev.type != "cuda" else "tf32x3"  # 3xTF32 rotations: float32 accuracy without spills
    qc = q.contiguous()
    R_K, mu_K, R_V, mu_V = k_t.R, k_t.mu, v_t.R, v_t.mu

    rows = window_rows is not None
    check(not rows or (window_rows.dtype == torch.int32 and window_rows.dim() == 1
                       and window_rows.numel() >= B and window_rows.device == dev),
          lambda: f"window_rows must be int32 [>= {B}] on {dev}, got "
          f"{None if window_rows is None else (window_rows.dtype, tuple(window_rows.shape), str(window_rows.device))}")
    sink = recent = None
    for name, k, v, n in segments.windows:
        seg = _window(name, k, v, n, B, hkv, d, rows)
        if name == "sink":
            sink = seg
        else:
            recent = seg
    capacity = int(page_table.shape[1]) * page_size
    auto = default_config(B, hkv, capacity, planes=planes)  # options left at None take the measured configuration
    block_n = auto["block_n"] if launch.block_n is None else launch.block_n
    span_pages = auto["span_pages"] if launch.span_pages is None else launch.span_pages
    fuse_bf16 = auto["fuse_bf16"] if launch.fuse_bf16 is None else launch.fuse_bf16
    maxnreg = launch.maxnreg
    if maxnreg is None:
        maxnreg = auto["maxnreg"] if block_n == auto["block_n"] else None
    num_splits = launch.num_splits
    if num_splits is None:
        num_splits = (auto["num_splits"] if block_n == auto["block_n"]
                      else auto["split_factor"] * default_num_splits(B, hkv, capacity, block_n))
    if not span_pages:  # a block stays within one page (pages under 16 slots: blocks gather rows over pages)
        block_n = min(block_n, max(page_size, 16))
    tps = triton.cdiv(triton.cdiv(capacity, num_splits), max(page_size, block_n)) * max(page_size, block_n)
    chunk = 64
    sink_chunks = triton.cdiv(int(sink[0].shape[2]), chunk) if sink is not None else 0
    recent_chunks = triton.cdiv(int(recent[0].shape[2]), chunk) if recent is not None else 0
    num_bf = max(1, sink_chunks + recent_chunks)
    s_total = num_splits + num_bf
    o_part = torch.empty(B, H, s_total, d, dtype=torch.float32, device=dev)
    lse_part = torch.empty(B, H, s_total, dtype=torch.float32, device=dev)
    dummy = lse_part
    sk, sv, sl = sink if sink is not None else (dummy, dummy, dummy)
    rk, rv, rl = recent if recent is not None else (dummy, dummy, dummy)
    s_strides = (sk.stride(0), sk.stride(1), sk.stride(2)) if sink is not None else (0, 0, 0)
    r_strides = (rk.stride(0), rk.stride(1), rk.stride(2)) if recent is not None else (0, 0, 0)
    wrow = window_rows if window_rows is not None else sl
    bf_flags = dict(CHUNK=chunk, HAS_SINK=sink is not None, HAS_RECENT=recent is not None,
                    WIN_ROWS=window_rows is not None,
                    DOT_T=tl.bfloat16 if dev.type == "cuda" else tl.float32)
    reg_cap = {"maxnreg": maxnreg} if maxnreg and dev.type == "cuda" else {}
    out = torch.empty(B, H, d, dtype=q.dtype, device=dev)
    muv = mu_V.to(dev, torch.float32).contiguous() if mu_V is not None else dummy
    grid = (B * hkv, num_splits + (num_bf if fuse_bf16 else 0))
    k_codes, k_scale, k_zero = k_pages.codes, k_pages.scale, k_pages.zero
    v_codes, v_scale, v_zero = v_pages.codes, v_pages.scale, v_pages.zero
    if planes:
        # two launches: split-K programs that rotate the query themselves (and, in the original
        # frame, rotate their partial back), then a column-parallel merge of partials in one frame
        rot_out = output_frame == "original"
        rk16 = _fp16_copy(R_K, dev) if R_K is not None else dummy
        rv16 = _fp16_copy(R_V, dev) if R_V is not None else dummy
        muk = mu_K.to(dev, torch.float32).contiguous() if mu_K is not None else dummy
        bf_args = (sk, sv, sl, *s_strides, rk, rv, rl, *r_strides, wrow)
        launchable(_planes_kernel, dev)[grid](
            qc, scale, rk16, muk, rv16, muv,
            k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
            k_codes.stride(0), k_codes.stride(1), k_scale.stride(0), k_scale.stride(1),
            page_table, page_table.stride(0), int_len,
            o_part, lse_part, tps, s_total,
            *bf_args, num_splits, sink_chunks, num_bf,
            HKV=hkv, REP=rep, HP=hp, D=d, BITS=bits, PAGE_SIZE=page_size, BLOCK_N=block_n,
            FAST_UNPACK=fast_unpack, ROW_GATHER=page_size < block_n,
            HAS_RK=R_K is not None, HAS_MUK=mu_K is not None,
            ROT_OUT=rot_out and R_V is not None, HAS_MUV=rot_out and mu_V is not None,
            FUSE_BF16=fuse_bf16, BF_BLOCK=32, **bf_flags, **plane_sources(bits),
            num_warps=launch.warps, num_stages=launch.stages, **reg_cap,
        )
        if not fuse_bf16:
            launchable(_bf16_partial_kernel, dev)[(B * hkv, num_bf)](
                qc, *bf_args, o_part, lse_part, num_splits, sink_chunks, num_bf, scale,
                HKV=hkv, REP=rep, HP=hp, D=d, BLOCK_N=32, **bf_flags, num_warps=8,
            )
        if rot_out:  # every partial is in the original frame: a plain merge, parallel over columns
            dc = min(32, d)
            launchable(_merge_cols_kernel, dev)[(B * hkv, d // dc)](
                o_part, lse_part, out, s_total,
                HKV=hkv, REP=rep, HPM=max(2, next_pow2(rep)), D=d, DC=dc, SP=32, num_warps=4,
            )
            return out
    else:
        q_rot = torch.empty(B, H, d, dtype=torch.float32, device=dev)
        q_orig = torch.empty(B, H, d, dtype=torch.float32, device=dev)
        qmu = torch.empty(B, H, dtype=torch.float32, device=dev)
        rk_t = R_K.to(dev, torch.float32).contiguous() if R_K is not None else q_rot
        muk = mu_K.to(dev, torch.float32).contiguous() if mu_K is not None else q_rot
        launchable(_prep_kernel, dev)[(B * hkv,)](
            qc, rk_t, muk, q_rot, q_orig, qmu, scale,
            HKV=hkv, REP=rep, HP=hp, D=d, HAS_RK=R_K is not None, HAS_MUK=mu_K is not None, PRECISION=precision,
            num_warps=8,
        )
        kw, vw = k_codes.view(torch.int32), v_codes.view(torch.int32)  # 4 packed bytes per load element
        bf_args = (q_orig, sk, sv, sl, *s_strides, rk, rv, rl, *r_strides, wrow)
        launchable(_partial_kernel, dev)[grid](
            q_rot, qmu,
            kw, k_scale, k_zero, vw, v_scale, v_zero,
            kw.stride(0), kw.stride(1),
            v_scale.stride(0), v_scale.stride(1),  # per-token meta strides (K's too, unless per-channel keys)
            page_table, page_table.stride(0), int_len,
            o_part, lse_part, tps, s_total,
            *bf_args, num_splits, sink_chunks, num_bf,
            HKV=hkv, REP=rep, HP=hp, D=d, G=group_size, BITS=bits, PAGE_SIZE=page_size, BLOCK_N=block_n,
            FAST_UNPACK=fast_unpack, ROW_GATHER=page_size < block_n, FUSE_BF16=fuse_bf16, BF_BLOCK=32, **bf_flags,
            stride_kmp=k_scale.stride(0), stride_kmh=k_scale.stride(1), KBLOCK=kblock,
            TT=min(kblock, block_n) if kblock else block_n,  # rows per key-block group of a tile
            num_warps=launch.warps, num_stages=launch.stages, **reg_cap,
        )
        if not fuse_bf16:
            launchable(_bf16_partial_kernel, dev)[(B * hkv, num_bf)](
                *bf_args, o_part, lse_part, num_splits, sink_chunks, num_bf, 1.0,
                HKV=hkv, REP=rep, HP=hp, D=d, BLOCK_N=32, **bf_flags, num_warps=8,
            )
    rv_t = R_V.to(dev, torch.float32).contiguous() if R_V is not None else dummy
    launchable(_merge_kernel, dev)[(B * hkv,)](
        o_part, lse_part, out, rv_t, muv, num_splits, num_bf,
        HKV=hkv, REP=rep, HP=hp, D=d, SP=MERGE_STEP,
        HAS_RV=R_V is not None, HAS_MUV=mu_V is not None, OUT_ROTATED=output_frame == "rotated",
        PRECISION=precision, num_warps=MERGE_WARPS,
    )
    return out


__all__ = ["SHORT_CONTEXT", "default_config", "default_num_splits", "paged_decode_attention_rows", "plane_sources"]

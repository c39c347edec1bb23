"""Paged INT2/INT4 KV pool: allocation, page tables, quantized writes, demotion, reads, decode attention.

Layout (docs/DESIGN.md, "Paged INT2 pool layout"), per layer and per tensor (K and V):
``codes`` uint8 ``[num_pages, Hkv, page_size, d*bits//8]``, ``scale``/``zero`` bf16
``[num_pages, Hkv, page_size, d//G]``. One page table int32 ``[max_batch, max_pages_per_seq]`` and
one length vector ``int_len`` int32 ``[max_batch]`` (quantized tokens per sequence) serve every
layer: quantized token ``t`` of sequence ``b`` lives at page ``page_table[b, t // page_size]``,
slot ``t % page_size``. A *slot* is ``page * page_size + offset`` (int64). Per-channel key pages
(``QuantPages(..., block=T)``, docs/DESIGN.md "Per-channel key pages on the paged path") keep the code bytes and put
one bf16 scale/zero pair per block of ``T`` slots and channel in ``scale``/``zero`` ``[num_pages, Hkv, page_size/T,
d]``; they are written whole blocks at a time, and ``channel_ring`` gives the decode step's recent-ring indices.

API (every kernel-backed function takes ``backend="torch"|"triton"``; the torch twin is the spec)::

    pool = PagedKVPool(num_layers=L, num_kv_heads=Hkv, head_dim=d, num_pages=P, max_batch=B,
                       max_pages_per_seq=M, bits=2, group_size=128, page_size=64, device="cuda")
    slots = pool.reserve([0, 1], [n0, n1])   # once per step, before any layer writes: allocates
                                             # pages, returns int64 slots [n0+n1], bumps int_len
    pool.write(layer, k_rows, v_rows, slots, kt, vt, backend=...)   # rows [N, Hkv, d], orig. frame
    pool.demote(layer, recent_k, recent_v, src_index, slots, kt, vt, backend=...)
        # quantizes recent_*[b, :, src_index[b]] (b = 0..N-1) into slots: oldest recent -> pool
    k_rot, v_rot = pool.read(layer, b)       # float32 [Hkv, int_len[b], d], rotated frame
    out = pool.attend(layer, q, kt, vt, sink_k=..., sink_v=..., sink_len=..., recent_k=...,
                      recent_v=..., recent_len=..., sm_scale=..., backend=...)   # [B, H, d]
    pool.release(b)                          # frees the sequence's pages, int_len[b] = 0

``kt``/``vt`` are ``HeadTransform(R [Hkv,d,d] or None, mu [Hkv,d] or None, rho [Hkv] or None)``
(``oscar.kernels.segments``, re-exported here) for K and V: stored row = ``Q(clip((x - mu) @ R, rho))``.
Sequences are rows ``0..B-1`` of the page table; ``attend`` reads rows ``0..q.shape[0]-1``. Free functions
``rotate_quantize_pack``, ``decode_attention(q, k_pages, v_pages, Segments(page_table, int_len, sink_k=, ...),
kt, vt)`` and ``gather_dequantize`` work on any pages (for other engines and tests). The torch twins here are
the specification of the kernels in ``oscar.kernels`` (``decode_rows``, ``decode_mma``, ``quantize``), which take
the same values plus a launch value (``oscar.kernels.launch``).

Decode attention merges three segments by log-sum-exp: BF16 sink ``[B, Hkv, S0, d]`` (valid
``sink_len[b]``), quantized pages (rotated frame, logits ``sm_scale*((q@R_K).k_hat + q.mu_K)``),
BF16 recent ``[B, Hkv, W, d]`` (valid slots ``0..recent_len[b]-1``, ring order does not matter).
``output_frame="original"`` returns ``o``; ``"rotated"`` returns ``(o - mu_V) @ R_V`` (value
rotation folded into ``o_proj``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from oscar.core import quant
from oscar.kernels.launch import MmaLaunch, QuantizeLaunch, RowsLaunch
from oscar.kernels.segments import HeadTransform, Segments

Backend = str
_BACKENDS = ("torch", "triton")


def _check_backend(backend: Backend) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not valid; choose one of {_BACKENDS}")


def rope_offsets(t: HeadTransform, positions: torch.Tensor) -> torch.Tensor:
    """``RoPE_p(t.rope_mu[h])`` float32 ``[*positions.shape, Hkv, d]`` at token ``positions`` (rotate-half RoPE,
    angles in float64, as ``oscar.core.rope.RopeSpec.offsets``)."""
    assert t.rope_mu is not None and t.rope_freq is not None
    m = t.rope_mu.to(positions.device, torch.float64)
    h, d = t.rope_freq.numel(), m.shape[-1]
    ang = positions.to(torch.float64)[..., None] * t.rope_freq.to(positions.device, torch.float64)
    cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]  # [..., 1, h]
    m1, m2 = m[:, :h], m[:, h:2 * h]
    y1 = (m1 * cos - m2 * sin) * t.rope_scaling
    y2 = (m2 * cos + m1 * sin) * t.rope_scaling
    rest = m[:, 2 * h:].expand(*y1.shape[:-1], d - 2 * h)
    return torch.cat([y1, y2, rest], dim=-1).to(torch.float32)


def _rope_rows(rows: torch.Tensor, t: HeadTransform, positions: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows ``[N, Hkv, d]`` minus their rope-centered offsets (float32), or the rows unchanged."""
    if not t.rope_centered:
        return rows
    if positions is None or positions.shape != (rows.shape[0],):
        raise ValueError(f"rope-centered keys need the token positions [N={rows.shape[0]}] of the rows, got "
                         f"{None if positions is None else tuple(positions.shape)}")
    return rows.to(torch.float32) - rope_offsets(t, positions.to(rows.device))


def check_key_block(block: int, page_size: int) -> None:
    """Refuse a per-channel key block that is not 0 or a power of two dividing ``page_size`` (a block lives in one
    page; the kernels take powers of two), naming the valid values."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 0:
        raise ValueError(f"key block={block!r} must be 0 (per-token keys) or a positive number of tokens")
    if block and (block & (block - 1) or page_size % block):
        valid = [2 ** i for i in range(page_size.bit_length()) if page_size % 2 ** i == 0]
        raise ValueError(f"key block={block} must be a power of two dividing page_size={page_size} (a block lives in "
                         f"one page); valid blocks: {valid}")


@dataclass(frozen=True, eq=False)
class QuantPages:
    """One layer's paged storage for K or V (the fields the kernels read: ``oscar.kernels.segments.Pages``).

    ``block`` > 0 (per-channel keys, docs/DESIGN.md "Per-channel key pages"): the same code bytes per slot, and
    ``scale``/``zero`` bf16 ``[P, Hkv, page_size / block, d]``, one pair per block of ``block`` slots and channel."""

    codes: torch.Tensor  # uint8 [P, Hkv, page_size, d*bits//8]
    scale: torch.Tensor  # bf16 [P, Hkv, page_size, d//G] ([P, Hkv, page_size/block, d] with block)
    zero: torch.Tensor  # bf16, as scale
    bits: int
    group_size: int
    layout: str = "rows"  # "rows" (token rows, planar packing) or "mma_k"/"mma_v" (oscar.core.quant, fragment order)
    block: int = 0  # 0: per-token groups; T > 0: per-channel keys over blocks of T slots

    def __post_init__(self) -> None:
        if self.layout not in quant.LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not valid; choose one of {quant.LAYOUTS}")
        check_key_block(self.block, self.page_size)
        if self.block and self.layout == "mma_v":
            raise ValueError("per-channel blocks are a key format: pages in the 'mma_v' layout take block=0")
        if self.layout != "rows":
            quant.check_mma_layout(self.bits, self.group_size, self.head_dim, self.page_size)
        meta = self.meta_shape
        if tuple(self.scale.shape[1:]) != meta[1:] or self.zero.shape != self.scale.shape:
            raise ValueError(f"scale/zero of shape {tuple(self.scale.shape)}/{tuple(self.zero.shape)} do not match "
                             f"pages of {'block ' + str(self.block) if self.block else 'per-token groups'}: expected "
                             f"[P, {meta[1]}, {meta[2]}, {meta[3]}]")

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return int(self.codes.shape[2])

    @property
    def head_dim(self) -> int:
        """Channels per row."""
        return int(self.codes.shape[3]) * 8 // self.bits

    @property
    def meta_shape(self) -> tuple[int, int, int, int]:
        """Shape of ``scale``/``zero``: ``[P, Hkv, page_size, d//G]``, or ``[P, Hkv, page_size/block, d]``."""
        p, h = int(self.codes.shape[0]), int(self.codes.shape[1])
        if self.block:
            return (p, h, self.page_size // self.block, self.head_dim)
        return (p, h, self.page_size, self.head_dim // self.group_size)

    @staticmethod
    def empty(num_pages: int, num_kv_heads: int, page_size: int, head_dim: int, bits: int, group_size: int,
              device: Union[str, torch.device] = "cpu", layout: str = "rows", block: int = 0) -> "QuantPages":
        """Zero-filled storage (``block`` > 0: per-channel key pages)."""
        quant.check_format(bits, group_size, head_dim)
        check_key_block(block, page_size)
        codes = torch.zeros(num_pages, num_kv_heads, page_size, head_dim * bits // 8, dtype=torch.uint8, device=device)
        if block:
            meta = (num_pages, num_kv_heads, page_size // block, head_dim)
        else:
            meta = (num_pages, num_kv_heads, page_size, head_dim // group_size)
        return QuantPages(codes, torch.zeros(meta, dtype=torch.bfloat16, device=device),
                          torch.zeros(meta, dtype=torch.bfloat16, device=device), bits, group_size, layout, block)

    def block_bytes(self, page: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        """Flat byte offsets ``[N, d*bits/8]`` within ``codes[page, head]`` of the tokens at ``off`` (mma layouts)."""
        _, byte_index = quant.mma_token_map(self.head_dim, self.layout, self.bits)
        w = self.codes.shape[3]
        tb = off % quant.MMA_BLOCK_TOKENS
        return (off - tb)[:, None] * w + byte_index.to(off.device)[tb]


# ----------------------------------------------------------------------------------------------
# rotate-clip-quantize-pack


def rotate_quantize_pack_torch(x: torch.Tensor, slots: torch.Tensor, pages: QuantPages, t: HeadTransform,
                               src_index: Optional[torch.Tensor] = None,
                               positions: Optional[torch.Tensor] = None) -> None:
    """Torch twin of the fused write: quantize rows of ``x`` into ``pages`` at ``slots`` in place.

    ``x`` ``[N, Hkv, d]``, or ``[N, Hkv, T, d]`` with ``src_index`` ``[N]`` taking row
    ``x[n, :, src_index[n]]``; ``positions`` ``[N]``: the rows' token positions (rope-centered keys).
    """
    rows = _rope_rows(_select_rows(x, src_index), t, positions)
    n, hkv, d = rows.shape
    _check_rows(rows, pages, slots)
    if n == 0:
        return
    rows, slots = rows.to(pages.codes.device), slots.to(pages.codes.device)
    xf = rows.to(torch.float32)
    if t.mu is not None:
        xf = xf - t.mu.to(xf.device, torch.float32)
    if t.R is not None:
        xf = torch.einsum("nhd,hde->nhe", xf, t.R.to(xf.device, torch.float32))
    clip: quant.ClipRatio = 1.0 if t.rho is None else t.rho.to(xf.device, torch.float32)
    page, off = slots // pages.page_size, slots % pages.page_size
    heads = torch.arange(hkv, device=slots.device)
    if pages.block:
        T = pages.block
        check_whole_blocks(slots, T)
        blocks = xf.reshape(n // T, T, hkv, d).transpose(1, 2)  # [nb, hkv, T, d], one block per row group
        qc = quant.quantize_channels(blocks, pages.bits, T, pages.group_size, clip)
        q_codes = qc.codes.transpose(1, 2).reshape(n, hkv, -1)  # per-token packed rows, as quantize's
        bp, bo = page[::T], off[::T] // T
        pages.scale[bp[:, None], heads[None, :], bo[:, None]] = qc.scale[:, :, 0]
        pages.zero[bp[:, None], heads[None, :], bo[:, None]] = qc.zero[:, :, 0]
    else:
        q = quant.quantize(xf, pages.bits, pages.group_size, clip_ratio=clip)
        q_codes = q.codes
        pages.scale[page[:, None], heads[None, :], off[:, None]] = q.scale
        pages.zero[page[:, None], heads[None, :], off[:, None]] = q.zero
    if pages.layout == "rows":
        pages.codes[page[:, None], heads[None, :], off[:, None]] = q_codes
    else:
        codes = quant.unpack_codes(q_codes, pages.bits, pages.group_size)  # [n, hkv, d]
        packed = quant.pack_codes_mma(codes, (off % quant.MMA_BLOCK_TOKENS)[:, None].expand(n, hkv), pages.layout,
                                      pages.bits)
        flat = pages.codes.view(pages.codes.shape[0], hkv, -1)
        flat[page[:, None, None], heads[None, :, None], pages.block_bytes(page, off)[:, None, :]] = packed


def check_whole_blocks(slots: torch.Tensor, block: int) -> None:
    """Refuse slots that are not whole blocks: ``N % block == 0`` and each run of ``block`` slots consecutive from a
    multiple of ``block`` (per-channel key pages are written a block at a time; reads the slots on the host)."""
    n = int(slots.shape[0])
    if n % block:
        raise ValueError(f"per-channel key pages take whole blocks of {block} rows; got {n} rows")
    runs = slots.reshape(-1, block)
    steps = runs - runs[:, :1]
    ok = bool((runs[:, 0] % block == 0).all()) and bool((steps == torch.arange(block, device=slots.device)).all())
    if not ok:
        bad = int((~((runs[:, 0] % block == 0) & (steps == torch.arange(block, device=slots.device)).all(1))).nonzero()[0])
        raise ValueError(f"per-channel key pages take blocks of {block} consecutive slots starting at a multiple of "
                         f"{block}; block {bad} has slots {runs[bad, :4].tolist()}...")


def _select_rows(x: torch.Tensor, src_index: Optional[torch.Tensor]) -> torch.Tensor:
    if src_index is None:
        if x.dim() != 3:
            raise ValueError(f"rows must be [N, Hkv, d], got shape {tuple(x.shape)}")
        return x
    if x.dim() != 4 or src_index.shape != (x.shape[0],):
        raise ValueError(f"with src_index [N] the source must be [N, Hkv, T, d]; got {tuple(x.shape)} "
                         f"and src_index {tuple(src_index.shape)}")
    return x[torch.arange(x.shape[0], device=x.device), :, src_index.long()]


def _check_rows(rows: torch.Tensor, pages: QuantPages, slots: torch.Tensor) -> None:
    n, hkv, d = rows.shape
    if hkv != pages.codes.shape[1] or d != pages.head_dim:
        raise ValueError(f"rows [N, {hkv}, {d}] do not match pages with Hkv={pages.codes.shape[1]}, d={pages.head_dim}")
    if slots.shape != (n,):
        raise ValueError(f"slots must be [N={n}], got {tuple(slots.shape)}")


def rotate_quantize_pack(x: torch.Tensor, slots: torch.Tensor, pages: QuantPages, t: HeadTransform, *,
                         src_index: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                         backend: Backend = "torch", launch: Optional[QuantizeLaunch] = None) -> None:
    """Rotate, center, clip, quantize and pack rows into ``pages`` at ``slots`` (in place); ``positions`` ``[N]``
    (token positions of the rows) are needed for rope-centered keys, whose offsets are subtracted first.
    ``launch``: the Triton writer's ``QuantizeLaunch`` (ignored by the torch twin)."""
    _check_backend(backend)
    if backend == "torch":
        rotate_quantize_pack_torch(x, slots, pages, t, src_index, positions)
        return
    from oscar.kernels.quantize import rotate_quantize_pack as kernel  # local: keeps triton out of import time

    if t.rope_centered:
        x, src_index, t = _rope_rows(_select_rows(x, src_index), t, positions), None, t.without_rope()
    if pages.block:
        from oscar.kernels.quantize import rotate_quantize_pack_channels  # local: keeps triton out of import time

        rotate_quantize_pack_channels(_select_rows(x, src_index), slots, pages, t, token_map=mma_map(pages),
                                      launch=launch)
        return
    kernel(x, slots, pages, t, src_index=src_index, token_map=mma_map(pages), launch=launch)


def mma_map(pages: QuantPages) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """The token map of pages in a fragment-order layout (``oscar.core.quant.mma_token_map``), None for rows."""
    return None if pages.layout == "rows" else quant.mma_token_map(pages.head_dim, pages.layout, pages.bits)


def rotate_quantize_pack_kv(xk: torch.Tensor, xv: torch.Tensor, slots: torch.Tensor, k_pages: QuantPages,
                            v_pages: QuantPages, kt: HeadTransform, vt: HeadTransform, *,
                            src_index: Optional[torch.Tensor] = None, positions: Optional[torch.Tensor] = None,
                            backend: Backend = "torch", launch: Optional[QuantizeLaunch] = None) -> None:
    """K and V rows into their pages at the same slots; one fused launch on the Triton backend when possible.
    ``positions`` ``[N]``: the rows' token positions, needed when ``kt`` is rope-centered."""
    _check_backend(backend)
    if kt.rope_centered and backend != "torch":  # the offsets come off the keys first; V's rows are taken as given
        xv = _select_rows(xv, src_index)
        xk, src_index = _rope_rows(_select_rows(xk, src_index), kt, positions), None
        xv = xv.to(xk.dtype)
        kt = kt.without_rope()
    same_kind = all((a is None) == (b is None) for a, b in ((kt.R, vt.R), (kt.mu, vt.mu), (kt.rho, vt.rho)))
    same_kind = same_kind and (k_pages.layout == "rows") == (v_pages.layout == "rows") and not k_pages.block
    if backend == "torch" or not same_kind or xk.stride() != xv.stride() or xk.dtype != xv.dtype:
        rotate_quantize_pack(xk, slots, k_pages, kt, src_index=src_index, positions=positions, backend=backend,
                             launch=launch)
        rotate_quantize_pack(xv, slots, v_pages, vt, src_index=src_index, backend=backend, launch=launch)
        return
    from oscar.kernels.quantize import rotate_quantize_pack_pair  # local: keeps triton out of import time

    rotate_quantize_pack_pair(xk, xv, slots, k_pages, v_pages, kt, vt, src_index=src_index,
                              token_maps=(mma_map(k_pages), mma_map(v_pages)), launch=launch)


# ----------------------------------------------------------------------------------------------
# reads


def slots_for(page_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slots (int64) of quantized positions ``pos`` of sequences ``seq`` (device ops, graph-safe)."""
    seq, pos = seq.long(), pos.long()
    return page_table[seq, pos // page_size].long() * page_size + pos % page_size


def check_channel_ring(recent: int, block: int) -> None:
    """Refuse a recent window that the per-channel ring cannot hold: ``W`` a positive multiple of ``T``."""
    if block <= 0 or recent < block or recent % block:
        raise ValueError(f"recent={recent}: a layer with per-channel key blocks of {block} tokens needs a recent window "
                         f"that is a positive multiple of {block} (docs/DESIGN.md 'Per-channel key pages'); e.g. "
                         f"recent={max(block, recent // max(block, 1) * block)}")


def channel_ring_slots(r: torch.Tensor, n: torch.Tensor, recent: int, block: int) -> torch.Tensor:
    """Ring slot of token ``r`` (counted past the sink) of a per-channel layer whose sequence holds ``n`` tokens past
    the sink (``r`` and ``n`` broadcast; docs/DESIGN.md "Per-channel key pages"): ``k*T + i`` for block ``k < m``,
    ``(k % m)*T + i`` for a complete block ``k >= m``, ``m*T + i`` for the incomplete one (``m = W / T``)."""
    T, m = block, recent // block
    k, i = r // T, r % T
    complete = (k + 1) * T <= n
    return torch.where(k < m, k * T + i, torch.where(complete, (k % m) * T + i, m * T + i))


def channel_ring(r: torch.Tensor, recent: int, block: int) -> dict[str, torch.Tensor]:
    """Indices of the decode step that brings token ``r`` (int64 ``[B]``, counted past the sink, >= 0) into the recent
    ring of a per-channel layer (``W = recent``, ``T = block``, ``C = W + T - 1`` slots; device ops, static shapes):

    - ``write``: ring slot of the new token ``[B]``;
    - ``demote`` bool ``[B]``: the step completes block ``k >= m`` and demotes block ``k - m``;
    - ``src`` ``[B, T]``: ring slots of the demoted block (read before anything is written);
    - ``qpos`` ``[B, T]``: its quantized positions (``(k - m)*T + j``; clamped at 0 where nothing demotes);
    - ``move_src``/``move_dst`` ``[B, T - 1]``: the tail rows that move into the freed slots after the demotion
      (where ``demote``);
    - ``int_len``/``recent_len`` int32 ``[B]`` after the step.
    """
    T, m = block, recent // block
    k, i = r // T, r % T
    blk = k % m
    demote = (k >= m) & (i == T - 1)
    j = torch.arange(T, device=r.device)
    n = r + 1
    int_len = torch.div((n - recent).clamp(min=0), T, rounding_mode="floor") * T
    return {
        "write": channel_ring_slots(r, n, recent, block),
        "demote": demote,
        "src": blk[:, None] * T + j,
        "qpos": (k - m).clamp(min=0)[:, None] * T + j,
        "move_src": m * T + j[: T - 1].expand(r.shape[0], T - 1),
        "move_dst": blk[:, None] * T + j[: T - 1],
        "int_len": int_len.to(torch.int32),
        "recent_len": (n - int_len).to(torch.int32),
    }


def gather_dequantize(pages: QuantPages, page_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Float32 rows ``[Hkv, length, d]`` (rotated frame) of sequence ``b``'s first ``length`` quantized tokens."""
    dev = pages.codes.device
    pos = torch.arange(length, device=dev)
    slots = slots_for(page_table, torch.full_like(pos, b), pos, pages.page_size)
    page, off = slots // pages.page_size, slots % pages.page_size
    if pages.layout == "rows":
        codes = pages.codes[page, :, off].transpose(0, 1)
    else:
        hkv = pages.codes.shape[1]
        flat = pages.codes.view(pages.codes.shape[0], hkv, -1)
        heads = torch.arange(hkv, device=dev)
        packed = flat[page[None, :, None], heads[:, None, None], pages.block_bytes(page, off)[None]]  # [Hkv, n, W]
        tb = (off % quant.MMA_BLOCK_TOKENS)[None].expand(hkv, length)
        codes = quant.pack_codes(quant.unpack_codes_mma(packed, tb, pages.layout, pages.bits), pages.bits,
                                 pages.group_size)
    if pages.block:  # per-channel keys: the block's scale and zero of every channel
        unpacked = quant.unpack_codes(codes, pages.bits, pages.group_size).to(torch.float32)
        j = off // pages.block
        return (unpacked * pages.scale[page, :, j].transpose(0, 1).to(torch.float32)
                + pages.zero[page, :, j].transpose(0, 1).to(torch.float32))
    q = quant.QuantizedRows(codes=codes, scale=pages.scale[page, :, off].transpose(0, 1),
                            zero=pages.zero[page, :, off].transpose(0, 1), bits=pages.bits,
                            group_size=pages.group_size, d=pages.head_dim)
    return quant.dequantize(q)


# ----------------------------------------------------------------------------------------------
# decode attention


def decode_attention_torch(
    q: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    segments: Segments,
    kt: HeadTransform,
    vt: HeadTransform,
    *,
    sm_scale: Optional[float] = None,
    output_frame: str = "original",
) -> torch.Tensor:
    """Torch twin of the paged decode attention: float32 dequantize-then-attend over three segments.

    ``q`` ``[B, H, d]``; returns ``[B, H, d]`` in ``q.dtype``. See the module docstring for the
    segments, the logits of the quantized segment and ``output_frame``. Rope-centered keys (``kt.rope_mu``)
    add ``q . RoPE_p(rope_mu)`` to the logit of quantized token ``t`` at position ``p = int_pos0[b] + t``
    (``segments.int_pos0``: an int or int ``[B]``, the position of each sequence's first quantized token).
    ``segments.window_rows`` (int ``[B]``): sequence ``b`` reads its sink and recent rows at row ``window_rows[b]``
    of the windows (any number of rows: a cache's per-slot window buffers, read in place); None: row ``b``.
    The lengths stay per sequence (``sink_len[b]``, ``recent_len[b]``).
    """
    B, H, d = q.shape
    hkv = k_pages.codes.shape[1]
    _check_attention_args(q, hkv, output_frame)
    windows = segments.windows
    wrows = _window_rows(segments.window_rows, B, windows[0][1] if windows else None)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    rep = H // hkv
    lens = segments.int_len.tolist()
    page_table = segments.page_table
    outs = []
    for b in range(B):
        qb = q[b].to(torch.float32).reshape(hkv, rep, d)  # [Hkv, rep, d]
        logits, values, frames = [], [], []
        for _, seg_k, seg_v, seg_len in windows:
            n, w = int(seg_len[b]), wrows[b]
            kk = seg_k[w, :, :n].to(torch.float32)
            logits.append(torch.einsum("hrd,htd->hrt", qb, kk) * scale)
            values.append(seg_v[w, :, :n].to(torch.float32))
            frames.append("original")
        n = int(lens[b])
        if n > 0:
            kh = gather_dequantize(k_pages, page_table, b, n)  # [Hkv, n, d] rotated
            vh = gather_dequantize(v_pages, page_table, b, n)
            q_rot = qb if kt.R is None else torch.einsum("hrd,hde->hre", qb, kt.R.to(qb.device, torch.float32))
            lg = torch.einsum("hrd,htd->hrt", q_rot, kh)
            if kt.mu is not None:
                lg = lg + torch.einsum("hrd,hd->hr", qb, kt.mu.to(qb.device, torch.float32))[..., None]
            if kt.rope_centered:
                pos = _pos0(segments.int_pos0, b, B) + torch.arange(n, device=qb.device)
                lg = lg + torch.einsum("hrd,thd->hrt", qb, rope_offsets(kt, pos))
            logits.append(lg * scale)
            values.append(vh)
            frames.append("rotated")
        if not logits:
            raise ValueError(f"sequence {b} has no tokens in any segment (sink, quantized, recent)")
        lse = torch.logsumexp(torch.cat(logits, dim=-1), dim=-1, keepdim=True)  # [Hkv, rep, 1]
        o = torch.zeros(hkv, rep, d, dtype=torch.float32, device=q.device)
        for lg, v, frame in zip(logits, values, frames):
            p = torch.exp(lg - lse)
            part = torch.einsum("hrt,htd->hrd", p, v)
            mass = p.sum(-1, keepdim=True)
            o = o + _to_frame(part, mass, frame, output_frame, vt)
        outs.append(o.reshape(H, d))
    return torch.stack(outs).to(q.dtype)


def _to_frame(part: torch.Tensor, mass: torch.Tensor, frame: str, output_frame: str, vt: HeadTransform) -> torch.Tensor:
    """Move a segment's ``sum p v`` (with ``sum p`` = ``mass``) to the output frame."""
    if frame == output_frame:
        return part
    R = None if vt.R is None else vt.R.to(part.device, torch.float32)
    mu = None if vt.mu is None else vt.mu.to(part.device, torch.float32)[:, None, :]
    if frame == "rotated":  # -> original: o = o_rot @ R^T + mass * mu
        out = part if R is None else torch.einsum("hre,hde->hrd", part, R)
        return out if mu is None else out + mass * mu
    out = part if mu is None else part - mass * mu  # -> rotated: (o - mass*mu) @ R
    return out if R is None else torch.einsum("hrd,hde->hre", out, R)


def _pos0(int_pos0: Union[int, torch.Tensor, None], b: int, batch: int) -> int:
    """Position of sequence ``b``'s first quantized token (rope-centered keys)."""
    if int_pos0 is None:
        raise ValueError("rope-centered keys need int_pos0 (the position of each sequence's first quantized token: "
                         "an int or int [B]); the cache passes its sink length")
    if isinstance(int_pos0, int):
        return int_pos0
    if int_pos0.numel() < batch:
        raise ValueError(f"int_pos0 must hold one position per sequence ([>= {batch}]), got {tuple(int_pos0.shape)}")
    return int(int_pos0[b])


def _window_rows(window_rows: Optional[torch.Tensor], batch: int, seg: Optional[torch.Tensor]) -> list[int]:
    """Row of the window tensors each sequence reads (``window_rows``, checked against their rows, or ``b``)."""
    if window_rows is None:
        return list(range(batch))
    if window_rows.dim() != 1 or window_rows.numel() < batch or window_rows.is_floating_point():
        raise ValueError(f"window_rows must be an int vector of one window row per sequence ([>= {batch}]), got "
                         f"{window_rows.dtype} {tuple(window_rows.shape)}")
    rows = [int(r) for r in window_rows[:batch].tolist()]
    n = int(seg.shape[0]) if seg is not None else 0
    bad = [r for r in rows if not 0 <= r < n]
    if seg is not None and bad:
        raise ValueError(f"window_rows {bad[:4]} are outside the {n} rows of the window tensors (valid: 0..{n - 1})")
    return rows


def _check_attention_args(q: torch.Tensor, hkv: int, output_frame: str) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, d] (one decode query per sequence), got shape {tuple(q.shape)}")
    if q.shape[1] % hkv != 0:
        raise ValueError(f"query heads H={q.shape[1]} must be a multiple of KV heads Hkv={hkv}")
    if output_frame not in ("original", "rotated"):
        raise ValueError(f"output_frame={output_frame!r} must be 'original' or 'rotated'")


def decode_attention(
    q: torch.Tensor,
    k_pages: QuantPages,
    v_pages: QuantPages,
    segments: Segments,
    kt: HeadTransform,
    vt: HeadTransform,
    *,
    sm_scale: Optional[float] = None,
    output_frame: str = "original",
    backend: Backend = "torch",
    launch: Union[RowsLaunch, MmaLaunch, None] = None,
) -> torch.Tensor:
    """Decode attention of one query per sequence over BF16 sink + quantized pages + BF16 recent.

    ``segments`` (``oscar.kernels.segments.Segments``): page table, quantized lengths, the BF16 windows (read in
    place at ``window_rows``), and ``int_pos0`` for rope-centered keys (``decode_attention_torch``). On
    ``backend="triton"`` row-layout pages go to ``oscar.kernels.decode_rows`` (``launch``: ``RowsLaunch``) and
    fragment-order pages to the CUDA kernel ``oscar.kernels.decode_mma`` (``launch``: ``MmaLaunch``); the torch
    twin ignores ``launch``. The kernels take int32 indices and do not check the window rows' range.
    """
    _check_backend(backend)
    if backend == "torch":
        return decode_attention_torch(q, k_pages, v_pages, segments, kt, vt, sm_scale=sm_scale,
                                      output_frame=output_frame)
    layout = _pair_layout(k_pages, v_pages)
    if layout == "mma" and k_pages.block and not _mma_reads_channel_keys():
        raise NotImplementedError(
            f"per-channel key pages (block={k_pages.block}) in the mma layout are not read by the CUDA kernel "
            "oscar.kernels.decode_mma yet (its CHANNEL_KEYS is false); use layout='rows' (Triton) or backend='torch'")
    if layout == "mma" and q.device.type != "cuda":
        raise ValueError("pages in the mma layout are read by a CUDA kernel; on a CPU use backend='torch' "
                         f"(q is on {q.device})")
    if kt.rope_centered:
        if layout != "mma":
            raise ValueError("rope-centered keys are read by the mma-layout CUDA kernel (pages in the 'mma' layout, "
                             "INT2, d 64/128) or backend='torch'; the row-layout Triton kernels do not add "
                             "q . RoPE_p(m)")
        _pos0(segments.int_pos0, 0, 0)  # present
    if layout == "rows":
        from oscar.kernels.decode_rows import paged_decode_attention_rows  # local: keeps triton out of import time

        return paged_decode_attention_rows(q, k_pages, v_pages, segments, kt, vt, sm_scale=sm_scale,
                                           output_frame=output_frame, launch=launch)
    from oscar.kernels.decode_mma import paged_decode_attention_mma  # local: keeps triton out of import time

    qk, unpad = pad_query_heads(q, k_pages.codes.shape[1])
    out = paged_decode_attention_mma(qk, k_pages, v_pages, segments, kt, vt, sm_scale=sm_scale,
                                     output_frame=output_frame, launch=launch)
    return out if unpad is None else unpad(out)


def _mma_reads_channel_keys() -> bool:
    """Whether the CUDA mma kernel reads per-channel key pages (``oscar.kernels.decode_mma.CHANNEL_KEYS``)."""
    from oscar.kernels import decode_mma  # local: keeps the CUDA launcher out of import time

    return bool(getattr(decode_mma, "CHANNEL_KEYS", False))


MMA_GQA = (1, 2, 4, 8)  # query heads per KV head that the mma kernel's template instances take


def pad_query_heads(q: torch.Tensor, hkv: int) -> tuple[torch.Tensor, Optional[Any]]:
    """``q`` ``[B, H, d]`` with each KV head's ``H/Hkv`` query heads padded by zero queries to the next GQA ratio
    of ``MMA_GQA`` (SmolLM2's 3 -> 4), and the function that drops the padded heads from the output; ``(q, None)``
    when the ratio is one of them. Each query head attends on its own, so the real heads' outputs are those of
    the unpadded call (device ops only: graph-capturable; the kernel reads each page once per KV head either way)."""
    B, H, d = q.shape
    rep = H // hkv
    if rep in MMA_GQA or rep > MMA_GQA[-1]:  # > 8: refused by the kernel, naming the ratio
        return q, None
    padded = next(r for r in MMA_GQA if r > rep)
    qp = q.new_zeros(B, hkv, padded, d)
    qp[:, :, :rep] = q.view(B, hkv, rep, d)
    return qp.view(B, hkv * padded, d), lambda o: o.view(B, hkv, padded, d)[:, :, :rep].reshape(B, H, d)


def _pair_layout(k_pages: QuantPages, v_pages: QuantPages) -> str:
    """'rows' or 'mma' (K pages in mma_k and V pages in mma_v); anything else is refused."""
    pair = (k_pages.layout, v_pages.layout)
    if pair == ("rows", "rows"):
        return "rows"
    if pair == ("mma_k", "mma_v"):
        return "mma"
    raise ValueError(f"K/V page layouts {pair} are not a valid pair; use ('rows', 'rows') or ('mma_k', 'mma_v')")


# ----------------------------------------------------------------------------------------------
# the pool


class PagedKVPool:
    """Paged quantized K/V storage for all layers of a model, with one page table shared by the layers."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, max_batch: int,
                 max_pages_per_seq: int, bits: int = 2, group_size: int = 128, page_size: int = 64,
                 device: Union[str, torch.device] = "cpu", layout: str = "rows") -> None:
        quant.check_format(bits, group_size, head_dim)
        if layout not in ("rows", "mma"):
            raise ValueError(f"layout={layout!r} is not valid; choose 'rows' or 'mma' (fragment order, oscar.core.quant)")
        k_layout, v_layout = ("rows", "rows") if layout == "rows" else ("mma_k", "mma_v")
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size={page_size} must be a power of two")
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("num_pages", num_pages),
                        ("max_batch", max_batch), ("max_pages_per_seq", max_pages_per_seq)):
            if v <= 0:
                raise ValueError(f"{name}={v} must be positive")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.bits, self.group_size, self.page_size = bits, group_size, page_size
        self.device = torch.device(device)
        self.layout = layout
        self.k = [QuantPages.empty(num_pages, num_kv_heads, page_size, head_dim, bits, group_size, device, k_layout)
                  for _ in range(num_layers)]
        self.v = [QuantPages.empty(num_pages, num_kv_heads, page_size, head_dim, bits, group_size, device, v_layout)
                  for _ in range(num_layers)]
        self.page_table = torch.zeros(max_batch, max_pages_per_seq, dtype=torch.int32, device=device)
        self.int_len = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self._free = list(range(num_pages - 1, -1, -1))
        self._pages: list[list[int]] = [[] for _ in range(max_batch)]
        self._lens = [0] * max_batch

    @property
    def num_free_pages(self) -> int:
        """Pages not held by any sequence."""
        return len(self._free)

    def length(self, b: int) -> int:
        """Quantized tokens held for sequence ``b`` (host mirror of ``int_len[b]``)."""
        return self._lens[b]

    def reserve(self, seqs: Sequence[int], counts: Union[int, Sequence[int]]) -> torch.Tensor:
        """Allocate room for ``counts`` more quantized tokens per sequence; return their slots (int64).

        Call once per step before any layer writes; every layer then writes the same slots.
        """
        counts = [counts] * len(seqs) if isinstance(counts, int) else list(counts)
        if len(counts) != len(seqs):
            raise ValueError(f"{len(seqs)} sequences but {len(counts)} counts")
        need = 0
        for b, c in zip(seqs, counts):
            if not 0 <= b < len(self._lens):
                raise ValueError(f"sequence {b} is out of range 0..{len(self._lens) - 1}")
            if c < 0:
                raise ValueError(f"count {c} for sequence {b} must be >= 0")
            pages_after = -(-(self._lens[b] + c) // self.page_size)
            if pages_after > self.page_table.shape[1]:
                raise ValueError(f"sequence {b} would need {pages_after} pages, over max_pages_per_seq="
                                 f"{self.page_table.shape[1]}")
            need += pages_after - len(self._pages[b])
        if need > len(self._free):
            raise RuntimeError(f"paged pool out of pages: {need} needed, {len(self._free)} free")
        slots: list[int] = []
        for b, c in zip(seqs, counts):
            start = self._lens[b]
            while len(self._pages[b]) * self.page_size < start + c:
                page = self._free.pop()
                self.page_table[b, len(self._pages[b])] = page
                self._pages[b].append(page)
            for t in range(start, start + c):
                slots.append(self._pages[b][t // self.page_size] * self.page_size + t % self.page_size)
            self._lens[b] = start + c
        self.int_len[: len(self._lens)] = torch.tensor(self._lens, dtype=torch.int32, device=self.device)
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def release(self, b: int) -> None:
        """Free sequence ``b``'s pages and set its length to 0."""
        self._free.extend(reversed(self._pages[b]))
        self._pages[b] = []
        self._lens[b] = 0
        self.int_len[b] = 0

    def write(self, layer: int, k_rows: torch.Tensor, v_rows: torch.Tensor, slots: torch.Tensor,
              kt: HeadTransform, vt: HeadTransform, backend: Backend = "torch",
              positions: Optional[torch.Tensor] = None) -> None:
        """Quantize K and V rows ``[N, Hkv, d]`` (original frame) of ``layer`` into ``slots`` (``positions`` [N]:
        the rows' token positions, for rope-centered keys)."""
        rotate_quantize_pack_kv(k_rows, v_rows, slots, self.k[layer], self.v[layer], kt, vt, backend=backend,
                                positions=positions)

    def demote(self, layer: int, recent_k: torch.Tensor, recent_v: torch.Tensor, src_index: torch.Tensor,
               slots: torch.Tensor, kt: HeadTransform, vt: HeadTransform, backend: Backend = "torch",
               positions: Optional[torch.Tensor] = None) -> None:
        """Quantize ``recent_*[n, :, src_index[n]]`` (``[N, Hkv, W, d]`` windows) into ``slots`` [N]."""
        rotate_quantize_pack_kv(recent_k, recent_v, slots, self.k[layer], self.v[layer], kt, vt,
                                src_index=src_index, backend=backend, positions=positions)

    def read(self, layer: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized float32 K and V ``[Hkv, T, d]`` of sequence ``b`` in the rotated frame."""
        n = self._lens[b]
        return (gather_dequantize(self.k[layer], self.page_table, b, n),
                gather_dequantize(self.v[layer], self.page_table, b, n))

    def attend(self, layer: int, q: torch.Tensor, kt: HeadTransform, vt: HeadTransform, *,
               sm_scale: Optional[float] = None, output_frame: str = "original", backend: Backend = "torch",
               launch: Union[RowsLaunch, MmaLaunch, None] = None, **windows: Any) -> torch.Tensor:
        """Decode attention for sequences ``0..q.shape[0]-1`` of ``layer`` (see ``decode_attention``); ``windows``:
        the fields of ``Segments`` other than the pool's page table and lengths (``sink_k=``, ..., ``int_pos0=``)."""
        B = q.shape[0]
        segments = Segments(self.page_table[:B], self.int_len[:B], **windows)
        return decode_attention(q, self.k[layer], self.v[layer], segments, kt, vt, sm_scale=sm_scale,
                                output_frame=output_frame, backend=backend, launch=launch)


__all__ = [
    "HeadTransform",
    "PagedKVPool",
    "channel_ring",
    "channel_ring_slots",
    "check_channel_ring",
    "check_key_block",
    "check_whole_blocks",
    "QuantPages",
    "Segments",
    "decode_attention",
    "decode_attention_torch",
    "gather_dequantize",
    "rotate_quantize_pack",
    "rotate_quantize_pack_kv",
    "rotate_quantize_pack_torch",
    "rope_offsets",
    "slots_for",
]

"""Decode attention v11: a warp-specialized INT2 decode over one record per (page, KV head), CUDA sm_90.

The record (``RecordLayout``; written by ``pack_records``, the torch twin writer, read back by ``unpack_records``)
holds a page's K codes (``mma_k`` fragment order), V codes (``mma_v``) and their per-token scale/zero, 16-byte
aligned, so one ``cp.async.bulk`` moves a page. In the kernel (``decode_v11.cu``) a producer warp reads the page
table and issues those copies into a shared-memory ring (mbarriers); four math warps score 64 tokens per softmax
step (tokens in the MMA M dimension) with no global loads, then split-K partials, the BF16 windows' CTAs and the
last-CTA merge as in v10 (``decode_mma``). Compiled at first use by NVRTC (``torch.cuda._utils``), as v10.

Formats: per-token INT2 keys and values; rope-centered keys (``HeadTransform.rope_mu``: the kernel adds
``q . RoPE_p(m)`` to each logit; no record bytes) and per-channel key records (``RecordLayout.key_block = T``: the
block's K scale/zero per channel after the meta; the query is scaled once per block, one ``q_r . z`` per block).
``pack_pages`` writes records from a layer's ``mma_k``/``mma_v`` pages (``oscar.cache.paged.QuantPages``).

The torch twin (the specification) is ``oscar.cache.paged.decode_attention_torch`` on the pages that
``unpack_records`` returns; tests/test_kernels_v11.py emulates the kernel's fragment arithmetic on the CPU.
Not served yet: v11 replaces v10 only where it is measured faster everywhere (reports/kernels/v11/README.md).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ._runtime import check
from .decode_mma import _derived, _launch, _window, mma_b_fragments, rope_table
from .segments import HeadTransform, Pages, Segments

LOG2E = 1.4426950408889634
MAX_PARTIALS = 256  # SMAX in decode_v11.cu
SOURCE = Path(__file__).with_name("decode_v11.cu")
TILE = 16  # tokens of an mma tile (a 16-token block of the fragment-order layout)


@dataclass(frozen=True)
class RecordLayout:
    """Byte layout of one (page, KV head) record; every section starts 16-byte aligned.

    ``[k_off, +PS*d*b/8)`` K codes (the page's ``mma_k`` bytes), ``[v_off, ...)`` V codes (``mma_v``),
    ``[meta_off, +PS*8)`` per-token meta: per 16-token tile 8 entries of 16 bytes, entry ``g`` = bf16
    ``{ks[g], ks[g+8], kz[g], kz[g+8], vs[g], vs[g+8], vz[g], vz[g+8]}`` (the 4 lanes ``(g, t)`` of a warp read it with
    one 16-byte load). Per-channel key pages (docs/DESIGN.md, ``key_block = T > 0``): the K words of the entries stay
    zero and ``[chan_off, +(PS/T)*4*d)`` holds per block of ``T`` tokens bf16 ``scale[d]`` then ``zero[d]`` (channel
    order of the rotated frame, the pages' values). Rope-centered keys need no bytes (the rope term depends on the
    query, the positions and the layer's means only)."""

    d: int
    page_size: int
    bits: int = 2
    key_block: int = 0

    def __post_init__(self) -> None:
        check(self.d in (64, 128), lambda: f"RecordLayout(d={self.d}): head_dim must be 64 or 128")
        check(self.bits == 2, lambda: f"RecordLayout(bits={self.bits}): records hold INT2 codes (INT4: not yet)")
        ps = self.page_size
        check(ps in (16, 32, 64, 128), lambda: f"RecordLayout(page_size={ps}): must be 16, 32, 64 or 128")
        kb = self.key_block
        check(kb == 0 or (kb % TILE == 0 and ps % kb == 0),
              lambda: f"RecordLayout(key_block={kb}): 0 (per-token keys) or a multiple of 16 dividing page_size={ps}")

    @property
    def code_bytes(self) -> int:
        return self.page_size * self.d * self.bits // 8

    @property
    def k_off(self) -> int:
        return 0

    @property
    def v_off(self) -> int:
        return self.code_bytes

    @property
    def meta_off(self) -> int:
        return 2 * self.code_bytes

    @property
    def chan_off(self) -> int:
        return self.meta_off + 8 * self.page_size

    @property
    def chan_bytes(self) -> int:
        return 0 if self.key_block == 0 else (self.page_size // self.key_block) * 4 * self.d

    @property
    def bytes(self) -> int:
        return -(-(self.chan_off + self.chan_bytes) // 16) * 16


def _meta_perm(ps: int) -> torch.Tensor:
    """Index of each meta bf16 into ``cat([ks, kz, vs, vz])`` of a page (``[4 * ps]``), in record order."""
    tiles = torch.arange(ps // TILE).view(-1, 1, 1, 1)
    g = torch.arange(8).view(1, -1, 1, 1)
    arr = torch.arange(4).view(1, 1, -1, 1)  # ks, kz, vs, vz
    half = torch.arange(2).view(1, 1, 1, -1)  # token g, g + 8
    return (arr * ps + tiles * TILE + g + 8 * half).reshape(-1)


def pack_records(k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor, v_codes: torch.Tensor,
                 v_scale: torch.Tensor, v_zero: torch.Tensor, layout: RecordLayout) -> torch.Tensor:
    """The torch twin writer: mma-layout pages (codes uint8 ``[P, Hkv, PS, d/4]`` in ``mma_k``/``mma_v``, scale/zero
    bf16 ``[P, Hkv, PS, 1]``; per-channel keys (``layout.key_block = T``): K scale/zero bf16 ``[P, Hkv, PS/T, d]``)
    -> records uint8 ``[P, Hkv, layout.bytes]``."""
    P, hkv, ps, nb = (int(s) for s in k_codes.shape)
    check(ps == layout.page_size and nb == layout.d * layout.bits // 8 and v_codes.shape == k_codes.shape,
          lambda: f"codes {tuple(k_codes.shape)} / {tuple(v_codes.shape)} do not match {layout}")
    kb = layout.key_block
    k_meta = (P, hkv, ps // kb, layout.d) if kb else (P, hkv, ps, 1)
    for name, t, shape in (("k_scale", k_scale, k_meta), ("k_zero", k_zero, k_meta),
                           ("v_scale", v_scale, (P, hkv, ps, 1)), ("v_zero", v_zero, (P, hkv, ps, 1))):
        what = "one pair per channel and key block" if kb and name[0] == "k" else "one group per row"
        check(tuple(t.shape) == shape and t.dtype == torch.bfloat16,
              lambda: f"{name} must be bf16 {list(shape)} ({what}), got {t.dtype} {tuple(t.shape)}")
    rec = torch.zeros(P, hkv, layout.bytes, dtype=torch.uint8, device=k_codes.device)
    cb = layout.code_bytes
    rec[..., layout.k_off:layout.k_off + cb] = k_codes.reshape(P, hkv, cb)
    rec[..., layout.v_off:layout.v_off + cb] = v_codes.reshape(P, hkv, cb)
    zeros = torch.zeros(P, hkv, ps, dtype=torch.bfloat16, device=k_codes.device)
    per_tok = (zeros, zeros) if kb else (k_scale.reshape(P, hkv, ps), k_zero.reshape(P, hkv, ps))
    meta = torch.cat([*per_tok, v_scale.reshape(P, hkv, ps), v_zero.reshape(P, hkv, ps)], dim=-1)
    meta = meta[..., _meta_perm(ps).to(meta.device)].contiguous()
    rec[..., layout.meta_off:layout.meta_off + 8 * ps] = meta.view(torch.uint8)
    if kb:
        chan = torch.cat([k_scale, k_zero], dim=-1).contiguous()  # [P, Hkv, PS/T, 2d]: scale[d], zero[d] per block
        rec[..., layout.chan_off:layout.chan_off + layout.chan_bytes] = chan.view(torch.uint8).reshape(P, hkv, -1)
    return rec


def pack_pages(k_pages: Pages, v_pages: Pages) -> tuple[torch.Tensor, RecordLayout]:
    """Records ``[P, Hkv, bytes]`` and their layout from a layer's K and V pages in the mma layouts (INT2, one group per
    row; K pages per token or per channel, ``k_pages.block``): the pages' codes and scale/zero, moved, not changed."""
    check(k_pages.layout == "mma_k" and v_pages.layout == "mma_v",
          lambda: f"pack_pages takes pages in the 'mma_k'/'mma_v' layouts, got {k_pages.layout!r}/{v_pages.layout!r}")
    check(k_pages.bits == 2 and v_pages.bits == 2,
          lambda: f"records hold INT2 codes, got bits {k_pages.bits}/{v_pages.bits}")
    check(int(getattr(v_pages, "block", 0)) == 0, "V pages are per token (block=0)")
    ps, d = int(k_pages.codes.shape[2]), int(k_pages.codes.shape[3]) * 4
    lay = RecordLayout(d, ps, key_block=int(getattr(k_pages, "block", 0)))
    return pack_records(k_pages.codes, k_pages.scale, k_pages.zero, v_pages.codes, v_pages.scale, v_pages.zero,
                        lay), lay


def unpack_records(records: torch.Tensor, layout: RecordLayout) -> tuple[torch.Tensor, ...]:
    """Records -> ``(k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)`` as ``pack_records`` took them (exact)."""
    P, hkv, nbytes = (int(s) for s in records.shape)
    check(nbytes == layout.bytes and records.dtype == torch.uint8,
          lambda: f"records must be uint8 [P, Hkv, {layout.bytes}] for {layout}, got {records.dtype} {tuple(records.shape)}")
    ps, cb, nb = layout.page_size, layout.code_bytes, layout.d * layout.bits // 8
    kc = records[..., layout.k_off:layout.k_off + cb].reshape(P, hkv, ps, nb).contiguous()
    vc = records[..., layout.v_off:layout.v_off + cb].reshape(P, hkv, ps, nb).contiguous()
    meta = records[..., layout.meta_off:layout.meta_off + 8 * ps].contiguous().view(torch.bfloat16)
    flat = torch.empty_like(meta)
    flat[..., _meta_perm(ps).to(meta.device)] = meta
    ks, kz, vs, vz = (flat[..., i * ps:(i + 1) * ps].reshape(P, hkv, ps, 1).contiguous() for i in range(4))
    if layout.key_block:
        chan = records[..., layout.chan_off:layout.chan_off + layout.chan_bytes].contiguous().view(torch.bfloat16)
        chan = chan.reshape(P, hkv, ps // layout.key_block, 2 * layout.d)
        ks, kz = chan[..., :layout.d].contiguous(), chan[..., layout.d:].contiguous()
    return kc, ks, kz, vc, vs, vz


def write_tokens(records: torch.Tensor, layout: RecordLayout, slots: torch.Tensor, k_bytes: torch.Tensor,
                 v_bytes: torch.Tensor, k_meta: torch.Tensor, v_meta: torch.Tensor, token_maps: tuple) -> None:
    """The torch twin writer for single tokens (prefill, demotion): token ``n`` goes to slot ``slots[n]``
    (``page * PS + offset``) of every KV head. ``k_bytes``/``v_bytes``: uint8 ``[N, Hkv, d/4]``, each token's codes
    packed for its position in a 16-token tile (``oscar.core.quant.pack_codes_mma``); ``k_meta``/``v_meta``: bf16
    ``[N, Hkv, 2]`` (scale, zero); ``token_maps``: the byte tables ``mma_token_map(d, "mma_k")[1]`` and
    ``(d, "mma_v")[1]`` (``[16, d/4]``; the kernels may not import ``oscar.core``). A token's bytes are its own, so
    writers of different tokens never touch the same byte. Per-channel key records (``layout.key_block > 0``):
    ``k_meta`` is None (the K words of the entries stay zero) and ``write_key_blocks`` writes the blocks' K
    scale/zero."""
    ps, hkv = layout.page_size, int(records.shape[1])
    n = int(slots.numel())
    check(k_bytes.shape == (n, hkv, layout.d // 4) and v_bytes.shape == k_bytes.shape,
          lambda: f"k_bytes/v_bytes must be uint8 [{n}, {hkv}, {layout.d // 4}], got {tuple(k_bytes.shape)}")
    check((k_meta is None) == (layout.key_block > 0),
          lambda: f"k_meta must be None for per-channel key records (key_block={layout.key_block}) and given otherwise")
    check(v_meta.shape == (n, hkv, 2) and v_meta.dtype == torch.bfloat16
          and (k_meta is None or (k_meta.shape == v_meta.shape and k_meta.dtype == torch.bfloat16)),
          lambda: f"k_meta/v_meta must be bf16 [{n}, {hkv}, 2], got {v_meta.dtype} {tuple(v_meta.shape)}")
    if k_meta is None:
        k_meta = torch.zeros_like(v_meta)
    dev = records.device
    slots = slots.to(dev, torch.int64)
    page, off = slots // ps, slots % ps
    tile, tb = off // TILE, off % TILE
    heads = torch.arange(hkv, device=dev)
    for base, tb_map, data in ((layout.k_off, token_maps[0], k_bytes), (layout.v_off, token_maps[1], v_bytes)):
        pos = base + tile[:, None] * (TILE * layout.d // 4) + tb_map.to(dev)[tb]  # [N, d/4]
        records[page[:, None, None], heads[None, :, None], pos[:, None, :]] = data.to(dev)
    ent = layout.meta_off // 2 + tile * 64 + (tb % 8) * 8 + tb // 8  # bf16 index of ks in the token's entry
    bf = records.view(torch.bfloat16)  # the same bytes as bf16 pairs [P, Hkv, bytes/2]
    for a, src in enumerate((k_meta[..., 0], k_meta[..., 1], v_meta[..., 0], v_meta[..., 1])):
        bf[page[:, None], heads[None, :], (ent + 2 * a)[:, None]] = src.to(dev)


def write_key_blocks(records: torch.Tensor, layout: RecordLayout, first_slots: torch.Tensor, k_scale: torch.Tensor,
                     k_zero: torch.Tensor) -> None:
    """The torch twin writer of per-channel key blocks (``layout.key_block = T``): block ``n`` starts at slot
    ``first_slots[n]`` (a multiple of ``T``) and takes bf16 ``k_scale[n]``/``k_zero[n]`` ``[Hkv, d]`` (its tokens' codes
    and V meta go through ``write_tokens``)."""
    T, ps, d, hkv = layout.key_block, layout.page_size, layout.d, int(records.shape[1])
    n = int(first_slots.numel())
    check(T > 0, lambda: f"write_key_blocks writes per-channel key records; {layout} has per-token keys")
    check(k_scale.shape == (n, hkv, d) and k_zero.shape == k_scale.shape and k_scale.dtype == torch.bfloat16
          and k_zero.dtype == torch.bfloat16,
          lambda: f"k_scale/k_zero must be bf16 [{n}, {hkv}, {d}], got {k_scale.dtype} {tuple(k_scale.shape)}")
    dev = records.device
    first = first_slots.to(dev, torch.int64)
    check(bool((first % T == 0).all()), lambda: f"first_slots must be multiples of key_block={T}")
    page, blk = first // ps, (first % ps) // T
    bf = records.view(torch.bfloat16)  # [P, Hkv, bytes/2]
    heads = torch.arange(hkv, device=dev)
    base = layout.chan_off // 2 + blk * 2 * d  # bf16 index of the block's scale[0]
    pos = base[:, None] + torch.arange(2 * d, device=dev)[None]  # [N, 2d]
    vals = torch.cat([k_scale, k_zero], dim=-1).to(dev)  # [N, Hkv, 2d]
    bf[page[:, None, None], heads[None, :, None], pos[:, None, :]] = vals


@dataclass(frozen=True)
class V11Launch:
    """Launch of the v11 kernel: ``num_splits`` split-K CTAs per (sequence, KV head) (default
    ``default_num_splits``), ``warps`` math warps (plus one producer), ``stages`` records in the ring (a multiple
    of ``warps``), ``min_blocks`` CTAs per SM the register allocation must allow (default ``default_min_blocks``:
    2 below 64 (sequence, KV head) pairs, where each CTA's latency counts, 3 from there)."""

    num_splits: Optional[int] = None
    warps: int = 4
    stages: int = 8
    min_blocks: Optional[int] = None

    def __post_init__(self) -> None:
        check(self.num_splits is None or (isinstance(self.num_splits, int) and 1 <= self.num_splits <= 254),
              lambda: f"V11Launch(num_splits={self.num_splits!r}) must be None or an int in [1, 254]")
        check(self.warps in (2, 4, 8), lambda: f"V11Launch(warps={self.warps!r}) must be one of 2, 4, 8")
        check(isinstance(self.stages, int) and self.stages >= self.warps and self.stages % self.warps == 0
              and self.stages <= 32, lambda: f"V11Launch(stages={self.stages!r}) must be a multiple of warps={self.warps} "
              "in [warps, 32]")
        check(self.min_blocks is None or self.min_blocks in (1, 2, 3, 4),
              lambda: f"V11Launch(min_blocks={self.min_blocks!r}) must be None or in 1-4")


def default_min_blocks(batch: int, num_kv_heads: int) -> int:
    """CTAs per SM for the register allocation: 2 (no spills in the prologue and merge) below 64 (sequence, KV head)
    pairs, 3 (12 math warps per SM for the streaming loop) from there (H200, reports/kernels/v11/README.md)."""
    return 2 if batch * num_kv_heads < 64 else 3


_POINTERS = ("q", "rec", "page_table", "int_len", "rk", "muk", "rot_out", "muv", "sink_k", "sink_v", "sink_len",
             "rec_k", "rec_v", "rec_len", "part_o", "part_ml", "counters", "out", "win_row")
_INTS = ("hkv", "pt_stride", "s_int", "s_total", "has_sink", "has_rec", "out_rotated", "pad_")
_LONGS = ("rs_p", "rs_h", "sk_b", "sk_h", "sk_t", "sk_max", "rk_b", "rk_h", "rk_t", "rk_max")
_ROPE_POINTERS = ("rope_m", "rope_w", "rope_tab", "rope_pos0")


class Params11(ctypes.Structure):
    """Mirror of ``struct Params11`` in ``decode_v11.cu`` (same order; C alignment rules)."""

    _fields_ = ([(n, ctypes.c_void_p) for n in _POINTERS] + [("sc", ctypes.c_float)]
                + [(n, ctypes.c_int) for n in _INTS] + [(n, ctypes.c_longlong) for n in _LONGS]
                + [(n, ctypes.c_void_p) for n in _ROPE_POINTERS] + [("rope_scaling", ctypes.c_float)]
                + [(n, ctypes.c_int) for n in ("rope_half", "rope_pos_add", "pad2_")])


def kernel_name(d: int, page_size: int, rep: int, warps: int, stages: int, min_blocks: int, rope: bool = False,
                key_block: int = 0) -> str:
    """The template instance: head_dim, page size, GQA ratio, math warps, ring stages, CTAs per SM, rope-centered keys
    (0/1) and the per-channel key block (0: per-token keys)."""
    return f"oscar_decode_v11<{d},{page_size},{rep},{warps},{stages},{min_blocks},{int(rope)},{key_block}>"


def dynamic_bytes(layout: RecordLayout, rep: int, launch: V11Launch, rope: bool = False) -> int:
    """The ring of records and (rope-centered keys) the rope table, then (aliased) the math warps' outputs."""
    table = layout.page_size * layout.d * 2 if rope else 0
    return max(launch.stages * layout.bytes + table, launch.warps * rep * layout.d * 4)


def default_num_splits(batch: int, num_kv_heads: int, pages_per_seq: int, launch: V11Launch,
                       num_sms: int = 132) -> int:
    """Split-K CTAs per (sequence, KV head): about 0.9 of a wave of SM slots (``num_sms * min_blocks``) below 64
    (sequence, KV head) pairs (more splits lengthen the merge, which is on the critical path there) and two waves
    from there (short CTAs balance the tail), each math warp at least 2 pages (measured on the H200,
    reports/kernels/v11/README.md)."""
    pairs = max(batch * num_kv_heads, 1)
    minb = launch.min_blocks or default_min_blocks(batch, num_kv_heads)
    waves = 0.9 if pairs < 64 else 2.0
    want = math.ceil(waves * num_sms * minb / pairs)
    most = max(1, min(MAX_PARTIALS - 2, math.ceil(pages_per_seq / (2 * launch.warps))))
    return int(max(1, min(want, most)))


_KERNELS: dict[tuple, ctypes.c_void_p] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _function(name: str, dev: torch.device) -> ctypes.c_void_p:
    key = (name, dev)
    if key not in _KERNELS:
        from torch.cuda._utils import _cuda_load_module, _nvrtc_compile

        with torch.cuda.device(dev):
            major, minor = torch.cuda.get_device_capability(dev)
            check(major >= 9, lambda: f"the v11 decode kernel needs compute capability >= 9.0 (cp.async.bulk), got "
                  f"{major}.{minor}")
            cubin, mangled = _nvrtc_compile(SOURCE.read_text(), name, f"{major}{minor}", None, ["-std=c++17"])
            _KERNELS[key] = _cuda_load_module(cubin, [mangled])[mangled].func
    return _KERNELS[key]


def _counters(dev: torch.device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(dev)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=dev)
        _COUNTERS[dev] = buf
    return buf


def paged_decode_attention_v11(q: torch.Tensor, records: torch.Tensor, layout: RecordLayout, segments: Segments,
                               k_t: HeadTransform, v_t: HeadTransform, *, sm_scale: Optional[float] = None,
                               output_frame: str = "original", launch: Optional[V11Launch] = None) -> torch.Tensor:
    """Decode attention ``[B, H, d]`` over BF16 sink + INT2 page records + BF16 recent; the result of
    ``oscar.cache.paged.decode_attention_torch`` on ``unpack_records(records, layout)`` (GQA 1/2/4/8). Per-channel
    key records: ``layout.key_block = T`` (the quantized lengths multiples of ``T``, as the format writes them).
    Rope-centered keys (``k_t.rope_mu``, ``rope_freq``, ``rope_scaling``) with ``segments.int_pos0`` (an int, or
    int32 ``[B]`` on the query's device: the position of each sequence's first quantized token) add
    ``q . RoPE_p(rope_mu)`` to each quantized logit."""
    launch = V11Launch() if launch is None else launch
    check(isinstance(launch, V11Launch), lambda: f"launch={launch!r} is not a V11Launch")
    check(q.is_cuda and q.dim() == 3, lambda: f"q must be a CUDA [B, H, d] tensor, got {tuple(q.shape)} on {q.device}")
    B, H, d = (int(s) for s in q.shape)
    check(d == layout.d, lambda: f"q's head_dim {d} differs from the records' {layout.d}")
    rope = k_t.rope_centered
    check(not rope or segments.int_pos0 is not None, "rope-centered keys need segments.int_pos0 (the position of each "
          "sequence's first quantized token)")
    dev = q.device
    check(records.dtype == torch.uint8 and records.dim() == 3 and records.shape[2] == layout.bytes
          and records.is_contiguous() and records.device == dev,
          lambda: f"records must be contiguous uint8 [P, Hkv, {layout.bytes}] on {dev}, got {records.dtype} "
          f"{tuple(records.shape)}")
    hkv = int(records.shape[1])
    check(H % hkv == 0 and H // hkv in (1, 2, 4, 8), lambda: f"GQA ratio H={H} / Hkv={hkv} must be 1, 2, 4 or 8")
    rep = H // hkv
    page_table, int_len, window_rows = segments.page_table, segments.int_len, segments.window_rows
    check(page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] >= B
          and page_table.stride(1) == 1 and page_table.device == dev, lambda: "page_table must be int32 [>= B, pages] on "
          f"{dev} with contiguous rows")
    check(int_len.dtype == torch.int32 and int_len.numel() >= B and int_len.device == dev,
          lambda: f"int_len must be int32 [>= {B}] on {dev}")
    check(output_frame in ("original", "rotated"),
          lambda: f"output_frame={output_frame!r} must be 'original' or 'rotated'")
    check(32 * launch.warps >= d // 2 and (d // 8) % launch.warps == 0,
          lambda: f"V11Launch(warps={launch.warps}) must divide d/8={d // 8}")
    rows = window_rows is not None
    sink = rec = None
    for name, k, v, n in segments.windows:
        seg = _window(name, k, v, n, B, hkv, d, dev, rows)
        if name == "sink":
            sink = seg
        else:
            rec = seg
    out = torch.empty(B, H, d, dtype=torch.bfloat16, device=dev)
    if B == 0:
        return out.to(q.dtype)

    def f32(t, name):
        if t is None:
            return None
        check(tuple(t.shape) == (hkv, d), lambda: f"{name} must be [{hkv}, {d}], got {tuple(t.shape)}")
        return _derived(t, "f32", lambda x: x.to(device=dev, dtype=torch.float32).contiguous())

    def frags(t, kind, name):
        if t is None:
            return None
        check(tuple(t.shape) == (hkv, d, d), lambda: f"{name} must be [{hkv}, {d}, {d}], got {tuple(t.shape)}")
        make = (lambda x: mma_b_fragments(x.to(dev, torch.float32).transpose(1, 2))) if kind == "T" else \
            (lambda x: mma_b_fragments(x.to(dev, torch.float32)))
        return _derived(t, "frag" + kind, make)

    pages_per_seq = int(page_table.shape[1])
    s_int = launch.num_splits or default_num_splits(B, hkv, pages_per_seq, launch)
    s_total = s_int + (sink is not None) + (rec is not None)
    check(s_total <= MAX_PARTIALS, lambda: f"num_splits={s_int} must be at most {MAX_PARTIALS - 2}")
    part_o = torch.empty(B, hkv, s_total, rep, d, dtype=torch.float32, device=dev)
    part_ml = torch.empty(B, hkv, s_total, rep, 2, dtype=torch.float32, device=dev)
    counters = _counters(dev, B * hkv)
    qb = q.to(torch.bfloat16).contiguous()
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)

    p = Params11()
    keep = []

    def ptr(name, t):
        if t is not None:
            keep.append(t)
            setattr(p, name, t.data_ptr())

    for name, t in (("q", qb), ("rec", records), ("page_table", page_table), ("int_len", int_len),
                    ("rk", frags(k_t.R, "", "R_K")), ("muk", f32(k_t.mu, "mu_K")),
                    ("rot_out", frags(v_t.R, "T" if output_frame == "original" else "", "R_V")),
                    ("muv", f32(v_t.mu, "mu_V")), ("part_o", part_o), ("part_ml", part_ml), ("counters", counters),
                    ("out", out), ("win_row", window_rows if sink or rec else None)):
        ptr(name, t)
    for prefix, seg in (("sink", sink), ("rec", rec)):
        if seg is not None:
            ptr(prefix + "_k", seg[0])
            ptr(prefix + "_v", seg[1])
            ptr(prefix + "_len", seg[2])
            short = "sk" if prefix == "sink" else "rk"
            for i, field in enumerate(("b", "h", "t")):
                setattr(p, f"{short}_{field}", int(seg[0].stride(i)))
            setattr(p, f"{short}_max", int(seg[0].shape[2]))
    p.sc = scale * LOG2E
    p.hkv, p.pt_stride, p.s_int, p.s_total = hkv, int(page_table.stride(0)), s_int, s_total
    p.has_sink, p.has_rec, p.out_rotated = int(sink is not None), int(rec is not None), int(output_frame == "rotated")
    p.rs_p, p.rs_h = int(records.stride(0)), int(records.stride(1))
    if rope:
        rope_freq, pos0, ps = k_t.rope_freq, segments.int_pos0, layout.page_size
        h = int(rope_freq.numel())
        check(rope_freq.dim() == 1 and 0 < 2 * h <= d, lambda: f"rope_freq must be [<= {d // 2}] frequencies, got "
              f"{tuple(rope_freq.shape)}")
        ptr("rope_m", f32(k_t.rope_mu, "rope_mu"))
        ptr("rope_w", _derived(rope_freq, f"ropew{d}", lambda x: torch.nn.functional.pad(
            x.to(dev, torch.float64), (0, d // 2 - x.numel())).contiguous()))
        ptr("rope_tab", _derived(rope_freq, f"v11tab{d},{ps},{dev}",
                                 lambda x: rope_table(x, d, 1, ps // TILE).to(dev)))
        if isinstance(pos0, torch.Tensor):
            check(pos0.dtype == torch.int32 and pos0.numel() >= B and pos0.device == dev,
                  lambda: f"int_pos0 must be an int or int32 [>= {B}] on {dev}, got {pos0.dtype} {tuple(pos0.shape)}")
            ptr("rope_pos0", pos0)
        else:
            check(0 <= int(pos0) < 2**30, lambda: f"int_pos0={pos0} must be a position in [0, 2^30)")
            p.rope_pos_add = int(pos0)
        p.rope_scaling, p.rope_half = float(k_t.rope_scaling), h
    minb = launch.min_blocks or default_min_blocks(B, hkv)
    name = kernel_name(d, layout.page_size, rep, launch.warps, launch.stages, minb, rope, layout.key_block)
    _launch(_function(name, dev), (s_total, hkv, B), 32 * (launch.warps + 1), p, dev,
            dynamic_bytes(layout, rep, launch, rope))
    return out if q.dtype == torch.bfloat16 else out.to(q.dtype)


__all__ = ["Params11", "RecordLayout", "V11Launch", "default_min_blocks", "default_num_splits", "dynamic_bytes", "kernel_name",
           "pack_pages", "pack_records", "paged_decode_attention_v11", "unpack_records", "write_key_blocks",
           "write_tokens"]

"""The OSCAR KV cache for transformers: BF16 sink, packed INT history in pages, BF16 recent window.

Per layer and KV head a sequence's tokens live in three segments (docs/DESIGN.md, "Paged INT2 pool
layout"): the first `sink` tokens in BF16, the last `recent` tokens in BF16, and everything in
between quantized in the rotated frame (`Q((x - mu) @ R)`, packed codes + bf16 scale/zero per
group) in fixed-size pages addressed through a per-sequence page table. BF16 segments keep the
original frame, so a cache whose windows cover the whole sequence is bit-identical to the BF16
cache. Each decode step writes the new token into the recent window; the oldest recent token is
demoted into the quantized segment once the window is full.

Sequences of a batch keep their own lengths: padding tokens (from a 2D attention mask) are never
stored, so a left-padded row behaves exactly like the same prompt alone.

The cache is a `transformers.Cache`; attention goes through the registered attention function
"oscar" (`oscar.cache.attention`), which calls `OscarLayer.attend_and_write`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from oscar.cache import formats, paged
from oscar.cache.formats import CacheFormat, format_class, format_for
from oscar.cache.rotations import LayerRotations  # re-exported: callers import it from here too
from oscar.core import quant
from oscar.cache.attention import (
    group_queries,
    int_segment,
    merge_segments,
    rotate_per_kv_head,
    segment_attention,
    set_pending,
    ungroup,
)

MODES = ("serving", "decode_equivalent")


def _real_tokens(kb: torch.Tensor, vb: torch.Tensor, valid: Optional[torch.Tensor],
                 b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence `b`'s keys and values of a chunk ([H, T, D] each), without its padded columns."""
    if valid is None:
        return kb[b], vb[b]
    cols = valid[b].nonzero().flatten()
    return kb[b][:, cols], vb[b][:, cols]


def _widen(x: torch.Tensor, slots: int) -> torch.Tensor:
    """`x` `[B, H, n, d]` zero-padded along dim 2 to `slots` rows (unused slots hold zeros)."""
    if x.shape[2] >= slots:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], slots - x.shape[2], x.shape[3])], dim=2)


@dataclass
class CacheSpec:
    """What a method asks of the torch cache: its storage format (`oscar.cache.formats`), per-layer rotations
    and the run-time choices (attention mode, kernels, value fold). Give ``format`` or build one from
    ``kind`` and the format fields (``bits``, ``group_size``, ``sink``, ``recent``, ``page_size``, ``seed``);
    those fields then read the format's values."""

    kind: str = "rotated"  # a registered format kind (oscar.cache.formats.KINDS)
    bits: int = 2
    group_size: int = 64  # effective group size (divides head_dim)
    sink: int = 64
    recent: int = 256
    page_size: int = 64
    layers: list[LayerRotations] = field(default_factory=list)
    fold_values: bool = False  # True: o_proj carries R_V and mu_V (oscar.models.surgery); attention returns (o - mu_V) @ R_V
    backend: str = "torch"  # torch | triton: decode steps through oscar.cache.paged.decode_attention(backend="triton")
    paged_decode: bool = False  # decode steps through oscar.cache.paged.decode_attention even on the torch backend
    mode: str = "serving"  # serving | decode_equivalent
    store_dtype: torch.dtype = torch.bfloat16
    seed: int = 0  # turboquant: seeds of the per-(layer, head) random rotations
    format: Optional[CacheFormat] = None

    def __post_init__(self) -> None:
        if self.format is None:
            self.format = format_for(self.kind, bits=self.bits, group_size=self.group_size, sink=self.sink,
                                     recent=self.recent, page_size=self.page_size, seed=self.seed)
        fmt = self.format
        self.kind, self.bits, self.group_size = fmt.kind, fmt.bits, fmt.group_size
        self.sink, self.recent, self.page_size, self.seed = fmt.sink, fmt.recent, fmt.page_size, fmt.seed
        fmt.check_served("torch")
        if self.mode not in MODES:
            raise ValueError(f"attention mode {self.mode!r} is not valid; valid modes are {MODES}")
        if self.backend not in ("torch", "triton"):
            raise ValueError(f"backend={self.backend!r} is not valid; choose 'torch' or 'triton'")
        if self.fold_values and not fmt.rotated:
            raise ValueError(f"fold_values needs a rotated cache format (the {fmt.kind} format has no value rotation)")


class PagedRows:
    """Packed INT rows of one tensor (K or V) in fixed-size pages: `codes` `[P, Hkv, page, d*b/8]`,
    `scale`/`zero` `[P, Hkv, page, d/G]`, plus one page list per sequence (the page table).

    `block > 0` (per-channel keys, `oscar.core.quant.quantize_channels`): the same code bytes per slot, and
    `scale`/`zero` `[P, Hkv, page/block, d]`, one pair per block of `block` slots and channel; `block`
    divides `page_size`, rows arrive in whole blocks, so a block never straddles two pages."""

    def __init__(self, batch: int, num_kv_heads: int, head_dim: int, bits: int, group_size: int, page_size: int,
                 device: torch.device, block: int = 0):
        self.hkv, self.d, self.bits, self.group_size, self.page_size = num_kv_heads, head_dim, bits, group_size, page_size
        self.device, self.block = device, block
        if block and page_size % block:
            raise ValueError(f"page_size={page_size} is not a multiple of the per-channel key block {block}; "
                             f"use a page_size that is a multiple of {block}")
        nb, ng = head_dim * bits // 8, head_dim // group_size
        meta_shape = (page_size // block, head_dim) if block else (page_size, ng)
        self.codes = torch.zeros(0, num_kv_heads, page_size, nb, dtype=torch.uint8, device=device)
        self.scale = torch.zeros(0, num_kv_heads, *meta_shape, dtype=torch.bfloat16, device=device)
        self.zero = torch.zeros(0, num_kv_heads, *meta_shape, dtype=torch.bfloat16, device=device)
        self.pages: list[list[int]] = [[] for _ in range(batch)]
        self.lengths: list[int] = [0] * batch
        self.num_pages = 0
        self.version = 0  # bumped by every change of the rows (a reader's cached copy is stale once it moves)

    def _new_page(self) -> int:
        if self.num_pages == self.codes.shape[0]:
            grow = max(4, self.codes.shape[0])
            self.codes = torch.cat([self.codes, self.codes.new_zeros(grow, *self.codes.shape[1:])])
            self.scale = torch.cat([self.scale, self.scale.new_zeros(grow, *self.scale.shape[1:])])
            self.zero = torch.cat([self.zero, self.zero.new_zeros(grow, *self.zero.shape[1:])])
        self.num_pages += 1
        return self.num_pages - 1

    def append(self, b: int, rows: quant.QuantizedRows | quant.ChannelQuantizedRows) -> None:
        """Append quantized rows `[Hkv, m, ...]` to sequence `b` (per-channel rows: whole blocks)."""
        self.version += 1
        if self.block:
            self._append_blocks(b, rows)  # type: ignore[arg-type]
            return
        m = rows.codes.shape[1]
        done = 0
        while done < m:
            slot = self.lengths[b] % self.page_size
            if slot == 0:
                self.pages[b].append(self._new_page())
            page = self.pages[b][-1]
            take = min(self.page_size - slot, m - done)
            self.codes[page, :, slot : slot + take] = rows.codes[:, done : done + take]
            self.scale[page, :, slot : slot + take] = rows.scale[:, done : done + take]
            self.zero[page, :, slot : slot + take] = rows.zero[:, done : done + take]
            self.lengths[b] += take
            done += take

    def append_rows(self, seqs: Sequence[int], rows: quant.QuantizedRows) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one quantized row per sequence: `rows` `[len(seqs), Hkv, 1, ...]`, row `i` to sequence
        `seqs[i]` (distinct), in one indexed write per tensor; returns the rows' (page, offset) index tensors."""
        if self.block:
            raise ValueError("per-channel key pages take whole blocks; use append")
        pages, slots = [], []
        for b in seqs:
            slot = self.lengths[b] % self.page_size
            if slot == 0:
                self.pages[b].append(self._new_page())
            pages.append(self.pages[b][-1])
            slots.append(slot)
            self.lengths[b] += 1
        self.version += 1
        p = torch.tensor(pages, dtype=torch.long, device=self.device)
        t = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.codes[p, :, t] = rows.codes[:, :, 0]
        self.scale[p, :, t] = rows.scale[:, :, 0]
        self.zero[p, :, t] = rows.zero[:, :, 0]
        return p, t

    def dequantized_at(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Float32 rows `[len(p), Hkv, 1, d]` dequantized from the stored slots `(page p[i], offset t[i])`
        (the same elementwise dequantization as `gather_dequantized`)."""
        rows = quant.QuantizedRows(self.codes[p, :, t][:, :, None], self.scale[p, :, t][:, :, None],
                                   self.zero[p, :, t][:, :, None], self.bits, self.group_size, self.d)
        return quant.dequantize(rows)

    def _append_blocks(self, b: int, rows: quant.ChannelQuantizedRows) -> None:
        self.version += 1
        if not isinstance(rows, quant.ChannelQuantizedRows) or rows.block != self.block:
            raise ValueError(f"pages of per-channel blocks of {self.block} tokens take ChannelQuantizedRows of that block")
        for j in range(rows.scale.shape[1]):
            slot = self.lengths[b] % self.page_size
            if slot == 0:
                self.pages[b].append(self._new_page())
            page, t = self.pages[b][-1], self.block
            self.codes[page, :, slot : slot + t] = rows.codes[:, j * t : (j + 1) * t]
            self.scale[page, :, slot // t] = rows.scale[:, j]
            self.zero[page, :, slot // t] = rows.zero[:, j]
            self.lengths[b] += t

    def reserve(self, b: int, m: int) -> torch.Tensor:
        """Allocate the next `m` slots of sequence `b` (new pages as needed); their slot ids
        (`page * page_size + offset`, int64 on the store's device) for a kernel to write into."""
        self.version += 1
        slots = []
        for _ in range(m):
            slot = self.lengths[b] % self.page_size
            if slot == 0:
                self.pages[b].append(self._new_page())
            slots.append(self.pages[b][-1] * self.page_size + slot)
            self.lengths[b] += 1
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def quant_pages(self) -> Any:
        """The pages as an `oscar.cache.paged.QuantPages` view (same tensors: kernels write through it)."""
        return paged.QuantPages(self.codes, self.scale, self.zero, self.bits, self.group_size, block=self.block)

    def page_table(self) -> torch.Tensor:
        """int32 `[B, max_pages]`; unused entries hold 0."""
        width = max((len(p) for p in self.pages), default=0)
        table = torch.zeros(len(self.pages), max(width, 1), dtype=torch.int32)
        for b, pages in enumerate(self.pages):
            if pages:
                table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return table.to(self.device)

    def gather_dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense float32 rows `[B, Hkv, L, d]` (L = max length, rounded to pages) and validity `[B, L]`."""
        table = self.page_table().long()
        bsz, width = table.shape
        codes = self.codes[table].permute(0, 2, 1, 3, 4).reshape(bsz, self.hkv, width * self.page_size, -1)
        meta_rows = width * self.scale.shape[2]
        scale = self.scale[table].permute(0, 2, 1, 3, 4).reshape(bsz, self.hkv, meta_rows, -1)
        zero = self.zero[table].permute(0, 2, 1, 3, 4).reshape(bsz, self.hkv, meta_rows, -1)
        if self.block:
            rows = quant.dequantize_channels(
                quant.ChannelQuantizedRows(codes, scale, zero, self.bits, self.block, self.group_size, self.d))
        else:
            rows = quant.dequantize(quant.QuantizedRows(codes, scale, zero, self.bits, self.group_size, self.d))
        lengths = torch.tensor(self.lengths, device=self.device)
        valid = torch.arange(width * self.page_size, device=self.device)[None, :] < lengths[:, None]
        return rows, valid

    def select(self, rows: Sequence[int]) -> None:
        """Keep sequences `rows` (in that order); their pages move into a compact pool, the rest are freed."""
        self.version += 1
        keep = [list(self.pages[b]) for b in rows]
        used = [p for pages in keep for p in pages]
        index = torch.tensor(used, dtype=torch.long, device=self.device)
        self.codes, self.scale, self.zero = (t.index_select(0, index) for t in (self.codes, self.scale, self.zero))
        renumber = {old: new for new, old in enumerate(used)}
        self.pages = [[renumber[p] for p in pages] for pages in keep]
        self.lengths = [self.lengths[b] for b in rows]
        self.num_pages = len(used)

    def extend(self, other: "PagedRows") -> None:
        """Append the sequences of `other` (same format) after this store's; their pages are copied in."""
        self.version += 1
        if (other.hkv, other.d, other.bits, other.group_size, other.page_size) != (self.hkv, self.d, self.bits, self.group_size, self.page_size):
            raise ValueError("cannot merge page stores of different formats (heads, head_dim, bits, group or page size)")
        n, m = self.num_pages, other.num_pages
        self.codes = torch.cat([self.codes[:n], other.codes[:m]])
        self.scale = torch.cat([self.scale[:n], other.scale[:m]])
        self.zero = torch.cat([self.zero[:n], other.zero[:m]])
        self.pages += [[p + n for p in pages] for pages in other.pages]
        self.lengths += list(other.lengths)
        self.num_pages = n + m

    def nbytes(self, rows: Optional[Sequence[int]] = None) -> int:
        """Bytes of the pages in use (codes + scale + zero), of all sequences or of `rows`."""
        per_page = sum(t[0].numel() * t.element_size() for t in (self.codes, self.scale, self.zero)) if self.codes.shape[0] else 0
        rows = range(len(self.pages)) if rows is None else rows
        return sum(len(self.pages[b]) for b in rows) * per_page


class OscarLayer(CacheLayerMixin):
    """One layer of the OSCAR cache (all KV heads, all sequences of the batch)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, spec: CacheSpec, rotations: Optional[LayerRotations], layer_idx: int):
        super().__init__()
        self.spec = spec
        self.rot = rotations
        self.layer_idx = layer_idx
        self.seen = 0  # token slots fed so far, padding included (what transformers calls the length)
        self._dequantized: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]]] = None

    # -- transformers Cache layer interface -----------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the BF16 segments and the page pool for the batch, heads and head_dim seen first."""
        b, hkv, _, d = key_states.shape
        self.batch, self.hkv, self.d = b, hkv, d
        self.device = key_states.device
        self.cdt = torch.float64 if key_states.dtype == torch.float64 else torch.float32  # attention math
        sp = self.spec
        dt = sp.store_dtype
        self.sink_k = torch.zeros(b, hkv, sp.sink, d, dtype=dt, device=self.device)
        self.sink_v = torch.zeros_like(self.sink_k)
        k_block = self.rot.k_block if sp.format.paged and self.rot is not None else 0
        cap = sp.recent + max(k_block - 1, 0) if sp.format.paged else 64  # per-channel keys demote whole blocks
        self.recent_k = torch.zeros(b, hkv, cap, d, dtype=dt, device=self.device)
        self.recent_v = torch.zeros_like(self.recent_k)
        self.sink_len = [0] * b
        self.recent_len = [0] * b
        if sp.format.paged:
            if self.rot is None:
                raise ValueError(f"layer {self.layer_idx}: the rotated cache needs LayerRotations")
            quant.check_format(sp.bits, sp.group_size, d)
            self.rot = self.rot.to(self.device, self.cdt)
            if tuple(self.rot.r_k.shape) != (hkv, d, d) or tuple(self.rot.r_v.shape) != (hkv, d, d):
                raise ValueError(
                    f"layer {self.layer_idx}: rotations of shape {tuple(self.rot.r_k.shape)} / {tuple(self.rot.r_v.shape)} "
                    f"do not match the model's {hkv} KV heads of head_dim {d}"
                )
            self.k_store = PagedRows(b, hkv, d, sp.bits, sp.group_size, sp.page_size, self.device, block=self.rot.k_block)
            self.v_store = PagedRows(b, hkv, d, sp.bits, sp.group_size, sp.page_size, self.device)
        self.keys = self.values = None
        self._dequantized = None
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the new keys/values for the attention call that follows (it attends and writes)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch:
            raise ValueError(f"batch size changed from {self.batch} to {key_states.shape[0]}; start a new cache")
        set_pending(self, key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the padding mask the attention function receives."""
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        """Token slots seen so far (padding included), as transformers counts positions."""
        return self.seen

    def get_max_length(self) -> int:
        """No maximum."""
        return -1

    def reset(self) -> None:
        """Drop everything; the next update starts from scratch."""
        self.is_initialized = False
        self.seen = 0
        self._dequantized = None

    def write_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store the rows `[B, Hkv, n, d]` of a prefill of the same tokens run elsewhere, without attending:
        the writes that prefill makes here (sink, INT pages, recent window). A serving prefill into an empty
        cache attends in BF16 for every method, so its rows do not depend on the method (`oscar.eval.shared_prefill`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch:
            raise ValueError(f"batch size changed from {self.batch} to {key_states.shape[0]}; start a new cache")
        self.seen += key_states.shape[-2]
        self._store_rows(key_states.to(self.spec.store_dtype), value_states.to(self.spec.store_dtype))

    def _store_rows(self, kb: torch.Tensor, vb: torch.Tensor) -> None:
        self._write(kb, vb, None)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search is not supported."""
        raise NotImplementedError("the OSCAR cache does not support beam search reordering")

    # -- batch rows (continuous batching: finished sequences leave, new ones join) ---------------

    _ROW_TENSORS: tuple[str, ...] = ("sink_k", "sink_v", "recent_k", "recent_v")  # [B, Hkv, slots, d]
    _ROW_LISTS: tuple[str, ...] = ("sink_len", "recent_len")

    def batch_select_indices(self, indices: Any) -> None:
        """Keep the sequences `indices` (in that order) and drop the others; nothing else changes."""
        rows = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        if not self.is_initialized:
            return
        if any(not 0 <= b < self.batch for b in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"row indices {rows} must be distinct and lie in [0, {self.batch})")
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for name in self._ROW_TENSORS:
            setattr(self, name, getattr(self, name).index_select(0, index))
        for name in self._ROW_LISTS:
            setattr(self, name, [getattr(self, name)[b] for b in rows])
        for store in self._stores():
            store.select(rows)
        self.batch = len(rows)

    def batch_extend(self, other: "OscarLayer") -> None:
        """Append the sequences of `other` (a layer of the same kind and spec, filled separately, e.g. the
        prefill of new requests) after this layer's. Slot counts (`seen`, padding included) become the
        larger of the two: the attention reads only each row's own stored tokens and its new chunk."""
        fields = ("format", "mode", "fold_values", "backend")
        if type(other) is not type(self) or any(getattr(other.spec, f) != getattr(self.spec, f) for f in fields):
            raise ValueError(f"layer {self.layer_idx}: cannot merge a {type(other).__name__} into a {type(self).__name__} "
                             f"with other settings ({', '.join(fields)} must agree)")
        if not other.is_initialized:
            return
        if not self.is_initialized:
            self.__dict__.update({k: v for k, v in other.__dict__.items() if k not in ("spec", "layer_idx")})
            return
        for name in self._ROW_TENSORS:
            a, b = getattr(self, name), getattr(other, name)
            width = max(a.shape[2], b.shape[2])
            setattr(self, name, torch.cat([_widen(a, width), _widen(b, width)], dim=0))
        for name in self._ROW_LISTS:
            setattr(self, name, getattr(self, name) + list(getattr(other, name)))
        for mine, theirs in zip(self._stores(), other._stores()):
            mine.extend(theirs)
        self.batch += other.batch
        self.seen = max(self.seen, other.seen)

    def _stores(self) -> list["PagedRows"]:
        """The INT page stores of this layer (none for BF16 and simulated kinds)."""
        return [self.k_store, self.v_store] if self.spec.format.paged and self.is_initialized else []

    # -- state -----------------------------------------------------------------------------------

    def int_lengths(self) -> list[int]:
        """Quantized tokens per sequence."""
        if not self.spec.format.paged or not self.is_initialized:
            return [0] * getattr(self, "batch", 0)
        return list(self.k_store.lengths)

    def lengths(self) -> list[int]:
        """Stored (non-padding) tokens per sequence."""
        ints = self.int_lengths()
        return [s + i + r for s, i, r in zip(self.sink_len, ints, self.recent_len)]

    def nbytes(self, rows: Optional[Sequence[int]] = None) -> int:
        """Bytes held: BF16 sink and recent rows in use plus the pages in use, K and V (of `rows` only when given)."""
        if not self.is_initialized:
            return 0
        rows = range(self.batch) if rows is None else rows
        row = self.hkv * self.d * self.sink_k.element_size() * 2
        total = row * sum(self.sink_len[b] + self.recent_len[b] for b in rows)
        if self.spec.format.paged:
            total += self.k_store.nbytes(rows) + self.v_store.nbytes(rows)
        return total

    # -- quantization ----------------------------------------------------------------------------

    def _quantize(self, x: torch.Tensor, which: str, positions: Optional[torch.Tensor] = None) -> Any:
        """Rotate-clip-quantize rows `[..., Hkv, m, d]` (BF16 values as stored) per KV head; keys of a
        rope-centered layer need their token `positions` (`[m]` or `[B, m]`, matching `x`). Keys of a
        per-channel layer (`k_block`) are whole blocks of consecutive tokens -> `ChannelQuantizedRows`."""
        r = self.rot
        assert r is not None
        rot, mu, rho = (r.r_k, r.mu_k, r.rho_k) if which == "k" else (r.r_v, r.mu_v, r.rho_v)
        extra = x.dim() - 3
        if mu is not None:
            mu = mu.reshape(*([1] * extra), self.hkv, 1, self.d)
        if which == "k" and r.rope_k is not None:
            if positions is None:
                raise RuntimeError(f"layer {self.layer_idx}: rope-centered keys are quantized without their positions")
            off = r.key_offsets(positions.reshape(-1, positions.shape[-1]), torch.float32)
            off = off.reshape(*x.shape[:-3], self.hkv, x.shape[-2], self.d) if extra else off[0]
            mu = off if mu is None else mu + off
        clipped = rho is not None and bool((rho < 1).any())
        if which == "k" and r.k_block:
            xc = x.float() if mu is None else x.float() - mu.float()
            rho_h: Any = rho.float().reshape(*([1] * extra), self.hkv) if clipped else 1.0  # type: ignore[union-attr]
            return quant.quantize_channels(torch.matmul(xc, rot.float()), self.spec.bits, r.k_block, self.spec.group_size, rho_h)
        rho_b: Any = 1.0
        if clipped:
            rho_b = rho.reshape(*([1] * extra), self.hkv, 1).expand(*x.shape[:-1])  # type: ignore[union-attr]
        return quant.rotate_clip_quantize(x.float(), rot, mu, rho_b, bits=self.spec.bits, group_size=self.spec.group_size)

    def _requantized(self, x: torch.Tensor, which: str, positions: torch.Tensor) -> torch.Tensor:
        """Dequantized rotated-frame image `[B, Hkv, L, d]` (float32) of rows `x` `[B, Hkv, L, d]` at `positions`
        `[B, L]` (-1: empty slot), as the cache would store them: per token, or for per-channel keys in whole
        blocks of consecutive tokens aligned at the sink (rows of an incomplete block: zero, never read)."""
        block = self.rot.k_block if which == "k" and self.rot is not None else 0
        if not block:
            return quant.dequantize(self._quantize(x, which, positions))
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        sink = self.spec.sink
        for b in range(x.shape[0]):
            cols = (positions[b] >= sink).nonzero().flatten()
            n = (cols.numel() // block) * block
            if n == 0:
                continue
            cols = cols[:n]
            first = int(positions[b, cols[0]])
            if (first - sink) % block or not torch.equal(positions[b, cols], torch.arange(first, first + n, device=x.device)):
                raise RuntimeError(f"layer {self.layer_idx}: per-channel key rows are not whole blocks aligned at the sink")
            out[b][:, cols] = quant.dequantize_channels(self._quantize(x[b][:, cols], which, positions[b, cols]))
        return out

    def _int_end(self, t: torch.Tensor) -> torch.Tensor:
        """End (exclusive) of the quantized range `[sink, end)` that a query at position `t` reads: `t + 1 - W`
        (at least the sink), rounded down to whole blocks past the sink for per-channel keys."""
        sp = self.spec
        past = (t + 1 - sp.sink - sp.recent).clamp(min=0)
        block = self.rot.k_block if sp.format.paged and self.rot is not None else 0
        if block:
            past = torch.div(past, block, rounding_mode="floor") * block
        return sp.sink + past

    def _with_key_offsets_rot(self, k_rot: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Dequantized rotated-frame keys `[B, Hkv, L, d]` plus the rope-centered offsets at `positions`
        `[B, L]` in that frame (`RoPE_p(m) @ R_K`); unchanged for a layer without rope centering."""
        assert self.rot is not None
        off = self.rot.key_offsets(positions, self.cdt)
        return k_rot if off is None else k_rot + rotate_per_kv_head(off, self.rot.r_k)

    # -- attention and writes --------------------------------------------------------------------

    def attend_and_write(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        valid: Optional[torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Attention output `[B, H, n, d]` for `n` new tokens, then store them (demoting as needed).

        Decode steps (`n == 1`) and decode-equivalent chunks: query `t` sees tokens `[0, S0)` in BF16,
        `[S0, t-W]` quantized and `(t-W, t]` in BF16. Serving chunks (`n > 1`): the stored segments as
        they are plus the chunk itself in BF16 (causal); the quantized history is only read.
        """
        n = query.shape[2]
        kb = key.to(self.spec.store_dtype)
        vb = value.to(self.spec.store_dtype)
        counts = [n] * self.batch if valid is None else [int(c) for c in valid.sum(dim=1).tolist()]
        decode_eq = n == 1 or self.spec.mode == "decode_equivalent"
        old = self.lengths()
        sp = self.spec
        needs_quant = any(i > 0 for i in self.int_lengths())
        if decode_eq and sp.format.paged:
            needs_quant = needs_quant or any(o + c > sp.sink + sp.recent for o, c in zip(old, counts))
        uniform = valid is None and len(set(self.sink_len)) == 1 and len(set(self.recent_len)) == 1
        if not needs_quant and uniform:
            out = self._attend_bf16_contiguous(module, query, kb, vb, scale)
        elif n == 1 and sp.format.paged and (sp.backend == "triton" or sp.paged_decode):
            self._write(kb, vb, valid)
            return self._attend_paged(query, scale)
        elif n == 1 and sp.format.paged and (valid is None or bool(valid.all())):
            self._write(kb, vb, None)  # the decode step's view is the stored state once the token is in
            return self._attend_stored(query, scale)
        elif n == 1:
            out = self._attend_segments(query, kb, vb, valid, scale, decode_eq, old)
        else:
            out = self._attend_chunk_dequantized(query, kb, vb, valid, scale, decode_eq, old)
        self._write(kb, vb, valid)
        return out

    def _attend_bf16_contiguous(
        self, module: torch.nn.Module, query: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """No quantized token is visible and no row is padded: one SDPA call over the tokens in order,
        exactly as transformers' own SDPA attention over a plain cache."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        s, r, n = self.sink_len[0], self.recent_len[0], query.shape[2]
        keys = torch.cat([self.sink_k[:, :, :s], self.recent_k[:, :, :r], kb], dim=2).to(query.dtype)
        values = torch.cat([self.sink_v[:, :, :s], self.recent_v[:, :, :r], vb], dim=2).to(query.dtype)
        past = s + r
        mask = None
        if n > 1 and past > 0:
            qpos = torch.arange(n, device=query.device) + past
            mask = (torch.arange(past + n, device=query.device)[None, :] <= qpos[:, None])[None, None]
        out, _ = sdpa_attention_forward(module, query, keys, values, mask, scaling=scale)
        out = out.transpose(1, 2)
        if self.spec.fold_values:
            out = self._to_folded_frame(out.to(self.cdt)).to(query.dtype)
        return out

    def _positions(self, valid: Optional[torch.Tensor], n: int, old: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Token positions (row-local, padding skipped) of the sink, recent and chunk slots; -1 = empty."""
        dev = self.device
        b = self.batch
        old_t = torch.tensor(old, device=dev)
        sink_len = torch.tensor(self.sink_len, device=dev)
        rec_len = torch.tensor(self.recent_len, device=dev)
        j = torch.arange(self.sink_k.shape[2], device=dev)[None, :].expand(b, -1)
        sink_pos = torch.where(j < sink_len[:, None], j, torch.full_like(j, -1))
        i = torch.arange(self.recent_k.shape[2], device=dev)[None, :].expand(b, -1)
        rec_start = old_t - rec_len
        rec_pos = torch.where(i < rec_len[:, None], rec_start[:, None] + i, torch.full_like(i, -1))
        if valid is None:
            chunk_pos = old_t[:, None] + torch.arange(n, device=dev)[None, :]
        else:
            chunk_pos = torch.where(valid, old_t[:, None] + valid.long().cumsum(dim=1) - 1, torch.full((b, n), -1, device=dev, dtype=torch.long))
        return sink_pos, rec_pos, chunk_pos

    def _attend_segments(
        self,
        query: torch.Tensor,
        kb: torch.Tensor,
        vb: torch.Tensor,
        valid: Optional[torch.Tensor],
        scale: float,
        decode_eq: bool,
        old: Sequence[int],
    ) -> torch.Tensor:
        """General path: BF16 segment, stored INT segment and (decode-equivalent) on-the-fly INT rows."""
        sp = self.spec
        n = query.shape[2]
        qg = group_queries(query.to(self.cdt), self.hkv)
        sink_pos, rec_pos, chunk_pos = self._positions(valid, n, old)
        t = chunk_pos[:, :, None]  # [B, n, 1] query positions
        q_ok = (chunk_pos >= 0)[:, :, None]

        k_bf = torch.cat([self.sink_k, self.recent_k, kb], dim=2).to(self.cdt)
        v_bf = torch.cat([self.sink_v, self.recent_v, vb], dim=2).to(self.cdt)
        pos_bf = torch.cat([sink_pos, rec_pos, chunk_pos], dim=1)[:, None, :]  # [B, 1, L]
        vis_bf = q_ok & (pos_bf >= 0) & (pos_bf <= t)
        if decode_eq and sp.format.paged:
            vis_bf = vis_bf & ((pos_bf < sp.sink) | (pos_bf >= self._int_end(t)))
        o_bf, lse_bf = segment_attention(qg, k_bf, v_bf, vis_bf[:, None, None], scale)

        int_parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        if sp.format.paged:
            rot = self.rot
            assert rot is not None
            if any(i > 0 for i in self.int_lengths()):
                k_rot, v_rot, svalid = self._int_rows()
                vis = q_ok & svalid[:, None, :]
                int_parts.append(int_segment(qg, k_rot, v_rot, vis[:, None, None], scale, rot.r_k, rot.mu_k))
            if decode_eq:
                pos_q = torch.cat([rec_pos, chunk_pos], dim=1)[:, None, :]
                vis_q = q_ok & (pos_q >= sp.sink) & (pos_q < self._int_end(t))
                if bool(vis_q.any()):
                    pq = pos_q[:, 0]
                    kq = self._requantized(torch.cat([self.recent_k, kb], dim=2), "k", pq).to(self.cdt)
                    kq = self._with_key_offsets_rot(kq, pq)
                    vq = quant.dequantize(self._quantize(torch.cat([self.recent_v, vb], dim=2), "v")).to(self.cdt)
                    int_parts.append(int_segment(qg, kq, vq, vis_q[:, None, None], scale, rot.r_k, rot.mu_k))

        return self._merge(o_bf, lse_bf, int_parts).to(query.dtype)

    def _merge(self, o_bf: torch.Tensor, lse_bf: torch.Tensor,
               int_parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Log-sum-exp merge of the BF16 segment `(o, lse)` and the INT segments `(o_rot, lse, mass)` into
        `[B, H, n, d]`, in the folded frame `(o - mu_V) @ R_V` with `fold_values`, else the original frame."""
        parts = []
        if self.spec.fold_values:  # every segment in the folded frame (o - mu_V) @ R_V; INT rows already are
            assert self.rot is not None
            o_bf_c = o_bf if self.rot.mu_v is None else o_bf - self.rot.mu_v[None, :, None, None, :]
            parts.append((rotate_per_kv_head(o_bf_c, self.rot.r_v), lse_bf))
            parts += [(o_rot, lse) for o_rot, lse, _ in int_parts]
        else:
            parts.append((o_bf, lse_bf))
            for o_rot, lse, mass in int_parts:
                o = rotate_per_kv_head(o_rot, self.rot.r_v.transpose(-1, -2))  # type: ignore[union-attr]
                if self.rot.mu_v is not None:  # type: ignore[union-attr]
                    o = o + mass.unsqueeze(-1) * self.rot.mu_v[None, :, None, None, :]  # type: ignore[union-attr]
                parts.append((o, lse))
        return ungroup(merge_segments(parts))

    def _attend_stored(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode step (one new token per sequence, already written): the query at position `t` reads the
        stored state, `[0, S0)` BF16 sink, `[S0, t-W]` INT pages, `(t-W, t]` BF16 recent window, which is the
        decode-equivalent view of `_attend_segments` without re-quantizing the window each step."""
        qg = group_queries(query.to(self.cdt), self.hkv)
        sink_pos, rec_pos, _ = self._positions(None, 0, self.lengths())
        k_bf = torch.cat([self.sink_k, self.recent_k], dim=2).to(self.cdt)
        v_bf = torch.cat([self.sink_v, self.recent_v], dim=2).to(self.cdt)
        vis_bf = (torch.cat([sink_pos, rec_pos], dim=1) >= 0)[:, None, None, None, :]
        o_bf, lse_bf = segment_attention(qg, k_bf, v_bf, vis_bf, scale)
        int_parts = []
        if any(i > 0 for i in self.int_lengths()):
            rot = self.rot
            assert rot is not None
            k_rot, v_rot, svalid = self._int_rows()
            int_parts.append(int_segment(qg, k_rot, v_rot, svalid[:, None, None, None, :], scale, rot.r_k, rot.mu_k))
        return self._merge(o_bf, lse_bf, int_parts).to(query.dtype)

    def _int_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dequantized rotated-frame INT keys (rope-centered offsets added) and values `[B, Hkv, L, d]` and
        their validity `[B, L]`, read from the pages. The dequantized copy is kept while the pages change
        only by the decode step's demotions (`_write_full_rows` adds those rows to it, dequantized from the
        pages they went into); any other change of the stores rebuilds it from the pages."""
        versions = (self.k_store.version, self.v_store.version)
        if self._dequantized is None or self._dequantized[3] != versions:
            k_rot, svalid = self.k_store.gather_dequantized()
            v_rot, _ = self.v_store.gather_dequantized()
            k_rot = self._with_key_offsets_rot(k_rot.to(self.cdt), self._int_positions(svalid))
            self._dequantized = (k_rot, v_rot.to(self.cdt), svalid, versions)
        return self._dequantized[:3]

    def _add_dequantized(self, seqs: list[int], versions: tuple[int, int], kpt: tuple[torch.Tensor, torch.Tensor],
                         vpt: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Keep the dequantized copy current after `append_rows` put one row of each sequence `seqs` at
        (page, offset) `kpt` / `vpt`; `versions` are the stores' versions before that append."""
        m = self._dequantized
        if m is None or m[3] != versions:
            return
        k_rot, v_rot, svalid, _ = m
        col = torch.tensor([self.k_store.lengths[b] - 1 for b in seqs], dtype=torch.long, device=self.device)
        if int(col.max()) >= svalid.shape[1]:  # a new page: rebuild at the next read
            self._dequantized = None
            return
        idx = torch.tensor(seqs, dtype=torch.long, device=self.device)
        k_new = self._with_key_offsets_rot(self.k_store.dequantized_at(*kpt).to(self.cdt), (col + self.spec.sink)[:, None])
        k_rot[idx, :, col] = k_new[:, :, 0]
        v_rot[idx, :, col] = self.v_store.dequantized_at(*vpt).to(self.cdt)[:, :, 0]
        svalid[idx, col] = True
        self._dequantized = (k_rot, v_rot, svalid, (self.k_store.version, self.v_store.version))

    def _attend_paged(self, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode step over the stored segments with `oscar.cache.paged.decode_attention` (Triton kernel on
        `backend="triton"`); the new token is already written."""
        sp = self.spec
        kt, vt = self._head_transforms()
        ks = self.k_store
        segments = paged.Segments(
            ks.page_table(),
            torch.tensor(ks.lengths, dtype=torch.int32, device=self.device),
            sink_k=self.sink_k,
            sink_v=self.sink_v,
            sink_len=torch.tensor(self.sink_len, dtype=torch.int32, device=self.device),
            recent_k=self.recent_k,
            recent_v=self.recent_v,
            recent_len=torch.tensor(self.recent_len, dtype=torch.int32, device=self.device),
            int_pos0=sp.sink,  # INT row j of a sequence is token sink + j
        )
        out = paged.decode_attention(query[:, :, 0], ks.quant_pages(), self.v_store.quant_pages(), segments, kt, vt,
                                     sm_scale=scale, output_frame="rotated" if sp.fold_values else "original",
                                     backend=sp.backend)
        return out[:, :, None, :]

    def _unrotate(self, rows_rot: torch.Tensor, which: str, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rotated-frame rows `[B, Hkv, L, d]` back to the original frame: `x_rot @ R.T + mu` (plus the
        rope-centered key offsets at `positions` `[B, L]`)."""
        r = self.rot
        assert r is not None
        rot, mu = (r.r_k, r.mu_k) if which == "k" else (r.r_v, r.mu_v)
        out = rotate_per_kv_head(rows_rot.to(self.cdt), rot.transpose(-1, -2))
        if mu is not None:
            out = out + mu[None, :, None, :]
        if which == "k" and r.rope_k is not None:
            if positions is None:
                raise RuntimeError(f"layer {self.layer_idx}: rope-centered keys are read without their positions")
            out = out + r.key_offsets(positions, self.cdt)  # type: ignore[operator]
        return out

    def _int_positions(self, svalid: torch.Tensor) -> torch.Tensor:
        """Positions `[B, L]` of the stored INT rows (row `j` of a sequence is token `sink + j`; -1 = empty)."""
        idx = torch.arange(svalid.shape[1], device=self.device)[None, :] + self.spec.sink
        return torch.where(svalid, idx, torch.full_like(idx, -1))

    def _attend_chunk_dequantized(
        self,
        query: torch.Tensor,
        kb: torch.Tensor,
        vb: torch.Tensor,
        valid: Optional[torch.Tensor],
        scale: float,
        decode_eq: bool,
        old: Sequence[int],
        block: int = 256,
    ) -> torch.Tensor:
        """Chunk of `n > 1` queries: one softmax over BF16 rows and dequantized rows (rotated back to
        the original frame, which gives the same logits as the rotated-frame form), with per-query
        visibility masks; queries go in blocks and each block reads only the columns it can see."""
        sp = self.spec
        n = query.shape[2]
        sink_pos, rec_pos, chunk_pos = self._positions(valid, n, old)
        keys = [self.sink_k.to(self.cdt), self.recent_k.to(self.cdt), kb.to(self.cdt)]
        vals = [self.sink_v.to(self.cdt), self.recent_v.to(self.cdt), vb.to(self.cdt)]
        pos = [sink_pos, rec_pos, chunk_pos]
        is_q = [False, False, False]
        if sp.format.paged:
            if any(i > 0 for i in self.int_lengths()):
                k_rot, svalid = self.k_store.gather_dequantized()
                v_rot, _ = self.v_store.gather_dequantized()
                int_pos = self._int_positions(svalid)
                keys.append(self._unrotate(k_rot, "k", int_pos))
                vals.append(self._unrotate(v_rot, "v"))
                pos.append(int_pos)
                is_q.append(True)
            if decode_eq:
                pq = torch.cat([rec_pos, chunk_pos], dim=1)
                keys.append(self._unrotate(self._requantized(torch.cat([self.recent_k, kb], dim=2), "k", pq), "k", pq))
                vals.append(self._unrotate(quant.dequantize(self._quantize(torch.cat([self.recent_v, vb], dim=2), "v")), "v"))
                pos.append(pq)
                is_q.append(True)
        k_all = torch.cat(keys, dim=2)
        v_all = torch.cat(vals, dim=2)
        p_all = torch.cat(pos, dim=1)[:, None, :]  # [B, 1, L]
        q_flag = torch.cat([torch.full((p.shape[1],), f, dtype=torch.bool, device=self.device) for p, f in zip(pos, is_q)])
        qf = query.to(self.cdt)
        out = torch.zeros_like(qf)
        for start in range(0, n, block):
            t = chunk_pos[:, start : start + block, None]  # [B, nb, 1]
            vis = (p_all >= 0) & (p_all <= t) & (t >= 0)
            if decode_eq and sp.format.paged:
                in_window = (p_all < sp.sink) | (p_all >= self._int_end(t))
                vis = vis & torch.where(q_flag[None, None, :], ~in_window, in_window)
            cols = vis.any(dim=1).any(dim=0).nonzero().flatten()
            if cols.numel() == 0:
                continue
            vis = vis[:, :, cols]
            seen = vis.any(dim=-1, keepdim=True)
            vis = vis | ~seen  # padding queries: attend to something, zeroed below
            o = torch.nn.functional.scaled_dot_product_attention(
                qf[:, :, start : start + block],
                k_all[:, :, cols],
                v_all[:, :, cols],
                attn_mask=vis[:, None],
                scale=scale,
                enable_gqa=True,
            )
            out[:, :, start : start + block] = o * seen[:, None].to(o.dtype)
        if sp.fold_values:
            out = self._to_folded_frame(out)
        return out.to(query.dtype)

    def _to_folded_frame(self, out: torch.Tensor) -> torch.Tensor:
        """`[B, H, n, d]` attention output (weights summing to 1) -> `(o - mu_V) @ R_V` per KV head."""
        assert self.rot is not None
        og = group_queries(out, self.hkv)
        if self.rot.mu_v is not None:
            og = og - self.rot.mu_v[None, :, None, None, :]
        return ungroup(rotate_per_kv_head(og, self.rot.r_v))

    def _write(self, kb: torch.Tensor, vb: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
        """Store the chunk's real tokens per sequence: fill the sink, then the recent window, demoting
        the oldest recent tokens into the pages when the window overflows."""
        sp = self.spec
        done = self._write_full_rows(kb, vb) if valid is None and kb.shape[2] == 1 else set()
        for b in range(self.batch):
            if b in done:
                continue
            k, v = _real_tokens(kb, vb, valid, b)
            m = k.shape[1]
            if m == 0:
                continue
            s = self.sink_len[b]
            take = min(sp.sink - s, m)
            if take > 0:
                self.sink_k[b, :, s : s + take] = k[:, :take]
                self.sink_v[b, :, s : s + take] = v[:, :take]
                self.sink_len[b] += take
                k, v = k[:, take:], v[:, take:]
            if k.shape[1] == 0:
                continue
            r = self.recent_len[b]
            if not sp.format.quantized:
                self._ensure_recent_capacity(r + k.shape[1])
                self.recent_k[b, :, r : r + k.shape[1]] = k
                self.recent_v[b, :, r : r + k.shape[1]] = v
                self.recent_len[b] = r + k.shape[1]
                continue
            all_k = torch.cat([self.recent_k[b, :, :r], k], dim=1)
            all_v = torch.cat([self.recent_v[b, :, :r], v], dim=1)
            over = all_k.shape[1] - sp.recent
            if over > 0 and self.rot is not None and self.rot.k_block:  # per-channel keys: whole blocks only
                over = (over // self.rot.k_block) * self.rot.k_block
            if over > 0:
                if sp.backend == "triton":
                    self._demote_triton(b, all_k[:, :over], all_v[:, :over])
                else:
                    first = sp.sink + self.k_store.lengths[b]  # INT row j of a sequence is token sink + j
                    kpos = torch.arange(first, first + over, device=self.device)
                    self.k_store.append(b, self._quantize(all_k[:, :over], "k", kpos))
                    self.v_store.append(b, self._quantize(all_v[:, :over], "v"))
                all_k, all_v = all_k[:, over:], all_v[:, over:]
            keep = all_k.shape[1]
            self.recent_k[b, :, :keep] = all_k
            self.recent_v[b, :, :keep] = all_v
            self.recent_len[b] = keep

    def _write_full_rows(self, kb: torch.Tensor, vb: torch.Tensor) -> set[int]:
        """Decode step, one token per sequence: every sequence whose sink and recent window are full demotes
        its oldest recent token and takes the new one, all in one quantizer call and one page write per
        tensor (the same per-token quantizer as one row at a time). Returns the sequences done here."""
        sp = self.spec
        if not sp.format.paged or sp.backend != "torch" or self.rot is None or self.rot.k_block or sp.recent < 1:
            return set()
        full = [b for b in range(self.batch) if self.sink_len[b] == sp.sink and self.recent_len[b] == sp.recent]
        if not full:  # one sequence too: its dequantized INT rows stay current instead of being rebuilt every step
            return set()
        idx = torch.tensor(full, dtype=torch.long, device=self.device)
        old_k, old_v = self.recent_k[idx, :, :1], self.recent_v[idx, :, :1]  # [F, Hkv, 1, d]
        pos = torch.tensor([sp.sink + self.k_store.lengths[b] for b in full], device=self.device)[:, None]
        versions = (self.k_store.version, self.v_store.version)
        kpt = self.k_store.append_rows(full, self._quantize(old_k, "k", pos))
        vpt = self.v_store.append_rows(full, self._quantize(old_v, "v"))
        self._add_dequantized(full, versions, kpt, vpt)
        w = sp.recent
        for name, new in (("recent_k", kb), ("recent_v", vb)):
            buf = getattr(self, name)
            buf[idx, :, : w - 1] = buf[idx, :, 1:w]  # advanced indexing reads a copy first
            buf[idx, :, w - 1] = new[idx, :, 0]
        return set(full)

    def _demote_triton(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows `[Hkv, m, d]` of sequence `b` into the pages with the fused rotate-clip-quantize-pack kernel
        (K and V in one launch), at slots reserved in both stores."""
        first = self.spec.sink + self.k_store.lengths[b]  # INT row j of a sequence is token sink + j
        slots = self.k_store.reserve(b, k.shape[1])
        if not torch.equal(self.v_store.reserve(b, v.shape[1]), slots):
            raise RuntimeError("K and V page stores went out of step; the cache is corrupt")

        paged.rotate_quantize_pack_kv(k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), slots,
                                      self.k_store.quant_pages(), self.v_store.quant_pages(), *self._head_transforms(),
                                      backend="triton", positions=torch.arange(first, first + k.shape[1],
                                                                               device=self.device))

    def _head_transforms(self) -> tuple[Any, Any]:
        """K and V `oscar.cache.paged.HeadTransform`s of this layer's rotations, for the paged kernels."""
        assert self.rot is not None
        return self.rot.paged_transforms(f"layer {self.layer_idx}")

    def _ensure_recent_capacity(self, needed: int) -> None:
        cap = self.recent_k.shape[2]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        pad = torch.zeros(self.batch, self.hkv, new_cap - cap, self.d, dtype=self.recent_k.dtype, device=self.device)
        self.recent_k = torch.cat([self.recent_k, pad], dim=2)
        self.recent_v = torch.cat([self.recent_v, pad.clone()], dim=2)


class SimulatedLayer(OscarLayer):
    """Accuracy-only baselines (KIVI-2, TurboQuant): the layer keeps every token in BF16 and attends to
    the quantize-dequantize image of the tokens the method would hold quantized at that moment.

    Boundaries for a query at position `t` (`T = t + 1` tokens): TurboQuant quantizes tokens
    `[S0, T - W)` per token; KIVI quantizes values `[0, T - R)` per token and keys in whole blocks of
    `G` tokens `[0, ((T - R) // G) * G)` per channel (`oscar.core.baselines.kivi_split`). Both are exact
    functions of the token (or its block), so decode steps and decode-equivalent chunks agree.
    Memory is not real here: `nbytes` reports the accounting of the method's format.
    """

    _ROW_TENSORS = ("hist_k", "hist_v", "fake_k", "fake_v")
    _ROW_LISTS = ("hist_len", "sink_len", "recent_len", "fake_len")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate a growing BF16 history; TurboQuant builds its per-head quantizers."""
        b, hkv, _, d = key_states.shape
        self.batch, self.hkv, self.d = b, hkv, d
        self.device = key_states.device
        self.cdt = torch.float32
        self.hist_k = torch.zeros(b, hkv, 64, d, dtype=self.spec.store_dtype, device=self.device)
        self.hist_v = torch.zeros_like(self.hist_k)
        self.hist_len = [0] * b
        # quantize-dequantize images of the history, current for the first `fake_len` tokens of each sequence
        self.fake_k = torch.zeros(b, hkv, 64, d, dtype=torch.float32, device=self.device)
        self.fake_v = torch.zeros_like(self.fake_k)
        self.fake_len = [0] * b
        self.sink_len = [0] * b
        self.recent_len = [0] * b
        self.quantizers = self.spec.format.quantizers(self.layer_idx, hkv, d)
        self.keys = self.values = None
        self.is_initialized = True

    def int_lengths(self) -> list[int]:
        """Tokens currently held quantized (values; KIVI keys may lag by a partial block)."""
        if not self.is_initialized:
            return []
        t = torch.tensor(self.hist_len)
        _, v_end, start = self._bounds(t)
        return [int(x) for x in (v_end - start).clamp(min=0).tolist()]

    def lengths(self) -> list[int]:
        """Stored tokens per sequence."""
        return list(self.hist_len)

    def nbytes(self, rows: Optional[Sequence[int]] = None) -> int:
        """Bytes the method's format would hold (accounting; this simulation keeps BF16 copies)."""
        if not self.is_initialized:
            return 0
        bits_total = 0.0
        for n in (self.hist_len if rows is None else [self.hist_len[b] for b in rows]):
            if n:
                bits_total += self.expected_bits(n) * n * self.hkv * self.d * 2
        return int(round(bits_total / 8))

    def expected_bits(self, n: int) -> float:
        """Accounting bits per element for one sequence of `n` tokens (the format's)."""
        return self.spec.format.expected_bits(n, self.d)

    def _bounds(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(key end, value end, start) of the quantized range for sequences of `total` tokens."""
        return self.spec.format.bounds(total)

    def _fake(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize-dequantize images of history rows `[B, Hkv, L, d]` (KIVI keys: whole blocks only; keys of an
        incomplete last block stay full precision, never visible as quantized)."""
        return self.spec.format.fake(k, v, self.quantizers)

    def attend_and_write(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        valid: Optional[torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Append the chunk to the history, then one softmax per query over the token versions
        (BF16 / quantized key and value) that the method would hold for that query."""
        sp = self.spec
        n = query.shape[2]
        if valid is None and n > 1 and sp.mode == "serving" and not any(self.hist_len):
            # an empty cache's serving prefill sees no quantized token: one SDPA call over the chunk, exactly as
            # transformers' own SDPA attention over a plain cache (as `OscarLayer._attend_bf16_contiguous`)
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            self._append(key.to(sp.store_dtype), value.to(sp.store_dtype), None)
            keys, values = self.hist_k[:, :, :n].to(query.dtype), self.hist_v[:, :, :n].to(query.dtype)
            out, _ = sdpa_attention_forward(module, query, keys, values, None, scaling=scale)
            return out.transpose(1, 2)
        old = torch.tensor(self.hist_len, device=self.device)
        self._append(key.to(sp.store_dtype), value.to(sp.store_dtype), valid)
        length = max(self.hist_len)
        hk, hv = self.hist_k[:, :, :length], self.hist_v[:, :, :length]
        kq, vq = self._fake_history(length)
        if valid is None:
            chunk_pos = old[:, None] + torch.arange(n, device=self.device)[None, :]
        else:
            chunk_pos = torch.where(valid, old[:, None] + valid.long().cumsum(dim=1) - 1, torch.full_like(valid, -1, dtype=torch.long))
        serving_chunk = n > 1 and sp.mode == "serving"
        total = old[:, None].expand(-1, n) if serving_chunk else chunk_pos + 1
        k_end, v_end, start = self._bounds(total)
        j = torch.arange(length, device=self.device)[None, None, :]
        hist_len = torch.tensor(self.hist_len, device=self.device)[:, None, None]
        t = chunk_pos[:, :, None]
        seen_ok = (j <= t) & (j < hist_len) & (t >= 0)
        k_q = (j >= start) & (j < k_end[:, :, None])
        v_q = (j >= start) & (j < v_end[:, :, None])
        if n == 1:  # one query per sequence: each token has one visible version (k_q implies v_q)
            keys = torch.where(k_q[:, 0, None, :, None], kq, hk.float())
            vals = torch.where(v_q[:, 0, None, :, None], vq, hv.float())
            vis = seen_ok
        else:
            keys = torch.cat([hk.float(), kq, hk.float()], dim=2)
            vals = torch.cat([hv.float(), vq, vq], dim=2)
            vis = torch.cat([seen_ok & ~k_q & ~v_q, seen_ok & k_q & v_q, seen_ok & ~k_q & v_q], dim=2)
        seen = vis.any(dim=-1, keepdim=True)
        vis = vis | ~seen
        out = torch.nn.functional.scaled_dot_product_attention(
            query.float(), keys, vals, attn_mask=vis[:, None], scale=scale, enable_gqa=True
        )
        out = out * seen[:, None].to(out.dtype)
        return out.to(query.dtype)

    def _fake_history(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize-dequantize images `[B, Hkv, length, d]` of the history. Each is an exact function of its
        token (KIVI keys: of their whole block), so they are kept: a decode step (one new token per
        sequence) computes only the new tokens' images (and a KIVI key block when it completes); anything
        else recomputes the whole history."""
        new = [b for b in range(self.batch) if self.fake_len[b] < self.hist_len[b]]
        if any(self.hist_len[b] - self.fake_len[b] != 1 for b in new):
            kq, vq = self._fake(self.hist_k[:, :, :length], self.hist_v[:, :, :length])
            self.fake_k[:, :, :length], self.fake_v[:, :, :length] = kq, vq
            self.fake_len = list(self.hist_len)
            return kq, vq
        if new:
            idx = torch.tensor(new, dtype=torch.long, device=self.device)
            col = torch.tensor([self.hist_len[b] - 1 for b in new], dtype=torch.long, device=self.device)
            self.spec.format.fake_step(self, new, idx, col)
            for b in new:
                self.fake_len[b] = self.hist_len[b]
        return self.fake_k[:, :, :length], self.fake_v[:, :, :length]

    def _store_rows(self, kb: torch.Tensor, vb: torch.Tensor) -> None:
        self._append(kb, vb, None)

    def _append(self, kb: torch.Tensor, vb: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
        for b in range(self.batch):
            k, v = _real_tokens(kb, vb, valid, b)
            m, r = k.shape[1], self.hist_len[b]
            if m == 0:
                continue
            if r + m > self.hist_k.shape[2]:
                cap = max(r + m, 2 * self.hist_k.shape[2])
                for name in self._ROW_TENSORS:
                    t = getattr(self, name)
                    setattr(self, name, torch.cat([t, t.new_zeros(self.batch, self.hkv, cap - t.shape[2], self.d)], dim=2))
            self.hist_k[b, :, r : r + m] = k
            self.hist_v[b, :, r : r + m] = v
            self.hist_len[b] = r + m


class WindowLayer(OscarLayer):
    """A sliding-window attention layer: it keeps only the last `window` tokens of each sequence, in BF16
    (bounded memory, nothing to quantize), and query `t` attends to positions `(t - window, t]` exactly as
    transformers' sliding-window mask does. Same in serving and decode-equivalent mode. With folded value
    rotations (`fold_values`) its output is returned in the folded frame like every other layer's."""

    is_sliding = True

    def __init__(self, spec: CacheSpec, rotations: Optional[LayerRotations], layer_idx: int, window: int):
        if window < 1:
            raise ValueError(f"layer {layer_idx}: sliding window {window} must be at least 1 token")
        super().__init__(spec, rotations, layer_idx)
        self.window = int(window)

    _ROW_TENSORS = ("win_k", "win_v")
    _ROW_LISTS = ("win_len", "total", "sink_len", "recent_len")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate an empty window per sequence."""
        b, hkv, _, d = key_states.shape
        self.batch, self.hkv, self.d = b, hkv, d
        self.device = key_states.device
        self.cdt = torch.float64 if key_states.dtype == torch.float64 else torch.float32
        self.win_k = torch.zeros(b, hkv, self.window, d, dtype=self.spec.store_dtype, device=self.device)
        self.win_v = torch.zeros_like(self.win_k)
        self.win_len = [0] * b  # valid rows, the sequence's most recent tokens in order
        self.total = [0] * b  # real tokens written so far (positions of the next token)
        self.sink_len = [0] * b
        self.recent_len = [0] * b
        if self.spec.fold_values:
            if self.rot is None:
                raise ValueError(f"layer {self.layer_idx}: folded value rotations need this layer's LayerRotations")
            self.rot = self.rot.to(self.device, self.cdt)
        self.keys = self.values = None
        self.is_initialized = True

    def _stores(self) -> list["PagedRows"]:
        """A window layer has no page store."""
        return []

    def int_lengths(self) -> list[int]:
        """Nothing is quantized in a window layer."""
        return [0] * getattr(self, "batch", 0)

    def lengths(self) -> list[int]:
        """Stored tokens per sequence (at most `window`)."""
        return list(self.win_len) if self.is_initialized else []

    def nbytes(self, rows: Optional[Sequence[int]] = None) -> int:
        """Bytes of the BF16 rows in use, K and V (of `rows` only when given)."""
        if not self.is_initialized:
            return 0
        lens = self.win_len if rows is None else [self.win_len[b] for b in rows]
        return sum(lens) * self.hkv * self.d * self.win_k.element_size() * 2

    def attend_and_write(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        valid: Optional[torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """Causal sliding-window attention of the `n` new tokens over the stored window and the chunk, then
        keep the last `window` tokens."""
        n = query.shape[2]
        kb, vb = key.to(self.spec.store_dtype), value.to(self.spec.store_dtype)
        dev = self.device
        old = torch.tensor(self.total, device=dev)
        wl = torch.tensor(self.win_len, device=dev)
        i = torch.arange(self.window, device=dev)[None, :]
        stored_pos = torch.where(i < wl[:, None], old[:, None] - wl[:, None] + i, torch.full_like(i, -1))
        if valid is None:
            chunk_pos = old[:, None] + torch.arange(n, device=dev)[None, :]
        else:
            chunk_pos = torch.where(valid, old[:, None] + valid.long().cumsum(dim=1) - 1, torch.full((self.batch, n), -1, device=dev, dtype=torch.long))
        pos = torch.cat([stored_pos, chunk_pos], dim=1)[:, None, :]  # [B, 1, window + n]
        t = chunk_pos[:, :, None]
        vis = (pos >= 0) & (pos <= t) & (pos > t - self.window) & (t >= 0)
        seen = vis.any(dim=-1, keepdim=True)
        vis = vis | ~seen  # padding queries: attend to something, zeroed below
        keys = torch.cat([self.win_k, kb], dim=2).to(self.cdt)
        vals = torch.cat([self.win_v, vb], dim=2).to(self.cdt)
        out = torch.nn.functional.scaled_dot_product_attention(
            query.to(self.cdt), keys, vals, attn_mask=vis[:, None], scale=scale, enable_gqa=True
        )
        out = out * seen[:, None].to(out.dtype)
        if self.spec.fold_values:
            out = self._to_folded_frame(out)
        self._write_window(kb, vb, valid)
        return out.to(query.dtype)

    def _store_rows(self, kb: torch.Tensor, vb: torch.Tensor) -> None:
        self._write_window(kb, vb, None)

    def _write_window(self, kb: torch.Tensor, vb: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
        for b in range(self.batch):
            k, v = _real_tokens(kb, vb, valid, b)
            m = k.shape[1]
            if m == 0:
                continue
            r = self.win_len[b]
            all_k = torch.cat([self.win_k[b, :, :r], k], dim=1)[:, -self.window :]
            all_v = torch.cat([self.win_v[b, :, :r], v], dim=1)[:, -self.window :]
            keep = all_k.shape[1]
            self.win_k[b, :, :keep] = all_k
            self.win_v[b, :, :keep] = all_v
            self.win_len[b] = keep
            self.total[b] += m


class OscarCache(Cache):
    """transformers `Cache` holding one layer per decoder layer: `OscarLayer` (or `SimulatedLayer`) for
    full-attention layers, `WindowLayer` for sliding-window layers (`windows[i]` is the window or None)."""

    def __init__(self, spec: CacheSpec, num_layers: int, windows: Optional[Sequence[Optional[int]]] = None):
        if spec.format.rotated and len(spec.layers) != num_layers:
            raise ValueError(f"the cache spec has rotations for {len(spec.layers)} layers but the model has {num_layers}")
        windows = list(windows) if windows is not None else [None] * num_layers
        if len(windows) != num_layers:
            raise ValueError(f"{len(windows)} sliding-window entries for a model of {num_layers} layers")
        layers: list[OscarLayer] = []
        for i, window in enumerate(windows):
            rot = spec.layers[i] if spec.format.rotated else None
            if window is not None:
                layers.append(WindowLayer(spec, rot, i, window))
            else:
                layers.append(torch_layer(spec, rot, i))
        super().__init__(layers=layers)
        self.spec = spec

    def nbytes(self) -> int:
        """Bytes the cache holds (BF16 segments in use + INT pages in use), all layers, K and V."""
        return sum(layer.nbytes() for layer in self.layers)

    def batch_extend(self, other: "OscarCache") -> None:
        """Append the sequences of `other` (a cache of the same spec and model) after this cache's rows."""
        if len(other.layers) != len(self.layers):
            raise ValueError(f"cannot merge a cache of {len(other.layers)} layers into one of {len(self.layers)}")
        for mine, theirs in zip(self.layers, other.layers):
            mine.batch_extend(theirs)

    def batch_size(self) -> int:
        """Sequences held (0 before the first forward pass)."""
        return next((int(layer.batch) for layer in self.layers if layer.is_initialized), 0)

    def bits_per_element(self, rows: Optional[Sequence[int]] = None) -> float:
        """Measured storage bits per cached K/V element over all layers and heads, of every sequence or of `rows`."""
        elements, nbytes = 0, 0
        for layer in self.layers:
            if layer.is_initialized:
                lengths = layer.lengths()
                elements += sum(lengths[b] for b in (range(len(lengths)) if rows is None else rows)) * layer.hkv * layer.d * 2
                nbytes += layer.nbytes(rows)
        if elements == 0:
            raise ValueError("the cache holds no tokens yet")
        return 8 * nbytes / elements


def cache_spec(fmt: CacheFormat, layers: Optional[Sequence[LayerRotations]] = None, **runtime: Any) -> CacheSpec:
    """The `CacheSpec` of format ``fmt``: ``layers`` the per-layer `LayerRotations` of a rotated format (dropped for
    the others), ``runtime`` the spec's run-time fields (mode, backend, fold_values, ...; those the format does not
    take, outside ``fmt.runtime_fields``, are dropped)."""
    return CacheSpec(format=fmt, layers=list(layers or []) if fmt.rotated else [],
                     **{k: v for k, v in runtime.items() if k in fmt.runtime_fields})


def torch_layer(spec: CacheSpec, rotations: Optional[LayerRotations], layer_idx: int) -> OscarLayer:
    """The cache layer of a full-attention layer in the format of ``spec``: a `SimulatedLayer` (BF16 rows attended
    as their quantize-dequantize image; it takes no rotations) for a simulated format, else an `OscarLayer`."""
    if spec.format.simulated:
        return SimulatedLayer(spec, None, layer_idx)
    return OscarLayer(spec, rotations, layer_idx)


# The format methods `CacheFormat.cache_spec` and `CacheFormat.torch_layer` forward here (formats imports no cache).
formats.provide("cache_spec", cache_spec)
formats.provide("torch_layer", torch_layer)


def spec_for_model(model: Any, kind: str = "rotated", rotations: Optional[list[LayerRotations]] = None, **kwargs: Any) -> CacheSpec:
    """A `CacheSpec` for `model` with identity rotations unless `rotations` are given."""
    cfg = model.config
    layers_n = int(cfg.num_hidden_layers)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    if format_class(kind).rotated and rotations is None:
        rotations = [LayerRotations.identity(hkv, d) for _ in range(layers_n)]
    if "group_size" in kwargs:
        kwargs["group_size"] = min(int(kwargs["group_size"]), d)
    return CacheSpec(kind=kind, layers=list(rotations or []), **kwargs)


__all__ = [
    "CacheSpec",
    "LayerRotations",
    "MODES",
    "OscarCache",
    "OscarLayer",
    "PagedRows",
    "SimulatedLayer",
    "WindowLayer",
    "cache_spec",
    "spec_for_model",
    "torch_layer",
]


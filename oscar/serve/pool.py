"""The OSCAR KV pool for SGLang: packed INT pages of SGLang's page size plus BF16 sink and recent windows per request.

Layout (``oscar.cache.paged``'s format; SGLang's pages are the pages): per layer, K and V each hold
``oscar.cache.paged.QuantPages`` with ``codes`` uint8 ``[size/P + 1, Hkv, P, d*bits/8]`` and BF16 ``scale``/``zero``
``[size/P + 1, Hkv, P, d/G]`` for SGLang's ``--page-size`` ``P``; token slot ``loc`` (SGLang's
``out_cache_loc``, from SGLang's own allocator) is token ``loc % P`` of page ``loc // P``. On CUDA, INT2 with
one group per row goes to the fragment-order layouts ``mma_k``/``mma_v`` read by the v9 decode kernel
(``oscar.kernels.decode_mma``, pages of 16k tokens); other formats and the CPU use token rows
(``oscar.cache.formats.RotatedFormat.resolve_layout``). The BF16 windows are per request slot (SGLang's ``req_pool_idx``), one
buffer per layer and tensor ``[R + 1, Hkv, S0 + W, d]``: the sink (positions ``0..S0-1``) in columns
``0..S0-1`` and a ring (position ``p >= S0`` at column ``S0 + (p - S0) % W``); slot ``R`` takes the rows of
the padded entries of a CUDA-graph batch. BF16 whatever the model dtype (as ``oscar.cache.torch_cache``), in the
original frame; rows are rounded to BF16 once, as they arrive.

Window convention (as ``oscar.cache.torch_cache``): for a sequence of length ``L`` the sink holds ``[0, min(L, S0))``,
the quantized pages ``[S0, L - W)`` and the ring ``[max(S0, L - W), L)``. The sink is a whole number of
pages (``S0 % P == 0``), so quantized token ``t`` (position ``S0 + t``) is token ``t % P`` of the page
``req_to_token[r, S0 + t] // P``: the kernel's page table is every ``P``-th column of SGLang's
``req_to_token`` from ``S0`` on, divided by ``P``. Every row at ``p >= S0`` is quantized into its token
slot as it arrives (write-through); a row in the ring is also kept in BF16 and only read from there while
it is in the window. Quantizing at arrival and quantizing at demotion give the same codes (the same
BF16 row through the same quantizer), so the decode step's demotion costs nothing: when a row leaves
the window the kernel's ``int_len`` grows by one and reads its codes. A decode step writes its new
row (quantized, and BF16 into the sink or ring) with device ops only: it is captured in the step's CUDA graph.
Token slots return to SGLang's allocator when a request ends; the window rows of a request slot are
overwritten by the next request that gets the slot.

Rope-centered keys (an ``auto`` artifact's ``+rope`` heads): a key row at position ``p`` is quantized minus
``RoPE_p(m)`` (``write`` passes each row's position, ``write_decode`` the decode metadata's ``pos``) and
``cached_rows`` adds it back; served by the mma-layout CUDA kernel and the torch twins, refused (naming the
format) where the pool would use the row-layout Triton kernels.

Per-channel keys (an artifact whose ``meta.json`` ``key_block[l] = T > 0``: ``auto``'s ``/ch<T>`` candidates, KIVI-2;
docs/DESIGN.md "Per-channel key pages"): such a layer's K pages are ``QuantPages(..., block=T)`` (one BF16 scale and
zero per block of ``T`` slots and channel; ``T`` divides ``P``, so a block lives in one page, and the sink is whole
pages, so blocks are aligned at ``S0``). Its ring has ``W + T - 1`` columns and holds the ``W`` to ``W + T - 1``
newest rows as a prefix of the ring (``oscar.cache.paged.channel_ring_slots``: complete blocks in ``m = W / T``
block slots, the incomplete block in the tail); ``int_len = T * floor((n - W) / T)`` for ``n`` rows past the sink.
Write-through by blocks: the step whose row completes block ``k`` quantizes the block's ``T`` keys and values at
once into their slots (``fmt.write``; quantizing at completion and at demotion give the same codes, so the demotion
of block ``k - m`` costs only the move of the tail's ``T - 1`` rows into its ring slots). Under CUDA graphs every
entry of the batch runs the block write (``T`` rows) and the move with fixed shapes: an entry that completes no
block writes into SGLang's padding page 0 and moves the rows of the padding request slot. The decode metadata of
these layers (`BlockMeta`) is computed once per step; per-token layers of the same model keep their own
``int_len``/``recent_len``.

Prefix (radix) cache: the quantized rows of a cached prefix already sit in its token slots (write-through), so a
request that hits it reads them through its own ``req_to_token`` row. Its BF16 sink rows lived in the windows of
the request slot that computed them; they are kept in a **sink store** indexed by SGLang page (``S0 % P == 0``:
the sink is whole pages): BF16 ``[C, Hkv, P, d]`` per layer and tensor, filled from a request slot's windows when
the radix tree takes its pages (``store_sink``, a hook before the tree's insert), released when the allocator
frees the page (``release_sink_pages``, a hook on the allocator), copied into the sink columns of a request
that hits the prefix (``sink_ids`` / ``restore_sink``). The recent window of a request that hits a prefix
comes from its own extend: the plugin caps every match at ``input_len - W`` (a hook on the request's
largest prefix), so the last ``W`` rows are always computed by the request itself. Per-channel layers: a match is
whole SGLang pages past a sink of whole pages, so whole key blocks (``T`` divides ``P``), and every block of a cached
page was quantized when its last row arrived (write-through by blocks): the rule is that a prefix is reused up to
its last whole page at or before ``input_len - W``, which is never past ``S0 + int_len`` of the request, so the
request's ring rows are all its own and the cached blocks are read as the donor wrote them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from oscar.cache import paged
from oscar.serve.settings import ENV_ARTIFACT, ENV_KERNELS, OscarServeError, ServeSettings, head_transforms
from oscar.serve.state import current_state

logger = logging.getLogger(__name__)


class OscarTokenToKVPool(MHATokenToKVPool):
    """SGLang MHA pool whose token slots hold OSCAR's packed INT rows (see the module docstring)."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str, enable_memory_saver: bool, *args: Any,
                 oscar_state: Optional[dict] = None, oscar_layout: str = "auto", **kwargs: Any) -> None:
        state = oscar_state if oscar_state is not None else current_state()
        self.settings: ServeSettings = state["settings"]
        self.rotations = state["rotations"]
        try:
            self.format = state["format"].replace(page_size=page_size)  # SGLang's pages are the format's pages
        except ValueError as err:  # per-channel keys: a block lives in one page
            raise OscarServeError(f"{ENV_ARTIFACT}: the served format does not fit --page-size {page_size}: {err}") from None
        self.format.check_served("pool")
        self.bits, self.group_size = self.format.bits, self.format.group_size
        self.sink, self.recent = self.format.sink, self.format.recent
        if self.sink % page_size:
            raise OscarServeError(f"the sink of {self.sink} tokens must be a multiple of --page-size {page_size}")
        self.kernels = self.settings.kernel_backend(device)
        layout = oscar_layout if self.kernels == "triton" or oscar_layout != "auto" else "rows"
        self.layout = self.format.resolve_layout(layout, head_dim, device)
        self.num_req_slots = 0
        self.static_block_writes = False  # True: the fixed-shape block writes of a CUDA-graph capture, also eager
        self.window_dtype = torch.bfloat16
        self.prefix_cache = bool(state.get("prefix_cache", False))  # the radix cache is on: keep sink pages
        self.sink_k: list[torch.Tensor] = []
        self.sink_v: list[torch.Tensor] = []
        self._sink_of_page: dict[int, int] = {}  # SGLang page -> row of the sink store
        self._sink_free: list[int] = []
        self.slot_generation: dict[int, int] = {}  # request slot -> ReqToTokenPool generation its windows hold
        self._sink_stored: dict[int, tuple] = {}  # request slot -> (generation, sink positions) already stored
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver,
                         *args, **kwargs)
        first = self.start_layer
        self.transforms = [head_transforms(self.rotations[first + i], device) for i in range(layer_num)]
        self.rope_centered = any(kt.rope_centered for kt, _ in self.transforms)
        if self.rope_centered and self.kernels != "torch" and self.layout != "mma":
            rope = [first + i for i, (kt, _) in enumerate(self.transforms) if kt.rope_centered]
            raise OscarServeError(
                f"{ENV_ARTIFACT}={str(self.settings.artifact)!r} has rope-centered keys in layers {rope}, which "
                f"{ENV_KERNELS}={self.kernels} serves through the mma-layout CUDA kernel only (INT2/INT4 with one "
                f"group per row, head_dim 64/128, --page-size a power of two >= 16); this pool is INT{self.bits}, "
                f"group {self.group_size}, head_dim {head_dim}, pages of {page_size} on {device} ({self.layout} "
                f"layout). Use {ENV_KERNELS}=torch, such a format, or calibrate with method.rope_center=false")
        bpt = self.format.bytes_per_token(layer_num, head_num, head_dim)
        bf16 = 2 * layer_num * head_num * head_dim * 2
        logger.info(
            "OSCAR KV pool: INT%d, group %d, sink %d, recent %d, pages of %d tokens (%s layout): %d bytes/token "
            "(BF16 KV: %d, %.2fx more tokens per byte); #tokens %d, pages %d bytes; kernels=%s",
            self.bits, self.group_size, self.sink, self.recent, page_size, self.layout, bpt, bf16, bf16 / bpt, size,
            self.pages_nbytes(), self.kernels)
        if self.block:
            logger.info("OSCAR KV pool: per-channel keys over blocks of %d tokens in layers %s (rings of %d rows)",
                        self.block, [first + i for i, t in enumerate(self.key_blocks) if t], self.recent + self.block - 1)
        self.prepare_writes()

    def prepare_writes(self) -> None:
        """Run every layer's write path once, eagerly, into SGLang's padding page 0 (zero rows, position 0): the
        tables the writers build at first use (fragment-order byte maps, permuted rotations, Triton compiles) exist
        before SGLang captures a decode step. Without it a per-channel layer's first block write happens inside the
        capture (the eager warm-up steps complete no block), where building a table is a host-to-device copy and a
        host sync that the capture refuses. Page 0 takes the padded entries' rows and is never read."""
        for i, (kp, vp) in enumerate(zip(self.k_pages, self.v_pages)):
            n = self.key_blocks[i] or 1  # a per-channel layer writes whole blocks
            rows = torch.zeros((n, self.head_num, self.head_dim), dtype=self.window_dtype, device=self.device)
            slots = torch.arange(n, dtype=torch.int64, device=self.device)
            pos = torch.zeros(n, dtype=torch.int64, device=self.device) if self.rope_centered else None
            self.format.write(rows, rows, slots, (kp, vp), self.transforms[i], backend=self.kernels, positions=pos)

    def _prepare_block_writes(self) -> None:
        """The per-channel layers' decode write once, eagerly (Triton/CUDA kernels), with the windows in place: one
        entry of the padding slot completing a block into SGLang's padding page 0, so that the launch is compiled
        before SGLang captures a decode step (the eager warm-up steps may complete no block)."""
        if self.kernels == "torch" or not self.block:
            return
        dev, T = self.device, self.block
        i64 = lambda v: torch.full((1,), v, dtype=torch.int64, device=dev)  # noqa: E731
        m = BlockMeta(int_len=torch.zeros(1, dtype=torch.int32, device=dev),
                      recent_len=torch.zeros(1, dtype=torch.int32, device=dev), col=i64(self.sink),
                      done=torch.ones(1, dtype=torch.bool, device=dev), src=i64(self.sink), slot0=i64(0),
                      pos=i64(T - 1), move_row=i64(self.pad_slot), move_dst=i64(self.sink))
        row = torch.zeros((1, self.head_num, self.head_dim), dtype=self.window_dtype, device=dev)
        for i, t in enumerate(self.key_blocks):
            if t:
                self._write_decode_blocks_fused(i, row, row, i64(self.pad_slot), m, i64(T - 1), t)

    # -- storage -----------------------------------------------------------------------------------

    def _create_buffers(self) -> None:
        first = int(self.start_layer or 0)
        self.key_blocks = [self.format.layer_key_block(first + i) for i in range(self.layer_num)]
        rot_blocks = [int(getattr(self.rotations[first + i], "k_block", 0) or 0) for i in range(self.layer_num)]
        if rot_blocks != self.key_blocks:
            raise OscarServeError(f"{ENV_ARTIFACT}: the served format's key blocks {self.key_blocks} (layers {first}..) "
                                  f"disagree with the artifact's rotations {rot_blocks} (meta.json key_block)")
        self.block = check_key_blocks(self.key_blocks, self.format, self.page_size, first)
        n = (self.size + self.page_size + self.page_size - 1) // self.page_size
        pairs = [self.format.new_pages(n, self.head_num, self.head_dim, self.device, self.layout, key_block=t)
                 if t else self.format.new_pages(n, self.head_num, self.head_dim, self.device, self.layout)
                 for t in self.key_blocks]
        self.k_pages = [k for k, _ in pairs]
        self.v_pages = [v for _, v in pairs]
        # SGLang code that probes the BF16 buffers gets an explicit refusal (properties below).
        self.k_scale_buffer = self.v_scale_buffer = None
        self.win_k: list[torch.Tensor] = []
        self.win_v: list[torch.Tensor] = []

    def bind_requests(self, num_req_slots: int) -> None:
        """Allocate the BF16 windows of ``num_req_slots`` request slots (SGLang's req_to_token rows), plus the
        padding slot ``num_req_slots``."""
        if num_req_slots <= self.num_req_slots:
            return
        def z(i: int) -> torch.Tensor:  # a per-channel layer's ring has W + T - 1 columns
            cols = self.sink + self.ring_size(i)
            return torch.zeros((num_req_slots + 1, self.head_num, cols, self.head_dim), dtype=self.window_dtype,
                               device=self.device)

        self.win_k = [z(i) for i in range(self.layer_num)]
        self.win_v = [z(i) for i in range(self.layer_num)]
        self.num_req_slots = num_req_slots
        self._prepare_block_writes()
        logger.info("OSCAR KV pool: BF16 windows for %d request slots: %.3f GB", num_req_slots,
                    self.windows_nbytes() / 2**30)
        if self.prefix_cache and self.sink:
            self._grow_sink_store(sink_store_pages(num_req_slots, self.sink, self.page_size))

    @property
    def pad_slot(self) -> int:
        """The request slot whose windows take the rows of padded batch entries."""
        return self.num_req_slots

    def sink_view(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sink K and V ``[R + 1, Hkv, S0, d]`` of local layer ``i`` (views of the window buffers)."""
        return self.win_k[i][:, :, : self.sink], self.win_v[i][:, :, : self.sink]

    def ring_view(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Recent-window ring K and V ``[R + 1, Hkv, W, d]`` of local layer ``i`` (views)."""
        return self.win_k[i][:, :, self.sink :], self.win_v[i][:, :, self.sink :]

    def ring_size(self, i: int) -> int:
        """Columns of local layer ``i``'s ring: ``W``, or ``W + T - 1`` for per-channel keys over blocks of ``T``."""
        return self.recent + max(self.key_blocks[i] - 1, 0)

    def window_index(self, pos: torch.Tensor) -> torch.Tensor:
        """Window column of position ``pos``: ``pos`` in the sink, ``S0 + (pos - S0) % W`` in the ring."""
        S0, W = self.sink, self.recent
        return torch.where(pos < S0, pos, S0 + (pos - S0).clamp(min=0) % W)

    def pages_nbytes(self) -> int:
        """Bytes of the packed pages (codes + scale + zero) of all layers."""
        return sum(t.numel() * t.element_size() for p in (*self.k_pages, *self.v_pages)
                   for t in (p.codes, p.scale, p.zero))

    def windows_nbytes(self) -> int:
        """Bytes of the BF16 sink and recent windows of all request slots and layers."""
        return sum(t.numel() * t.element_size() for t in (*self.win_k, *self.win_v))

    def window_bytes_per_request(self) -> int:
        """Window bytes one request slot costs (what pool sizing reserves per running request; the rings of
        per-channel layers hold ``T - 1`` rows more)."""
        item = torch.empty((), dtype=self.window_dtype).element_size()
        cols = sum(self.sink + self.ring_size(i) for i in range(self.layer_num))
        return 2 * self.head_num * cols * self.head_dim * item

    def get_kv_size_bytes(self) -> tuple[int, int]:
        k = sum(t.numel() * t.element_size() for p in self.k_pages for t in (p.codes, p.scale, p.zero))
        v = sum(t.numel() * t.element_size() for p in self.v_pages for t in (p.codes, p.scale, p.zero))
        return k, v

    def _clear_buffers(self) -> None:
        self.k_pages, self.v_pages = [], []
        self.win_k, self.win_v = [], []

    def _refuse(self, what: str) -> Any:
        raise NotImplementedError(
            f"{what} is not available on the OSCAR KV pool (packed INT{self.bits} rows, not BF16 buffers); "
            "it is only read through --attention-backend oscar"
        )

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._refuse("get_key_buffer")

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._refuse("get_value_buffer")

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._refuse("get_kv_buffer")

    def set_kv_buffer(self, layer: Any, loc_info: Any, cache_k: torch.Tensor, cache_v: torch.Tensor, *args: Any,
                      **kwargs: Any) -> None:
        self._refuse("set_kv_buffer (writes need the request positions: OscarAttnBackend writes the pool)")

    def get_contiguous_buf_infos(self) -> Any:
        return self._refuse("PD-disaggregation transfer")

    def get_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        return self._refuse("get_cpu_copy")

    def load_cpu_copy(self, *args: Any, **kwargs: Any) -> Any:
        return self._refuse("load_cpu_copy")

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        self._refuse("move_kv_cache")

    # -- the sink store of the prefix cache -------------------------------------------------------------

    def _grow_sink_store(self, pages: int) -> None:
        old = len(self._sink_free) + len(self._sink_of_page)
        if pages <= old:
            return
        shape = (pages, self.head_num, self.page_size, self.head_dim)
        grow = lambda t: torch.cat([t, torch.zeros((pages - old, *shape[1:]), dtype=t.dtype, device=t.device)])  # noqa: E731
        if old:
            self.sink_k = [grow(t) for t in self.sink_k]
            self.sink_v = [grow(t) for t in self.sink_v]
            logger.warning("OSCAR KV pool: the BF16 sink store of the prefix cache grew from %d to %d pages (%.3f GB; "
                           "more distinct cached prefixes than 2x the request slots)", old, pages,
                           self.sink_store_nbytes() / 2**30)
        else:
            self.sink_k = [torch.zeros(shape, dtype=self.window_dtype, device=self.device) for _ in range(self.layer_num)]
            self.sink_v = [torch.zeros(shape, dtype=self.window_dtype, device=self.device) for _ in range(self.layer_num)]
            logger.info("OSCAR KV pool: BF16 sink store of the prefix cache: %d pages, %.3f GB", pages,
                        self.sink_store_nbytes() / 2**30)
        self._sink_free.extend(range(pages - 1, old - 1, -1))

    def sink_store_nbytes(self) -> int:
        """Bytes of the BF16 sink store (all layers, K and V)."""
        return sum(t.numel() * t.element_size() for t in (*self.sink_k, *self.sink_v))

    def sink_pages_in_use(self) -> int:
        """Pages of the sink store that hold a cached prefix's sink."""
        return len(self._sink_of_page)

    def _sink_pages(self, req_to_token: torch.Tensor, r: int, n: int) -> list[int]:
        return [int(x) for x in (req_to_token[r, 0:n:self.page_size] // self.page_size).tolist()]

    def store_sink(self, req_to_token: torch.Tensor, r: int, length: int) -> int:
        """Keep the BF16 sink rows of request slot ``r`` (its first ``length`` positions are computed) for the
        radix tree, by SGLang page: the whole pages of positions ``[0, min(S0, length))`` that have no entry
        yet. Returns the number of pages stored."""
        n = min(self.sink, length // self.page_size * self.page_size)
        if not (self.prefix_cache and self.num_req_slots and n > 0):
            return 0
        key = (self.slot_generation.get(r), n)
        if self._sink_stored.get(r) == key:  # this request's sink pages are held already (a later checkpoint):
            return 0                          # no host sync; a page the tree swapped in is the tree's, stored
        self._sink_stored[r] = key
        new = [(j, page) for j, page in enumerate(self._sink_pages(req_to_token, r, n)) if page not in self._sink_of_page]
        if not new:
            return 0
        have = len(self._sink_free) + len(self._sink_of_page)
        if len(self._sink_free) < len(new):
            self._grow_sink_store(max(2 * have, have + len(new)))
        rows = [self._sink_free.pop() for _ in new]
        for (_, page), row in zip(new, rows):
            self._sink_of_page[page] = row
        P = self.page_size
        cols = torch.tensor([j * P + t for j, _ in new for t in range(P)], device=self.device)
        dst = torch.tensor(rows, device=self.device)
        for i in range(self.layer_num):
            for win, store in ((self.win_k[i], self.sink_k[i]), (self.win_v[i], self.sink_v[i])):
                store[dst] = win[r][:, cols].unflatten(1, (len(new), P)).transpose(0, 1)
        return len(new)

    def release_sink_pages(self, page_ids: Any) -> None:
        """The allocator frees ``page_ids`` (SGLang pages): their sink-store rows become free."""
        if not self._sink_of_page:  # nothing stored: no host sync
            return
        ids = page_ids.tolist() if isinstance(page_ids, torch.Tensor) else page_ids
        for page in ids:
            row = self._sink_of_page.pop(int(page), None)
            if row is not None:
                self._sink_free.append(row)

    def clear_sink_store(self) -> None:
        """Every page is free again (the allocator was cleared: SGLang's flush_cache)."""
        self._sink_free.extend(self._sink_of_page.values())
        self._sink_of_page.clear()
        self.slot_generation.clear()
        self._sink_stored.clear()

    def sink_ids(self, req_to_token: torch.Tensor, r: int, n: int) -> torch.Tensor:
        """Sink-store rows of the pages holding positions ``[0, n)`` of request slot ``r`` (a cached prefix
        computed by another request); refuses a page the store does not hold."""
        pages = self._sink_pages(req_to_token, r, n)
        missing = [p for p in pages if p not in self._sink_of_page]
        if missing:
            raise RuntimeError(f"OSCAR KV pool: the sink rows of cached pages {missing[:8]} are not in the sink store "
                               "(a prefix-cache page reached a request without passing the plugin's tree hooks)")
        return torch.tensor([self._sink_of_page[p] for p in pages], device=self.device)

    def restore_sink(self, layer_id: int, r: int, ids: torch.Tensor) -> None:
        """Copy the sink-store rows ``ids`` into the sink columns ``[0, len(ids) * P)`` of request slot ``r``."""
        i = self._local(layer_id)
        n = int(ids.numel()) * self.page_size
        for win, store in ((self.win_k[i], self.sink_k[i]), (self.win_v[i], self.sink_v[i])):
            win[r, :, :n] = store[ids].transpose(0, 1).flatten(1, 2)

    # -- writes ------------------------------------------------------------------------------------

    def _local(self, layer_id: int) -> int:
        return layer_id - self.start_layer

    def write_plan(self, loc: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, seq_len: torch.Tensor) -> "WritePlan":
        """Where an extend's rows go in every per-token layer (`write`'s arguments less the rows): computed once per
        forward, so that the layers' writes index with it and wait for no host sync (two ``nonzero`` here)."""
        quant = torch.nonzero(pos >= self.sink).flatten()
        keep = torch.nonzero((pos < self.sink) | (pos >= seq_len - self.recent)).flatten()
        return WritePlan(quant=quant, quant_loc=loc.index_select(0, quant), quant_pos=pos.index_select(0, quant),
                         keep=keep, keep_req=req.index_select(0, keep),
                         keep_col=self.window_index(pos.index_select(0, keep)))

    def write(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, req: torch.Tensor,
              pos: torch.Tensor, seq_len: torch.Tensor, plan: Optional["WritePlan"] = None) -> None:
        """Store new rows ``k``/``v`` ``[N, Hkv, d]`` (original frame) of request slots ``req`` at positions
        ``pos`` (``[N]``, int64), where ``seq_len[n]`` is the length of row ``n``'s sequence after this
        forward (an extend, eager): rows past the sink quantized into slot ``loc``, sink rows and rows inside
        the recent window also into the BF16 windows. ``plan``: `write_plan` of these arguments (the backend
        computes it once per forward); without it, computed here."""
        i = self._local(layer_id)
        kb, vb = k.to(self.window_dtype), v.to(self.window_dtype)
        if self.key_blocks[i]:
            self._write_blocks(i, kb, vb, loc, req, pos, seq_len)
            return
        plan = self.write_plan(loc, req, pos, seq_len) if plan is None else plan
        if plan.quant.numel():
            self.format.write(kb.index_select(0, plan.quant), vb.index_select(0, plan.quant), plan.quant_loc,
                              (self.k_pages[i], self.v_pages[i]), self.transforms[i], backend=self.kernels,
                              positions=plan.quant_pos if self.rope_centered else None)
        if plan.keep.numel():
            self.win_k[i][plan.keep_req, :, plan.keep_col] = kb.index_select(0, plan.keep)
            self.win_v[i][plan.keep_req, :, plan.keep_col] = vb.index_select(0, plan.keep)

    def _write_blocks(self, i: int, kb: torch.Tensor, vb: torch.Tensor, loc: torch.Tensor, req: torch.Tensor,
                      pos: torch.Tensor, seq_len: torch.Tensor) -> None:
        """`write` of a per-channel layer (an extend, eager): sink rows into the sink columns; per request, the rows
        past the sink of positions ``[S0 + int_len(L), L)`` into the ring (earlier rows still in the ring move to
        their columns at the new length), and every key block whose last row arrives in this forward quantized
        whole, keys and values (``fmt.write``), from the ring's earlier rows and this forward's rows."""
        S0, T = self.sink, self.key_blocks[i]
        sink = pos < S0
        if bool(sink.any()):
            self.win_k[i][req[sink], :, pos[sink]] = kb[sink]
            self.win_v[i][req[sink], :, pos[sink]] = vb[sink]
        past = ~sink
        if not bool(past.any()):
            return
        kb, vb, loc, req, pos, seq_len = kb[past], vb[past], loc[past], req[past], pos[past], seq_len[past]
        # rows of one request are contiguous and in position order (SGLang's extend layout)
        slots = req.tolist()
        starts = [0] + [j for j in range(1, len(slots)) if slots[j] != slots[j - 1]] + [len(slots)]
        blocks_k, blocks_v, blocks_slot, blocks_pos = [], [], [], []
        for a, b in zip(starts[:-1], starts[1:]):
            r, p0, L = slots[a], int(pos[a]), int(seq_len[a])
            n_old, n = p0 - S0, L - S0
            lo = S0 + min(self.int_length(n, T), (n_old // T) * T)  # the new ring's first row, the first open block's
            old_cols = S0 + paged.channel_ring_slots(torch.arange(lo - S0, n_old, device=self.device), n_old,
                                                     self.recent, T)
            rows_k = torch.cat([self.win_k[i][r][:, old_cols].transpose(0, 1), kb[a:b]])  # positions lo..L-1
            rows_v = torch.cat([self.win_v[i][r][:, old_cols].transpose(0, 1), vb[a:b]])
            keep = S0 + self.int_length(n, T)
            cols = S0 + paged.channel_ring_slots(torch.arange(keep - S0, n, device=self.device), n, self.recent, T)
            self.win_k[i][r][:, cols] = rows_k[keep - lo :].transpose(0, 1)
            self.win_v[i][r][:, cols] = rows_v[keep - lo :].transpose(0, 1)
            first, end = n_old // T * T, n // T * T  # the blocks completed by this forward: rows [first, end)
            if end > first:  # consecutive blocks: one slice of rows; each block's slots end at its last row's slot
                blocks_k.append(rows_k[first + S0 - lo : end + S0 - lo])
                blocks_v.append(rows_v[first + S0 - lo : end + S0 - lo])
                last = loc[a + S0 - p0 + torch.arange(first + T - 1, end, T, device=loc.device)]
                blocks_slot.append((last[:, None] - (T - 1) + torch.arange(T, device=loc.device)).flatten())
                blocks_pos.append(torch.arange(S0 + first, S0 + end, device=self.device))
        if blocks_k:
            self.format.write(torch.cat(blocks_k), torch.cat(blocks_v), torch.cat(blocks_slot),
                              (self.k_pages[i], self.v_pages[i]), self.transforms[i], backend=self.kernels,
                              positions=torch.cat(blocks_pos) if self.rope_centered else None)

    def int_length(self, n: Any, block: int) -> Any:
        """Quantized rows read of a sequence with ``n`` rows past the sink (int or int tensor): ``n - W``, for
        per-channel keys over blocks of ``T`` rounded down to whole blocks (``T * floor((n - W) / T)``), at least 0."""
        if isinstance(n, torch.Tensor):
            past = (n - self.recent).clamp(min=0)
            return torch.div(past, block, rounding_mode="floor") * block if block else past
        past = max(0, n - self.recent)
        return past // block * block if block else past

    def write_decode(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, req: torch.Tensor,
                     col: torch.Tensor, pos: Optional[torch.Tensor] = None, blocks: Optional["BlockMeta"] = None
                     ) -> None:
        """A decode step's new rows ``[B, Hkv, d]`` at positions ``pos`` ``[B]`` (needed for rope-centered
        keys): quantized into their token slots ``loc`` and BF16 into window column ``col`` of request slot
        ``req`` (device ops of fixed shapes: graph-capturable). A sink row's codes land in its slot too and are
        never read (the page table starts at ``S0``); a padded entry (``loc`` 0, SGLang's padding slot) writes
        the padding slots."""
        i = self._local(layer_id)
        kb, vb = k.to(self.window_dtype), v.to(self.window_dtype)
        if self.key_blocks[i]:
            if blocks is None:
                raise RuntimeError(f"OSCAR KV pool: layer {layer_id} has per-channel keys; its decode write needs the "
                                   "step's BlockMeta (decode_metadata computes it)")
            self._write_decode_blocks(i, kb, vb, req, blocks, loc)
            col = blocks.col
        else:
            self.format.write(kb, vb, loc, (self.k_pages[i], self.v_pages[i]), self.transforms[i],
                              backend=self.kernels, positions=pos if self.rope_centered else None)
        self.win_k[i][req, :, col] = kb
        self.win_v[i][req, :, col] = vb

    def _write_decode_blocks(self, i: int, kb: torch.Tensor, vb: torch.Tensor, req: torch.Tensor,
                             m: "BlockMeta", loc: torch.Tensor) -> None:
        """A decode step of a per-channel layer, before the new rows ``[B, Hkv, d]`` take their ring columns: the
        entries whose row completes a key block quantize it (the block's first ``T - 1`` rows from the ring, then
        the new row) into its slots, and those past the first ``m`` blocks move the tail into the block slot of
        the block that leaves the window (already quantized).

        Triton/CUDA kernels: one launch for the keys (``oscar.kernels.quantize.quantize_key_blocks_from_ring``: the
        entries that complete no block do nothing; no gather, no host sync, the same under CUDA graphs and eager)
        and the new value rows quantized per token into their slots ``loc`` now (a value's codes depend on its row
        only: those a block would write later, in slots no read reaches before the block completes). The torch
        twin (CPU): fixed shapes under CUDA graph capture or ``static_block_writes`` (the other entries write
        SGLang's padding page and move the padding slot's rows); eager, only the entries that complete a block."""
        T = self.key_blocks[i]
        if self.kernels != "torch":
            self._write_decode_blocks_fused(i, kb, vb, req, m, loc, T)
            return
        j = torch.arange(T - 1, device=kb.device)
        static = self.static_block_writes or (kb.is_cuda and torch.cuda.is_current_stream_capturing())
        idx = None if static else m.done.nonzero().flatten()
        if idx is not None and idx.numel() == 0:
            return
        sel = (lambda t: t) if idx is None else (lambda t: t[idx])  # noqa: E731
        r, src = sel(req), sel(m.src)
        win_k, win_v = self.win_k[i], self.win_v[i]
        cols = src[:, None] + j  # [N, T - 1]: the block's earlier rows in the ring
        rows_k = torch.cat([win_k[r[:, None], :, cols], sel(kb)[:, None]], dim=1)  # [N, T, Hkv, d]
        rows_v = torch.cat([win_v[r[:, None], :, cols], sel(vb)[:, None]], dim=1)
        slots = sel(m.slot0)[:, None] + torch.arange(T, device=kb.device)
        positions = (self._block_positions(sel(m.pos), T).flatten() if self.transforms[i][0].rope_centered
                     else None)
        self.format.write(rows_k.flatten(0, 1), rows_v.flatten(0, 1), slots.flatten(), (self.k_pages[i], self.v_pages[i]),
                          self.transforms[i], backend=self.kernels, positions=positions)
        mv, dst = sel(m.move_row), sel(m.move_dst)
        tail = self.sink + self.recent + j  # the tail's T - 1 rows
        for win in (win_k, win_v):
            win[mv[:, None], :, dst[:, None] + j] = win[mv[:, None], :, tail[None, :].expand(mv.shape[0], T - 1)]

    @staticmethod
    def _block_positions(pos: torch.Tensor, T: int) -> torch.Tensor:
        """``[N, T]`` token positions of the blocks that end at positions ``pos`` ``[N]`` (clamped at 0: entries
        that complete no block)."""
        return (pos[:, None] - (T - 1) + torch.arange(T, device=pos.device)).clamp(min=0)

    def _write_decode_blocks_fused(self, i: int, kb: torch.Tensor, vb: torch.Tensor, req: torch.Tensor,
                                   m: "BlockMeta", loc: torch.Tensor, T: int) -> None:
        """`_write_decode_blocks` on the Triton/CUDA kernels: two launches (keys by block, values by row) plus the
        rope-centered offsets of the block's positions where the layer's keys have them."""
        from oscar.kernels.quantize import quantize_key_blocks_from_ring  # local: keeps triton out of import time

        kt, vt = self.transforms[i]
        offsets = None
        if kt.rope_centered:  # [B, T, Hkv, d]
            offsets = paged.rope_offsets(kt, self._block_positions(m.pos, T)).contiguous()
            kt = kt.without_rope()
        kp = self.k_pages[i]
        quantize_key_blocks_from_ring(kb, self.win_k[i], self.win_v[i], req, m.done, m.src, m.slot0, m.move_row,
                                      m.move_dst, self.sink + self.recent, kp, kt, offsets=offsets,
                                      token_map=paged.mma_map(kp))
        paged.rotate_quantize_pack(vb, loc, self.v_pages[i], vt, backend=self.kernels)

    # -- per-channel decode metadata ----------------------------------------------------------------

    def block_meta(self, L: torch.Tensor, req: torch.Tensor, pad: torch.Tensor, loc: torch.Tensor,
                   out: Optional["BlockMeta"] = None) -> Optional["BlockMeta"]:
        """The decode step's `BlockMeta` of the per-channel layers (None without such layers): device ops of fixed
        shapes from the sequence lengths ``L`` after the step (``[B]`` int64, 1 for padded entries), request slots
        ``req`` (padded entries: the padding slot), ``pad`` and the new rows' token slots ``loc``; into ``out``'s
        buffers when given (CUDA graphs)."""
        if not self.block:
            return None
        S0, W, T = self.sink, self.recent, self.block
        mb = W // T
        n = L - S0  # rows past the sink after the step
        r = n - 1  # the new row, counted past the sink (< 0: a sink row)
        rr = r.clamp(min=0)
        k, i = torch.div(rr, T, rounding_mode="floor"), rr % T
        int_len = torch.where(pad, torch.zeros_like(n), self.int_length(n.clamp(min=0), T))
        done = (r >= 0) & (i == T - 1) & ~pad
        move = done & (k >= mb)
        ring = torch.where(k < mb, k * T + i, torch.where(done, (k % mb) * T + i, mb * T + i))
        vals = dict(
            int_len=int_len.to(torch.int32),
            recent_len=(n.clamp(min=0) - int_len).to(torch.int32),
            col=torch.where(r < 0, L - 1, S0 + ring),
            done=done,
            src=S0 + torch.where(k < mb, k * T, torch.full_like(k, mb * T)),
            slot0=torch.where(done, loc.to(torch.int64) - (T - 1), torch.zeros_like(n)),
            pos=L - 1,
            move_row=torch.where(move, req, torch.full_like(req, self.pad_slot)),
            move_dst=S0 + (k % mb) * T,
        )
        if out is None:
            return BlockMeta(**vals)
        B = L.shape[0]
        for name, v in vals.items():
            getattr(out, name)[:B].copy_(v)
        return out.view(B)

    def block_meta_buffers(self, max_bs: int) -> Optional["BlockMeta"]:
        """Fixed buffers of `BlockMeta` for CUDA-graph batches of up to ``max_bs`` entries (None without per-channel
        layers)."""
        if not self.block:
            return None
        i64 = lambda: torch.zeros(max_bs, dtype=torch.int64, device=self.device)  # noqa: E731
        i32 = lambda: torch.zeros(max_bs, dtype=torch.int32, device=self.device)  # noqa: E731
        return BlockMeta(int_len=i32(), recent_len=i32(), col=i64(), done=torch.zeros(max_bs, dtype=torch.bool,
                         device=self.device), src=i64(), slot0=i64(), pos=i64(),
                         move_row=torch.full((max_bs,), self.pad_slot, dtype=torch.int64, device=self.device),
                         move_dst=i64())

    def lengths(self, i: int, int_len: torch.Tensor, recent_len: torch.Tensor, blocks: Optional["BlockMeta"]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int_len, recent_len)`` of local layer ``i`` in a decode step: the step's per-token lengths, or its
        `BlockMeta`'s for a per-channel layer."""
        if self.key_blocks[i]:
            assert blocks is not None
            return blocks.int_len, blocks.recent_len
        return int_len, recent_len

    def page_columns(self, req_to_token: torch.Tensor) -> torch.Tensor:
        """The view of ``req_to_token`` holding, for each request slot, the first token slot of each page
        past the sink (every ``P``-th column from ``S0``)."""
        return req_to_token[:, self.sink :: self.page_size]

    def page_table(self, req_to_token: torch.Tensor, req: torch.Tensor, out: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
        """The kernel's page table int32 ``[B, ceil((C - S0) / P)]`` of request slots ``req`` (device ops)."""
        pages = torch.index_select(self.page_columns(req_to_token), 0, req) // self.page_size
        if out is None:
            return pages.to(torch.int32).contiguous()
        out[: pages.shape[0]].copy_(pages)
        return out[: pages.shape[0]]

    def quantized_end(self, i: int, length: int, ring: bool = True) -> int:
        """End (exclusive position) of the quantized rows of a sequence of ``length`` positions in local layer ``i``:
        ``S0 + int_len`` (whole key blocks for a per-channel layer) while its ring holds the rest; with
        ``ring=False`` (a cached prefix of another request: the ring holds none of it) ``length``; at least ``S0``."""
        if not ring or length <= self.sink:
            return max(self.sink, length)
        return self.sink + self.int_length(length - self.sink, self.key_blocks[i])

    def ring_columns(self, i: int, pos: torch.Tensor, length: int) -> torch.Tensor:
        """Window columns of positions ``pos`` (in the ring: ``>= quantized_end``) of a sequence of ``length``
        positions in local layer ``i``: ``S0 + (p - S0) % W``, or for per-channel keys the ring slot of
        ``oscar.cache.paged.channel_ring_slots``."""
        T = self.key_blocks[i]
        if not T:
            return self.window_index(pos)
        return self.sink + paged.channel_ring_slots(pos - self.sink, length - self.sink, self.recent, T)

    def cached_rows(self, layer_id: int, req_to_token: torch.Tensor, r: int, length: int, ring: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[Hkv, length, d]`` (float32, original frame) of positions ``0..length-1`` of request slot
        ``r`` as the cache holds them: BF16 sink, dequantized pages ``[S0, length - W)`` (rope-centered keys with
        their offsets added back), BF16 ring. With ``ring=False`` (a cached prefix computed by another request:
        this slot's ring does not hold it) the pages up to ``length``."""
        i = self._local(layer_id)
        S0 = self.sink
        n_sink, q_end = min(length, S0), self.quantized_end(i, length, ring)
        parts_k = [self.win_k[i][r, :, :n_sink].float()]
        parts_v = [self.win_v[i][r, :, :n_sink].float()]
        if q_end > S0:
            table = self.page_table(req_to_token, torch.tensor([r], device=req_to_token.device))
            kt, vt = self.transforms[i]
            for pages, t, out in ((self.k_pages[i], kt, parts_k), (self.v_pages[i], vt, parts_v)):
                x = paged.gather_dequantize(pages, table, 0, q_end - S0)  # rotated frame
                if t.R is not None:
                    x = torch.einsum("hte,hde->htd", x, t.R.to(x.device, torch.float32))
                if t.mu is not None:
                    x = x + t.mu.to(x.device, torch.float32)[:, None, :]
                if t.rope_centered:  # the rope-centered key offsets RoPE_p(m) of positions S0..q_end-1
                    x = x + paged.rope_offsets(t, torch.arange(S0, q_end, device=x.device)).transpose(0, 1)
                out.append(x)
        if length > q_end:
            cols = self.ring_columns(i, torch.arange(q_end, length, device=self.device), length)
            parts_k.append(self.win_k[i][r][:, cols].float())
            parts_v.append(self.win_v[i][r][:, cols].float())
        return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)


@dataclass
class WritePlan:
    """Where an extend's rows go in a per-token layer (`OscarTokenToKVPool.write_plan`; device tensors, int64)."""

    quant: torch.Tensor  # [Nq] rows past the sink (quantized into their token slots)
    quant_loc: torch.Tensor  # [Nq] their token slots
    quant_pos: torch.Tensor  # [Nq] their positions (rope-centered keys)
    keep: torch.Tensor  # [Nw] rows also kept in BF16 (sink, recent window)
    keep_req: torch.Tensor  # [Nw] their request slots
    keep_col: torch.Tensor  # [Nw] their window columns


@dataclass
class BlockMeta:
    """Decode metadata of the per-channel layers of one step (device tensors ``[B]``; `OscarTokenToKVPool.block_meta`)."""

    int_len: torch.Tensor  # int32 quantized rows read (whole blocks)
    recent_len: torch.Tensor  # int32 ring rows read (W .. W + T - 1 once the sequence is past S0 + W)
    col: torch.Tensor  # int64 window column of the new row (after the step's move)
    done: torch.Tensor  # bool the new row completes a key block: the step quantizes it
    src: torch.Tensor  # int64 ring column of that block's first row
    slot0: torch.Tensor  # int64 token slot of the block's first row (0: SGLang's padding page)
    pos: torch.Tensor  # int64 position of the new row
    move_row: torch.Tensor  # int64 request slot whose tail moves (the padding slot where none does)
    move_dst: torch.Tensor  # int64 first window column the tail moves to

    def view(self, batch: int) -> "BlockMeta":
        """The first ``batch`` entries (views)."""
        return BlockMeta(**{f.name: getattr(self, f.name)[:batch] for f in fields(self)})


def check_key_blocks(blocks: list[int], fmt: Any, page_size: int, first: int = 0) -> int:
    """The one per-channel key block ``T`` of the served layers (0: none); refuses what the pool does not serve,
    naming it: two block sizes in one artifact, a block that is not a power of two dividing ``--page-size``, a
    recent window that is not a multiple of ``T``."""
    sizes = sorted({t for t in blocks if t})
    if not sizes:
        return 0
    where = [first + i for i, t in enumerate(blocks) if t]
    if len(sizes) > 1:
        raise OscarServeError(f"{ENV_ARTIFACT}: per-channel keys with block sizes {sizes} in one artifact (layers "
                              f"{where}); the SGLang pool serves one block size per artifact")
    T = sizes[0]
    try:
        paged.check_key_block(T, page_size)
    except ValueError as err:
        raise OscarServeError(f"{ENV_ARTIFACT}: per-channel keys over blocks of {T} tokens (layers {where}) need "
                              f"--page-size a multiple of {T}: {err}") from None
    try:
        paged.check_channel_ring(int(fmt.recent), T)
    except ValueError as err:
        raise OscarServeError(f"{ENV_ARTIFACT}: {err} (OSCAR_RECENT, else the artifact's format)") from None
    return T


def sink_store_pages(num_req_slots: int, sink: int, page_size: int) -> int:
    """Pages of the sink store reserved for ``num_req_slots`` request slots: the sinks of twice as many
    prefixes as slots (the running requests' and as many cached ones); it grows, logged, past that."""
    return 2 * num_req_slots * (sink // page_size)


__all__ = ["BlockMeta", "OscarTokenToKVPool", "WritePlan", "check_key_blocks", "sink_store_pages"]

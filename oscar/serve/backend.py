"""SGLang attention backend ``oscar``: attention over BF16 sink + INT pages + BF16 recent, writing the OSCAR pool.

- Extend (prefill, and each chunk of a chunked prefill): causal attention of the chunk's queries over the
  request's cached prefix as the cache holds it (BF16 sink, INT pages, BF16 ring; nothing for a first chunk)
  and the chunk's own rows rounded to BF16 (without a prefix and with a BF16 model, exactly SGLang's
  ``torch_native`` computation); then the rows go to the pool (``OscarTokenToKVPool.write``). A prefix with
  quantized rows is read in place (``oscar.cache.extend.extend_attention``: the Triton kernel
  ``oscar.kernels.extend_paged`` on ``OSCAR_KERNELS=triton``, its twin otherwise), in the pages' rotated frame:
  the queries and the ``S0 + W + n`` BF16 rows are transformed, no prefix row is dequantized into memory or
  rotated back, so the cost is the ``n x prefix`` attention. By default (``extend_route="dequant"``,
  ``OSCAR_EXTEND_ROUTE``) the Triton kernels read them instead by dequantizing the pages once per layer into FP16
  rows (one Triton pass) and one flash SDPA: on the H200 a radix hit's extend (256 queries over 29,744 cached
  tokens, 32 heads, d 128) took 1.83 ms per layer that way against 8.31 ms for the in-place kernel
  (reports/serving/prefix_profile.md); ``OSCAR_EXTEND_ROUTE=pages`` keeps the in-place kernel. A prefix from the radix cache (computed by another
  request: the request slot changed hands since its windows were written) gets its BF16 sink rows from the
  pool's sink store and is read quantized past the sink (this slot's ring never held it); the plugin caps a
  match so that the extend covers the recent window.
- Decode: write the new row (quantized into its token slot, BF16 into its window column), then attend over
  the three segments with ``oscar.cache.paged.decode_attention``: on CUDA the v9 mma kernel over fragment-order
  pages (or the Triton row kernel for other formats), on a CPU the torch twin. The metadata (window
  columns, segment lengths, the page table) is computed on the device from ``seq_lens`` and
  ``req_pool_indices`` with no host sync, into fixed buffers under CUDA graphs
  (``init_cuda_graph_state`` / ``init_forward_metadata_out_graph`` / ``init_forward_metadata_in_graph``: the
  decode graph runner records ``in_graph`` inside the capture, so a replay recomputes it). On a CPU, while no
  request of the batch has quantized rows, the step is plain attention over the windows in position order
  (the same ``torch_native`` computation).
- Rope-centered keys: the new row's position goes to the writer (``DecodeMeta.pos``) and decode passes
  ``int_pos0 = S0`` (quantized row ``t`` is position ``S0 + t``), constant under CUDA graphs.
- With the value rotation folded into ``o_proj`` (``OSCAR_FOLD``, on by default) every path returns
  ``(o - mu_V) @ R_V`` per KV head, which the folded ``o_proj`` maps back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention

from oscar.cache.extend import extend_attention, gqa_attention
from oscar.kernels.launch import MmaLaunch
from oscar.kernels.segments import Segments
from oscar.serve.labels import install_labels, labels_requested
from oscar.serve.pool import OscarTokenToKVPool
from oscar.serve.reuse import PREFILL_STAGE_MIB
from oscar.serve.state import current_state


ENV_EXTEND_ROUTE = "OSCAR_EXTEND_ROUTE"


@dataclass
class _ExtendMeta:
    req: torch.Tensor  # [N] request slot per token
    pos: torch.Tensor  # [N] position per token
    seq_len: torch.Tensor  # [N] sequence length of the token's request
    starts: list[int]
    lens: list[int]
    prefix: list[int]  # cached prefix length per request (earlier chunks, or a prefix-cache hit)
    req_slots: list[int]
    hit: list[bool]  # the prefix was computed by another request (the radix cache): not in this slot's windows
    sink_ids: list[Optional[torch.Tensor]]  # sink-store rows of a hit's sink pages
    plan: Optional[Any] = None  # where the rows go in every per-token layer (pool.write_plan, once per forward)
    rows: dict = field(default_factory=dict)  # (request slot, ring kind) -> (page table, ring columns), once per forward
    stage: list[Optional["_Stage"]] = field(default_factory=list)  # per request: its staged earlier chunks, or None
    stage_keep: list[bool] = field(default_factory=list)  # this chunk's rows are appended to the stage


@dataclass
class _Stage:
    """One request's own earlier prefill chunks as BF16 rows (what a one-shot prefill reads), kept until its prefill
    ends: per local layer, ``[Hkv, n, d]`` pieces in position order (``OSCAR_PREFILL_STAGE_MIB``)."""

    generation: int  # the request slot's SGLang generation when the stage began
    length: int  # positions the stage holds once the current forward has appended its chunk
    k: list[list[torch.Tensor]]
    v: list[list[torch.Tensor]]


@dataclass
class DecodeMeta:
    """Per-step decode metadata, shared by the layers (device tensors of the batch's size)."""

    req: torch.Tensor  # [B] int64 request slot (padded entries: the pool's padding slot)
    win_row: torch.Tensor  # [B] int32 the same slot: the row of the window buffers the kernel reads in place
    col: torch.Tensor  # [B] int64 window column of the new row
    sink_len: torch.Tensor  # [B] int32
    recent_len: torch.Tensor  # [B] int32
    int_len: torch.Tensor  # [B] int32 quantized rows read by the kernel
    page_table: torch.Tensor  # [B, pages past the sink] int32
    seq_lens: Optional[list[int]] = None  # host copy (eager CPU window path only)
    pos: Optional[torch.Tensor] = None  # [B] int64 position of the new row (rope-centered keys' writes)
    blocks: Optional[Any] = None  # the per-channel key layers' lengths, ring and block indices (pool.block_meta)


def decode_metadata(pool: Any, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    out_cache_loc: torch.Tensor, out: Optional[DecodeMeta] = None) -> DecodeMeta:
    """The decode metadata of a batch from SGLang's device tensors, with device ops of fixed shapes only (no
    host sync): into ``out``'s buffers when given (CUDA graphs), else into new tensors. An entry whose
    ``out_cache_loc`` is 0 (SGLang's padding slot: a padded CUDA-graph entry) uses the pool's padding
    request slot and reads nothing."""
    S0, W = pool.sink, pool.recent
    L = seq_lens.to(torch.int64)
    pad = out_cache_loc.to(torch.int64) == 0
    real = torch.where(pad, torch.zeros_like(L), req_pool_indices.to(torch.int64))  # a row of req_to_token
    req = torch.where(pad, torch.full_like(L, pool.pad_slot), real)
    L = torch.where(pad, torch.ones_like(L), L)
    vals = dict(req=req, win_row=req.to(torch.int32), col=pool.window_index(L - 1),
                sink_len=L.clamp(max=S0).to(torch.int32),
                recent_len=(L - S0).clamp(min=0, max=W).to(torch.int32),
                int_len=torch.where(pad, torch.zeros_like(L), (L - S0 - W).clamp(min=0)).to(torch.int32))
    if out is None or out.pos is not None:
        vals["pos"] = L - 1
    if out is None:
        return DecodeMeta(**vals, page_table=pool.page_table(req_to_token, real),
                          blocks=pool.block_meta(L, req, pad, out_cache_loc))
    B = L.shape[0]
    for name, v in vals.items():
        getattr(out, name)[:B].copy_(v)
    pool.page_table(req_to_token, real, out=out.page_table)
    blocks = None if out.blocks is None else pool.block_meta(L, req, pad, out_cache_loc, out=out.blocks)
    return DecodeMeta(**{name: getattr(out, name)[:B] for name in vals}, page_table=out.page_table[:B], blocks=blocks)


class OscarAttnBackend(AttentionBackend):
    """Attention over an ``OscarTokenToKVPool`` (see the module docstring)."""

    mma_waves: Optional[int] = None  # OSCAR_MMA (oscar.serve.settings): split-K waves or fixed splits, launch options
    mma_splits: Optional[int] = None
    mma_options: Optional[dict] = None
    extend_in_place_max: int = 4096  # extends of up to this many tokens read a quantized prefix in place
    extend_route: str = "dequant"  # how they read it (extend_attention's route; OSCAR_EXTEND_ROUTE): dequant | pages
    stage_max_tokens: int = 0  # prompt positions a chunked prefill keeps as BF16 rows (_Stage); 0: none
    stage_chunk: int = 0  # SGLang's --chunked-prefill-size (which first extends may be cut); 0: unknown, stage all

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, OscarTokenToKVPool):
            raise RuntimeError(
                f"--attention-backend oscar needs the OSCAR KV pool, but the server built {type(pool).__name__}; "
                "the oscar plugin's pool hook did not apply (is the plugin loaded? see SGLANG_PLUGINS)"
            )
        self.device = model_runner.device
        self.pool = pool
        self.req_to_token_pool = model_runner.req_to_token_pool
        pool.bind_requests(int(self.req_to_token_pool.req_to_token.shape[0]))
        self.folded = bool(current_state().get("fold", True))
        self.meta: Any = None
        self.graph: Optional[DecodeMeta] = None  # fixed-size buffers of the CUDA-graph decode metadata
        self.num_splits: dict[int, int] = {}
        mma = dict(getattr(current_state().get("settings"), "mma", ()))
        self.mma_waves, self.mma_splits = mma.pop("waves", None), mma.pop("splits", None)
        self.mma_options = mma  # OSCAR_MMA (oscar.serve.settings): MmaLaunch fields (warps, stages, ...)
        self.launches: dict[int, Any] = {}
        # chunked prefill: a request's earlier chunks as BF16 rows until its prefill ends (_Stage), per slot
        self.stage: dict[int, _Stage] = {}
        stage_mib = int(getattr(current_state().get("settings"), "prefill_stage_mib", PREFILL_STAGE_MIB))
        row_bytes = 2 * pool.layer_num * pool.head_num * pool.head_dim * torch.finfo(pool.window_dtype).bits // 8
        self.stage_max_tokens = (stage_mib << 20) // row_bytes  # positions one request may stage
        chunk = getattr(getattr(model_runner, "server_args", None), "chunked_prefill_size", None)
        if chunk is not None and int(chunk) <= 0:  # one chunk per prompt: nothing to stage
            self.stage_max_tokens = 0
        self.stage_chunk = int(chunk) if chunk else 0
        route = os.environ.get(ENV_EXTEND_ROUTE)
        if route:
            if route not in ("pages", "dequant"):
                raise ValueError(f"{ENV_EXTEND_ROUTE}={route!r}: valid routes are 'pages' (the kernel reads the codes "
                                 "in place) and 'dequant' (the pages dequantized once, then SDPA)")
            self.extend_route = route
        if labels_requested():  # OSCAR_PROFILE_LABELS: the phases as torch.profiler ranges (oscar.serve.labels)
            install_labels(self)

    # -- metadata (once per forward, shared by the layers) -----------------------------------------

    @property
    def _eager_windows(self) -> bool:
        """Whether an all-window batch attends by plain SDPA in position order (CPU / torch kernels)."""
        return self.pool.kernels == "torch"

    def _decode_meta(self, fb: Any, out: Optional[DecodeMeta] = None) -> DecodeMeta:
        return decode_metadata(self.pool, self.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens,
                               fb.out_cache_loc, out)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Eager metadata of a forward (SGLang calls it outside CUDA graphs)."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.meta = None
            return
        if mode.is_decode():
            if self.stage_max_tokens:
                self.stage.clear()  # no prefill is between its chunks while a decode-only step runs
            self.meta = self._decode_meta(forward_batch)
            if self._eager_windows:
                cpu = forward_batch.seq_lens_cpu
                self.meta.seq_lens = [int(x) for x in (cpu if cpu is not None else forward_batch.seq_lens.cpu()).tolist()]
            return
        self.meta = self._extend_meta(forward_batch)

    def _extend_meta(self, fb: Any) -> _ExtendMeta:
        req = fb.req_pool_indices.long()
        dev = req.device
        seq_lens = [int(x) for x in (fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens.cpu()).tolist()]
        lens = [int(x) for x in fb.extend_seq_lens_cpu]
        prefix = [int(p) for p in (fb.extend_prefix_lens_cpu or [0] * len(lens))]
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        pos = (torch.cat([torch.arange(p, p + n, device=dev) for p, n in zip(prefix, lens)]) if lens
               else torch.empty(0, dtype=torch.int64, device=dev))
        counts = torch.tensor(lens, device=dev)
        slots = [int(r) for r in req.tolist()]
        hit = self._prefix_hits(slots, prefix)
        r2t = self.req_to_token_pool.req_to_token
        sink_ids = [self.pool.sink_ids(r2t, r, min(p, self.pool.sink)) if h and min(p, self.pool.sink) else None
                    for r, p, h in zip(slots, prefix, hit)]
        req_rows = torch.repeat_interleave(req, counts)
        seq_len = torch.repeat_interleave(torch.tensor(seq_lens, device=dev), counts)
        plan = self.pool.write_plan(fb.out_cache_loc.long(), req_rows, pos, seq_len)
        mixed = bool(getattr(fb.forward_mode, "is_mixed", lambda: False)())
        stage, _, keep = self._stage_plan(slots, prefix, lens, mixed)
        return _ExtendMeta(req=req_rows, pos=pos, seq_len=seq_len, starts=starts, lens=lens, prefix=prefix,
                           req_slots=slots, hit=hit, sink_ids=sink_ids, plan=plan, stage=stage, stage_keep=keep)

    def _stage_plan(self, slots: list[int], prefix: list[int], lens: list[int], mixed: bool = False
                    ) -> tuple[list[Optional[_Stage]], list[bool], list[bool]]:
        """Per request of an extend: its stage, whether its prefix is read from it, whether this chunk is appended.
        A request continues its stage when the stage holds exactly its prefix in the same slot generation; a prefix
        of at most the sink (a first chunk after an exact radix hit: BF16 rows) seeds a new one; a first chunk
        (no prefix) starts one. Every extend's rows are staged, since a forward does not know whether more chunks
        follow: stages not continued by the next forward are dropped then (at most one batch of chunk rows beside
        the chunked request's own), and a decode-only step drops them all. A request whose prompt outgrows
        ``stage_max_tokens`` reads the INT pages from there on (as without the stage). A mixed batch (SGLang's
        ``--enable-mixed-chunk``: decode rows ride along, and they must read the pool) stages nothing. Knowing
        SGLang's chunk size, a first chunk is staged only where SGLang may have cut it: the batch's last request
        (the prefill adder cuts the request that meets the budget, page-aligned, and adds nothing after it) in a batch
        that used its chunk budget to within a page; elsewhere no later chunk follows."""
        if not self.stage_max_tokens:  # OSCAR_PREFILL_STAGE_MIB=0: every chunk reads the cache
            return [], [], []
        if mixed:
            self.stage = {}
            return [], [], []
        gens = getattr(self.req_to_token_pool, "req_generation", None)
        old, self.stage = self.stage, {}
        stages, read, keep = [], [], []
        full = not self.stage_chunk or sum(lens) > self.stage_chunk - self.pool.page_size
        for j, (r, p, n) in enumerate(zip(slots, prefix, lens)):
            gen = int(gens[r]) if gens is not None else 0
            st = old.get(r)
            cont = st is not None and p > 0 and st.generation == gen and st.length == p
            fits = p + n <= self.stage_max_tokens and (cont or (full and j == len(lens) - 1))
            if not (cont or (fits and p <= self.pool.sink)):  # a new stage starts on no prefix or a BF16 sink
                stages.append(None), read.append(False), keep.append(False)
                continue
            if not cont:
                layers = self.pool.layer_num
                st = _Stage(generation=gen, length=p, k=[[] for _ in range(layers)], v=[[] for _ in range(layers)])
            if fits:
                st.length = p + n
                self.stage[r] = st
            stages.append(st), read.append(p > 0), keep.append(fits)
        return stages, read, keep

    def _staged_prefix(self, st: _Stage, i: int, layer_id: int, r2t: torch.Tensor, r: int, p: int, hit: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[Hkv, p, d]`` (BF16) of a request's prefix from its stage; a new stage on a prefix within the
        BF16 sink (after an exact radix hit) first takes those rows from the pool, exact."""
        if not st.k[i]:
            pk, pv = self.pool.cached_rows(layer_id, r2t, r, p, ring=not hit)
            st.k[i].append(pk.to(self.pool.window_dtype)), st.v[i].append(pv.to(self.pool.window_dtype))
        return torch.cat(st.k[i], dim=1), torch.cat(st.v[i], dim=1)

    def _prefix_hits(self, slots: list[int], prefix: list[int]) -> list[bool]:
        """Which extends start on a prefix this request slot's windows do not hold: the slot changed hands
        (SGLang's ``ReqToTokenPool.req_generation``) since its windows were written, so the prefix came from
        the radix tree. A later chunk of the same request keeps its slot and generation. Records the
        generation each slot's windows now hold."""
        gens = getattr(self.req_to_token_pool, "req_generation", None)
        out = []
        for r, p in zip(slots, prefix):
            gen = int(gens[r]) if gens is not None else 0
            out.append(p > 0 and self.pool.slot_generation.get(r) != gen)
            self.pool.slot_generation[r] = gen
        return out

    # CUDA graphs (decode): fixed buffers, bound outside the capture, filled by ops recorded inside it

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        dev = self.pool.device
        cols = self.pool.page_columns(self.req_to_token_pool.req_to_token).shape[1]
        i64 = lambda: torch.zeros(max_bs, dtype=torch.int64, device=dev)  # noqa: E731
        i32 = lambda: torch.zeros(max_bs, dtype=torch.int32, device=dev)  # noqa: E731
        self.graph = DecodeMeta(req=torch.full((max_bs,), self.pool.pad_slot, dtype=torch.int64, device=dev),
                                win_row=torch.full((max_bs,), self.pool.pad_slot, dtype=torch.int32, device=dev),
                                col=i64(),
                                sink_len=i32(), recent_len=i32(), int_len=i32(),
                                page_table=torch.zeros(max_bs, cols, dtype=torch.int32, device=dev), pos=i64(),
                                blocks=self.pool.block_meta_buffers(max_bs))

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Outside the capture / before a replay: the layers read views of the fixed buffers."""
        if self.graph is None or not forward_batch.forward_mode.is_decode():
            self.init_forward_metadata(forward_batch)
            return
        B = int(forward_batch.batch_size)
        g = self.graph
        if self.stage_max_tokens:
            self.stage.clear()
        self.meta = DecodeMeta(req=g.req[:B], win_row=g.win_row[:B], col=g.col[:B], sink_len=g.sink_len[:B],
                               recent_len=g.recent_len[:B], int_len=g.int_len[:B], page_table=g.page_table[:B],
                               pos=g.pos[:B], blocks=None if g.blocks is None else g.blocks.view(B))

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Inside the capture (recorded, so each replay recomputes it): the decode metadata into the buffers."""
        if self.graph is not None and forward_batch.forward_mode.is_decode():
            self._decode_meta(forward_batch, self.graph)

    # -- helpers -----------------------------------------------------------------------------------

    @staticmethod
    def _check_layer(layer: Any) -> None:
        if layer.qk_head_dim != layer.v_head_dim:
            raise NotImplementedError(f"--attention-backend oscar needs qk_head_dim == v_head_dim, got "
                                      f"{layer.qk_head_dim} and {layer.v_head_dim}")
        if getattr(layer, "sliding_window_size", None) not in (None, -1):
            raise NotImplementedError(f"--attention-backend oscar does not support sliding-window layers "
                                      f"(layer {layer.layer_id}: window {layer.sliding_window_size})")
        if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
            raise NotImplementedError(f"--attention-backend oscar does not support logit soft-capping "
                                      f"(layer {layer.layer_id}: logit_cap {layer.logit_cap})")

    def _to_folded(self, o: torch.Tensor, layer_id: int) -> torch.Tensor:
        """``[N, H, d]`` attention output -> ``(o - mu_V) @ R_V`` per KV head (the folded ``o_proj``'s frame)."""
        vt = self.pool.transforms[layer_id - self.pool.start_layer][1]
        n, h, d = o.shape
        hkv = vt.R.shape[0]
        og = o.float().reshape(n, hkv, h // hkv, d)
        if vt.mu is not None:
            og = og - vt.mu[None, :, None, :]
        return torch.einsum("nkpd,kde->nkpe", og, vt.R).reshape(n, h, d).to(o.dtype)

    def _num_splits(self, batch: int, hkv: int) -> Optional[int]:
        """Split-K of the mma kernel per batch size, from the server's context length (fixed, so that the
        captured grid fits every replay)."""
        if self.pool.layout != "mma" or self.pool.kernels == "torch":  # the twin has no split-K
            return None
        if batch not in self.num_splits:
            from oscar.kernels.decode_mma import default_num_splits  # local: keeps triton out of import time

            cap = int(self.req_to_token_pool.req_to_token.shape[1])
            props = torch.cuda.get_device_properties(self.pool.device)
            self.num_splits[batch] = self.mma_splits or default_num_splits(
                batch, hkv, cap, num_warps=self.mma_options.get("warps", 8),
                num_sms=int(props.multi_processor_count), ctas_per_sm=self.mma_options.get("min_blocks", 2),
                waves=self.mma_waves)
        return self.num_splits[batch]

    def _launch(self, batch: int, hkv: int) -> Optional[Any]:
        """The mma kernel's launch for this batch size (``OSCAR_MMA`` with the split-K of ``_num_splits``); None where
        the pages are rows or the kernels the torch twin (their defaults)."""
        splits = self._num_splits(batch, hkv)
        if splits is None:
            return None
        if batch not in self.launches:
            self.launches[batch] = MmaLaunch(num_splits=splits, **self.mma_options)
        return self.launches[batch]

    # -- forwards ----------------------------------------------------------------------------------

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        self._check_layer(layer)
        m: _ExtendMeta = self.meta
        H, Hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        q3 = q.view(-1, H, d)
        kb = k.view(-1, Hkv, d).to(self.pool.window_dtype)
        vb = v.view(-1, Hkv, d).to(self.pool.window_dtype)
        out = torch.empty_like(q3)
        r2t = self.req_to_token_pool.req_to_token
        li = self.pool._local(layer.layer_id)
        for j, (start, n, p, r, hit, ids) in enumerate(zip(m.starts, m.lens, m.prefix, m.req_slots, m.hit,
                                                           m.sink_ids)):
            if ids is not None:  # a prefix-cache hit: its BF16 sink rows from the sink store
                self.pool.restore_sink(layer.layer_id, r, ids)
            st = m.stage[j] if m.stage else None
            if st is None and self._pages_in_place(layer.layer_id, p, n, hit):
                out[start : start + n] = self._extend_over_pages(q3[start : start + n], kb[start : start + n],
                                                                 vb[start : start + n], layer, r2t, r, p, hit)
                continue
            qs = q3[start : start + n].movedim(0, 1)  # [H, n, d]
            ks = kb[start : start + n].movedim(0, 1).to(q.dtype)
            vs = vb[start : start + n].movedim(0, 1).to(q.dtype)
            mask = None
            if p > 0:
                if st is not None:  # its own earlier chunks as one prefill reads them (BF16, the prefill stage)
                    pk, pv = self._staged_prefix(st, li, layer.layer_id, r2t, r, p, hit)
                else:  # an earlier chunk within the windows (or per-channel keys): its rows as the cache holds them
                    pk, pv = self.pool.cached_rows(layer.layer_id, r2t, r, p, ring=not hit)
                ks = torch.cat([pk.to(q.dtype), ks], dim=1)
                vs = torch.cat([pv.to(q.dtype), vs], dim=1)
                del pk, pv  # a long prefix's float32 rows: gone before the attention allocates
                # query i (position p + i) sees keys 0..p + i: causal aligned to the bottom right, which the flash
                # and memory-efficient kernels take as a bias object on CUDA (a boolean mask would not reach them)
                mask = causal_lower_right(n, p + n) if q.is_cuda else \
                    torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(p)
            if q.is_cuda:  # the flash / cuDNN kernels one KV head at a time (no H/Hkv copies of a long prefix)
                o = gqa_attention(q3[start : start + n], ks, vs, mask if mask is not None else causal_lower_right(n, n),
                                  layer.scaling)
            else:  # SGLang's torch_native computation
                o = scaled_dot_product_attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=mask,
                                                 enable_gqa=H != Hkv, scale=layer.scaling, is_causal=mask is None)
                o = o.squeeze(0).movedim(1, 0)
            out[start : start + n] = self._to_folded(o, layer.layer_id) if self.folded else o
            if st is not None and m.stage_keep[j]:  # the next chunk of this prompt reads these rows in BF16
                st.k[li].append(kb[start : start + n].movedim(0, 1).contiguous())
                st.v[li].append(vb[start : start + n].movedim(0, 1).contiguous())
        if save_kv_cache:
            self.pool.write(layer.layer_id, kb, vb, forward_batch.out_cache_loc.long(), m.req, m.pos, m.seq_len,
                            plan=m.plan)
        return out.reshape(q3.shape[0], H * d)

    def _prefix_split(self, p: int, hit: bool) -> tuple[int, int]:
        """``(n_sink, q_end)`` of a cached prefix of ``p`` positions: sink ``[0, n_sink)``, quantized pages
        ``[S0, q_end)``, ring ``[q_end, p)``. A later chunk's ring holds the last ``W`` positions; a hit's ring
        holds nothing of the prefix (the match cap leaves the window to the extend), so its pages run to ``p``."""
        S0, W = self.pool.sink, self.pool.recent
        return min(p, S0), max(S0, p if hit else p - W)

    def _pages_in_place(self, layer_id: int, p: int, n: int, hit: bool) -> bool:
        """Whether this extend of ``n`` tokens reads its prefix's quantized rows in place (``_extend_over_pages``):
        up to ``extend_in_place_max`` tokens (a hit's window, short chunks). A longer extend dequantizes the prefix
        once (``cached_rows``), a cost of at most ``1 / extend_in_place_max`` prefix rows per query beside its
        attention, and keeps SGLang's flash SDPA for its long causal part; per-channel key layers
        (``pool.key_blocks``) and rope-centered keys under the Triton kernels (the kernel does not add their offsets;
        the twin would build a float bias per query and row) keep ``cached_rows`` too. With ``extend_route="dequant"``
        on the Triton kernels any length does (the pages dequantized once by one Triton pass, then flash SDPA: the
        long causal part stays on the flash kernel, without ``cached_rows``' torch dequantization)."""
        blocks = getattr(self.pool, "key_blocks", None)
        i = layer_id - self.pool.start_layer
        per_channel = bool(blocks) and bool(blocks[i])
        rope_on_kernel = self.pool.kernels == "triton" and self.pool.transforms[i][0].rope_centered
        any_length = self.extend_route == "dequant" and self.pool.kernels == "triton"
        return (p > 0 and (n <= self.extend_in_place_max or any_length) and not per_channel and not rope_on_kernel
                and self._prefix_split(p, hit)[1] > self.pool.sink)

    def _extend_over_pages(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, r2t: torch.Tensor,
                           r: int, p: int, hit: bool) -> torch.Tensor:
        """One request's extend ``[n, H, d]`` over its cached prefix with quantized rows: the BF16 sink and ring
        rows of the prefix and the chunk's own rows (causal) beside the pages read in place
        (``oscar.cache.extend.extend_attention``: the Triton kernel or its twin, in the pages' rotated frame)."""
        pool, i = self.pool, layer.layer_id - self.pool.start_layer
        n_sink, q_end = self._prefix_split(p, hit)
        key = (r, pool.key_blocks[i] if getattr(pool, "key_blocks", None) else 0)
        rows = self.meta.rows if isinstance(self.meta, _ExtendMeta) else {}
        if key not in rows:  # the same in every layer of the forward (per-channel layers: block slots)
            rows[key] = (pool.page_table(r2t, torch.tensor([r], device=r2t.device))[0],
                         pool.ring_columns(i, torch.arange(q_end, p, device=q.device), p))
        table, ring = rows[key]
        bk = torch.cat([pool.win_k[i][r, :, :n_sink], pool.win_k[i][r][:, ring], k.movedim(0, 1)], dim=1)
        bv = torch.cat([pool.win_v[i][r, :, :n_sink], pool.win_v[i][r][:, ring], v.movedim(0, 1)], dim=1)
        kt, vt = pool.transforms[i]
        return extend_attention(q, pool.k_pages[i], pool.v_pages[i], table, q_end - pool.sink, bk, bv,
                                n_sink + p - q_end, kt, vt, sm_scale=layer.scaling,
                                output_frame="rotated" if self.folded else "original", int_pos0=pool.sink,
                                backend=pool.kernels, route=self.extend_route)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        self._check_layer(layer)
        m: DecodeMeta = self.meta
        H, Hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, H, d)
        pool, i = self.pool, layer.layer_id - self.pool.start_layer
        if save_kv_cache:
            pool.write_decode(layer.layer_id, k.view(-1, Hkv, d), v.view(-1, Hkv, d),
                              forward_batch.out_cache_loc.long(), m.req, m.col, m.pos, blocks=m.blocks)
        if m.seq_lens is not None and max(m.seq_lens, default=0) <= pool.sink + pool.recent:
            out = self._decode_windows(q3, layer, m, i)
            if self.folded:
                out = self._to_folded(out, layer.layer_id)
            return out.reshape(q3.shape[0], H * d)
        segments = Segments(m.page_table, pool.lengths(i, m.int_len, m.recent_len, m.blocks)[0],
                            **self._window_segments(m, i),
                            int_pos0=pool.sink if pool.rope_centered else None)  # INT row t: token S0 + t
        out = pool.format.attend(q3, (pool.k_pages[i], pool.v_pages[i]), segments, pool.transforms[i],
                                 sm_scale=layer.scaling, output_frame="rotated" if self.folded else "original",
                                 backend=pool.kernels, launch=self._launch(q3.shape[0], Hkv))
        return out.reshape(q3.shape[0], H * d)

    def _window_segments(self, m: DecodeMeta, i: int) -> dict[str, Any]:
        """The pool's sink and ring buffers ``[R + 1, Hkv, S, d]`` as they are, read in place at row ``win_row[b]``
        (the request slot; no gather)."""
        sk, sv = self.pool.sink_view(i)
        rk, rv = self.pool.ring_view(i)
        segs = dict(recent_k=rk, recent_v=rv, recent_len=self.pool.lengths(i, m.int_len, m.recent_len, m.blocks)[1],
                    window_rows=m.win_row)
        if self.pool.sink:
            segs.update(sink_k=sk, sink_v=sv, sink_len=m.sink_len)
        return segs

    def _decode_windows(self, q3: torch.Tensor, layer: Any, m: DecodeMeta, i: int) -> torch.Tensor:
        """Decode attention while every row is in the BF16 windows: keys in position order, one SDPA per
        request (as ``torch_native``)."""
        pool = self.pool
        H, Hkv = layer.tp_q_head_num, layer.tp_k_head_num
        out = torch.empty_like(q3)
        for b, L in enumerate(m.seq_lens or []):
            r = int(m.req[b])
            cols = pool.window_index(torch.arange(L, device=q3.device))
            ks = pool.win_k[i][r][:, cols].to(q3.dtype)
            vs = pool.win_v[i][r][:, cols].to(q3.dtype)
            qs = q3[b : b + 1].movedim(0, 1)  # [H, 1, d]
            o = scaled_dot_product_attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), enable_gqa=H != Hkv,
                                             scale=layer.scaling, is_causal=False)
            out[b] = o.squeeze(0).movedim(1, 0)[0]
        return out

    def support_triton(self) -> bool:
        return False


__all__ = ["DecodeMeta", "ENV_EXTEND_ROUTE", "OscarAttnBackend", "decode_metadata"]

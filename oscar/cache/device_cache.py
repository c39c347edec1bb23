"""Device-resident decode caches that a CUDA graph can capture: static BF16 and paged OSCAR INT2/INT4.

`oscar.cache.torch_cache.OscarCache` keeps page lists and segment lengths on the host and loops over the
sequences of a batch, so a decode step cannot be captured in a CUDA graph. The caches here keep
everything a step reads or writes on the device, with shapes fixed when the cache is built:

- `StaticBF16Cache`: K/V ``[B, Hkv, capacity, d]`` per layer; a step writes the new token at
  ``pos`` and attends over the first ``span`` positions with torch SDPA (the query heads of a KV
  head become the query rows: no mask, no KV copy; the SDPA backend is the caller's choice).
- `DeviceOscarCache`: the three segments of docs/DESIGN.md (BF16 sink ``[B, Hkv, S0, d]``, packed
  pages through `oscar.cache.paged` in the row or the fragment-order (mma) page layout, BF16 recent window
  ``[B, Hkv, W, d]`` as a ring). Each sequence owns a fixed-capacity page table row (``[B, M]`` int32
  on the device, pages disjoint); one extra page takes the writes of sequences that have nothing to
  demote. Every index of a step (sink slot, ring slot, demotion slot, segment lengths) is computed on
  the device from the position vector ``pos``, and the demotion is one
  `oscar.cache.paged.rotate_quantize_pack_kv` launch for the whole batch, so the step has no host
  synchronisation and no data-dependent shapes.

Window convention (the same as `oscar.cache.torch_cache`): query ``t`` sees ``[0, S0)`` in BF16, ``[S0, t-W]``
quantized and ``(t-W, t]`` in BF16; the step demotes the ring's oldest row (token ``t-W``) before
the new token takes its slot.

Use: `register()` once, build the model with attention implementation `ATTN_IMPLEMENTATION`, fill
the cache (`import_prefill` from a plain forward's keys/values, or `fill_random` for timing), then
`decode_step(model, cache, tokens)`; `GraphedDecoder` captures that step in a CUDA graph. Sequences
of a batch have equal lengths (no padding).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Optional, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from oscar.cache import formats, paged
from oscar.cache.formats import BF16Format, CacheFormat
from oscar.cache.attention import plain_causal_attention, set_pending, take_pending

ATTN_IMPLEMENTATION = "oscar_device"


def register() -> None:
    """Register the attention function with transformers (idempotent). No mask function is
    registered, so transformers builds no attention mask for this implementation."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, device_attention_forward)


def enable(model: torch.nn.Module) -> str:
    """Switch ``model`` to the device-cache attention; returns the previous implementation name."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return previous


def device_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Registered attention: a device cache layer attends and writes; without one (a prefill through a
    plain cache) causal attention over the keys given."""
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(f"sliding-window attention (window {kwargs['sliding_window']}) is not supported")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    layer = take_pending(key)
    if layer is None:
        return plain_causal_attention(module, query, key, value, attention_mask, scale), None
    if query.shape[2] != 1:
        raise ValueError(f"device caches take one decode token per sequence, got {query.shape[2]}; "
                         "prefill through a plain cache and import_prefill")
    out = layer.attend_and_write(query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


class _DeviceLayer(CacheLayerMixin):
    """One decoder layer's view of a device cache: records K/V for the attention call that follows."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: "DeviceCache", layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Storage is allocated when the cache is built."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the new keys/values for the attention call that follows (it writes and attends)."""
        set_pending(self, key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, *args: Any) -> tuple[int, int]:
        """(kv_length, kv_offset); no mask is built for this attention implementation."""
        return self.cache.seq_len + 1, 0

    def get_seq_length(self, *args: Any) -> int:
        """Tokens per sequence (host mirror of ``pos``)."""
        return self.cache.seq_len

    def get_max_length(self) -> int:
        """Fixed capacity in tokens."""
        return self.cache.capacity

    def reset(self) -> None:
        """Device caches are reset by building a new one."""
        raise NotImplementedError("build a new device cache instead of resetting one")

    def attend_and_write(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention output ``[B, H, 1, d]`` of the decode token, after writing it."""
        return self.cache.attend_and_write(self.layer_idx, query, key, value, scale)


class DeviceCache(Cache):
    """Base of the device caches: per-sequence position vector ``pos`` (int64 ``[B]``, on the device)
    and its host mirror ``seq_len`` (all sequences have the same length)."""

    def __init__(self, num_layers: int, batch: int, capacity: int, device: torch.device) -> None:
        if batch <= 0 or capacity <= 0:
            raise ValueError(f"batch={batch} and capacity={capacity} must be positive")
        super().__init__(layers=[_DeviceLayer(self, i) for i in range(num_layers)])
        self.batch, self.capacity, self.device = batch, capacity, torch.device(device)
        self.pos = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self.seq_len = 0

    def set_length(self, n: int) -> None:
        """Every sequence holds ``n`` tokens (after a prefill import or a random fill)."""
        if not 0 <= n < self.capacity:
            raise ValueError(f"length {n} must lie in [0, capacity={self.capacity})")
        self.pos.fill_(n)
        self.seq_len = n

    def advance(self) -> None:
        """One token more per sequence (device op; call once per step after the forward)."""
        self.pos.add_(1)
        self.seq_len += 1

    def check_room(self, steps: int) -> None:
        """Refuse (on the host, before capture or replay) a run that would pass the capacity."""
        if self.seq_len + steps > self.capacity:
            raise ValueError(f"{steps} more steps from length {self.seq_len} pass the capacity {self.capacity}")

    def prepare(self) -> None:
        """Per-step device indices shared by every layer (call once per step before the forward)."""

    def step_state(self) -> list[torch.Tensor]:
        """Tensors a step reads after writing them in the same step's slots (restored after warm-up steps)."""
        return []

    def attend_and_write(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scale: float) -> torch.Tensor:
        raise NotImplementedError

    def storage(self) -> list[torch.Tensor]:
        """Every tensor that holds cached tokens (for byte accounting)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes allocated for cached tokens, all layers, K and V."""
        return sum(t.numel() * t.element_size() for t in self.storage())


# ----------------------------------------------------------------------------------------------
# static BF16


class StaticBF16Cache(DeviceCache):
    """BF16 (model dtype) K/V ``[B, Hkv, capacity, d]`` per layer; decode attention with torch SDPA."""

    def __init__(self, *, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.bfloat16, device: Any = "cpu", fmt: Optional[BF16Format] = None) -> None:
        super().__init__(num_layers, batch, capacity, device)
        self.format = fmt if fmt is not None else BF16Format(name="bf16")
        self.format.check_served("device")
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.hkv, self.d = num_kv_heads, head_dim
        self.span: Optional[int] = None  # positions attended; None: seq_len + 1 (read on the host)
        self.gqa = "rows"  # rows: query heads of a KV head as query rows; enable_gqa: SDPA's GQA flag

    def storage(self) -> list[torch.Tensor]:
        return self.k + self.v

    def fill_random(self, length: int, generator: Optional[torch.Generator] = None) -> None:
        """Random keys/values in every slot (exact for timing) and every sequence at ``length``."""
        for t in self.storage():
            t.normal_(0.0, 1.0, generator=generator)
        self.set_length(length)

    def import_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys/values ``[B, Hkv, L, d]`` of a prompt (all layers imported, then ``set_length(L)``)."""
        n = k.shape[2]
        self.k[layer][:, :, :n] = k.to(self.k[layer].dtype)
        self.v[layer][:, :, :n] = v.to(self.v[layer].dtype)

    def attend_and_write(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scale: float) -> torch.Tensor:
        kc, vc = self.k[layer], self.v[layer]
        idx = self.pos[:1]  # equal lengths: one write position for the batch
        kc.index_copy_(2, idx, key.to(kc.dtype))
        vc.index_copy_(2, idx, value.to(vc.dtype))
        span = self.seq_len + 1 if self.span is None else self.span
        b, h, _, d = query.shape
        q = query.to(kc.dtype)
        if self.gqa == "rows":
            out = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(b, self.hkv, h // self.hkv, d), kc[:, :, :span], vc[:, :, :span], scale=scale)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, kc[:, :, :span], vc[:, :, :span], scale=scale, enable_gqa=True)
        return out.reshape(b, h, 1, d).to(query.dtype)


# ----------------------------------------------------------------------------------------------
# paged OSCAR


class DeviceOscarCache(DeviceCache):
    """BF16 sink + packed INT pages (`oscar.cache.paged`) + BF16 recent ring, all indices on the device.

    ``transforms`` is one ``(kt, vt)`` pair of `oscar.cache.paged.HeadTransform` per layer (float32 on the
    device). ``quant_capacity`` is the number of quantized tokens a sequence can hold; the page table
    gets ``ceil(quant_capacity / page_size)`` pages per sequence (``shuffle_pages``: a seeded
    permutation of the pool instead of consecutive pages, for tests of the indirection).

    ``fmt`` is the paged cache format (`oscar.cache.formats`, ``fmt.paged``): its windows, bits, group and page
    size, and how its rows are written (``fmt.write``) and read (``fmt.attend``). ``layout``: ``"mma"`` stores
    K/V pages in the fragment-order layouts ``mma_k``/``mma_v`` of `oscar.core.quant` (demotion through the
    Triton writer that stores that layout, attention through the v9/v10 CUDA kernel `oscar.kernels.decode_mma`;
    INT2 or INT4 with one group per row, head_dim 64/128, pages of 16k tokens); ``"rows"`` the token-row layout
    (v8 Triton kernel; any format); ``"auto"`` (default) resolves to ``"mma"`` on a CUDA device where the format
    allows it, else ``"rows"`` (``fmt.resolve_layout``). The torch backend reads and writes both layouts (the
    twin of either path).
    """

    def __init__(self, fmt: Any, *, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, quant_capacity: int,
                 transforms: Sequence[tuple[paged.HeadTransform, paged.HeadTransform]],
                 dtype: torch.dtype = torch.bfloat16, device: Any = "cpu", backend: str = "triton",
                 shuffle_pages: bool = False, launch: Any = None, layout: str = "auto") -> None:
        fmt.check_served("device")
        self.format = fmt
        sink, recent, page_size = fmt.sink, fmt.recent, fmt.page_size
        if sink < 0 or recent < 1:
            raise ValueError(f"sink={sink} must be at least 0 and recent={recent} at least 1 on the device cache")
        if len(transforms) != num_layers:
            raise ValueError(f"{len(transforms)} layer transforms for {num_layers} layers")
        # per-channel key layers (HeadTransform.block = T): K pages of blocks, a ring of W + T - 1 rows
        self.blocks = [int(kt.block) for kt, _ in transforms]
        for layer, block in enumerate(self.blocks):
            try:
                fmt.check_key_block(block)
            except ValueError as exc:
                raise ValueError(f"layer {layer}: {exc}") from exc
            if block:
                paged.check_channel_ring(recent, block)
        if len({b for b in self.blocks if b}) > 1:
            raise ValueError(f"per-channel key layers with several blocks {sorted(set(self.blocks))}; one cache takes one")
        self.key_block = max(self.blocks, default=0)
        super().__init__(num_layers, batch, sink + recent + quant_capacity, device)
        self.sink, self.recent, self.page_size, self.backend = sink, recent, page_size, backend
        self.hkv, self.d, self.bits, self.group_size = num_kv_heads, head_dim, fmt.bits, fmt.group_size
        self.launch = launch  # oscar.kernels.launch.RowsLaunch / MmaLaunch for the layout's kernel (None: its default)
        self.layout = fmt.resolve_layout(layout, head_dim, device)
        pages_per_seq = max(1, -(-quant_capacity // page_size))
        num_pages = batch * pages_per_seq + 1  # the last page takes the writes of non-demoting sequences
        self.trash_slot = (num_pages - 1) * page_size
        order = torch.arange(batch * pages_per_seq, dtype=torch.int32)
        if shuffle_pages:
            order = order[torch.randperm(order.numel(), generator=torch.Generator().manual_seed(0))]
        self.page_table = order.reshape(batch, pages_per_seq).to(self.device)
        self.transforms = [(self._on_device(kt), self._on_device(vt)) for kt, vt in transforms]
        pairs = [fmt.new_pages(num_pages, num_kv_heads, head_dim, self.device, self.layout, key_block=block)
                 for block in self.blocks]
        self.k_pages = [k for k, _ in pairs]
        self.v_pages = [v for _, v in pairs]
        # BF16 rows of a layer in one buffer [2 (K, V), B, Hkv, S0 + ring, d] (ring W, or W + T - 1 for per-channel
        # keys): sink and ring are views, so a step writes its new token (sink or ring slot) with one indexed store
        self.bf16 = [torch.zeros(2, batch, num_kv_heads, sink + recent + max(block - 1, 0), head_dim, dtype=dtype,
                                 device=self.device) for block in self.blocks]
        self.sink_k = [buf[0, :, :, :sink] for buf in self.bf16]
        self.sink_v = [buf[1, :, :, :sink] for buf in self.bf16]
        self.recent_k = [buf[0, :, :, sink:] for buf in self.bf16]
        self.recent_v = [buf[1, :, :, sink:] for buf in self.bf16]
        self._rows = torch.arange(batch, device=self.device)
        self.step: dict[str, torch.Tensor] = {}

    def _on_device(self, t: paged.HeadTransform) -> paged.HeadTransform:
        return t.to(self.device)

    def step_state(self) -> list[torch.Tensor]:
        """The BF16 buffers: a step demotes the ring row that it then overwrites with the new token, so a
        repeated step would demote the new token; everything else a step writes, it rewrites identically."""
        return self.bf16

    def storage(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for pages in self.k_pages + self.v_pages:
            out += [pages.codes, pages.scale, pages.zero]
        return out + self.bf16

    def _slots(self, qpos: torch.Tensor) -> torch.Tensor:
        """Slots (int64) of quantized positions ``qpos`` ``[B, n]`` of every sequence."""
        page = qpos // self.page_size
        return self.page_table[self._rows[:, None], page].long() * self.page_size + qpos % self.page_size

    # -- filling ---------------------------------------------------------------------------------

    def import_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys/values ``[B, Hkv, L, d]`` (original frame) of a prompt into the three segments (the
        middle quantized through `oscar.cache.paged.rotate_quantize_pack_kv`); then ``set_length(L)``."""
        B, _, L, _ = k.shape
        S0, W = self.sink, self.recent
        if L + 1 > self.capacity:
            raise ValueError(f"a prompt of {L} tokens leaves no room in a cache of capacity {self.capacity}")
        dt = self.sink_k[layer].dtype
        k, v = k.to(dt), v.to(dt)  # quantize the rows as stored (as the host cache demotes them)
        ns = min(L, S0)
        self.sink_k[layer][:, :, :ns] = k[:, :, :ns].to(dt)
        self.sink_v[layer][:, :, :ns] = v[:, :, :ns].to(dt)
        if self.blocks[layer]:
            self._import_channel(layer, k, v)
            return
        nq = max(0, L - S0 - W)
        self._write_history(layer, k, v, nq)
        start = max(S0, L - W)
        if L > start:
            ring = (torch.arange(start, L, device=self.device) - S0) % W
            self.recent_k[layer][:, :, ring] = k[:, :, start:L].to(dt)
            self.recent_v[layer][:, :, ring] = v[:, :, start:L].to(dt)

    def _write_history(self, layer: int, k: torch.Tensor, v: torch.Tensor, nq: int) -> None:
        """Quantize the prefill rows `[S0, S0 + nq)` of `k`/`v` `[B, Hkv, L, d]` into the layer's pages."""
        if nq <= 0:
            return
        B, S0 = k.shape[0], self.sink
        qpos = torch.arange(nq, device=self.device)[None, :].expand(B, -1)
        rows_k = k[:, :, S0:S0 + nq].transpose(1, 2).reshape(B * nq, self.hkv, self.d).contiguous()
        rows_v = v[:, :, S0:S0 + nq].transpose(1, 2).reshape(B * nq, self.hkv, self.d).contiguous()
        self.format.write(rows_k, rows_v, self._slots(qpos).reshape(-1), (self.k_pages[layer], self.v_pages[layer]),
                          self.transforms[layer], backend=self.backend, positions=S0 + qpos.reshape(-1))

    def _import_channel(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """`import_prefill` of a per-channel key layer: whole blocks into the pages, the rest into the ring at the
        slots of `oscar.cache.paged.channel_ring_slots`."""
        L = k.shape[2]
        S0, W, T = self.sink, self.recent, self.blocks[layer]
        n = max(0, L - S0)
        nq = max(0, (n - W) // T) * T
        self._write_history(layer, k, v, nq)
        if n > nq:
            r = torch.arange(nq, n, device=self.device)
            ring = paged.channel_ring_slots(r, torch.tensor(n, device=self.device), W, T)
            self.recent_k[layer][:, :, ring] = k[:, :, S0 + nq:L]
            self.recent_v[layer][:, :, ring] = v[:, :, S0 + nq:L]

    def fill_random(self, length: int, generator: Optional[torch.Generator] = None) -> None:
        """Random codes, scales, zeros and BF16 rows in every slot (exact for timing: the kernels do the
        same work on any bytes) and every sequence at ``length``."""
        for pages in self.k_pages + self.v_pages:
            pages.codes.random_(0, 256, generator=generator)
            pages.scale.uniform_(0.005, 0.05, generator=generator)
            pages.zero.uniform_(-0.2, -0.1, generator=generator)
        for t in self.bf16:
            t.normal_(0.0, 1.0, generator=generator)
        self.set_length(length)

    # -- a decode step ---------------------------------------------------------------------------

    def prepare(self) -> None:
        """Indices of this step, from ``pos`` (the new token's position), shared by all layers."""
        S0, W = self.sink, self.recent
        p = self.pos
        r = p - S0
        demote = r >= W
        qpos = (r - W).clamp(min=0)
        max_q = self.page_table.shape[1] * self.page_size - 1
        slot = self._slots(qpos.clamp(max=max_q)[:, None])[:, 0]
        ring_idx = r.clamp(min=0) % W
        self.step = {
            "write_idx": torch.where(p < S0, p, S0 + ring_idx),  # slot of the new token in the BF16 buffer
            "ring_idx": ring_idx,
            "demote_slot": torch.where(demote, slot, torch.full_like(slot, self.trash_slot)),
            "demote_pos": S0 + qpos,  # token position of the demoted row (rope-centered keys)
            "sink_len": (p + 1).clamp(max=S0).to(torch.int32),
            "recent_len": (r + 1).clamp(min=0, max=W).to(torch.int32),
            "int_len": (r + 1 - W).clamp(min=0).to(torch.int32),
        }
        T = self.key_block
        if T:  # per-channel key layers: demotion by whole blocks (docs/DESIGN.md "Per-channel key pages")
            ch = paged.channel_ring(r.clamp(min=0), W, T)
            in_sink = r < 0
            demote_b = ch["demote"] & ~in_sink
            trash = self.trash_slot + torch.arange(T, device=self.device)
            qslots = self._slots(ch["qpos"].clamp(max=max_q))
            self.step.update({
                "ch_write_idx": torch.where(in_sink, p, S0 + ch["write"]),
                "ch_src": S0 + ch["src"],  # [B, T] rows of the demoted block in the BF16 buffer
                "ch_slots": torch.where(demote_b[:, None], qslots, trash[None, :]).reshape(-1),
                "ch_pos": (S0 + ch["qpos"]).reshape(-1),
                "ch_move_src": S0 + ch["move_src"],
                "ch_move_dst": S0 + ch["move_dst"],
                "ch_demote": demote_b,
                "ch_recent_len": torch.where(in_sink, 0, ch["recent_len"]).to(torch.int32),
                "ch_int_len": torch.where(in_sink, 0, ch["int_len"]).to(torch.int32),
            })

    def attend_and_write(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         scale: float) -> torch.Tensor:
        if not self.step:
            raise RuntimeError("DeviceOscarCache.prepare() must run before the forward of each step")
        st = self.step
        if self.blocks[layer]:
            return self._attend_and_write_channel(layer, query, key, value, scale)
        kt, vt = self.transforms[layer]
        rk, rv = self.recent_k[layer], self.recent_v[layer]
        # 1. demote the ring's oldest row (where the ring is full) before the new token takes its slot
        pages = (self.k_pages[layer], self.v_pages[layer])
        self.format.write(rk, rv, st["demote_slot"], pages, (kt, vt), src_index=st["ring_idx"], backend=self.backend,
                          positions=st["demote_pos"])
        # 2. write the new token into its sink or ring slot
        buf = self.bf16[layer]
        buf[0, self._rows, :, st["write_idx"]] = key[:, :, 0].to(buf.dtype)
        buf[1, self._rows, :, st["write_idx"]] = value[:, :, 0].to(buf.dtype)
        # 3. attend over the three segments
        return self._attend(layer, query, scale, st["int_len"], st["recent_len"])

    def _attend(self, layer: int, query: torch.Tensor, scale: float, int_len: torch.Tensor,
                recent_len: torch.Tensor) -> torch.Tensor:
        kt, vt = self.transforms[layer]
        sink = {} if self.sink == 0 else dict(sink_k=self.sink_k[layer], sink_v=self.sink_v[layer],
                                              sink_len=self.step["sink_len"])
        segments = paged.Segments(self.page_table, int_len, recent_k=self.recent_k[layer],
                                  recent_v=self.recent_v[layer], recent_len=recent_len,
                                  int_pos0=self.sink if kt.rope_centered else None, **sink)
        out = self.format.attend(query[:, :, 0], (self.k_pages[layer], self.v_pages[layer]), segments, (kt, vt),
                                 sm_scale=scale, output_frame="original", backend=self.backend, launch=self.launch)
        return out[:, :, None, :]

    def _attend_and_write_channel(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  scale: float) -> torch.Tensor:
        """Decode step of a per-channel key layer: demote a whole block where the ring completes one (every sequence
        writes ``T`` rows, into the trash page where nothing demotes: static shapes), move the ring's tail into the
        freed slots, write the new token, attend (docs/DESIGN.md "Per-channel key pages")."""
        st = self.step
        buf = self.bf16[layer]
        B, T = self.batch, self.blocks[layer]
        bi = self._rows[:, None].expand(B, T)
        rows_k = buf[0][bi, :, st["ch_src"]].reshape(B * T, self.hkv, self.d)  # [B, T, Hkv, d] gathered
        rows_v = buf[1][bi, :, st["ch_src"]].reshape(B * T, self.hkv, self.d)
        self.format.write(rows_k, rows_v, st["ch_slots"], (self.k_pages[layer], self.v_pages[layer]),
                          self.transforms[layer], backend=self.backend, positions=st["ch_pos"])
        if T > 1:
            bm = self._rows[:, None].expand(B, T - 1)
            moved = buf[:, bm, :, st["ch_move_src"]]  # [B, T-1, 2, Hkv, d]
            kept = buf[:, bm, :, st["ch_move_dst"]]
            buf[:, bm, :, st["ch_move_dst"]] = torch.where(st["ch_demote"][:, None, None, None, None], moved, kept)
        buf[0, self._rows, :, st["ch_write_idx"]] = key[:, :, 0].to(buf.dtype)
        buf[1, self._rows, :, st["ch_write_idx"]] = value[:, :, 0].to(buf.dtype)
        return self._attend(layer, query, scale, st["ch_int_len"], st["ch_recent_len"])


# ----------------------------------------------------------------------------------------------
# driving the model


def forward_kwargs(model: torch.nn.Module) -> set[str]:
    inner = getattr(model, "model", model)
    try:
        return set(inspect.signature(type(inner).forward).parameters)
    except (TypeError, ValueError):
        return set()


def prefill(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Plain causal forward of a prompt ``[B, L]`` (no device cache): last-position logits ``[B, V]``
    and each layer's keys/values ``[B, Hkv, L, d]`` (post-RoPE), to import into a device cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    key = "cache" if "cache" in forward_kwargs(model) else "past_key_values"
    out = model(input_ids=input_ids, use_cache=True, **{key: cache})
    kv = []
    for layer in cache.layers:
        kv.append((layer.keys, layer.values))
    return out.logits[:, -1], kv


def import_prefill(cache: DeviceCache, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """All layers' prompt keys/values into ``cache``; every sequence then holds the prompt."""
    if len(kv) != len(cache.layers):
        raise ValueError(f"{len(kv)} layers of keys/values for a cache of {len(cache.layers)} layers")
    for layer, (k, v) in enumerate(kv):
        cache.import_prefill(layer, k, v)  # type: ignore[attr-defined]
    cache.set_length(int(kv[0][0].shape[2]))


def sample(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next tokens ``[B]`` (int64): greedy at temperature 0, else softmax sampling by the exponential race
    (``argmax p / E`` with ``E ~ Exp(1)``: no host synchronisation, capturable)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / race).argmax(dim=-1)


def warm_up(model: torch.nn.Module, cache: DeviceCache, tokens: torch.Tensor, *, temperature: float = 0.0,
            steps: int = 2, forward: Optional[Any] = None) -> None:
    """Run ``steps`` decode steps without advancing (kernel compilation, allocator), then put back what
    they changed that the next real step reads, so that step computes exactly what it would have
    computed without the warm-up."""
    saved = [t.clone() for t in cache.step_state()]
    with torch.no_grad():
        for _ in range(steps):
            decode_step(model, cache, tokens, temperature=temperature, advance=False, forward=forward)
    for t, s in zip(cache.step_state(), saved):
        t.copy_(s)


def decode_step(model: torch.nn.Module, cache: DeviceCache, tokens: torch.Tensor, *, temperature: float = 0.0,
                advance: bool = True, forward: Optional[Any] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for every sequence: embeddings, every layer, LM head, sampling.

    ``tokens`` ``[B]`` int64 (each sequence's last token, at position ``cache.pos``). Returns
    ``(next_tokens [B], logits [B, V])``. With ``advance=False`` the cache positions stay (the step
    then rewrites the same slots when repeated: the timing mode). ``forward``: a fused step
    (`oscar.models.fused_step.FusedDecoder`, ``forward(cache, tokens) -> logits``) in place of the model's
    transformers forward.
    """
    cache.prepare()
    if forward is not None:
        logits = forward(cache, tokens)
    else:
        params = forward_kwargs(model)
        kwargs: dict[str, Any] = dict(input_ids=tokens[:, None], position_ids=cache.pos[:, None], use_cache=True)
        kwargs["cache" if "cache" in params else "past_key_values"] = cache  # transformers >= 5.2x renamed it
        if "cache_position" in params:
            kwargs["cache_position"] = cache.pos[:1]
        logits = model(**kwargs).logits[:, -1]
    nxt = sample(logits, temperature)
    if advance:
        cache.advance()
    return nxt, logits


class GraphedDecoder:
    """`decode_step` captured in a CUDA graph over static buffers ``tokens`` ``[B]`` and ``logits``.

    ``replay()`` runs one step reading ``tokens`` and leaves the next tokens in ``tokens`` (and the
    logits in ``logits``). With ``advance=True`` the graph also moves ``cache.pos`` on the device;
    the host mirror ``cache.seq_len`` is moved by ``replay``. ``forward``: the fused step of
    `decode_step` (compiled code is compiled in the warm-up, before the capture).
    """

    def __init__(self, model: torch.nn.Module, cache: DeviceCache, tokens: torch.Tensor, *, temperature: float = 0.0,
                 advance: bool = True, warmup: int = 2, forward: Optional[Any] = None) -> None:
        if advance and isinstance(cache, StaticBF16Cache):
            raise ValueError("the static BF16 cache attends a span fixed at capture (timing mode): capture it with "
                             "advance=False, or decode eagerly")
        self.model, self.cache, self.advance = model, cache, advance
        self.tokens = tokens.clone()
        self.temperature = temperature
        length = cache.seq_len
        self.graph = torch.cuda.CUDAGraph()

        def capture() -> None:
            torch.cuda.synchronize()
            with torch.cuda.graph(self.graph), torch.no_grad():
                nxt, logits = decode_step(model, cache, self.tokens, temperature=temperature, advance=advance,
                                          forward=forward)
                self.tokens.copy_(nxt)
                self.logits = logits
            torch.cuda.synchronize()

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile kernels, settle the allocator; the state is put back after
            warm_up(model, cache, self.tokens, temperature=temperature, steps=warmup, forward=forward)
        torch.cuda.current_stream().wait_stream(stream)
        capture()  # records only: nothing runs, the cache is as the warm-up left it
        if advance:  # capture ran the host part of advance() once: undo it; replays move pos on the device
            cache.seq_len = length
        self.tokens.copy_(tokens)

    def replay(self) -> None:
        """One decode step."""
        if self.advance:
            self.cache.check_room(1)
        self.graph.replay()
        if self.advance:
            self.cache.seq_len += 1


def kv_elements(num_layers: int, batch: int, tokens: int, num_kv_heads: int, head_dim: int) -> int:
    """K and V elements held for ``batch`` sequences of ``tokens`` tokens."""
    return 2 * num_layers * batch * tokens * num_kv_heads * head_dim


def oscar_quant_capacity(context: int, sink: int, recent: int, page_size: int, extra_steps: int = 0) -> int:
    """Quantized tokens per sequence for a context of ``context`` tokens plus ``extra_steps`` decode steps."""
    need = max(1, context + extra_steps + 1 - sink - recent)
    return int(math.ceil(need / page_size) * page_size)


def for_format(fmt: CacheFormat, **geometry: Any) -> DeviceCache:
    """The device cache of format ``fmt`` (refused by name, `oscar.cache.formats.FormatNotServed`, for a format the
    device cache does not serve): a `DeviceOscarCache` for a paged format (``geometry`` as `paged_cache_for`), a
    `StaticBF16Cache` for an unquantized one (as `static_bf16_for`)."""
    fmt.check_served("device")
    if fmt.paged:
        return paged_cache_for(fmt, **geometry)
    if not fmt.quantized:
        return static_bf16_for(fmt, **geometry)
    raise NotImplementedError(f"format {fmt.kind!r} is served by the device cache but builds none")


def static_bf16_for(fmt: CacheFormat, *, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, context: int,
                    extra_steps: int = 0, dtype: torch.dtype = torch.bfloat16, device: Any = "cpu") -> StaticBF16Cache:
    """The static BF16 device cache of an unquantized format with room for ``context + extra_steps`` tokens per
    sequence."""
    return StaticBF16Cache(num_layers=num_layers, batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           capacity=context + extra_steps + 1, dtype=dtype, device=device, fmt=fmt)


def paged_cache_for(fmt: CacheFormat, *, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, context: int,
                    transforms: Sequence[tuple[Any, Any]], extra_steps: int = 0, dtype: torch.dtype = torch.bfloat16,
                    device: Any = "cpu", **options: Any) -> DeviceOscarCache:
    """The paged device cache of a paged format with room for ``context + extra_steps`` tokens per sequence;
    ``transforms`` one ``(kt, vt)`` `HeadTransform` pair per layer; ``options``: ``backend``, ``layout``,
    ``shuffle_pages``, ``launch`` (`oscar.kernels.launch`)."""
    cap = oscar_quant_capacity(context, fmt.sink, fmt.recent, fmt.page_size, extra_steps)
    return DeviceOscarCache(fmt, num_layers=num_layers, batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim,
                            quant_capacity=cap, transforms=transforms, dtype=dtype, device=device, **options)


# The format method `CacheFormat.device_cache` forwards here (formats imports no cache).
formats.provide("device_cache", for_format)


__all__ = [
    "ATTN_IMPLEMENTATION",
    "DeviceCache",
    "DeviceOscarCache",
    "GraphedDecoder",
    "StaticBF16Cache",
    "decode_step",
    "device_attention_forward",
    "enable",
    "for_format",
    "import_prefill",
    "kv_elements",
    "oscar_quant_capacity",
    "paged_cache_for",
    "prefill",
    "register",
    "sample",
    "static_bf16_for",
    "warm_up",
]

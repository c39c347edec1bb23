"""The OSCAR KV pool for SGLang: packed INT pages per token slot plus BF16 sink and recent windows per request.

Layout (``oscar.paged``'s format with one token per page, so SGLang's token slots are the pages):
per layer, K and V each hold ``oscar.paged.QuantPages`` with ``codes`` uint8
``[size + page_size, Hkv, 1, d*bits/8]`` and BF16 ``scale``/``zero`` ``[size + page_size, Hkv, 1, d/G]``;
slot ``loc`` (SGLang's ``out_cache_loc``, allocated and freed by SGLang's own allocator) is page ``loc``.
The BF16 windows are per request slot (SGLang's ``req_pool_idx``): ``sink`` ``[R, Hkv, S0, d]`` (positions
``0..S0-1``) and a ring ``recent`` ``[R, Hkv, W, d]`` (position ``p >= S0`` at ``(p - S0) % W``), BF16
whatever the model dtype (as ``oscar.cache``), in the original frame. Rows are rounded to BF16 once, as they
arrive; prefill attention, windows and quantization all read the rounded rows.

Window convention (as ``oscar.cache``): for a sequence of length ``L`` the sink holds ``[0, min(L, S0))``,
the pages ``[S0, L - W)`` (rotated, quantized) and the ring ``[max(S0, L - W), L)``. A prefill quantizes
its middle rows directly; each decode step first demotes the row that leaves the window (position
``L - 1 - W``) from the ring into its slot, then writes the new row (demotion inside the decode step).
Token slots return to SGLang's allocator when a request ends; the window rows of a request slot are
simply overwritten by the next request that gets the slot.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from oscar import paged
from oscar.serve.settings import ServeSettings, bytes_per_token, head_transforms, window_bytes_per_request

logger = logging.getLogger(__name__)


class OscarTokenToKVPool(MHATokenToKVPool):
    """SGLang MHA pool whose token slots hold OSCAR's packed INT rows (see the module docstring)."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str, enable_memory_saver: bool, *args: Any,
                 oscar_state: Optional[dict] = None, **kwargs: Any) -> None:
        from oscar.serve.plugin import current_state

        state = oscar_state if oscar_state is not None else current_state()
        self.settings: ServeSettings = state["settings"]
        self.rotations = state["rotations"]
        self.bits, self.group_size = int(state["bits"]), int(state["group_size"])
        self.sink, self.recent = self.settings.sink, self.settings.recent
        self.kernels = self.settings.kernel_backend(device)
        self.num_req_slots = 0
        self.window_dtype = torch.bfloat16
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver,
                         *args, **kwargs)
        first = self.start_layer
        self.transforms = [head_transforms(self.rotations[first + i], device) for i in range(layer_num)]
        bpt = bytes_per_token(layer_num, head_num, head_dim, self.bits, self.group_size)
        bf16 = 2 * layer_num * head_num * head_dim * 2
        logger.info(
            "OSCAR KV pool: INT%d, group %d, sink %d, recent %d: %d bytes/token (BF16 KV: %d, %.2fx more tokens "
            "per byte); #tokens %d, pages %d bytes; kernels=%s",
            self.bits, self.group_size, self.sink, self.recent, bpt, bf16, bf16 / bpt, size,
            self.pages_nbytes(), self.kernels)

    # -- storage -----------------------------------------------------------------------------------

    def _create_buffers(self) -> None:
        n = self.size + self.page_size
        self.k_pages = [paged.QuantPages.empty(n, self.head_num, 1, self.head_dim, self.bits, self.group_size,
                                               self.device) for _ in range(self.layer_num)]
        self.v_pages = [paged.QuantPages.empty(n, self.head_num, 1, self.head_dim, self.bits, self.group_size,
                                               self.device) for _ in range(self.layer_num)]
        # SGLang code that probes the BF16 buffers gets an explicit refusal (properties below).
        self.k_scale_buffer = self.v_scale_buffer = None
        self.sink_k: list[torch.Tensor] = []
        self.sink_v: list[torch.Tensor] = []
        self.recent_k: list[torch.Tensor] = []
        self.recent_v: list[torch.Tensor] = []

    def bind_requests(self, num_req_slots: int) -> None:
        """Allocate the BF16 windows of ``num_req_slots`` request slots (SGLang's req_to_token rows)."""
        if num_req_slots <= self.num_req_slots:
            return
        shape_s = (num_req_slots, self.head_num, self.sink, self.head_dim)
        shape_r = (num_req_slots, self.head_num, self.recent, self.head_dim)
        z = lambda shape: torch.zeros(shape, dtype=self.window_dtype, device=self.device)  # noqa: E731
        self.sink_k = [z(shape_s) for _ in range(self.layer_num)]
        self.sink_v = [z(shape_s) for _ in range(self.layer_num)]
        self.recent_k = [z(shape_r) for _ in range(self.layer_num)]
        self.recent_v = [z(shape_r) for _ in range(self.layer_num)]
        self.num_req_slots = num_req_slots
        logger.info("OSCAR KV pool: BF16 windows for %d request slots: %.3f GB", num_req_slots,
                    self.windows_nbytes() / 2**30)

    def pages_nbytes(self) -> int:
        """Bytes of the packed pages (codes + scale + zero) of all layers."""
        return sum(t.numel() * t.element_size() for p in (*self.k_pages, *self.v_pages)
                   for t in (p.codes, p.scale, p.zero))

    def windows_nbytes(self) -> int:
        """Bytes of the BF16 sink and recent windows of all request slots and layers."""
        return sum(t.numel() * t.element_size() for t in (*self.sink_k, *self.sink_v, *self.recent_k, *self.recent_v))

    def window_bytes_per_request(self) -> int:
        """Window bytes one request slot costs (what pool sizing reserves per running request)."""
        return window_bytes_per_request(self.layer_num, self.head_num, self.head_dim, self.sink, self.recent,
                                        torch.empty((), dtype=self.window_dtype).element_size())

    def get_kv_size_bytes(self) -> tuple[int, int]:
        k = sum(t.numel() * t.element_size() for p in self.k_pages for t in (p.codes, p.scale, p.zero))
        v = sum(t.numel() * t.element_size() for p in self.v_pages for t in (p.codes, p.scale, p.zero))
        return k, v

    def _clear_buffers(self) -> None:
        self.k_pages, self.v_pages = [], []
        self.sink_k, self.sink_v, self.recent_k, self.recent_v = [], [], [], []

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

    # -- writes ------------------------------------------------------------------------------------

    def _local(self, layer_id: int) -> int:
        return layer_id - self.start_layer

    def write(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, req: torch.Tensor,
              pos: torch.Tensor, seq_len: torch.Tensor) -> None:
        """Store new rows ``k``/``v`` ``[N, Hkv, d]`` (original frame) of request slots ``req`` at positions
        ``pos`` (``[N]``, int64), where ``seq_len[n]`` is the length of row ``n``'s sequence after this
        forward: sink rows to the sink, rows already outside the recent window quantized into slot ``loc``,
        the others into the ring."""
        i = self._local(layer_id)
        kb, vb = k.to(self.window_dtype), v.to(self.window_dtype)
        S0, W = self.sink, self.recent
        in_sink = pos < S0
        if bool(in_sink.any()):
            r, p = req[in_sink], pos[in_sink]
            self.sink_k[i][r, :, p] = kb[in_sink]
            self.sink_v[i][r, :, p] = vb[in_sink]
        in_int = (pos >= S0) & (pos < seq_len - W)
        if bool(in_int.any()):
            paged.rotate_quantize_pack_kv(kb[in_int], vb[in_int], loc[in_int], self.k_pages[i], self.v_pages[i],
                                          *self.transforms[i], backend=self.kernels)
        in_ring = (pos >= S0) & (pos >= seq_len - W)
        if bool(in_ring.any()):
            r, slot = req[in_ring], (pos[in_ring] - S0) % W
            self.recent_k[i][r, :, slot] = kb[in_ring]
            self.recent_v[i][r, :, slot] = vb[in_ring]

    def demote(self, layer_id: int, req: torch.Tensor, new_pos: torch.Tensor, req_to_token: torch.Tensor) -> None:
        """Before writing position ``new_pos[b]`` of request slot ``req[b]``: quantize the ring row that
        leaves the window (position ``new_pos - W``, when it is past the sink) into its token slot."""
        S0, W = self.sink, self.recent
        old = new_pos - W
        leaving = old >= S0
        if not bool(leaving.any()):
            return
        i = self._local(layer_id)
        r, p = req[leaving], old[leaving]
        slots = req_to_token[r, p].long()
        src = (p - S0) % W
        paged.rotate_quantize_pack_kv(self.recent_k[i][r], self.recent_v[i][r], slots, self.k_pages[i],
                                      self.v_pages[i], *self.transforms[i], src_index=src, backend=self.kernels)


__all__ = ["OscarTokenToKVPool"]

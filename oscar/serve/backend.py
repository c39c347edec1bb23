"""SGLang attention backend ``oscar``: attention over BF16 sink + INT pages + BF16 recent, writing the OSCAR pool.

- Extend (prefill, no cached prefix): causal attention of each request's chunk over its own rows rounded
  to BF16 (with a BF16 model, exactly SGLang's ``torch_native`` computation), then the rows go to the pool (sink,
  quantized middle, ring): prompt keys are quantized once the prompt is in, as in ``oscar.cache``'s
  serving mode.
- Decode: demote the row leaving the recent window, write the new row, then attend over the three
  segments with ``oscar.paged.decode_attention`` (torch twin on CPU, Triton kernel on CUDA), the query
  rotated by ``R_K`` inside it. While no request of the batch has quantized rows the step is plain
  attention over the windows in position order (the same ``torch_native`` computation).
- With the value rotation folded into ``o_proj`` (``OSCAR_FOLD``, on by default) every path returns
  ``(o - mu_V) @ R_V`` per KV head, which the folded ``o_proj`` maps back.

Prefix reuse (radix cache, chunked prefill) is refused at start-up (``oscar.serve.plugin``); a forward
that still carries a cached prefix raises instead of attending wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from torch.nn.functional import scaled_dot_product_attention

from oscar import paged


@dataclass
class _ExtendMeta:
    req: torch.Tensor  # [N] request slot per token
    pos: torch.Tensor  # [N] position per token
    seq_len: torch.Tensor  # [N] sequence length of the token's request
    starts: list[int]
    lens: list[int]


@dataclass
class _DecodeMeta:
    req: torch.Tensor  # [B]
    new_pos: torch.Tensor  # [B] position of the token written this step
    seq_lens: list[int]
    sink_len: torch.Tensor  # [B] int32
    recent_len: torch.Tensor  # [B] int32
    int_len: torch.Tensor  # [B] int32
    any_int: bool
    page_table: Optional[torch.Tensor] = None  # [B, max_int] int32 (token slots of positions S0..)


class OscarAttnBackend(AttentionBackend):
    """Attention over an ``OscarTokenToKVPool`` (see the module docstring)."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        from oscar.serve.pool import OscarTokenToKVPool

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
        from oscar.serve.plugin import current_state

        self.folded = bool(current_state().get("fold", True))
        self.meta: Any = None

    # -- metadata (once per forward, shared by the layers) -----------------------------------------

    def init_forward_metadata(self, forward_batch: Any) -> None:
        mode = forward_batch.forward_mode
        req = forward_batch.req_pool_indices.long()
        seq_lens = [int(x) for x in (forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None
                                     else forward_batch.seq_lens.cpu()).tolist()]
        dev = req.device
        if mode.is_decode():
            S0, W = self.pool.sink, self.pool.recent
            L = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
            int_len = (L - S0 - W).clamp(min=0)
            max_int = int(int_len.max()) if len(seq_lens) else 0
            page_table = None
            if max_int > 0:
                page_table = self.req_to_token_pool.req_to_token[req, S0 : S0 + max_int].to(torch.int32)
            self.meta = _DecodeMeta(
                req=req, new_pos=L - 1, seq_lens=seq_lens, sink_len=L.clamp(max=S0).to(torch.int32),
                recent_len=(L - S0).clamp(min=0, max=W).to(torch.int32), int_len=int_len.to(torch.int32),
                any_int=max_int > 0, page_table=page_table)
            return
        if mode.is_idle():
            self.meta = None
            return
        prefix = forward_batch.extend_prefix_lens_cpu or [0] * len(seq_lens)
        if any(int(p) > 0 for p in prefix):
            raise RuntimeError(
                f"--attention-backend oscar got an extend with cached prefixes {list(prefix)}: prefix reuse is not "
                "supported; start the server with --disable-radix-cache and --chunked-prefill-size -1"
            )
        lens = [int(x) for x in forward_batch.extend_seq_lens_cpu]
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        pos = torch.cat([torch.arange(n, device=dev) for n in lens]) if lens else torch.empty(0, dtype=torch.int64)
        counts = torch.tensor(lens, device=dev)
        self.meta = _ExtendMeta(req=torch.repeat_interleave(req, counts), pos=pos,
                                seq_len=torch.repeat_interleave(torch.tensor(seq_lens, device=dev), counts),
                                starts=starts, lens=lens)

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
        for start, n in zip(m.starts, m.lens):
            qs = q3[start : start + n].movedim(0, 1)  # [H, n, d]
            ks = kb[start : start + n].movedim(0, 1).to(q.dtype)
            vs = vb[start : start + n].movedim(0, 1).to(q.dtype)
            o = scaled_dot_product_attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), enable_gqa=H != Hkv,
                                             scale=layer.scaling, is_causal=True)
            out[start : start + n] = o.squeeze(0).movedim(1, 0)
        if save_kv_cache:
            self.pool.write(layer.layer_id, kb, vb, forward_batch.out_cache_loc.long(), m.req, m.pos, m.seq_len)
        if self.folded:
            out = self._to_folded(out, layer.layer_id)
        return out.reshape(q3.shape[0], H * d)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        self._check_layer(layer)
        m: _DecodeMeta = self.meta
        H, Hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        q3 = q.reshape(-1, H, d)
        pool, i = self.pool, layer.layer_id - self.pool.start_layer
        if save_kv_cache:
            r2t = self.req_to_token_pool.req_to_token
            pool.demote(layer.layer_id, m.req, m.new_pos, r2t)
            pool.write(layer.layer_id, k.view(-1, Hkv, d), v.view(-1, Hkv, d), forward_batch.out_cache_loc.long(),
                       m.req, m.new_pos, m.new_pos + 1)
        if not m.any_int:
            out = self._decode_windows(q3, layer, m, i)
            if self.folded:
                out = self._to_folded(out, layer.layer_id)
            return out.reshape(q3.shape[0], H * d)
        S0 = pool.sink
        segs = dict(
            sink_k=pool.sink_k[i][m.req] if S0 else None, sink_v=pool.sink_v[i][m.req] if S0 else None,
            sink_len=m.sink_len if S0 else None, recent_k=pool.recent_k[i][m.req], recent_v=pool.recent_v[i][m.req],
            recent_len=m.recent_len)
        kt, vt = pool.transforms[i]
        out = paged.decode_attention(q3, pool.k_pages[i], pool.v_pages[i], m.page_table, m.int_len, kt, vt,
                                     sm_scale=layer.scaling, output_frame="rotated" if self.folded else "original",
                                     backend=pool.kernels, **segs)
        return out.reshape(q3.shape[0], H * d)

    def _decode_windows(self, q3: torch.Tensor, layer: Any, m: _DecodeMeta, i: int) -> torch.Tensor:
        """Decode attention while every row is in the BF16 windows: keys in position order, one SDPA per
        request (as ``torch_native``)."""
        pool = self.pool
        S0, W = pool.sink, pool.recent
        H, Hkv = layer.tp_q_head_num, layer.tp_k_head_num
        out = torch.empty_like(q3)
        for b, L in enumerate(m.seq_lens):
            r = int(m.req[b])
            ns = min(L, S0)
            ring = [(p - S0) % W for p in range(S0, L)]
            ks = torch.cat([pool.sink_k[i][r, :, :ns], pool.recent_k[i][r][:, ring]], dim=1).to(q3.dtype)
            vs = torch.cat([pool.sink_v[i][r, :, :ns], pool.recent_v[i][r][:, ring]], dim=1).to(q3.dtype)
            qs = q3[b : b + 1].movedim(0, 1)  # [H, 1, d]
            o = scaled_dot_product_attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), enable_gqa=H != Hkv,
                                             scale=layer.scaling, is_causal=False)
            out[b] = o.squeeze(0).movedim(1, 0)[0]
        return out

    def support_triton(self) -> bool:
        return False


__all__ = ["OscarAttnBackend"]

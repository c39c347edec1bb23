"""What the kernels read besides the query: the per-head transform of K or V, and the segments of a decode step.

Torch only (kernels import torch and triton only, so these values live at the lowest floor; the library imports
them, and ``oscar.cache.paged`` re-exports ``HeadTransform``). The page storage itself
(``oscar.cache.paged.QuantPages``) stays beside its format contract in ``oscar.core.quant``; the kernels read the
fields named by ``Pages``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Union

import torch


class Pages(Protocol):
    """The fields of one layer's paged K or V storage that the kernels read (``oscar.cache.paged.QuantPages``)."""

    codes: torch.Tensor  # uint8 [P, Hkv, page_size, d*bits//8]
    scale: torch.Tensor  # bf16 [P, Hkv, page_size, d//G]
    zero: torch.Tensor  # bf16 [P, Hkv, page_size, d//G]
    bits: int
    group_size: int
    layout: str  # "rows", "mma_k" or "mma_v"
    block: int  # 0: per-token scale/zero [P, Hkv, page_size, d//G]; T > 0: per-channel keys, [P, Hkv, page_size/T, d]


def _shape(t: Optional[torch.Tensor]) -> Optional[tuple[int, ...]]:
    return None if t is None else tuple(t.shape)


def _is_int_tensor(t: object, dim: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == dim and not t.is_floating_point() and not t.is_complex()


@dataclass(frozen=True, eq=False)
class HeadTransform:
    """Per-KV-head transform of one tensor before quantization: ``clip((x - mu - RoPE_p(rope_mu)) @ R, rho)``.

    Rope-centered keys (``oscar.core.rope``): ``rope_mu`` holds the pre-RoPE means ``m`` (zero rows for heads
    that are not centered) and ``rope_freq``/``rope_scaling`` the layer's rotate-half RoPE; a row at
    position ``p`` is stored minus ``RoPE_p(m)``, and decode adds ``q . RoPE_p(m)`` back to its logit.
    ``block`` > 0: keys quantized per channel over blocks of ``block`` tokens (docs/DESIGN.md "Per-channel key
    pages"); their pages are ``QuantPages(..., block=block)``.
    """

    R: Optional[torch.Tensor] = None  # [Hkv, d, d] float32, orthogonal; None = identity
    mu: Optional[torch.Tensor] = None  # [Hkv, d] float32; None = no centering
    rho: Optional[torch.Tensor] = None  # [Hkv] clip ratios in (0, 1]; None = no clipping
    rope_mu: Optional[torch.Tensor] = None  # [Hkv, d] float32 pre-RoPE means of rope-centered heads; None = none
    rope_freq: Optional[torch.Tensor] = None  # [rotary_dim/2] float64 inverse frequencies (with rope_mu)
    rope_scaling: float = 1.0  # RoPE attention scaling (transformers' attention_scaling)
    block: int = 0  # >0: per-channel keys over blocks of this many tokens

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 0:
            raise ValueError(f"block={self.block!r} must be 0 (per-token keys) or a positive number of tokens")
        if self.R is not None and (self.R.dim() != 3 or self.R.shape[1] != self.R.shape[2]):
            raise ValueError(f"R must be [Hkv, d, d] (one square rotation per KV head), got {_shape(self.R)}")
        for name in ("mu", "rope_mu"):
            t = getattr(self, name)
            if t is not None and t.dim() != 2:
                raise ValueError(f"{name} must be [Hkv, d], got {_shape(t)}")
        if self.rho is not None and self.rho.dim() != 1:
            raise ValueError(f"rho must be [Hkv] (one clip ratio per KV head), got {_shape(self.rho)}")
        if (self.rope_mu is None) != (self.rope_freq is None):
            raise ValueError("rope-centered keys need both rope_mu (pre-RoPE means) and rope_freq (the RoPE)")
        if self.rope_freq is not None:
            d = int(self.rope_mu.shape[-1])
            if self.rope_freq.dim() != 1 or not 0 < 2 * self.rope_freq.numel() <= d:
                raise ValueError(f"rope_freq of shape {tuple(self.rope_freq.shape)} does not fit head_dim {d}: "
                                 "expected a vector of at most head_dim/2 frequencies")

    def to(self, device: Union[str, torch.device]) -> "HeadTransform":
        """Copy onto ``device`` (float32; the RoPE frequencies stay float64)."""

        def mv(x: Optional[torch.Tensor], dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
            return None if x is None else x.to(device, dtype).contiguous()

        return HeadTransform(mv(self.R), mv(self.mu), mv(self.rho), mv(self.rope_mu), mv(self.rope_freq, torch.float64),
                             self.rope_scaling, self.block)

    @property
    def rope_centered(self) -> bool:
        """Whether rows carry the rope-centered offset ``RoPE_p(rope_mu)`` (keys only)."""
        return self.rope_mu is not None

    def without_rope(self) -> "HeadTransform":
        """The same transform without the rope-centered offset (for rows whose offsets are already subtracted)."""
        return HeadTransform(self.R, self.mu, self.rho, block=self.block)


@dataclass(frozen=True, eq=False)
class Segments:
    """What one decode step reads besides the quantized pages: where the pages are and the BF16 windows.

    ``page_table`` int ``[B, M]`` and ``int_len`` int ``[B]``: quantized token ``t`` of sequence ``b`` lives at page
    ``page_table[b, t // page_size]``, slot ``t % page_size``; ``int_len[b]`` quantized tokens. BF16 windows in
    the original frame, each given as keys, values and valid lengths together: ``sink_*`` ``[B, Hkv, S0, d]`` and
    ``recent_*`` ``[B, Hkv, W, d]`` (a ring: its order does not matter) with lengths int ``[B]``; with ``window_rows``
    (int ``[B]``) sequence ``b`` reads row ``window_rows[b]`` of windows ``[R, Hkv, S, d]`` instead of row ``b``
    (per-slot buffers read in place). ``int_pos0`` (int or int ``[B]``): position of each sequence's first
    quantized token, needed for rope-centered keys. The kernels take int32 tensors on the query's device.
    """

    page_table: torch.Tensor
    int_len: torch.Tensor
    sink_k: Optional[torch.Tensor] = None
    sink_v: Optional[torch.Tensor] = None
    sink_len: Optional[torch.Tensor] = None
    recent_k: Optional[torch.Tensor] = None
    recent_v: Optional[torch.Tensor] = None
    recent_len: Optional[torch.Tensor] = None
    window_rows: Optional[torch.Tensor] = None
    int_pos0: Union[int, torch.Tensor, None] = None

    def __post_init__(self) -> None:
        if not _is_int_tensor(self.page_table, 2):
            raise ValueError(f"page_table must be an integer tensor [B, pages], got "
                             f"{getattr(self.page_table, 'dtype', type(self.page_table).__name__)} "
                             f"{_shape(self.page_table) if isinstance(self.page_table, torch.Tensor) else ''}")
        if not _is_int_tensor(self.int_len, 1):
            raise ValueError(f"int_len must be an integer tensor [B] (quantized tokens per sequence), got "
                             f"{getattr(self.int_len, 'dtype', type(self.int_len).__name__)} "
                             f"{_shape(self.int_len) if isinstance(self.int_len, torch.Tensor) else ''}")
        for name in ("sink", "recent"):
            k, v, n = (getattr(self, f"{name}_{x}") for x in ("k", "v", "len"))
            given = [f"{name}_{x}" for x, t in zip(("k", "v", "len"), (k, v, n)) if t is not None]
            if given and len(given) < 3:
                raise ValueError(f"{name}_k, {name}_v and {name}_len go together (a window is keys, values and "
                                 f"lengths); got only {', '.join(given)}")
            if k is None:
                continue
            if k.dim() != 4 or tuple(v.shape) != tuple(k.shape):
                raise ValueError(f"{name}_k and {name}_v must be [B, Hkv, S, d] of one shape, got {_shape(k)} and "
                                 f"{_shape(v)}")
            if not _is_int_tensor(n, 1):
                raise ValueError(f"{name}_len must be an integer tensor [B], got {n.dtype} {_shape(n)}")
        if self.window_rows is not None and not _is_int_tensor(self.window_rows, 1):
            raise ValueError(f"window_rows must be an integer tensor [B] (the window row each sequence reads), got "
                             f"{getattr(self.window_rows, 'dtype', type(self.window_rows).__name__)} "
                             f"{_shape(self.window_rows) if isinstance(self.window_rows, torch.Tensor) else ''}")
        p = self.int_pos0
        if p is not None and not (_is_int_tensor(p, 1) or (isinstance(p, int) and not isinstance(p, bool) and p >= 0)):
            raise ValueError(f"int_pos0={p!r} must be a position >= 0 (int) or an integer tensor [B]")

    @property
    def windows(self) -> tuple[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor], ...]:
        """The windows given, in order: ``(name, keys, values, lengths)`` for ``"sink"`` then ``"recent"``."""
        out = []
        for name in ("sink", "recent"):
            k = getattr(self, f"{name}_k")
            if k is not None:
                out.append((name, k, getattr(self, f"{name}_v"), getattr(self, f"{name}_len")))
        return tuple(out)


__all__ = ["HeadTransform", "Pages", "Segments"]

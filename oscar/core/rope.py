"""RoPE as the cache sees it: rotate-half rotary embedding of a key at a position, its inverse, and
the position-aware key mean ("rope centering").

A key bias (Qwen2's `k_proj` has one) or any constant part `m` of the pre-RoPE keys reaches the cache
as `RoPE_p(m)`: a vector that turns with the position `p`. A per-token quantizer with one zero point
per group cannot remove it, and a constant post-RoPE mean cannot either (it averages to ~0 over the
fast-turning pairs). Rope centering subtracts the exact `RoPE_p(m)` before rotation and quantization
and adds it back on read; it is a deterministic function of the position, so nothing is stored.

Convention (`RopeSpec`): the rotary part is the first `rotary_dim` channels, split in halves
(`x1 = x[:r/2]`, `x2 = x[r/2:r]`, transformers' `rotate_half`); channel pair `(i, i + r/2)` turns by
`p * inv_freq[i]`, and the result is multiplied by `scaling` (transformers' `attention_scaling`,
1 for the default RoPE). Channels past `rotary_dim` pass through (partial rotary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RopeSpec:
    """Rotate-half RoPE of one layer: `inv_freq` `[rotary_dim/2]` (float64), `scaling`, `head_dim`."""

    inv_freq: torch.Tensor
    scaling: float
    head_dim: int

    @property
    def rotary_dim(self) -> int:
        """Channels the rotation acts on (`2 * len(inv_freq)`)."""
        return 2 * int(self.inv_freq.numel())

    def __post_init__(self) -> None:
        if self.inv_freq.ndim != 1 or self.rotary_dim > self.head_dim or self.rotary_dim == 0:
            raise ValueError(
                f"inv_freq of shape {tuple(self.inv_freq.shape)} does not fit head_dim {self.head_dim}: "
                "expected a vector of at most head_dim/2 frequencies"
            )
        if not self.scaling > 0:
            raise ValueError(f"RoPE scaling {self.scaling} must be positive")

    def to_json(self) -> dict[str, Any]:
        """Plain form for artifact metadata (`from_json` reads it back exactly: float64 as Python floats)."""
        return {"inv_freq": [float(x) for x in self.inv_freq.tolist()], "scaling": float(self.scaling), "head_dim": int(self.head_dim)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> "RopeSpec":
        """Inverse of `to_json`; refuses a malformed entry with the field it lacks."""
        try:
            return RopeSpec(torch.tensor(data["inv_freq"], dtype=torch.float64), float(data["scaling"]), int(data["head_dim"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed RoPE entry {data!r}: needs inv_freq, scaling and head_dim ({exc})") from None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos`, `sin` `[*positions.shape, rotary_dim/2]` of the angles `p * inv_freq` (float64 inside)."""
        ang = positions.to(torch.float64)[..., None] * self.inv_freq.to(positions.device)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """RoPE of rows `x` `[..., L, d]` at `positions` (broadcast to `[..., L]`); `inverse` undoes it."""
        r, h = self.rotary_dim, self.rotary_dim // 2
        cos, sin = self.cos_sin(positions, torch.float64)
        x64 = x.to(torch.float64)
        x1, x2 = x64[..., :h], x64[..., h:r]
        if inverse:
            y1, y2 = (x1 * cos + x2 * sin) / self.scaling, (x2 * cos - x1 * sin) / self.scaling
        else:
            y1, y2 = (x1 * cos - x2 * sin) * self.scaling, (x2 * cos + x1 * sin) * self.scaling
        return torch.cat([y1, y2, x64[..., r:]], dim=-1).to(x.dtype)

    def offsets(self, mean: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`RoPE_p(mean[h])` for every head and position: `mean` `[Hkv, d]`, `positions` `[B, L]` -> `[B, Hkv, L, d]`.

        Positions below 0 (empty slots) get a zero offset.
        """
        pos = positions.clamp(min=0)[:, None, :]  # [B, 1, L]
        rows = mean.to(torch.float64)[None, :, None, :].expand(pos.shape[0], -1, pos.shape[2], -1)
        out = self.apply(rows, pos.expand(-1, mean.shape[0], -1))
        return (out * (positions >= 0)[:, None, :, None]).to(dtype)

    def averaged_second_moment(self, second: torch.Tensor, positions: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """`mean_p RoPE_p S RoPE_p^T` for a pre-RoPE second moment `S` `[d, d]` over `positions` `[P]`.

        The post-RoPE second moment of rows whose pre-RoPE second moment is `S` at every position
        (the stationarity assumption of a calibration window): the target a rope-centered `raw`
        candidate diagonalizes.
        """
        s = second.to(torch.float64)
        acc = torch.zeros_like(s)
        for start in range(0, positions.numel(), chunk):
            p = positions[start : start + chunk].to(torch.float64)
            # rows of S turned: (S R_p^T)[i] = RoPE_p(S[i]); then the rows of its transpose
            right = self.apply(s[None].expand(p.numel(), -1, -1), p[:, None].expand(-1, s.shape[0]))
            both = self.apply(right.transpose(1, 2), p[:, None].expand(-1, s.shape[0]))
            acc += both.sum(0)
        out = acc / max(positions.numel(), 1)
        return (out + out.T) / 2

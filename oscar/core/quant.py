"""Per-token, per-group asymmetric INT-b quantization of rotated KV rows (torch twins of the kernels).

This module is the specification of the quantized storage format (docs/DESIGN.md, "Quantized
storage format"). The Triton kernels in `oscar.kernels` mirror these functions operation by
operation, so the arithmetic here is deliberately plain float32 in a fixed order:

1. `x` float32 `[..., d]` (already rotated and, if the method centers, mean-centered).
2. Clip: `tau = quantile(|x|, rho)` over the row's `d` channels with `torch.quantile`
   linear-interpolation semantics (see `percentile_clip`), then `x = clamp(x, -tau, tau)`.
3. Per group of `G` channels: `scale = bf16((max - min) / (2^b - 1))`, `zero = bf16(min)`, and
   `code = clamp(floor((x - zero) / scale + 0.5), 0, 2^b - 1)` computed with the *rounded* scale
   and zero (as float32); `code = 0` where `scale == 0` (a constant group dequantizes exactly to
   `bf16(min)`).
4. Dequantize: `x_hat = code * scale + zero` in float32.
5. Codes are packed planar within each group (`pack_codes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

SUPPORTED_BITS = (2, 4)

ClipRatio = Union[float, torch.Tensor]


@dataclass
class QuantizedRows:
    """Quantized rows: packed codes `[..., d*bits//8]` uint8, per-group bf16 `scale`/`zero` `[..., d//G]`."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    d: int

    @property
    def shape(self) -> torch.Size:
        """Shape of the dequantized tensor `[..., d]`."""
        return torch.Size((*self.scale.shape[:-1], self.d))

    def nbytes(self) -> int:
        """Bytes held by codes, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


def check_format(bits: int, group_size: int, d: int) -> None:
    """Refuse a (bits, group_size, d) combination the storage format does not support."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; valid values are {SUPPORTED_BITS}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size={group_size!r} must be a positive integer")
    if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
        raise ValueError(f"head_dim d={d!r} must be a positive integer")
    if d % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide head_dim d={d}; "
            f"valid group sizes divide {d} (e.g. {_divisors_hint(d, bits)})"
        )
    per_byte = 8 // bits
    if group_size % per_byte != 0:
        raise ValueError(
            f"group_size={group_size} is not a multiple of {per_byte}, required to pack "
            f"{per_byte} INT{bits} codes per byte within a group"
        )


def _divisors_hint(d: int, bits: int) -> list[int]:
    per_byte = 8 // bits
    return [g for g in range(per_byte, d + 1, per_byte) if d % g == 0][-4:]


def _check_finite(x: torch.Tensor, what: str) -> None:
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(
            f"{what} contains {bad} non-finite value(s) (NaN or inf) out of {x.numel()}; "
            "quantization needs finite inputs"
        )


def _clip_ratio_tensor(rho: ClipRatio, batch_shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Clip ratio as float32 broadcast to the row shape `batch_shape`, validated in (0, 1]."""
    r = torch.as_tensor(rho, dtype=torch.float32, device=device)
    if not torch.isfinite(r).all() or bool((r <= 0).any()) or bool((r > 1).any()):
        raise ValueError(f"clip ratio rho={rho!r} must lie in (0, 1] (1.0 means no clipping)")
    try:
        return torch.broadcast_to(r, batch_shape)
    except RuntimeError as exc:
        raise ValueError(
            f"clip ratio of shape {tuple(r.shape)} does not broadcast to the row shape {tuple(batch_shape)}"
        ) from exc


def percentile_clip(x: torch.Tensor, rho: ClipRatio) -> tuple[torch.Tensor, torch.Tensor]:
    """Clamp each row of `x` to `[-tau, tau]`, `tau` the rho-quantile of `|x|` over its last dim.

    Exactly `torch.quantile(|x|, rho, dim=-1, interpolation="linear")` in float32: sort `|x|`
    ascending into `s`, `pos = float32(rho) * (d - 1)` (float32 product), `lo = floor(pos)`,
    `hi = ceil(pos)`, `w = pos - lo`, `tau = torch.lerp(s[lo], s[hi], w)`, i.e.
    `s[lo] + w * (s[hi] - s[lo])` when `w < 0.5` and `s[hi] - (s[hi] - s[lo]) * (1 - w)` otherwise.
    `rho` is a float or a tensor broadcastable to `x.shape[:-1]` (one ratio per row or per head).
    Returns `(clipped float32, tau float32 [...])`.
    """
    x = x.to(torch.float32)
    _check_finite(x, "percentile_clip input")
    d = x.shape[-1]
    r = _clip_ratio_tensor(rho, x.shape[:-1], x.device)
    s, _ = x.abs().sort(dim=-1)
    pos = r * float(d - 1)
    lo = pos.floor()
    hi = pos.ceil()
    w = pos - lo
    s_lo = s.gather(-1, lo.long().unsqueeze(-1)).squeeze(-1)
    s_hi = s.gather(-1, hi.long().unsqueeze(-1)).squeeze(-1)
    tau = torch.lerp(s_lo, s_hi, w)
    t = tau.unsqueeze(-1)
    return torch.minimum(torch.maximum(x, -t), t), tau


def _group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def quantize_codes(
    x: torch.Tensor, bits: int, group_size: int, clip_ratio: ClipRatio = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpacked codes uint8 `[..., d]` with bf16 scale/zero `[..., d//G]` (the format's steps 1-3)."""
    if x.ndim < 1:
        raise ValueError("quantize needs a tensor with a channel dimension [..., d]")
    d = int(x.shape[-1])
    check_format(bits, group_size, d)
    x = x.to(torch.float32)
    _check_finite(x, "quantize input")
    if not (isinstance(clip_ratio, (int, float)) and float(clip_ratio) == 1.0):
        x, _ = percentile_clip(x, clip_ratio)
    g = _group_view(x, group_size)
    mn = g.amin(dim=-1)
    mx = g.amax(dim=-1)
    qmax = float(2**bits - 1)
    scale_bf = ((mx - mn) / qmax).to(torch.bfloat16)
    zero_bf = mn.to(torch.bfloat16)
    if not torch.isfinite(scale_bf).all():
        raise ValueError(
            "quantize input range overflows the bf16 scale (max - min is too large to represent); "
            f"largest |x| = {float(x.abs().max()):.3e}"
        )
    scale = scale_bf.to(torch.float32).unsqueeze(-1)
    zero = zero_bf.to(torch.float32).unsqueeze(-1)
    top = zero + qmax * scale  # the largest value a group dequantizes to
    if not (torch.isfinite(zero_bf).all() and torch.isfinite(top).all()):
        raise ValueError(
            "quantize input overflows the bf16 zero point or its dequantized range (finite rows need "
            f"|x| below about {float(torch.finfo(torch.bfloat16).max):.3e}); largest |x| = {float(x.abs().max()):.3e}"
        )
    nonzero = scale != 0
    safe = torch.where(nonzero, scale, torch.ones_like(scale))
    code = torch.floor((g - zero) / safe + 0.5).clamp_(0.0, qmax)
    code = torch.where(nonzero, code, torch.zeros_like(code))
    return code.to(torch.uint8).reshape(x.shape), scale_bf, zero_bf


def quantize(x: torch.Tensor, bits: int, group_size: int, clip_ratio: ClipRatio = 1.0) -> QuantizedRows:
    """Quantize rows `[..., d]` to packed INT-`bits` codes with per-group bf16 scale and zero."""
    codes, scale, zero = quantize_codes(x, bits, group_size, clip_ratio)
    return QuantizedRows(
        codes=pack_codes(codes, bits, group_size),
        scale=scale,
        zero=zero,
        bits=bits,
        group_size=group_size,
        d=int(x.shape[-1]),
    )


def dequantize_codes(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`code * scale + zero` in float32 from unpacked codes `[..., d]`, then cast to `dtype`."""
    c = _group_view(codes.to(torch.float32), group_size)
    out = c * scale.to(torch.float32).unsqueeze(-1) + zero.to(torch.float32).unsqueeze(-1)
    return out.reshape(codes.shape).to(dtype)


def dequantize(q: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct `[..., d]` rows from a `QuantizedRows` (float32 arithmetic, cast to `dtype`)."""
    codes = unpack_codes(q.codes, q.bits, q.group_size)
    if codes.shape[-1] != q.d:
        raise ValueError(f"packed codes unpack to {codes.shape[-1]} channels but QuantizedRows.d={q.d}")
    return dequantize_codes(codes, q.scale, q.zero, q.group_size, dtype)


def pack_codes(codes: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Pack uint8 codes `[..., d]` planar within each group into `[..., d*bits//8]` bytes.

    INT2: byte `j < G/4` of a group holds channels `j, j+G/4, j+2G/4, j+3G/4` in bits 0-1, 2-3,
    4-5, 6-7. INT4: byte `j < G/2` holds channel `j` in bits 0-3 and `j+G/2` in bits 4-7.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    d = int(codes.shape[-1])
    check_format(bits, group_size, d)
    if codes.numel() and int(codes.max()) >= 2**bits:
        raise ValueError(f"code value {int(codes.max())} does not fit in {bits} bits (valid 0..{2**bits - 1})")
    per = 8 // bits
    planes = codes.reshape(*codes.shape[:-1], d // group_size, per, group_size // per)
    packed = torch.zeros(planes.shape[:-2] + planes.shape[-1:], dtype=torch.uint8, device=codes.device)
    for p in range(per):
        packed |= planes[..., p, :] << (bits * p)
    return packed.reshape(*codes.shape[:-1], d * bits // 8)


def unpack_codes(packed: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Inverse of `pack_codes`: uint8 `[..., d*bits//8]` -> uint8 codes `[..., d]`."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    nbytes = int(packed.shape[-1])
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; valid values are {SUPPORTED_BITS}")
    d = nbytes * 8 // bits
    check_format(bits, group_size, d)
    per = 8 // bits
    mask = (1 << bits) - 1
    groups = packed.reshape(*packed.shape[:-1], d // group_size, group_size // per)
    planes = [(groups >> (bits * p)) & mask for p in range(per)]
    return torch.stack(planes, dim=-2).reshape(*packed.shape[:-1], d)


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, clip_ratio: ClipRatio = 1.0) -> torch.Tensor:
    """Quantize then dequantize (float32), skipping the packing round trip (identical values)."""
    codes, scale, zero = quantize_codes(x, bits, group_size, clip_ratio)
    return dequantize_codes(codes, scale, zero, group_size)


def rotate_clip_quantize(
    x: torch.Tensor,
    R: torch.Tensor,
    mu: torch.Tensor | None = None,
    rho: ClipRatio = 1.0,
    *,
    bits: int,
    group_size: int,
) -> QuantizedRows:
    """`quantize((x - mu) @ R, ...)` in float32: the torch twin of the fused cache-write kernel.

    `x` `[..., d]`, `R` `[d, d]` (or broadcastable batch of them, e.g. `[Hkv, d, d]` against
    `x` `[B, Hkv, T, d]` after unsqueezing), `mu` broadcastable to `x`.
    """
    if R.shape[-1] != x.shape[-1] or R.shape[-2] != x.shape[-1]:
        raise ValueError(f"rotation of shape {tuple(R.shape)} does not match rows with d={x.shape[-1]}")
    xf = x.to(torch.float32)
    if mu is not None:
        xf = xf - mu.to(torch.float32)
    return quantize(xf @ R.to(torch.float32), bits, group_size, clip_ratio=rho)


# ----------------------------------------------------------------------------------------------
# Per-channel key blocks (the "channel" key format, KIVI-style; docs/DESIGN.md, "Per-channel key pages").
#
# Keys of a layer that `auto` gave the channel format are quantized per channel over blocks of `T`
# consecutive tokens (aligned at the start of the quantized segment, which the cache fills in whole blocks):
# the same steps 2-4 as above with the block's `T` tokens of one channel as the group (step 2's quantile is
# taken over those `T` values), so `scale`/`zero` are bf16 `[..., n/T, d]`, one pair per block and channel.
# A token's codes pack exactly like a per-token row (`pack_codes` with the layer's `group_size`), so a page's
# code bytes have the same layout in both formats; only where scale and zero live differs.


@dataclass
class ChannelQuantizedRows:
    """Rows `[..., n, d]` quantized per channel over blocks of `block` tokens: packed codes
    `[..., n, d*bits//8]` (per token, `pack_codes` with `group_size`), bf16 `scale`/`zero` `[..., n//block, d]`."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    block: int
    group_size: int
    d: int

    @property
    def shape(self) -> torch.Size:
        """Shape of the dequantized tensor `[..., n, d]`."""
        return torch.Size((*self.codes.shape[:-1], self.d))

    def nbytes(self) -> int:
        """Bytes held by codes, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


def check_block(block: int, num_tokens: int) -> None:
    """Refuse a channel block size that is not positive or does not divide the token count."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"channel block={block!r} must be a positive number of tokens")
    if num_tokens % block:
        raise ValueError(f"{num_tokens} tokens are not whole blocks of {block}; the channel format quantizes whole blocks only")


def quantize_channels(
    x: torch.Tensor, bits: int, block: int, group_size: int, clip_ratio: ClipRatio = 1.0
) -> ChannelQuantizedRows:
    """Quantize rows `[..., n, d]` per channel over blocks of `block` consecutive tokens (`n % block == 0`).

    `clip_ratio` is a float or a tensor broadcastable to `x.shape[:-2]` (one ratio per head); the clip
    quantile of each block and channel is taken over its `block` values.
    """
    if x.ndim < 2:
        raise ValueError(f"quantize_channels needs rows [..., n, d], got shape {tuple(x.shape)}")
    n, d = int(x.shape[-2]), int(x.shape[-1])
    check_format(bits, group_size, d)
    check_block(block, n)
    blocks = x.to(torch.float32).reshape(*x.shape[:-2], n // block, block, d).transpose(-1, -2)  # [..., nb, d, T]
    rho: ClipRatio = clip_ratio
    if isinstance(clip_ratio, torch.Tensor):
        rho = torch.as_tensor(clip_ratio, dtype=torch.float32, device=x.device)
        rho = torch.broadcast_to(rho, x.shape[:-2])[..., None, None].expand(blocks.shape[:-1])
    codes, scale, zero = quantize_codes(blocks, bits, block, rho)  # codes [..., nb, d, T], scale [..., nb, d, 1]
    codes = codes.transpose(-1, -2).reshape(x.shape)
    return ChannelQuantizedRows(pack_codes(codes, bits, group_size), scale[..., 0], zero[..., 0], bits, block, group_size, d)


def dequantize_channels(q: ChannelQuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reconstruct `[..., n, d]` rows: `code[t, c] * scale[t // block, c] + zero[t // block, c]` (float32)."""
    codes = unpack_codes(q.codes, q.bits, q.group_size)
    n = int(codes.shape[-2])
    if codes.shape[-1] != q.d or n != q.scale.shape[-2] * q.block:
        raise ValueError(f"codes {tuple(codes.shape)} do not match {q.scale.shape[-2]} blocks of {q.block} tokens, d={q.d}")
    c = codes.to(torch.float32).reshape(*codes.shape[:-2], n // q.block, q.block, q.d)
    out = c * q.scale.to(torch.float32).unsqueeze(-2) + q.zero.to(torch.float32).unsqueeze(-2)
    return out.reshape(codes.shape).to(dtype)


def channel_bits_per_element(head_dim: int, bits: int, block: int, meta_bits: int = 16) -> float:
    """Bits per quantized key element of the channel format: `bits + 2 * meta_bits / block`."""
    if block <= 0:
        raise ValueError(f"channel block={block} must be positive")
    return bits + 2 * meta_bits / block


def bits_per_element(
    num_tokens: int,
    head_dim: int,
    bits: int,
    group_size: int,
    sink: int,
    recent: int,
    meta_bits: int = 16,
    full_bits: int = 16,
) -> float:
    """Average storage bits per cached element for one sequence, one KV head, K or V.

    The first `sink` and the last `recent` tokens stay at `full_bits` (BF16); the others cost
    `bits` per channel plus one scale and one zero of `meta_bits` each per group of `group_size`:
    `(n_q * (d*bits + 2*(d/G)*meta_bits) + n_full * d * full_bits) / (num_tokens * d)` with
    `n_full = min(num_tokens, sink + recent)` and `n_q = num_tokens - n_full`.
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens={num_tokens} must be positive")
    if sink < 0 or recent < 0:
        raise ValueError(f"sink={sink} and recent={recent} must be non-negative")
    check_format(bits, group_size, head_dim)
    n_full = min(num_tokens, sink + recent)
    n_q = num_tokens - n_full
    per_token_q = head_dim * bits + 2 * (head_dim // group_size) * meta_bits
    total = n_q * per_token_q + n_full * head_dim * full_bits
    return total / (num_tokens * head_dim)


def bits_per_element_of(num_tokens: int, head_dim: int, tensors: list[torch.Tensor]) -> float:
    """Bits per element actually allocated by `tensors` holding `num_tokens` rows of `head_dim`."""
    if num_tokens <= 0 or head_dim <= 0:
        raise ValueError(f"num_tokens={num_tokens} and head_dim={head_dim} must be positive")
    total_bits = sum(8 * t.numel() * t.element_size() for t in tensors)
    return total_bits / (num_tokens * head_dim)


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Frobenius relative error `||x - x_hat|| / ||x||` (float64)."""
    x64 = x.to(torch.float64)
    den = float(torch.linalg.vector_norm(x64))
    return float(torch.linalg.vector_norm(x64 - x_hat.to(torch.float64))) / (den if den > 0 else 1.0)


# ----------------------------------------------------------------------------------------------
# Page layout in tensor-core fragment order ("mma"), INT2 or INT4, one group per row, d in (64, 128).
#
# A page of a pool in this layout is a sequence of blocks of 16 tokens; a block holds the same
# bytes as 16 packed rows (16 * d/4) but arranged so that lane L = 4r + c of a warp finds every code
# it feeds to ``mma.sync.m16n8k16`` in the d/8 contiguous bytes at ``L * d/8`` of the block, and each
# 16-bit half word holds 8 codes whose 2-bit slot ``i`` (bits 2i, 2i+1) becomes one fp16 operand
# register by one ``lop3`` (magic number 0x6400) and one ``fma``. Every byte belongs to one token, so a
# writer stores a token's d/4 bytes without touching its neighbours'. With part p (0, 1), word u
# (0 .. d/64-1), half h (0, 1) and slot i (0..7), byte ``L*d/8 + p*d/16 + 4u + 2h + i//4``, bits
# ``2*(i%4)`` hold
#   K (scores, keys are the B operand k=channel, n=token): token ``8p + r``,
#       channel ``16*(4u + i//2) + 8*(i%2) + 2c + h``;
#   V (output, values^T are the A operand m=channel, k=token): token ``8p + 2c + h``,
#       channel ``16*(4u + i//2) + 8*(i%2) + r``.
# Scale and zero stay per token in their own tensors (unchanged).
#
# INT4 (same operands, twice the bytes): lane L's d/4 bytes at ``L*d/4``; word u (0 .. d/32-1), half h, slot
# i (0..3, 4 bits each: i < 2 in the low byte, i >= 2 in the high byte, so slots 2-3 need one shift per word and
# every slot stays a subnormal c * 16^(i%2) * 2^-24), byte ``L*d/4 + p*d/8 + 4u + 2h + i//2``, bits ``4*(i%2)``:
#   K: token ``8p + r``, channel ``16*(2u + i//2) + 8*(i%2) + 2c + h``;
#   V: token ``8p + 2c + h``, channel ``16*(2u + i//2) + 8*(i%2) + r``.

MMA_BLOCK_TOKENS = 16
LAYOUTS = ("rows", "mma_k", "mma_v")


MMA_BITS = (2, 4)


def check_mma_layout(bits: int, group_size: int, d: int, page_size: int | None = None) -> None:
    """Refuse a format the fragment-order layout does not cover (INT2/INT4, G = d, d 64/128, pages of 16k)."""
    if bits not in MMA_BITS:
        raise ValueError(f"the mma page layout is defined for bits in {MMA_BITS}, got bits={bits}")
    if d not in (64, 128):
        raise ValueError(f"the mma page layout needs head_dim d in (64, 128), got d={d}")
    if group_size != d:
        raise ValueError(f"the mma page layout needs one group per row (group_size == d={d}), got {group_size}")
    if page_size is not None and (page_size <= 0 or page_size % MMA_BLOCK_TOKENS):
        raise ValueError(f"the mma page layout needs page_size a multiple of {MMA_BLOCK_TOKENS}, got {page_size}")


_MMA_MAPS: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def mma_token_map(d: int, layout: str, bits: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(channel_order [16, d], byte_index [16, d*bits/8])`` (int64, CPU) of the fragment-order layout.

    Token ``tb`` of a block owns bytes ``byte_index[tb]`` (offsets in the block's ``16*d*bits/8`` bytes,
    ascending); byte ``k`` of them holds channels ``channel_order[tb, per*k : per*(k+1)]`` (``per = 8/bits``) in
    bits 0-1, 2-3, 4-5, 6-7 (INT2) or 0-3, 4-7 (INT4).
    """
    if layout not in ("mma_k", "mma_v"):
        raise ValueError(f"layout={layout!r} has no token map; valid: 'mma_k', 'mma_v'")
    check_mma_layout(bits, d, d)
    key = (d, layout, bits)
    if key not in _MMA_MAPS:
        per = 8 // bits  # codes per byte
        slots = 2 * per  # slots of a half word
        lane_bytes, part_bytes = d * bits // 16, d * bits // 32
        pos = torch.empty(MMA_BLOCK_TOKENS, d, dtype=torch.int64)  # code position in the block
        for lane in range(32):
            r, c = divmod(lane, 4)
            for p in range(2):
                for u in range(d * bits // 128):
                    for h in range(2):
                        for i in range(slots):
                            byte = lane * lane_bytes + p * part_bytes + 4 * u + 2 * h + i // per
                            ch16 = 16 * (per * u + i // 2) + 8 * (i % 2)
                            if layout == "mma_k":
                                tok, ch = 8 * p + r, ch16 + 2 * c + h
                            else:
                                tok, ch = 8 * p + 2 * c + h, ch16 + r
                            pos[tok, ch] = per * byte + i % per
        order = torch.argsort(pos, dim=1)
        byte_index = torch.gather(pos, 1, order)[:, ::per] // per
        _MMA_MAPS[key] = (order, byte_index.contiguous())
    return _MMA_MAPS[key]


def pack_codes_mma(codes: torch.Tensor, token_in_block: torch.Tensor, layout: str, bits: int = 2) -> torch.Tensor:
    """Codes uint8 ``[..., d]`` of tokens at block positions ``token_in_block`` ``[...]`` -> their
    ``[..., d*bits/8]`` bytes, byte ``k`` going to ``mma_token_map(d, layout, bits)[1][tb, k]`` of the block."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if codes.numel() and int(codes.max()) >= 2**bits:
        raise ValueError(f"code value {int(codes.max())} does not fit in {bits} bits (valid 0..{2**bits - 1})")
    d, per = int(codes.shape[-1]), 8 // bits
    order, _ = mma_token_map(d, layout, bits)
    idx = order.to(codes.device)[token_in_block.long()]  # [..., d]
    q = torch.gather(codes, -1, idx.expand(codes.shape)).reshape(*codes.shape[:-1], d // per, per)
    out = q[..., 0].clone()
    for s in range(1, per):
        out |= q[..., s] << (bits * s)
    return out


def unpack_codes_mma(packed: torch.Tensor, token_in_block: torch.Tensor, layout: str, bits: int = 2) -> torch.Tensor:
    """Inverse of ``pack_codes_mma``: a token's ``[..., d*bits/8]`` bytes -> codes uint8 ``[..., d]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    per = 8 // bits
    d = int(packed.shape[-1]) * per
    order, _ = mma_token_map(d, layout, bits)
    mask = (1 << bits) - 1
    slots = torch.stack([(packed >> (bits * s)) & mask for s in range(per)], dim=-1).reshape(*packed.shape[:-1], d)
    idx = order.to(packed.device)[token_in_block.long()].expand(slots.shape)
    return torch.empty_like(slots).scatter_(-1, idx, slots)


__all__ = [
    "ChannelQuantizedRows",
    "LAYOUTS",
    "MMA_BITS",
    "MMA_BLOCK_TOKENS",
    "QuantizedRows",
    "SUPPORTED_BITS",
    "bits_per_element",
    "bits_per_element_of",
    "channel_bits_per_element",
    "check_block",
    "check_format",
    "check_mma_layout",
    "dequantize",
    "dequantize_channels",
    "dequantize_codes",
    "fake_quantize",
    "mma_token_map",
    "pack_codes",
    "pack_codes_mma",
    "percentile_clip",
    "quantize",
    "quantize_channels",
    "quantize_codes",
    "relative_error",
    "rotate_clip_quantize",
    "unpack_codes_mma",
]

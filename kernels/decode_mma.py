"""Paged INT2/INT4 decode attention on pages in tensor-core fragment order (CUDA, one launch per call).

The pages are in the ``mma_k`` / ``mma_v`` layouts that ``oscar.core.quant`` defines (``mma_token_map``):
each lane of a warp loads the codes of its ``mma.sync`` operands with one 8- or 16-byte load per 16
tokens and turns them into fp16 registers with one ``lop3`` and one ``fma`` per two codes; no shared
memory on the way. One launch does everything (``decode_mma.cu``): ``num_splits`` CTAs per sequence and
KV head over the quantized tokens (query rotated in the CTA, scores ``s_K (q.c) + z_K sum(q) + q.mu_K``,
output ``sum (p s_V) c + sum p z_V``; per-channel keys, ``QuantPages.block = T``: scores ``(q_r s) . c + q_r . z``
with ``s``, ``z`` of the token's block of ``T``, the query scaled once per block), one CTA per BF16 window (sink,
recent; bf16 tensor cores), and the log-sum-exp merge with the change of frame done by the last CTA of each
(sequence, KV head) (an atomic ticket; the counter is reset by that CTA, so the grid is fixed and the call can be
captured in a CUDA graph).

Compiled at first use by NVRTC (``torch.cuda._utils``); CUDA only. Launcher: ``paged_decode_attention_mma``;
launch settings: ``oscar.kernels.launch.MmaLaunch``; torch twin (the specification):
``oscar.cache.paged.decode_attention_torch`` on the same pages; CPU tests emulate the fragment arithmetic
(tests/test_kernels_decode_mma.py, tests/test_kernels_decode_rope.py, tests/test_kernels_decode_mma_channel.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
import weakref
from pathlib import Path
from typing import Optional

import torch

from ._runtime import check
from .launch import ROPE_BLOCKS, MmaLaunch
from .segments import HeadTransform, Pages, Segments

LOG2E = 1.4426950408889634
MAX_PARTIALS = 256  # SMAX in decode_mma.cu: split-K partials plus BF16 windows per (sequence, KV head)
SOURCE = Path(__file__).with_name("decode_mma.cu")
CHANNEL_KEYS = True  # reads per-channel key pages (QuantPages.block > 0; docs/DESIGN.md "Per-channel key pages")
_POINTERS = ("q", "kc", "vc", "ks", "kz", "vs", "vz", "page_table", "int_len", "rk", "muk", "rot_out", "muv",
             "sink_k", "sink_v", "sink_len", "rec_k", "rec_v", "rec_len", "part_o", "part_ml", "counters", "out")
_INTS = ("hkv", "pt_stride", "page_shift", "s_int", "s_total", "has_sink", "has_rec", "out_rotated")
_LONGS = ("cs_p", "cs_h", "ss_p", "ss_h", "sk_b", "sk_h", "sk_t", "sk_max", "rk_b", "rk_h", "rk_t", "rk_max")
_ROPE_POINTERS = ("rope_m", "rope_w", "rope_tab", "rope_pos0")


class Params(ctypes.Structure):
    """Mirror of ``struct Params`` in ``decode_mma.cu`` (same order; C alignment rules)."""

    _fields_ = ([(n, ctypes.c_void_p) for n in _POINTERS] + [("sc", ctypes.c_float)]
                + [(n, ctypes.c_int) for n in _INTS] + [(n, ctypes.c_longlong) for n in _LONGS]
                + [(n, ctypes.c_void_p) for n in _ROPE_POINTERS] + [("rope_scaling", ctypes.c_float)]
                + [("rope_half", ctypes.c_int), ("rope_pos_add", ctypes.c_int), ("win_row", ctypes.c_void_p)]
                + [("kss_p", ctypes.c_longlong), ("kss_h", ctypes.c_longlong)])


_KERNELS: dict[tuple, ctypes.c_void_p] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_COPIES: dict[tuple, tuple] = {}


def kernel_name(d: int, rep: int, num_warps: int, stages: int, min_blocks: int, rope_blocks: int = 0,
                bits: int = 2, block: int = 0) -> str:
    """The template instance: head_dim, code bits, GQA ratio, warps per CTA, stages of each warp's cp.async ring
    (blocks of 16 tokens; stages - 1 in flight), the CTAs per SM the register allocation must allow
    (``__launch_bounds__``), for rope-centered keys a warp's blocks per turn of the rope term (0: none), and the
    tokens per channel block of per-channel keys (0: per-token keys)."""
    return f"oscar_decode_mma<{d},{bits},{rep},{num_warps},{stages},{min_blocks},{rope_blocks},{block}>"


def stage_bytes(d: int, bits: int = 2, block: int = 0) -> int:
    """One stage of a warp's ring (``Stage`` in decode_mma.cu): K and V codes of 16 tokens, their per-token
    scales/zeros (V only with per-channel keys), and with per-channel keys a channel block's K scales and zeros."""
    codes = 2 * 16 * d * bits // 8
    return codes + (64 + 4 * d if block else 128)


def dynamic_bytes(d: int, rep: int, num_warps: int, stages: int, bits: int = 2, block: int = 0) -> int:
    """Dynamic shared memory of a launch: the warps' cp.async rings, then (aliased) their outputs."""
    return max(num_warps * stages * stage_bytes(d, bits, block), num_warps * rep * d * 4)


def shared_bytes(d: int, rep: int, num_warps: int, stages: int, rope: bool = False, bits: int = 2,
                 block: int = 0) -> int:
    """Shared memory of a CTA, static plus dynamic (mirrors decode_mma.cu)."""
    rope_u = 4 * rep * (d + 4) if rope else 4
    query_frags = 48 * d if block else 16  # s_qc: the query's fragments for per-channel keys
    static = 4 * rep * d + 4 * rep * MAX_PARTIALS + 2 * 4 * num_warps * 2 * rep + rope_u + query_frags + 16
    return static + dynamic_bytes(d, rep, num_warps, stages, bits, block)


def shared_limit(bits: int, min_blocks: int) -> int:
    """Shared memory a CTA may use: what ``min_blocks`` CTAs of an SM may share (228 KiB, 1 KiB reserved per CTA; at
    most 227 KiB). The default ``stages`` stays at 4 (the measured v9 configurations, under 48 KiB for INT2);
    deeper rings (5, 6 stages of 8 warps) are asked for explicitly."""
    return min(227 * 1024, 228 * 1024 // max(1, min_blocks) - 1024)


def rope_table(inv_freq: torch.Tensor, d: int, num_warps: int, rope_blocks: int) -> torch.Tensor:
    """The rope term's constant A fragments (fp16 in int32 ``[RT, d/16, 32, 4]``): entry ``[k, kc, 4g + t, r]`` packs
    ``E[k, j, c], E[k, j, c + 1]`` with ``j = g + 8 (r & 1)``, ``c = 16 kc + 2t + 8 (r >> 1)``, where
    ``E[k, j, c] = cos(x w_c)`` for ``c < d/2`` and ``sin(x w_{c - d/2})`` above, ``x = 16 num_warps k + j`` and
    ``w`` the inverse frequencies padded with zeros to ``d/2`` (float64, then fp16). ``num_warps`` is the stride in
    blocks between a warp's consecutive blocks: the warps of a CTA (per-token keys), 1 (per-channel keys)."""
    w = torch.zeros(d // 2, dtype=torch.float64)
    w[: inv_freq.numel()] = inv_freq.detach().to("cpu", torch.float64)
    x = (16 * num_warps * torch.arange(rope_blocks, dtype=torch.float64)[:, None]
         + torch.arange(16, dtype=torch.float64)[None, :])  # [RT, 16]
    ang = x[..., None] * w  # [RT, 16, d/2]
    E = torch.cat([ang.cos(), ang.sin()], dim=-1).to(torch.float16)  # [RT, 16, d]
    ar = lambda n, at: torch.arange(n).view([-1 if i == at else 1 for i in range(5)])  # noqa: E731
    kc, g, t, r, e = ar(d // 16, 0), ar(8, 1), ar(4, 2), ar(4, 3), ar(2, 4)
    rows, cols = torch.broadcast_tensors(g + 8 * (r % 2), 16 * kc + 2 * t + 8 * (r // 2) + e)
    frag = E[:, rows, cols]  # [RT, d/16, 8, 4, 4, 2]
    return frag.reshape(rope_blocks, d // 16, 32, 4, 2).contiguous().view(torch.int32).reshape(rope_blocks, d // 16, 32, 4)


def _function(d: int, rep: int, num_warps: int, stages: int, min_blocks: int, dev: torch.device,
              rope_blocks: int = 0, bits: int = 2, block: int = 0) -> ctypes.c_void_p:
    key = (d, rep, num_warps, stages, min_blocks, rope_blocks, bits, block, dev)
    if key not in _KERNELS:
        try:
            from torch.cuda._utils import _cuda_load_module, _nvrtc_compile
        except ImportError as err:  # pragma: no cover - depends on the torch build
            raise RuntimeError("the mma decode kernel needs torch.cuda._utils (NVRTC), absent in this torch") from err
        name = kernel_name(d, rep, num_warps, stages, min_blocks, rope_blocks, bits, block)
        with torch.cuda.device(dev):
            major, minor = torch.cuda.get_device_capability(dev)
            check(major >= 8, lambda: f"the mma decode kernel needs compute capability >= 8.0, got {major}.{minor}")
            cubin, mangled = _nvrtc_compile(SOURCE.read_text(), name, f"{major}{minor}", None, ["-std=c++17"])
            _KERNELS[key] = _cuda_load_module(cubin, [mangled])[mangled].func
    return _KERNELS[key]


_ATTRS: dict[tuple, int] = {}
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (percent of the most shared memory)


def _set_attribute(lib, func: ctypes.c_void_p, attr: int, value: int) -> None:
    key = (ctypes.cast(func, ctypes.c_void_p).value, attr)
    if _ATTRS.get(key) != value:
        err = lib.cuFuncSetAttribute(func, attr, value)
        if err != 0:
            raise RuntimeError(f"cuFuncSetAttribute({attr}, {value}) of the mma decode kernel failed with CUDA error {err}")
        _ATTRS[key] = value


@functools.cache
def _driver() -> ctypes.CDLL:
    """The CUDA driver library, opened once (torch's helper opens a new ``ctypes.CDLL`` per call)."""
    from torch.cuda._utils import _get_gpu_runtime_library

    return _get_gpu_runtime_library()


def _launch(func: ctypes.c_void_p, grid: tuple, threads: int, params: Params, dev: torch.device, dynamic: int = 0,
            carveout: Optional[int] = None) -> None:
    lib = _driver()
    _set_attribute(lib, func, _MAX_DYNAMIC_SHARED, dynamic)
    if carveout is not None:
        _set_attribute(lib, func, _CARVEOUT, carveout)
    args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
    stream = torch.cuda.current_stream(dev)
    err = lib.cuLaunchKernel(func, grid[0], grid[1], grid[2], threads, 1, 1, dynamic,
                             ctypes.c_void_p(stream.cuda_stream), args, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernel of the mma decode kernel failed with CUDA error {err}")


def _derived(t: torch.Tensor, kind: str, make) -> torch.Tensor:
    """A derived copy of ``t`` (fp32 contiguous, or its per-head transpose), made once per tensor and version."""
    key = (id(t), kind)
    hit = _COPIES.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    out = make(t)
    for k in [k for k, v in _COPIES.items() if v[0]() is None]:
        del _COPIES[k]
    _COPIES[key] = (weakref.ref(t), t._version, out)
    return out


def mma_b_fragments(M: torch.Tensor) -> torch.Tensor:
    """``M`` ``[H, D, D]`` (for ``y = x @ M``) as fp16 B fragments of ``mma.m16n8k16``: int32 ``[H, D/8, D/16, 32, 2]``.

    Entry ``[h, nt, kc, 4g + t, r]`` packs ``M[h, 16 kc + 2t + 8r + e, 8 nt + g]`` for ``e = 0`` (low half), 1 (high).
    """
    H, D, D2 = M.shape
    if D != D2 or D % 16:
        raise ValueError(f"M must be [H, D, D] with D a multiple of 16, got {tuple(M.shape)}")
    dev = M.device
    ar = lambda n, at: torch.arange(n, device=dev).view([-1 if i == at else 1 for i in range(6)])  # noqa: E731
    nt, kc, g, t, r, e = ar(D // 8, 0), ar(D // 16, 1), ar(8, 2), ar(4, 3), ar(2, 4), ar(2, 5)
    rows, cols = torch.broadcast_tensors(16 * kc + 2 * t + 8 * r + e, 8 * nt + g)
    frag = M.to(torch.float16)[:, rows, cols]  # [H, D/8, D/16, 8, 4, 2, 2]
    return frag.reshape(H, D // 8, D // 16, 32, 2, 2).contiguous().view(torch.int32).reshape(H, D // 8, D // 16, 32, 2)


def _counters(dev: torch.device, n: int) -> torch.Tensor:
    buf = _COUNTERS.get(dev)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=dev)
        _COUNTERS[dev] = buf
    return buf


def default_num_splits(batch: int, num_kv_heads: int, capacity_tokens: int, num_warps: int = 8,
                       num_sms: int = 132, ctas_per_sm: int = 2, waves: Optional[float] = None,
                       blocks_per_warp: int = 4) -> int:
    """Splits per sequence and KV head: about ``waves`` full waves of CTAs (default: one below 64 (sequence,
    KV head) pairs, two from there; measured on the H200, reports/kernels/mma/sweep4.csv), each warp at least
    ``blocks_per_warp`` blocks of 16 tokens."""
    pairs = max(batch * num_kv_heads, 1)
    if waves is None:
        waves = 1.0 if pairs < 64 else 2.0
    want = math.ceil(waves * num_sms * ctas_per_sm / pairs)
    most = max(1, min(MAX_PARTIALS - 2, math.ceil(capacity_tokens / (16 * blocks_per_warp * num_warps))))
    return int(max(1, min(want, most)))


def _window(name, k, v, n, B, hkv, d, dev, rows):
    check(k.shape == v.shape and k.dim() == 4 and (rows or k.shape[0] == B) and k.shape[1] == hkv and k.shape[3] == d,
          lambda: f"{name} keys/values must be [B={B}, Hkv={hkv}, S, {d}] (or [R, Hkv, S, {d}] with window_rows), got "
          f"{tuple(k.shape)} and {tuple(v.shape)}")
    check(k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16,
          lambda: f"{name} keys/values must be bf16, got {k.dtype}")
    check(k.stride() == v.stride() and k.stride(-1) == 1 and all(st % 2 == 0 for st in k.stride()[:3]),
          lambda: f"{name} keys and values need equal strides, contiguous rows of even stride; got {k.stride()}, {v.stride()}")
    check(n.dtype == torch.int32 and n.numel() >= B and n.device == dev,
          lambda: f"{name} lengths must be int32 [>= {B}] on {dev}")
    return k, v, n


def paged_decode_attention_mma(
    q: torch.Tensor,
    k_pages: Pages,
    v_pages: Pages,
    segments: Segments,
    k_t: HeadTransform,
    v_t: HeadTransform,
    *,
    sm_scale: Optional[float] = None,
    output_frame: str = "original",
    launch: Optional[MmaLaunch] = None,
) -> torch.Tensor:
    """Decode attention ``[B, H, d]`` (``q.dtype``) over BF16 sink + INT2/INT4 pages in the mma layouts + BF16 recent.

    Same arguments and result as ``oscar.cache.paged.decode_attention_torch`` (the twin) on K pages in ``mma_k`` and
    V pages in ``mma_v`` (INT2 or INT4, one group per row, d 64/128, GQA 1/2/4/8); ``launch``: ``MmaLaunch``
    (split-K, warps, ring stages, CTAs per SM, carveout, rope turn). ``segments.window_rows`` (int32 ``[B]``):
    sequence ``b`` reads row ``window_rows[b]`` of the windows (``[R, Hkv, S, d]``: a cache's per-slot window
    buffers, read in place; the rows are not range-checked).

    Rope-centered keys (``k_t.rope_mu``: stored as ``(k - mu - RoPE_p(m)) R_K``; ``rope_mu`` ``[Hkv, d]`` with zero rows
    for heads that are not centered, ``rope_freq`` the inverse frequencies ``[r/2]`` of the rotate-half RoPE,
    ``rope_scaling``) with ``segments.int_pos0`` (position of each sequence's first quantized token: int, or int32
    ``[B]``) add ``q . RoPE_p(m)`` to each quantized logit.

    Per-channel keys (``k_pages.block = T``, a power of two from 16 dividing the page size; ``k_pages.scale``/``zero``
    bf16 ``[P, Hkv, page_size/T, d]``, contiguous): the logit of a token of block ``j`` is
    ``(q_r * scale[j]) . code + q_r . zero[j]`` (+ ``q . mu_K``, + the rope term); each warp reads a contiguous run of
    blocks and turns the query at its first block and at each block's first 16 tokens; the products ``q_r * scale`` are
    fp16 (scales below 6e-5 lose precision there, above 65504 overflow).
    """
    launch = MmaLaunch() if launch is None else launch
    check(isinstance(launch, MmaLaunch), lambda: f"launch={launch!r} is not an MmaLaunch (the mma kernel's settings)")
    num_warps, min_blocks, rope_blocks = launch.warps, launch.min_blocks, launch.rope_blocks
    R_K, mu_K, R_V, mu_V = k_t.R, k_t.mu, v_t.R, v_t.mu
    page_table, int_len, window_rows = segments.page_table, segments.int_len, segments.window_rows
    check(k_pages.layout == "mma_k" and v_pages.layout == "mma_v",
          lambda: f"the mma decode kernel reads K pages in 'mma_k' and V pages in 'mma_v', got {k_pages.layout!r} and "
          f"{v_pages.layout!r} (row-layout pages: oscar.kernels.decode_rows)")
    bits = k_pages.bits
    check(v_pages.bits == bits, lambda: f"K and V pages need one format, got INT{bits} and INT{v_pages.bits}")
    block = int(getattr(k_pages, "block", 0))
    check(int(getattr(v_pages, "block", 0)) == 0,
          lambda: "V pages are per token (block=0); per-channel blocks are a key "
          f"format, got V pages with block={getattr(v_pages, 'block', 0)}")
    k_codes, k_scale, k_zero = k_pages.codes, k_pages.scale, k_pages.zero
    v_codes, v_scale, v_zero = v_pages.codes, v_pages.scale, v_pages.zero
    check(q.is_cuda, lambda: f"the mma decode kernel runs on CUDA tensors, q is on {q.device}")
    check(q.dim() == 3, lambda: f"q must be [B, H, d], got shape {tuple(q.shape)}")
    B, H, d = (int(s) for s in q.shape)
    check(d in (64, 128), lambda: f"head_dim d={d} is not supported by the mma layout; valid: 64, 128")
    dev = q.device
    check(k_codes.dim() == 4 and k_codes.dtype == torch.uint8 and k_codes.shape == v_codes.shape,
          lambda: f"codes must be uint8 [P, Hkv, page_size, {d // 4}] for K and V, got {tuple(k_codes.shape)}, "
          f"{tuple(v_codes.shape)}")
    npages, hkv, page_size, nbytes = (int(s) for s in k_codes.shape)
    check(bits in (2, 4), lambda: f"bits={bits} is not supported by the mma layout; valid: 2, 4")
    check(nbytes == d * bits // 8,
          lambda: f"codes rows must be d*bits/8={d * bits // 8} bytes (INT{bits}), got {nbytes}")
    check(page_size % 16 == 0 and page_size & (page_size - 1) == 0,
          lambda: f"page_size={page_size} must be a power of two >= 16 for the mma layout")
    check(block == 0 or (block >= 16 and block & (block - 1) == 0 and page_size % block == 0),
          lambda: f"per-channel key block={block} must be 0 (per-token keys) or a power of two >= 16 dividing "
          f"page_size={page_size} (the kernel takes whole 16-token blocks of one channel block)")
    check(H % hkv == 0 and H // hkv in (1, 2, 4, 8),
          lambda: f"query heads H={H} over KV heads Hkv={hkv}: GQA ratio must be 1, 2, 4 or 8")
    rep = H // hkv
    rope = k_t.rope_centered
    rope_pos0 = segments.int_pos0
    check(not rope or rope_pos0 is not None, "rope-centered keys need segments.int_pos0 (the position of each "
          "sequence's first quantized token)")
    limit = shared_limit(bits, min_blocks)
    stages = launch.stages
    if stages is None:
        stages = 4
        while stages > 2 and shared_bytes(d, rep, num_warps, stages, rope, bits, block) > limit:
            stages -= 1
    check(2 <= stages <= 6 and shared_bytes(d, rep, num_warps, stages, rope, bits, block) <= limit,
          lambda: f"stages={stages} must be in 2-6 and fit {limit} bytes of shared memory "
          f"({shared_bytes(d, rep, num_warps, stages, rope, bits, block)} bytes at d={d}, INT{bits}, GQA {rep}, "
          f"{num_warps} warps{f', key block {block}' if block else ''})")
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes)):
        check(t.is_contiguous() and t.device == dev, lambda: f"{name} must be contiguous on {dev}")
    for name, t in (("k_scale", k_scale), ("k_zero", k_zero), ("v_scale", v_scale), ("v_zero", v_zero)):
        if block and name[0] == "k":
            check(tuple(t.shape) == (npages, hkv, page_size // block, d) and t.dtype == torch.bfloat16
                  and t.is_contiguous() and t.device == dev and t.data_ptr() % 16 == 0,
                  lambda: f"{name} of per-channel keys must be contiguous, 16-byte aligned bf16 [{npages}, {hkv}, "
                  f"{page_size // block}, {d}] on {dev} (block {block}), got {t.dtype} {tuple(t.shape)}")
            continue
        check(tuple(t.shape) == (npages, hkv, page_size, 1) and t.dtype == torch.bfloat16 and t.is_contiguous()
              and t.device == dev, lambda: f"{name} must be contiguous bf16 [{npages}, {hkv}, {page_size}, 1] on {dev} "
              f"(one group per row), got {t.dtype} {tuple(t.shape)}")
    check(page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] >= B
          and page_table.stride(1) == 1 and page_table.device == dev,
          lambda: f"page_table must be int32 [>= {B}, pages] with contiguous rows on {dev}, got {page_table.dtype} "
          f"{tuple(page_table.shape)}")
    check(int_len.dtype == torch.int32 and int_len.numel() >= B and int_len.device == dev,
          lambda: f"int_len must be int32 [>= {B}] on {dev}, got {int_len.dtype} {tuple(int_len.shape)}")
    check(output_frame in ("original", "rotated"),
          lambda: f"output_frame={output_frame!r} must be 'original' or 'rotated'")
    check(32 * num_warps >= d, lambda: f"MmaLaunch(warps={num_warps}) is too few for d={d}: at least d/32 warps")
    rows = window_rows is not None
    check(not rows or (window_rows.dtype == torch.int32 and window_rows.dim() == 1 and window_rows.numel() >= B
                       and window_rows.device == dev),
          lambda: f"window_rows must be int32 [>= {B}] on {dev}, got "
          f"{None if window_rows is None else (window_rows.dtype, tuple(window_rows.shape), str(window_rows.device))}")
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

    def f32(t, shape, name):
        if t is None:
            return None
        check(tuple(t.shape) == shape, lambda: f"{name} must be {list(shape)}, got {tuple(t.shape)}")
        return _derived(t, "f32", lambda x: x.to(device=dev, dtype=torch.float32).contiguous())

    def frags(t, kind, name):
        if t is None:
            return None
        check(tuple(t.shape) == (hkv, d, d), lambda: f"{name} must be [{hkv}, {d}, {d}], got {tuple(t.shape)}")
        make = (lambda x: mma_b_fragments(x.to(dev, torch.float32).transpose(1, 2))) if kind == "T" else \
            (lambda x: mma_b_fragments(x.to(dev, torch.float32)))
        return _derived(t, "frag" + kind, make)

    rk = frags(R_K, "", "R_K")
    muk = f32(mu_K, (hkv, d), "mu_K")
    muv = f32(mu_V, (hkv, d), "mu_V")
    # the quantized partials o_rot go to the original frame by o_rot @ R_V^T; BF16 partials to the rotated by o @ R_V
    rot_out = frags(R_V, "T" if output_frame == "original" else "", "R_V")
    capacity = int(page_table.shape[1]) * page_size
    s_int = launch.num_splits if launch.num_splits is not None else default_num_splits(B, hkv, capacity, num_warps)
    s_total = s_int + (sink is not None) + (rec is not None)
    check(s_int >= 1 and s_total <= MAX_PARTIALS, lambda: f"num_splits={s_int} must be in [1, {MAX_PARTIALS - 2}]")
    part_o = torch.empty(B, hkv, s_total, rep, d, dtype=torch.float32, device=dev)
    part_ml = torch.empty(B, hkv, s_total, rep, 2, dtype=torch.float32, device=dev)
    counters = _counters(dev, B * hkv)
    qb = q.to(torch.bfloat16).contiguous()
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)

    p = Params()
    keep = []  # tensors whose pointers the launch holds

    def ptr(name, t):
        if t is not None:
            keep.append(t)
            setattr(p, name, t.data_ptr())

    for name, t in (("q", qb), ("kc", k_codes), ("vc", v_codes), ("ks", k_scale), ("kz", k_zero), ("vs", v_scale),
                    ("vz", v_zero), ("page_table", page_table), ("int_len", int_len), ("rk", rk), ("muk", muk),
                    ("rot_out", rot_out), ("muv", muv), ("part_o", part_o), ("part_ml", part_ml),
                    ("counters", counters), ("out", out), ("win_row", window_rows if sink or rec else None)):
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
    p.hkv, p.pt_stride, p.page_shift = hkv, int(page_table.stride(0)), page_size.bit_length() - 1
    p.s_int, p.s_total, p.has_sink, p.has_rec = s_int, s_total, int(sink is not None), int(rec is not None)
    p.out_rotated = int(output_frame == "rotated")
    p.cs_p, p.cs_h = int(k_codes.stride(0)), int(k_codes.stride(1))
    p.ss_p, p.ss_h = int(v_scale.stride(0)), int(v_scale.stride(1))
    p.kss_p, p.kss_h = int(k_scale.stride(0)), int(k_scale.stride(1))
    rt = 0
    if rope:
        rt = rope_blocks
        rope_freq = k_t.rope_freq
        h = int(rope_freq.numel())
        check(rope_freq.dim() == 1 and 0 < 2 * h <= d, lambda: f"rope_freq must be [<= {d // 2}] frequencies, got "
              f"{tuple(rope_freq.shape)}")
        ptr("rope_m", f32(k_t.rope_mu, (hkv, d), "rope_mu"))
        ptr("rope_w", _derived(rope_freq, f"ropew{d}", lambda x: torch.nn.functional.pad(
            x.to(dev, torch.float64), (0, d // 2 - x.numel())).contiguous()))
        stride = 1 if block else num_warps  # blocks between a warp's consecutive blocks
        ptr("rope_tab", _derived(rope_freq, f"ropetab{d},{stride},{rt},{dev}",
                                 lambda x: rope_table(x, d, stride, rt).to(dev)))
        if isinstance(rope_pos0, torch.Tensor):
            check(rope_pos0.dtype == torch.int32 and rope_pos0.numel() >= B and rope_pos0.device == dev,
                  lambda: f"int_pos0 must be an int or int32 [>= {B}] on {dev}, got {rope_pos0.dtype} {tuple(rope_pos0.shape)}")
            ptr("rope_pos0", rope_pos0)
        else:
            check(0 <= int(rope_pos0) < 2**30, lambda: f"int_pos0={rope_pos0} must be a position in [0, 2^30)")
            p.rope_pos_add = int(rope_pos0)
        p.rope_scaling, p.rope_half = float(k_t.rope_scaling), h
    _launch(_function(d, rep, num_warps, stages, min_blocks, dev, rt, bits, block), (s_total, hkv, B), 32 * num_warps,
            p, dev, dynamic_bytes(d, rep, num_warps, stages, bits, block), launch.carveout)
    return out if q.dtype == torch.bfloat16 else out.to(q.dtype)


__all__ = ["CHANNEL_KEYS", "Params", "ROPE_BLOCKS", "default_num_splits", "dynamic_bytes", "kernel_name",
           "mma_b_fragments", "paged_decode_attention_mma", "rope_table", "shared_bytes", "shared_limit", "stage_bytes"]

"""End-to-end decode throughput: random-weight models of real architectures, device caches, CUDA-graph
timing, a per-step breakdown (GEMM / attention / quantize+demote / other) and the correctness check
of the device path against the host-driven cache.

Used by the throughput table (`python -m oscar gpu throughput`; measuring in `oscar.bench.throughput.run`); the
functions take plain arguments so tests can drive them on the CPU with tiny models.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from oscar.cache import attention
from oscar.cache import device_cache as dc
from oscar.cache import paged
from oscar.cache.formats import CacheFormat
from oscar.cache.torch_cache import LayerRotations
from oscar.core.rotation import random_orthogonal
from oscar.models.engine import new_cache, rotations_in_code
from oscar.models.methods import needs_statistics

CACHES = ("bf16", "oscar", "saw_int4")


# ----------------------------------------------------------------------------------------------
# models


def architecture_config(family: str, dims: dict[str, Any]) -> Any:
    """A transformers config of ``family`` (config class from the registry) with the given sizes."""
    import transformers

    classes = {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config", "llama": "LlamaConfig"}
    if family not in classes:
        raise ValueError(f"family {family!r} has no throughput profile; valid: {', '.join(classes)}")
    cls = getattr(transformers, classes[family])
    return cls(**dims)


def build_random_model(config: Any, *, device: Any, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> Any:
    """``AutoModelForCausalLM`` of ``config`` with seeded random weights, built directly on ``device``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, std)
    return model.eval()


def geometry(model: Any) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head_dim)."""
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return int(cfg.num_hidden_layers), heads, hkv, d


# ----------------------------------------------------------------------------------------------
# cache formats


@dataclass
class TimedCache:
    """A cache the profile times: its storage format (`oscar.cache.formats.CacheFormat`, the value the
    engine and the SGLang settings use too), the per-layer kernel transforms of a quantized format, the
    page layout and a note on where the rotations came from."""

    format: CacheFormat
    transforms: Optional[list[tuple[paged.HeadTransform, paged.HeadTransform]]] = None
    note: str = ""
    layout: str = "auto"  # page layout of a paged format: auto | rows | mma (RotatedFormat.resolve_layout)

    name = property(lambda self: self.format.name)
    bits = property(lambda self: self.format.bits)
    group_size = property(lambda self: self.format.group_size)
    sink = property(lambda self: self.format.sink)
    recent = property(lambda self: self.format.recent)
    page_size = property(lambda self: self.format.page_size)

    def with_windows(self, sink: int, recent: int, page_size: int) -> "TimedCache":
        """The same cache with other BF16 windows and page size (the tiny correctness check)."""
        fmt = dataclasses.replace(self.format, sink=sink, recent=recent, page_size=page_size)
        return TimedCache(fmt, self.transforms, self.note, self.layout)


def head_transforms(rotations: Sequence[Any]) -> list[tuple[paged.HeadTransform, paged.HeadTransform]]:
    """`oscar.cache.torch_cache.LayerRotations` -> per-layer (K, V) `HeadTransform`s (clip ratios only where < 1)."""
    return [r.paged_transforms(f"layer {layer}") for layer, r in enumerate(rotations)]


def timing_rotations(method_cfg: Any, model: Any, seed: int = 0) -> tuple[list[Any], str]:
    """Per-layer rotations for timing a method: built in code where the method needs no calibration;
    for calibrated methods a seeded random orthogonal matrix per (layer, head) of the same shape (a
    dense ``[Hkv, d, d]`` rotation, the same kernel work as ``U.H.P``), with the method's fixed clip
    ratios. Returns the rotations and a note saying which."""
    if not needs_statistics(method_cfg):
        return rotations_in_code(method_cfg, model), f"{method_cfg.name}: rotations built in code"
    layers, _, hkv, d = geometry(model)
    clip = str(method_cfg.clip) != "none"
    rho_k = torch.full((hkv,), float(method_cfg.rho_k)) if clip else None
    rho_v = torch.full((hkv,), float(method_cfg.rho_v)) if clip else None
    rots = []
    for layer in range(layers):
        rk = torch.stack([random_orthogonal(d, seed=seed + 1000 * layer + h, dtype=torch.float32) for h in range(hkv)])
        rv = torch.stack([random_orthogonal(d, seed=seed + 1000 * layer + h + 500, dtype=torch.float32) for h in range(hkv)])
        rots.append(LayerRotations(rk, rv, None, None, rho_k, rho_v))
    note = (f"{method_cfg.name}: seeded random orthogonal [Hkv, d, d] rotations in place of the calibrated U.H.P "
            f"(same shape, same kernel work), clip ratios {float(method_cfg.rho_k)}/{float(method_cfg.rho_v)}")
    return rots, note


def timed_cache(method_cfg: Any, model: Any, seed: int = 0) -> TimedCache:
    """The `TimedCache` of a method whose format the device cache serves, on ``model``."""
    fmt = CacheFormat.from_method(method_cfg, geometry(model)[3])
    fmt.check_served("device")
    if not fmt.quantized:
        return TimedCache(fmt, note="static BF16 cache, torch SDPA")
    rots, note = timing_rotations(method_cfg, model, seed)
    return TimedCache(fmt, transforms=head_transforms(rots), note=note)


def new_device_cache(fmt: TimedCache, model: Any, batch: int, context: int, *, extra_steps: int, device: Any,
                     backend: str = "triton", dtype: torch.dtype = torch.bfloat16,
                     shuffle_pages: bool = False) -> dc.DeviceCache:
    """A device cache of ``fmt`` with room for ``context + extra_steps`` tokens per sequence."""
    layers, _, hkv, d = geometry(model)
    geo = dict(num_layers=layers, batch=batch, num_kv_heads=hkv, head_dim=d, context=context, extra_steps=extra_steps,
               dtype=dtype, device=device)
    if not fmt.format.paged:
        return fmt.format.device_cache(**geo)
    return fmt.format.device_cache(**geo, transforms=fmt.transforms, backend=backend, shuffle_pages=shuffle_pages,
                                   layout=fmt.layout)


def kernel_label(cache: dc.DeviceCache) -> str:
    """Which attention kernel and page layout a device cache runs (recorded in every report row)."""
    if isinstance(cache, dc.DeviceOscarCache):
        if cache.backend != "triton":
            return f"torch twin, {cache.layout} pages"
        return "v9 CUDA mma kernel, mma pages" if cache.layout == "mma" else "v8 Triton kernel, row pages"
    return "torch SDPA, static BF16"


# ----------------------------------------------------------------------------------------------
# correctness: device path against the host-driven cache


def reference_decode(model: Any, prompt: torch.Tensor, fmt: TimedCache, steps: int, rotations: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode through the host-driven `oscar.cache.torch_cache.OscarCache` (torch backend): tokens ``[B, steps]``
    and the logits of each step ``[B, steps, V]`` (step 0 = the prompt's last position)."""
    attention.enable(model)
    cache = new_cache(model, fmt.format.cache_spec(list(rotations) if fmt.transforms is not None else None))
    key = "cache" if "cache" in dc.forward_kwargs(model) else "past_key_values"
    toks, logits = [], []
    with torch.no_grad():
        lg = model(prompt, use_cache=True, **{key: cache}).logits[:, -1]
        for _ in range(steps):
            logits.append(lg.float())
            tok = lg.argmax(-1)
            toks.append(tok)
            lg = model(tok[:, None], use_cache=True, **{key: cache}).logits[:, -1]
    return torch.stack(toks, 1), torch.stack(logits, 1)


def device_decode(model: Any, prompt: torch.Tensor, cache: dc.DeviceCache, steps: int, *, graph: bool = False,
                  forced: Optional[torch.Tensor] = None, forward: Optional[Any] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decode through a device cache (prefill by a plain forward, then `decode_step`, in a CUDA
    graph when ``graph``): tokens ``[B, steps]`` and logits ``[B, steps, V]`` as `reference_decode`.
    ``forced`` ``[B, >= steps - 1]``: feed these tokens instead of the path's own (teacher forcing, so
    two paths can be compared step by step on the same history). ``forward``: the fused step
    (`oscar.models.fused_step.FusedDecoder`) in place of the transformers forward."""
    dc.enable(model)
    toks, logits = [], []
    with torch.no_grad():
        lg, kv = dc.prefill(model, prompt)
        dc.import_prefill(cache, kv)
        tok = lg.argmax(-1)
        toks.append(tok)
        logits.append(lg.float())
        cache.check_room(steps)
        feed = (lambda s, own: own) if forced is None else (lambda s, own: forced[:, s].to(own.device))
        runner = (dc.GraphedDecoder(model, cache, feed(0, tok), advance=True, forward=forward)
                  if graph and steps > 1 else None)
        for s in range(steps - 1):
            if runner is not None:
                runner.tokens.copy_(feed(s, tok))
                runner.replay()
                tok, lg = runner.tokens.clone(), runner.logits
            else:
                tok, lg = dc.decode_step(model, cache, feed(s, tok), forward=forward)
            toks.append(tok)
            logits.append(lg.float().clone())
    return torch.stack(toks, 1), torch.stack(logits, 1)


def kernels_against_twins(model: Any, prompt: torch.Tensor, fmt: TimedCache, device: Any) -> dict[str, float]:
    """Localise a device-path difference: the prompt imported into two caches on ``device``, one through
    the Triton quantize kernel and one through its torch twin, then each layer's decode attention on the
    Triton-written cache by the Triton kernel and by the torch twin (random query of the model's scale).

    Returns the share of dequantized cache elements that differ between the two imports, the largest
    relative difference of those elements' rows, and the largest per-row relative difference of the
    attention outputs (``||o_triton - o_torch|| / ||o_torch||``)."""
    layers, heads, hkv, d = geometry(model)
    B, L = prompt.shape
    with torch.no_grad():
        dc.enable(model)
        _, kv = dc.prefill(model, prompt.to(device))
        caches = {}
        for backend in ("triton", "torch"):
            caches[backend] = new_device_cache(fmt, model, B, L, extra_steps=1, device=device, backend=backend,
                                               shuffle_pages=True)
            dc.import_prefill(caches[backend], kv)
        tr, tw = caches["triton"], caches["torch"]
        nq = max(0, L - fmt.sink - fmt.recent)
        differ, total, row_rel, attn_rel = 0, 0, 0.0, 0.0
        gen = torch.Generator(device=device).manual_seed(0)
        for layer in range(layers):
            for b in range(B):
                for pages_tr, pages_tw in ((tr.k_pages[layer], tw.k_pages[layer]), (tr.v_pages[layer], tw.v_pages[layer])):
                    a = paged.gather_dequantize(pages_tr, tr.page_table, b, nq)
                    c = paged.gather_dequantize(pages_tw, tw.page_table, b, nq)
                    differ += int((a != c).sum())
                    total += a.numel()
                    rel = (a - c).norm(dim=-1) / c.norm(dim=-1).clamp_min(1e-12)
                    row_rel = max(row_rel, float(rel.max()) if rel.numel() else 0.0)
            q = kv[layer][0].float().std() * torch.randn(B, heads, d, generator=gen, device=device)
            lens = {"sink_len": torch.full((B,), min(L, fmt.sink), dtype=torch.int32, device=device),
                    "recent_len": torch.full((B,), min(max(L - fmt.sink, 0), fmt.recent), dtype=torch.int32, device=device)}
            kt, vt = tr.transforms[layer]
            segments = paged.Segments(tr.page_table, torch.full((B,), nq, dtype=torch.int32, device=device),
                                      sink_k=tr.sink_k[layer], sink_v=tr.sink_v[layer], recent_k=tr.recent_k[layer],
                                      recent_v=tr.recent_v[layer], **lens)
            outs = [paged.decode_attention(q, tr.k_pages[layer], tr.v_pages[layer], segments, kt, vt, sm_scale=d ** -0.5,
                                           backend=backend).float()
                    for backend in ("triton", "torch")]
            rel = (outs[0] - outs[1]).norm(dim=-1) / outs[1].norm(dim=-1).clamp_min(1e-12)
            attn_rel = max(attn_rel, float(rel.max()))
    return {"quant_elements_differ": differ / max(total, 1), "quant_row_rel_diff_max": row_rel,
            "attention_rel_diff_max": attn_rel}


def teacher_forced_kl(model: Any, prompt: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-step KL(BF16 || cache) of ``logits`` ``[B, n, V]`` against a plain full forward of
    ``prompt + tokens`` (the BF16 reference on the same token path)."""
    attention.enable(model)
    seq = torch.cat([prompt, tokens[:, :-1].to(prompt.device)], dim=1)
    with torch.no_grad():
        ref = model(seq).logits[:, prompt.shape[1] - 1:].float()
    ref_lp = torch.log_softmax(ref, -1)
    lp = torch.log_softmax(logits.to(ref.device), -1)
    return (ref_lp.exp() * (ref_lp - lp)).sum(-1)


# ----------------------------------------------------------------------------------------------
# timing and the step breakdown


def time_graph(replay: Callable[[], None], reps: int, warmup: int = 3) -> list[float]:
    """Microseconds of each of ``reps`` replays (CUDA events, after ``warmup``)."""
    for _ in range(warmup):
        replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return out


GEMM_NAMES = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk")
ATTENTION_NAMES = ("oscar_decode_mma", "_planes_kernel", "_partial_kernel", "_bf16_partial_kernel", "_merge_kernel", "_merge_cols_kernel",
                   "_prep_kernel", "fmha", "flash", "sdpa", "attention", "cudnn")
QUANT_NAMES = ("_rotate_quantize_kernel",)


def classify_kernel(name: str) -> str:
    """``quantize`` | ``attention`` | ``gemm`` | ``other`` from a CUDA kernel's name."""
    low = name.lower()
    if any(k in low for k in QUANT_NAMES):
        return "quantize"
    if any(k.lower() in low for k in ATTENTION_NAMES):
        return "attention"
    if any(k in low for k in GEMM_NAMES):
        return "gemm"
    return "other"


def kernel_breakdown(step: Callable[[], None]) -> tuple[dict[str, float], dict[str, float]]:
    """Run ``step`` once under the torch profiler: microseconds of GPU kernel time per category and per
    kernel name (summed over the step's launches)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    per_cat = {"gemm": 0.0, "attention": 0.0, "quantize": 0.0, "other": 0.0}
    per_name: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = float(getattr(evt, "device_time", 0.0) or getattr(evt, "cuda_time", 0.0) or 0.0)
        if us <= 0:
            continue
        per_cat[classify_kernel(evt.name)] += us
        per_name[evt.name] = per_name.get(evt.name, 0.0) + us
    return per_cat, per_name


def split_step(step_us: float, kernels: dict[str, float]) -> dict[str, float]:
    """Graph step time split into GEMM / attention / quantize+demote / other: the first three are the
    kernels' measured times, ``other`` the rest of the step (small kernels and gaps); never negative."""
    gemm, attn, quant = kernels["gemm"], kernels["attention"], kernels["quantize"]
    return {"gemm_us": gemm, "attention_us": attn, "quantize_us": quant, "other_us": max(0.0, step_us - gemm - attn - quant)}


def median(xs: Sequence[float]) -> float:
    """Median (nan for an empty list)."""
    return statistics.median(xs) if xs else math.nan


__all__ = [
    "CACHES",
    "TimedCache",
    "architecture_config",
    "build_random_model",
    "timed_cache",
    "classify_kernel",
    "device_decode",
    "geometry",
    "head_transforms",
    "kernel_breakdown",
    "kernel_label",
    "kernels_against_twins",
    "new_device_cache",
    "reference_decode",
    "split_step",
    "teacher_forced_kl",
    "time_graph",
    "timing_rotations",
]

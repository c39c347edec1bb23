"""The decode step of a dense decoder fused at load time: one token per sequence through a device cache.

The transformers forward of a decode step launches one small kernel per operation (float32 RMSNorm as
pow / mean / rsqrt / mul, RoPE as slices, cats and multiplies, residual adds, SiLU, casts) and three
GEMMs where two would do: ~140 us per layer of launches and gaps around the cache call at batch 1 on an
H200. `FusedDecoder` runs the same computation with

- fused projections: Q, K and V in one GEMM, gate and up in one GEMM. The concatenated weights are built
  once from the adapter's modules, and the modules' own weights become views of them, so the model
  holds each weight once and its transformers forward still works (the "HF eager + graph" baseline);
- the layer bodies around the cache call compiled (`torch.compile`, inductor, static shapes): per layer,
  one compiled function runs the output projection, the residual add fused with the next RMSNorm, the
  MLP, the second residual add fused with the next layer's input RMSNorm, the QKV GEMM and the per-head
  QK-norm fused with RoPE on the query and key rows; the cache call (`DeviceCache.attend_and_write`: the
  project's kernels, or SDPA on the static BF16 cache) stays outside the compiled code;
- the model's own RoPE (`rotary_emb` once per step, the modeling module's `apply_rotary_pos_emb` inside
  the compiled code) and the model's own norm weights and epsilons: no modeling file is forked, and a
  family whose modules do not compute what this step computes is refused at load time (checked
  numerically on the model's own modules), not approximated.

The step is capturable in one CUDA graph (`oscar.cache.device_cache.GraphedDecoder` with ``forward=``).
Without compilation (``compile=False``, the CPU tests) the same functions run eagerly.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from oscar.models.adapters import UnsupportedModel, get_adapter, layer_windows

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the supported families compute it: float32 statistics, the normalised row cast back to
    the input dtype, then scaled by the weight."""
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dt)


@dataclass
class LayerWeights:
    """One decoder layer's tensors for the fused step (views of the model's parameters)."""

    ln1: torch.Tensor
    wqkv: torch.Tensor
    bqkv: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    wo: torch.Tensor
    bo: Optional[torch.Tensor]
    ln2: torch.Tensor
    wgu: torch.Tensor
    bgu: Optional[torch.Tensor]
    wd: torch.Tensor
    bd: Optional[torch.Tensor]

    def attn_in(self) -> tuple[Any, ...]:
        return self.ln1, self.wqkv, self.bqkv, self.q_norm, self.k_norm

    def block_out(self) -> tuple[Any, ...]:
        return self.wo, self.bo, self.ln2, self.wgu, self.bgu, self.wd, self.bd


def _fuse(modules: list[torch.nn.Linear], what: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Concatenate the weights (and biases) of ``modules`` along the output dimension and make each
    module's parameters views of the result, so no weight is held twice."""
    biases = [m.bias for m in modules]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise UnsupportedModel(f"{what}: some projections have a bias and some do not; the fused GEMM needs all or none")
    with torch.no_grad():
        w = torch.cat([m.weight for m in modules], dim=0).contiguous()
        b = None if biases[0] is None else torch.cat(biases, dim=0).contiguous()
        start = 0
        for m in modules:
            n = m.weight.shape[0]
            m.weight = torch.nn.Parameter(w[start:start + n], requires_grad=False)
            if b is not None:
                m.bias = torch.nn.Parameter(b[start:start + n], requires_grad=False)
            start += n
    return w, b


def _norm_eps(module: torch.nn.Module, what: str) -> float:
    """The epsilon of a norm module, after checking on a random row that the module computes `rms_norm`."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if eps is None or weight is None:
        raise UnsupportedModel(f"{what} ({type(module).__name__}) has no weight/epsilon of an RMSNorm")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.shape[-1], generator=gen).to(weight.device, weight.dtype)
    with torch.no_grad():
        ours, theirs = rms_norm(x, weight, float(eps)), module(x)
    if not torch.allclose(ours.float(), theirs.float(), rtol=1e-2, atol=1e-3):
        raise UnsupportedModel(f"{what} ({type(module).__name__}) does not compute weight * x / rms(x); "
                               "the fused decode step supports plain RMSNorm only")
    return float(eps)


class FusedDecoder:
    """The fused decode step of ``model`` (families whose adapter has ``fused_step``).

    ``compile``: ``True`` compiles the layer bodies with `torch.compile` (``backend``, default inductor;
    static shapes, one compilation per batch size); ``False`` runs them eagerly (same arithmetic).
    Calling the decoder runs one step: ``decoder(cache, tokens) -> logits [B, V]`` (the cache's
    ``prepare()`` must have run, as in `oscar.cache.device_cache.decode_step`).
    """

    def __init__(self, model: torch.nn.Module, *, compile: bool = True, backend: str = "inductor") -> None:
        adapter = get_adapter(model)
        if not adapter.fused_step:
            raise UnsupportedModel(f"family {adapter.family!r} has no fused decode step ({adapter.notes}); "
                                   f"families with one: llama, qwen2, qwen3")
        if any(w is not None for w in layer_windows(model)):
            raise UnsupportedModel("the fused decode step supports full-attention layers only (sliding-window layers found)")
        cfg = model.config
        act = ACTIVATIONS.get(str(getattr(cfg, "hidden_act", "")))
        if act is None:
            raise UnsupportedModel(f"hidden_act={getattr(cfg, 'hidden_act', None)!r} has no fused step; "
                                   f"valid: {', '.join(ACTIVATIONS)}")
        dims = adapter.dims(model)
        self.model, self.adapter, self.dims = model, adapter, dims
        self.act = act
        layers = adapter.layers(model)
        attn0 = adapter.attention(model, 0)
        module = sys.modules.get(type(attn0).__module__)
        self.apply_rope = getattr(module, "apply_rotary_pos_emb", None)
        if self.apply_rope is None:
            raise UnsupportedModel(f"{getattr(module, '__name__', '?')} has no apply_rotary_pos_emb")
        self.rotary = adapter.rotary(model)
        self.scale = float(getattr(attn0, "scaling", dims.head_dim ** -0.5))
        self.layers: list[LayerWeights] = []
        eps: set[float] = set()
        for i, layer in enumerate(layers):
            attn = getattr(layer, adapter.attn_attr)
            mlp = getattr(layer, adapter.mlp_attr)
            p = adapter.projections(model, i)
            wqkv, bqkv = _fuse([p["q"], p["k"], p["v"]], f"layer {i} q/k/v")
            wgu, bgu = _fuse([getattr(mlp, adapter.gate_proj), getattr(mlp, adapter.up_proj)], f"layer {i} gate/up")
            down = getattr(mlp, adapter.down_proj)
            norms = [getattr(layer, adapter.input_norm), getattr(layer, adapter.post_norm)]
            qk = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)] if adapter.qk_norm else [None, None]
            if adapter.qk_norm and None in qk:
                raise UnsupportedModel(f"layer {i}: the {adapter.family} adapter expects q_norm and k_norm modules")
            eps |= {_norm_eps(m, f"layer {i} norm") for m in norms + [m for m in qk if m is not None]}
            self.layers.append(LayerWeights(
                ln1=norms[0].weight, wqkv=wqkv, bqkv=bqkv, q_norm=None if qk[0] is None else qk[0].weight,
                k_norm=None if qk[1] is None else qk[1].weight, wo=p["o"].weight, bo=p["o"].bias, ln2=norms[1].weight,
                wgu=wgu, bgu=bgu, wd=down.weight, bd=down.bias))
        inner = getattr(model, "model", model)
        final = getattr(inner, "norm")
        eps.add(_norm_eps(final, "final norm"))
        if len(eps) != 1:
            raise UnsupportedModel(f"norm epsilons differ between modules ({sorted(eps)}); the fused step takes one")
        self.eps = eps.pop()
        self.final_norm = final.weight
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings().weight
        self.compiled = bool(compile)
        if compile:
            _allow_recompiles()
        wrap = (lambda f: torch.compile(f, backend=backend, dynamic=False, fullgraph=True)) if compile else (lambda f: f)
        self._first, self._mid, self._last = wrap(self._first_impl), wrap(self._mid_impl), wrap(self._last_impl)

    # -- the compiled pieces -----------------------------------------------------------------

    def _qkv(self, x: torch.Tensor, ln1: torch.Tensor, wqkv: torch.Tensor, bqkv: Optional[torch.Tensor],
             qn: Optional[torch.Tensor], kn: Optional[torch.Tensor], cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RMSNorm, the fused QKV GEMM, per-head QK-norm and RoPE: q ``[B, H, 1, d]``, k, v ``[B, Hkv, 1, d]``."""
        d, h, hkv = self.dims.head_dim, self.dims.num_heads, self.dims.num_kv_heads
        b = x.shape[0]
        qkv = F.linear(rms_norm(x, ln1, self.eps), wqkv, bqkv)
        q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(b, 1, h, d), k.view(b, 1, hkv, d), v.view(b, 1, hkv, d)
        if qn is not None:
            q, k = rms_norm(q, qn, self.eps), rms_norm(k, kn, self.eps)  # type: ignore[arg-type]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.apply_rope(q, k, cos, sin)
        return q, k, v

    def _block_out(self, x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor, bo: Optional[torch.Tensor],
                   ln2: torch.Tensor, wgu: torch.Tensor, bgu: Optional[torch.Tensor], wd: torch.Tensor,
                   bd: Optional[torch.Tensor]) -> torch.Tensor:
        """Output projection + residual, RMSNorm, fused gate/up GEMM, activation, down projection + residual."""
        x = x + F.linear(o.transpose(1, 2).reshape(x.shape[0], -1), wo, bo)
        gate, up = F.linear(rms_norm(x, ln2, self.eps), wgu, bgu).chunk(2, dim=-1)
        return x + F.linear(self.act(gate) * up, wd, bd)

    def _first_impl(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *w: Any) -> tuple[torch.Tensor, ...]:
        return self._qkv(x, *w, cos, sin)

    def _mid_impl(self, x: torch.Tensor, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  *w: Any) -> tuple[torch.Tensor, ...]:
        x = self._block_out(x, o, *w[:7])
        return (x, *self._qkv(x, *w[7:], cos, sin))

    def _last_impl(self, x: torch.Tensor, o: torch.Tensor, final: torch.Tensor, head: torch.Tensor,
                   *w: Any) -> torch.Tensor:
        x = self._block_out(x, o, *w)
        return F.linear(rms_norm(x, final, self.eps), head)

    # -- a step --------------------------------------------------------------------------------

    def __call__(self, cache: Any, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of one decode step for ``tokens`` ``[B]`` at positions ``cache.pos``."""
        x = self.embed(tokens)  # [B, D]
        cos, sin = self.rotary(x[:, None], cache.pos[:, None])
        layers = self.layers
        q, k, v = self._first(x, cos, sin, *layers[0].attn_in())
        for i, lw in enumerate(layers):
            o = cache.attend_and_write(i, q, k, v, self.scale)
            if i + 1 < len(layers):
                x, q, k, v = self._mid(x, o, cos, sin, *lw.block_out(), *layers[i + 1].attn_in())
            else:
                logits = self._last(x, o, self.final_norm, self.lm_head, *lw.block_out())
        return logits


RECOMPILE_LIMIT = 64


def _allow_recompiles() -> None:
    """Raise dynamo's per-function recompile limit (default 8) to `RECOMPILE_LIMIT`: each compiled piece is
    one code object shared by every `FusedDecoder`, compiled once per (model, batch size), and a profile
    run of two models over five batch sizes plus the check passes 8; with ``fullgraph=True`` the limit is a
    hard failure (seen on the H200 at the ninth graph)."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(int(getattr(dynamo_config, name)), RECOMPILE_LIMIT * 4
                                             if name.startswith("accumulated") else RECOMPILE_LIMIT))


def fused_decoder(model: torch.nn.Module, *, compile: bool = True, backend: str = "inductor") -> Optional[FusedDecoder]:
    """`FusedDecoder` of ``model``, or None (with the reason printed to stderr) for a family without one."""
    try:
        return FusedDecoder(model, compile=compile, backend=backend)
    except UnsupportedModel as exc:
        print(f"fused decode step not available: {exc}", file=sys.stderr)
        return None


__all__ = ["ACTIVATIONS", "FusedDecoder", "LayerWeights", "fused_decoder", "rms_norm"]

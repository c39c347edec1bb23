"""Architecture adapters: where attention lives in each model family and how to reach q/k/v/o.

Adding a model family is one entry in `ADAPTERS`; no modeling file is ever forked. Activation
capture and the OSCAR cache work through the transformers attention-function interface, which
receives post-RoPE queries and keys, so adapters only describe module paths and head geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from oscar.core.rope import RopeSpec

HEAD_DIM_BASES = (1, 12, 20)  # head_dim = 2^k * base: the sizes with a known Hadamard matrix


class UnsupportedModel(ValueError):
    """A model whose architecture has no adapter, or whose geometry OSCAR cannot rotate."""


@dataclass(frozen=True)
class ModelDims:
    """Attention geometry of a model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rotary_dim: int

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class ModelAdapter:
    """How one architecture family exposes its attention modules."""

    family: str
    model_types: tuple[str, ...]
    layers_path: str = "model.layers"
    attn_attr: str = "self_attn"
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    qk_norm: bool = False  # per-head RMSNorm on q and k, applied before RoPE
    rope: str = "full"  # full | partial (config.partial_rotary_factor of each head rotated)
    notes: str = ""
    # the fused decode step (oscar.models.fused_step): dense MLP with gate/up/down projections, plain RMSNorm
    fused_step: bool = False
    mlp_attr: str = "mlp"
    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    input_norm: str = "input_layernorm"
    post_norm: str = "post_attention_layernorm"

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder layer list of `model`."""
        obj: object = model
        for part in self.layers_path.split("."):
            if not hasattr(obj, part):
                raise UnsupportedModel(
                    f"{type(model).__name__} has no attribute path {self.layers_path!r} "
                    f"expected by the {self.family!r} adapter"
                )
            obj = getattr(obj, part)
        return obj  # type: ignore[return-value]

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        """The attention module of decoder layer `layer`."""
        layers = self.layers(model)
        if not 0 <= layer < len(layers):
            raise IndexError(f"layer {layer} out of range; the model has {len(layers)} layers (0..{len(layers) - 1})")
        return getattr(layers[layer], self.attn_attr)

    def projections(self, model: nn.Module, layer: int) -> dict[str, nn.Linear]:
        """The q/k/v/o projection modules of layer `layer`, keyed "q", "k", "v", "o"."""
        attn = self.attention(model, layer)
        names = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj, "o": self.o_proj}
        return {key: getattr(attn, name) for key, name in names.items()}

    def rotary(self, model: nn.Module) -> nn.Module:
        """The model's rotary embedding module (``cos, sin = rotary(x, position_ids)``)."""
        rot = _rotary_module(model)
        if rot is None:
            raise UnsupportedModel(f"{type(model).__name__} has no rotary_emb module")
        return rot

    def dims(self, model_or_config: object) -> ModelDims:
        """Attention geometry read from the transformers config."""
        config = getattr(model_or_config, "config", model_or_config)
        text_config = getattr(config, "get_text_config", lambda: config)()
        num_heads = int(text_config.num_attention_heads)
        hidden = int(text_config.hidden_size)
        head_dim = getattr(text_config, "head_dim", None) or hidden // num_heads
        num_kv = int(getattr(text_config, "num_key_value_heads", None) or num_heads)
        factor = 1.0
        if self.rope == "partial":
            factor = float(getattr(text_config, "partial_rotary_factor", 1.0))
            rope_params = getattr(text_config, "rope_parameters", None) or {}
            factor = float(rope_params.get("partial_rotary_factor", factor))
        return ModelDims(
            num_layers=int(text_config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=int(head_dim),
            hidden_size=hidden,
            rotary_dim=int(int(head_dim) * factor),
        )


SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(model_or_config: object) -> list[int | None]:
    """Per decoder layer: the sliding-window length of a sliding-attention layer, None for full attention.

    Reads `config.layer_types` (transformers >= 4.53: "full_attention" / "sliding_attention") and
    `config.sliding_window`; a config without `layer_types` has full attention everywhere.
    """
    config = getattr(model_or_config, "config", model_or_config)
    text_config = getattr(config, "get_text_config", lambda: config)()
    n = int(text_config.num_hidden_layers)
    types = list(getattr(text_config, "layer_types", None) or ["full_attention"] * n)
    window = getattr(text_config, "sliding_window", None)
    out: list[int | None] = []
    for i, kind in enumerate(types):
        if kind == "sliding_attention":
            if not window:
                raise UnsupportedModel(f"layer {i} is a sliding_attention layer but the config has sliding_window={window!r}")
            out.append(int(window))
        else:
            out.append(None)
    return out


def check_supported(model_or_config: object) -> None:
    """Refuse, in one line, an attention feature the OSCAR cache cannot reproduce (before any work starts).

    Supported: causal full attention and causal sliding-window layers (`layer_types`), any mix.
    Refused: attention-logit soft-capping (Gemma 2), bidirectional attention, other layer types
    (chunked, linear, ...).
    """
    config = getattr(model_or_config, "config", model_or_config)
    text_config = getattr(config, "get_text_config", lambda: config)()
    name = getattr(text_config, "model_type", "?")
    cap = getattr(text_config, "attn_logit_softcapping", None)
    if cap is not None:
        raise UnsupportedModel(f"model_type {name!r} uses attention-logit soft-capping ({cap}); the OSCAR cache supports uncapped softmax attention only")
    if getattr(text_config, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"model_type {name!r} uses bidirectional attention; the OSCAR cache supports causal attention only")
    bad = sorted({t for t in (getattr(text_config, "layer_types", None) or []) if t not in SUPPORTED_LAYER_TYPES})
    if bad:
        raise UnsupportedModel(
            f"model_type {name!r} has layer types {bad}; the OSCAR cache supports {', '.join(SUPPORTED_LAYER_TYPES)}"
        )
    layer_windows(text_config)


ADAPTERS: dict[str, ModelAdapter] = {
    adapter.family: adapter
    for adapter in (
        ModelAdapter(family="llama", model_types=("llama",), fused_step=True,
                     notes="SmolLM2, Llama 2/3: no biases, full RoPE"),
        ModelAdapter(family="qwen2", model_types=("qwen2",), fused_step=True, notes="Qwen2/2.5: q/k/v biases, full RoPE"),
        ModelAdapter(family="qwen3", model_types=("qwen3",), qk_norm=True, fused_step=True,
                     notes="Qwen3: per-head q/k RMSNorm before RoPE"),
        ModelAdapter(
            family="gemma3",
            model_types=("gemma3_text",),
            qk_norm=True,
            notes="Gemma 3 text: q/k RMSNorm before RoPE, sliding-window layers interleaved with full ones, "
                  "(1 + w) RMSNorm and scaled embeddings (no fused decode step)",
        ),
        ModelAdapter(
            family="glm4_moe",
            model_types=("glm4_moe",),
            qk_norm=True,
            rope="partial",
            notes="GLM-4.5/4.6/4.7: MoE MLP, optional q/k norm, partial rotary (no fused decode step)",
        ),
    )
}

_BY_MODEL_TYPE = {mt: adapter for adapter in ADAPTERS.values() for mt in adapter.model_types}


def get_adapter(model_or_type: object) -> ModelAdapter:
    """The adapter of a model, a transformers config, or a `model_type` / family string."""
    if isinstance(model_or_type, str):
        key = model_or_type
    else:
        config = getattr(model_or_type, "config", model_or_type)
        key = getattr(config, "model_type", None)
    adapter = _BY_MODEL_TYPE.get(key) or ADAPTERS.get(key)  # type: ignore[arg-type]
    if adapter is None:
        raise UnsupportedModel(
            f"no adapter for model_type {key!r}; supported model types: {', '.join(sorted(_BY_MODEL_TYPE))}"
        )
    return adapter


def is_supported_head_dim(head_dim: int) -> bool:
    """True when head_dim = 2^k * b for b in (1, 12, 20), the sizes with a Hadamard matrix."""
    if head_dim < 2:
        return False
    for base in HEAD_DIM_BASES:
        if head_dim % base == 0:
            rest = head_dim // base
            if rest & (rest - 1) == 0:
                return True
    return False


def check_head_dim(head_dim: int) -> None:
    """Refuse a head_dim with no Hadamard construction, naming the valid forms."""
    if not is_supported_head_dim(head_dim):
        lower = [d for d in range(2, 1025) if is_supported_head_dim(d)]
        near = [d for d in lower if abs(d - head_dim) <= max(32, head_dim // 2)][:8]
        raise UnsupportedModel(
            f"unsupported head_dim {head_dim}: OSCAR rotations need head_dim = 2^k, 2^k*12 or 2^k*20 "
            f"(e.g. {', '.join(map(str, near or lower[:8]))})"
        )


def _rotary_module(model: nn.Module) -> nn.Module | None:
    for path in ("model.rotary_emb", "model.language_model.rotary_emb", "rotary_emb"):
        obj: object = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.Module):
            return obj
    return None


def key_rope(model: nn.Module, layer: int, positions: int = 2048) -> tuple[object | None, str]:
    """The rotate-half RoPE (`oscar.core.rope.RopeSpec`) that layer `layer` applies to its keys, or (None, why).

    Read from the model's rotary embedding (`inv_freq` and `attention_scaling`, per layer type where
    the model has several) and accepted only if it reproduces, within float32 rounding, the `cos`/`sin`
    the model computes for positions `0..positions-1` and the model's own `apply_rotary_pos_emb` on a
    random key: a RoPE variant this cannot express (dynamic scaling, interleaved pairs, ...) is
    reported, not guessed. Rope-centered keys (`oscar.core.rope`) need it.
    """
    import inspect
    import sys

    import torch

    rot = _rotary_module(model)
    if rot is None:
        return None, f"{type(model).__name__} has no rotary_emb module"
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)()
    types = list(getattr(text_config, "layer_types", None) or [])
    layer_type = types[layer] if layer < len(types) else None
    prefix = f"{layer_type}_" if layer_type and hasattr(rot, f"{layer_type}_inv_freq") else ""
    inv_freq = getattr(rot, f"{prefix}inv_freq", None)
    scaling = float(getattr(rot, f"{prefix}attention_scaling", 1.0))
    if inv_freq is None:
        return None, f"{type(rot).__name__} has no {prefix}inv_freq"
    dims = get_adapter(model).dims(model)
    spec = RopeSpec(inv_freq.detach().to("cpu", torch.float64), scaling, dims.head_dim)
    if spec.rotary_dim != dims.rotary_dim:
        return None, f"rotary_dim {spec.rotary_dim} from inv_freq differs from the config's {dims.rotary_dim}"
    device = inv_freq.device
    pos = torch.arange(positions, device=device)[None]
    probe = torch.zeros(1, 1, positions, dims.head_dim, device=device, dtype=torch.float32)
    args = (probe, pos) if not prefix else (probe, pos, layer_type)
    try:
        with torch.no_grad():
            cos, sin = rot(*args)
    except TypeError as exc:
        return None, f"{type(rot).__name__}.forward{inspect.signature(rot.forward)} could not be called ({exc})"
    ours_cos, ours_sin = spec.cos_sin(pos[0].cpu())
    ref_cos, ref_sin = cos[0].double().cpu(), sin[0].double().cpu()
    expect_cos = torch.cat([ours_cos, ours_cos], -1) * scaling
    expect_sin = torch.cat([ours_sin, ours_sin], -1) * scaling
    if ref_cos.shape[-1] != spec.rotary_dim or not (
        torch.allclose(ref_cos, expect_cos, atol=2e-3) and torch.allclose(ref_sin, expect_sin, atol=2e-3)
    ):
        return None, "the model's cos/sin are not the rotate-half layout of inv_freq (interleaved or dynamic RoPE)"
    module = sys.modules.get(type(get_adapter(model).attention(model, layer)).__module__)
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if apply is None:
        return None, f"{getattr(module, '__name__', '?')} has no apply_rotary_pos_emb"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, positions, dims.head_dim, generator=gen, dtype=torch.float64)
    try:
        _, k_model = apply(x, x, cos.double().cpu(), sin.double().cpu())
    except TypeError as exc:
        return None, f"apply_rotary_pos_emb could not be called ({exc})"
    if not torch.allclose(k_model[0, 0], spec.apply(x[0, 0], pos[0].cpu()), atol=1e-2 * max(scaling, 1.0)):
        return None, "the model's apply_rotary_pos_emb is not rotate-half RoPE over the first rotary_dim channels"
    return spec, ""

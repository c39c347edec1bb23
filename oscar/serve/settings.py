"""OSCAR settings of the SGLang plugin: read from the environment, validated against the model at start-up.

SGLang's ``--kv-cache-dtype`` choices are a closed list, so the plugin carries its own settings in
environment variables (inherited by SGLang's scheduler processes):

========================  ==========================================================================
``OSCAR_ARTIFACT``        calibration artifact directory (``rotations.safetensors`` + ``meta.json``);
                          required
``OSCAR_SINK``            BF16 sink tokens per request (default 64)
``OSCAR_RECENT``          BF16 recent window per request (default 256, at least 1)
``OSCAR_BITS``            2 or 4; must equal the artifact's bits (default: the artifact's)
``OSCAR_GROUP_SIZE``      quantization group; must equal the artifact's (default: the artifact's)
``OSCAR_KERNELS``         ``torch`` (the twins in ``oscar.cache.paged``) or ``triton``; default ``triton``
                          on CUDA, ``torch`` elsewhere
``OSCAR_MMA``             launch of the mma decode kernel, ``KEY=INT,...`` with keys ``warps`` (2, 4, 8),
                          ``stages``, ``min_blocks``, ``carveout``, ``waves`` (split-K waves of CTAs) or
                          ``splits`` (fixed split-K); default: the kernel's own (``default_num_splits``)
========================  ==========================================================================

Everything here is plain Python + torch (no sglang import), so it is tested in the default environment too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

ENV_ARTIFACT = "OSCAR_ARTIFACT"
ENV_SINK = "OSCAR_SINK"
ENV_RECENT = "OSCAR_RECENT"
ENV_BITS = "OSCAR_BITS"
ENV_GROUP = "OSCAR_GROUP_SIZE"
ENV_KERNELS = "OSCAR_KERNELS"
ENV_MMA = "OSCAR_MMA"
ENV_VARS = (ENV_ARTIFACT, ENV_SINK, ENV_RECENT, ENV_BITS, ENV_GROUP, ENV_KERNELS, ENV_MMA)
MMA_KEYS = ("warps", "stages", "min_blocks", "carveout", "waves", "splits")

# Model types whose attention the plugin handles (the oscar.models adapter registry) and config fields
# that mark architectures it refuses.
_REFUSED_FIELDS = {
    "kv_lora_rank": "multi-head latent attention (MLA)",
    "q_lora_rank": "multi-head latent attention (MLA)",
    "linear_attn_config": "hybrid linear attention",
    "mamba_d_state": "hybrid linear attention (Mamba layers)",
    "full_attention_interval": "hybrid linear attention",
}


class OscarServeError(ValueError):
    """An OSCAR serving setting, flag or model that the plugin refuses at start-up."""


def _int_env(env: Mapping[str, str], name: str, default: Optional[int]) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise OscarServeError(f"{name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class ServeSettings:
    """The OSCAR cache settings of one server."""

    artifact: Path
    sink: int = 64
    recent: int = 256
    bits: Optional[int] = None
    group_size: Optional[int] = None
    kernels: Optional[str] = None
    mma: tuple[tuple[str, int], ...] = ()  # OSCAR_MMA, parsed (parse_mma)

    @staticmethod
    def from_env(env: Optional[Mapping[str, str]] = None) -> "ServeSettings":
        """Settings from ``OSCAR_*`` variables; refuses missing or malformed values, naming them."""
        env = os.environ if env is None else env
        art = env.get(ENV_ARTIFACT)
        if not art:
            raise OscarServeError(
                f"--attention-backend oscar needs {ENV_ARTIFACT}=<calibration artifact directory> "
                "(made by `python -m oscar calibrate model=<model> method=<method>`)"
            )
        kernels = env.get(ENV_KERNELS) or None
        if kernels not in (None, "torch", "triton"):
            raise OscarServeError(f"{ENV_KERNELS}={kernels!r} is not valid; choose 'torch' or 'triton'")
        s = ServeSettings(
            artifact=Path(art),
            sink=int(_int_env(env, ENV_SINK, 64)),  # type: ignore[arg-type]
            recent=int(_int_env(env, ENV_RECENT, 256)),  # type: ignore[arg-type]
            bits=_int_env(env, ENV_BITS, None),
            group_size=_int_env(env, ENV_GROUP, None),
            kernels=kernels,
            mma=parse_mma(env.get(ENV_MMA) or ""),
        )
        if s.sink < 0:
            raise OscarServeError(f"{ENV_SINK}={s.sink} must be >= 0")
        if s.recent < 1:
            raise OscarServeError(f"{ENV_RECENT}={s.recent} must be >= 1 (the newest token is always BF16)")
        if s.bits is not None and s.bits not in (2, 4):
            raise OscarServeError(f"{ENV_BITS}={s.bits} is not supported; valid values are 2 and 4")
        return s

    def cache_format(self, bits: int, group_size: int) -> Any:
        """The `oscar.cache.formats.CacheFormat` this server stores (``bits`` and ``group_size`` resolved from
        the artifact by `load_rotations`): the same value the embedded engine and the profile use."""
        from oscar.cache.formats import CacheFormat

        return CacheFormat.serving(sink=self.sink, recent=self.recent, bits=bits, group_size=group_size)

    def kernel_backend(self, device: Any) -> str:
        """``torch`` or ``triton`` for ``device`` (the setting, else triton on CUDA and torch elsewhere)."""
        if self.kernels is not None:
            return self.kernels
        return "triton" if torch.device(device).type == "cuda" else "torch"


def parse_mma(text: str) -> tuple[tuple[str, int], ...]:
    """``OSCAR_MMA`` (``KEY=INT,...``, keys ``MMA_KEYS``) as ``((key, value), ...)``; refuses unknown keys, values
    that are not positive integers and ``waves`` with ``splits``."""
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, raw = item.partition("=")
        if key not in MMA_KEYS or not raw.strip().isdigit() or int(raw) < (0 if key == "carveout" else 1):
            raise OscarServeError(f"{ENV_MMA} item {item!r} is not valid: use KEY=INT with KEY one of {MMA_KEYS} "
                                  "and a positive integer (carveout: a percentage)")
        out[key] = int(raw)
    if "waves" in out and "splits" in out:
        raise OscarServeError(f"{ENV_MMA}={text!r} gives both waves and splits; give one")
    return tuple(out.items())


def check_architecture(hf_config: Any) -> None:
    """Refuse architectures the plugin cannot serve correctly (naming what is unsupported)."""
    from oscar.models.adapters import UnsupportedModel, check_head_dim, get_adapter

    cfg = getattr(hf_config, "text_config", None) or hf_config
    model_type = getattr(cfg, "model_type", None)
    try:
        get_adapter(str(model_type))
    except UnsupportedModel as err:
        raise OscarServeError(f"--attention-backend oscar cannot serve this model: {err}") from None
    for field, what in _REFUSED_FIELDS.items():
        if getattr(cfg, field, None) is not None:
            raise OscarServeError(
                f"--attention-backend oscar does not support {what} (config field {field} of model_type "
                f"{model_type!r}); serve it with another --attention-backend"
            )
    layer_types = getattr(cfg, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd:
        raise OscarServeError(
            f"--attention-backend oscar does not support layer types {odd} (sliding-window or hybrid layers) "
            f"of model_type {model_type!r}; only full-attention layers"
        )
    uses_window = getattr(cfg, "use_sliding_window", None)
    if uses_window or (getattr(cfg, "sliding_window", None) and uses_window is None):
        raise OscarServeError(
            f"--attention-backend oscar does not support sliding-window attention (sliding_window="
            f"{getattr(cfg, 'sliding_window', None)} in the config of model_type {model_type!r})"
        )
    from oscar.core.artifact import model_config_fields

    try:
        check_head_dim(int(model_config_fields(cfg)["head_dim"]))
    except UnsupportedModel as err:
        raise OscarServeError(str(err)) from None


def load_rotations(settings: ServeSettings, hf_config: Any) -> tuple[list[Any], int, int]:
    """Per-layer ``LayerRotations`` (float32, CPU), bits and effective group size, from the artifact,
    after checking it against ``hf_config`` (config hash, layers, KV heads, head_dim) and the settings.

    ``auto`` artifacts (per-head rotations and targets, centering ``mu_K``/``mu_V``, rope-centered keys) are
    served; the pool refuses rope-centered keys where its kernels do not take token positions
    (`oscar.serve.pool.OscarTokenToKVPool`). Per-channel keys (``method.channel_block > 0``) are refused here."""
    from oscar.core.artifact import ArtifactMismatch, load_artifact
    from oscar.models.engine import layer_rotations

    cfg = getattr(hf_config, "text_config", None) or hf_config
    path = settings.artifact
    if not path.is_dir():
        raise OscarServeError(f"{ENV_ARTIFACT}={str(path)!r} is not a directory (a calibration artifact is a "
                              "directory with rotations.safetensors and meta.json)")
    try:
        art = load_artifact(path, model=cfg, group_size=settings.group_size, bits=settings.bits)
    except (ArtifactMismatch, FileNotFoundError) as err:
        raise OscarServeError(f"{ENV_ARTIFACT}: {err}") from None
    channel_layers = [layer for layer in range(art.num_layers) if art.key_block(layer)]
    if channel_layers:
        raise OscarServeError(
            f"{ENV_ARTIFACT}={str(path)!r} has per-channel keys in layers {channel_layers} (auto chose '/ch"
            f"{art.key_block(channel_layers[0])}' key candidates, method.channel_block="
            f"{art.key_block(channel_layers[0])}), which the SGLang pool does not serve (its pages carry one scale "
            "and zero per token); calibrate it with method.channel_block=0 (the default)"
        )
    return layer_rotations(art), int(art.meta["bits"]), int(art.meta["group_size"])


def validate(settings: ServeSettings, hf_config: Any) -> tuple[list[Any], int, int]:
    """Architecture check, then the artifact against the model (what the plugin runs at start-up)."""
    check_architecture(hf_config)
    return load_rotations(settings, hf_config)


def head_transforms(rot: Any, device: Any) -> tuple[Any, Any]:
    """``oscar.cache.paged.HeadTransform`` for K and V of one layer's ``LayerRotations`` (float32 on ``device``);
    clip ratios only where some are below 1, as in the embedded cache."""
    return rot.paged_transforms("OSCAR KV pool", device)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bits: int, group_size: int) -> int:
    """Pool bytes per token (all layers, K and V): packed codes plus BF16 scale and zero per group
    (`oscar.cache.formats.CacheFormat.bytes_per_token`)."""
    from oscar.cache.formats import CacheFormat

    return CacheFormat.serving(sink=0, recent=1, bits=bits, group_size=group_size).bytes_per_token(
        num_layers, num_kv_heads, head_dim)


def window_bytes_per_request(num_layers: int, num_kv_heads: int, head_dim: int, sink: int, recent: int,
                             itemsize: int = 2) -> int:
    """BF16 sink + recent window bytes of one request slot (all layers, K and V)
    (`oscar.cache.formats.CacheFormat.window_bytes`)."""
    from oscar.cache.formats import CacheFormat

    return CacheFormat(name="window", sink=sink, recent=recent).window_bytes(num_layers, num_kv_heads, head_dim, itemsize)


__all__ = [
    "ENV_VARS",
    "OscarServeError",
    "ServeSettings",
    "bytes_per_token",
    "check_architecture",
    "head_transforms",
    "load_rotations",
    "validate",
    "window_bytes_per_request",
]

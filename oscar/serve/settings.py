"""OSCAR settings of the SGLang plugin: read from the environment, validated against the model at start-up.

SGLang's ``--kv-cache-dtype`` choices are a closed list, so the plugin carries its own settings in
environment variables (inherited by SGLang's scheduler processes). The cache format is the artifact's: its
``meta.json`` names the format it was calibrated for (``cache_format``: kind, bits, group, windows;
`oscar.cache.formats.CacheFormat.of_artifact`), and the server serves that format; only the BF16 windows
may be changed at serve time.

========================  ==========================================================================
``OSCAR_ARTIFACT``        calibration artifact directory (``rotations.safetensors`` + ``meta.json``);
                          required
``OSCAR_SINK``            BF16 sink tokens per request (default: the artifact's format)
``OSCAR_RECENT``          BF16 recent window per request, at least 1 (default: the artifact's format)
``OSCAR_KERNELS``         ``torch`` (the twins in ``oscar.cache.paged``) or ``triton``; default ``triton``
                          on CUDA, ``torch`` elsewhere
``OSCAR_MMA``             launch of the mma decode kernel, ``KEY=INT,...`` with keys ``warps`` (2, 4, 8),
                          ``stages``, ``min_blocks``, ``carveout``, ``waves`` (split-K waves of CTAs) or
                          ``splits`` (fixed split-K); default: the kernel's own (``default_num_splits``)
``OSCAR_PREFIX_REUSE``    what a radix-cache hit reuses: ``exact`` (default) the cached prefix's BF16 sink only
                          (the sink store), so that a hit reads what a cold prefill reads and its tokens are
                          the cold run's; ``quantized`` every cached page up to the recent window: the hit's
                          extend reads the INT2 history (faster; HumanEval at 0/64 windows lost 9-10 points
                          to it, docs/SERVING.md "Prefix reuse")
``OSCAR_PREFILL_STAGE_MIB`` MiB of BF16 K/V rows (all layers) a chunked prefill keeps of its own earlier chunks
                          until the prefill ends, so that every chunk reads the prompt as one prefill would
                          (BF16), not the INT2 pages its earlier chunks were written to; default 2048; a
                          request whose prompt needs more reads the pages for the rest; 0: off
========================  ==========================================================================

Everything here is plain Python + torch (no sglang import), so it is tested in the default environment too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from oscar.cache.formats import CacheFormat
from oscar.core.artifact import ArtifactMismatch, load_artifact, model_config_fields
from oscar.models.adapters import UnsupportedModel, check_head_dim, get_adapter
from oscar.serve.reuse import ENV_PREFILL_STAGE, ENV_PREFIX_REUSE, PREFILL_STAGE_MIB, PREFIX_REUSE

ENV_ARTIFACT = "OSCAR_ARTIFACT"
ENV_SINK = "OSCAR_SINK"
ENV_RECENT = "OSCAR_RECENT"
RETIRED_ENV = {"OSCAR_BITS": "bits", "OSCAR_GROUP_SIZE": "group_size"}  # the artifact's format fixes them
ENV_KERNELS = "OSCAR_KERNELS"
ENV_MMA = "OSCAR_MMA"
ENV_VARS = (ENV_ARTIFACT, ENV_SINK, ENV_RECENT, ENV_KERNELS, ENV_MMA, ENV_PREFIX_REUSE, ENV_PREFILL_STAGE)
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
    sink: Optional[int] = None  # None: the artifact's format
    recent: Optional[int] = None
    kernels: Optional[str] = None
    mma: tuple[tuple[str, int], ...] = ()  # OSCAR_MMA, parsed (parse_mma)
    prefix_reuse: str = PREFIX_REUSE[0]  # OSCAR_PREFIX_REUSE
    prefill_stage_mib: int = PREFILL_STAGE_MIB  # OSCAR_PREFILL_STAGE_MIB

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
        retired = [name for name in RETIRED_ENV if env.get(name)]
        if retired:
            raise OscarServeError(
                f"{', '.join(retired)} are no longer read: the artifact's meta.json fixes the cache format "
                f"({', '.join(RETIRED_ENV[n] for n in retired)} included); unset them and serve an artifact calibrated "
                "with the format you want")
        kernels = env.get(ENV_KERNELS) or None
        if kernels not in (None, "torch", "triton"):
            raise OscarServeError(f"{ENV_KERNELS}={kernels!r} is not valid; choose 'torch' or 'triton'")
        reuse = env.get(ENV_PREFIX_REUSE) or PREFIX_REUSE[0]
        if reuse not in PREFIX_REUSE:
            raise OscarServeError(f"{ENV_PREFIX_REUSE}={reuse!r} is not valid; choose one of {', '.join(PREFIX_REUSE)} "
                                  "(exact: a radix hit reuses the BF16 sink only; quantized: every cached page)")
        s = ServeSettings(
            artifact=Path(art),
            sink=_int_env(env, ENV_SINK, None),
            recent=_int_env(env, ENV_RECENT, None),
            kernels=kernels,
            mma=parse_mma(env.get(ENV_MMA) or ""),
            prefix_reuse=reuse,
            prefill_stage_mib=_int_env(env, ENV_PREFILL_STAGE, PREFILL_STAGE_MIB),
        )
        if s.prefill_stage_mib < 0:
            raise OscarServeError(f"{ENV_PREFILL_STAGE}={s.prefill_stage_mib} must be >= 0 (MiB; 0 turns the staging off)")
        if s.sink is not None and s.sink < 0:
            raise OscarServeError(f"{ENV_SINK}={s.sink} must be >= 0")
        if s.recent is not None and s.recent < 1:
            raise OscarServeError(f"{ENV_RECENT}={s.recent} must be >= 1 (the newest token is always BF16)")
        return s

    def cache_format(self, artifact_format: Any) -> Any:
        """The `oscar.cache.formats.CacheFormat` this server stores: the artifact's, with the windows of
        ``OSCAR_SINK``/``OSCAR_RECENT`` where set; refused unless the SGLang pool serves it."""
        fmt = artifact_format.replace(**{k: v for k, v in (("sink", self.sink), ("recent", self.recent))
                                         if v is not None})
        try:
            fmt.check_served("pool")
        except NotImplementedError as err:
            raise OscarServeError(f"{ENV_ARTIFACT}={str(self.artifact)!r}: {err}") from None
        return fmt

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
    try:
        check_head_dim(int(model_config_fields(cfg)["head_dim"]))
    except UnsupportedModel as err:
        raise OscarServeError(str(err)) from None


def load_rotations(settings: ServeSettings, hf_config: Any) -> tuple[list[Any], Any]:
    """Per-layer ``LayerRotations`` (float32, CPU) and the served cache format (`ServeSettings.cache_format` of
    the artifact's recorded format), after checking the artifact against ``hf_config`` (config hash, layers, KV
    heads, head_dim).

    ``auto`` artifacts (per-head rotations and targets, centering ``mu_K``/``mu_V``, rope-centered keys) are
    served; the pool refuses rope-centered keys where its kernels do not take token positions
    (`oscar.serve.pool.OscarTokenToKVPool`). Per-channel keys (``meta.json`` ``key_block``: ``auto`` with
    ``method.channel_block > 0``) are served in pages of per-channel blocks (one block size per artifact; the
    pool checks it against ``--page-size`` and the recent window). A KIVI-2 artifact (``python -m oscar calibrate
    method=kivi2``: identity, ``cache_format`` kind ``kivi``) is served as its paged twin (``KiviFormat.served``:
    per-channel keys over blocks of its group, per-token values, no sink, its residual as the recent window)."""
    from oscar.models.engine import layer_rotations  # local: keeps transformers out of import time

    cfg = getattr(hf_config, "text_config", None) or hf_config
    path = settings.artifact
    if not path.is_dir():
        raise OscarServeError(f"{ENV_ARTIFACT}={str(path)!r} is not a directory (a calibration artifact is a "
                              "directory with rotations.safetensors and meta.json)")
    try:
        art = load_artifact(path, model=cfg)
    except (ArtifactMismatch, FileNotFoundError) as err:
        raise OscarServeError(f"{ENV_ARTIFACT}: {err}") from None
    blocks = sorted({art.key_block(layer) for layer in range(art.num_layers)} - {0})
    if len(blocks) > 1:
        raise OscarServeError(
            f"{ENV_ARTIFACT}={str(path)!r} has per-channel keys over blocks of {blocks} tokens; the SGLang pool serves "
            "one block size per artifact (calibrate with one method.channel_block)")
    recorded = CacheFormat.of_artifact(art.meta)
    rotations = None
    if hasattr(recorded, "served") and "pool" not in recorded.served_by:
        # a simulated format with a servable twin (KIVI-2 -> per-channel key pages, identity transforms,
        # KiviFormat.served): the artifact of `python -m oscar calibrate method=kivi2` is served as that format
        recorded = recorded.served(art.head_dim)
        rotations = recorded.layer_rotations(art.num_layers, art.num_kv_heads, art.head_dim)
    try:
        fmt = settings.cache_format(recorded)
    except OscarServeError:
        raise
    except ValueError as err:
        raise OscarServeError(f"{ENV_ARTIFACT}={str(path)!r}: {err}") from None
    if blocks and (fmt.recent < blocks[0] or fmt.recent % blocks[0]):
        raise OscarServeError(
            f"{ENV_ARTIFACT}={str(path)!r} has per-channel keys over blocks of {blocks[0]} tokens: the recent window "
            f"({fmt.recent}: OSCAR_RECENT, else the artifact's format) must be a positive multiple of {blocks[0]} "
            "(the ring holds W to W + T - 1 rows and releases whole blocks)")
    if (fmt.bits, fmt.group_size) != (int(art.meta["bits"]), int(art.meta["group_size"])):
        raise OscarServeError(f"{ENV_ARTIFACT}={str(path)!r}: its cache_format (INT{fmt.bits}, group {fmt.group_size}) "
                              f"disagrees with the artifact's bits {art.meta['bits']} and group {art.meta['group_size']}")
    return (layer_rotations(art) if rotations is None else rotations), fmt


def validate(settings: ServeSettings, hf_config: Any) -> tuple[list[Any], Any]:
    """Architecture check, then the artifact against the model (what the plugin runs at start-up)."""
    check_architecture(hf_config)
    return load_rotations(settings, hf_config)


def head_transforms(rot: Any, device: Any) -> tuple[Any, Any]:
    """``oscar.cache.paged.HeadTransform`` for K and V of one layer's ``LayerRotations`` (float32 on ``device``);
    clip ratios only where some are below 1, as in the embedded cache."""
    return rot.paged_transforms("OSCAR KV pool", device)


__all__ = [
    "ENV_PREFILL_STAGE",
    "ENV_PREFIX_REUSE",
    "ENV_VARS",
    "PREFIX_REUSE",
    "OscarServeError",
    "ServeSettings",
    "check_architecture",
    "head_transforms",
    "load_rotations",
    "validate",
]

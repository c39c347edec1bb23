"""The calibration artifact: `rotations.safetensors` + `meta.json` (docs/DESIGN.md), no pickle.

Tensors (float32), per layer `l`: `layers.{l}.R_K`, `layers.{l}.R_V` `[Hkv, d, d]`,
`layers.{l}.mu_K`, `layers.{l}.mu_V` `[Hkv, d]` (zeros when the method does not center),
`layers.{l}.rho_K`, `layers.{l}.rho_V` `[Hkv]`, and `layers.{l}.eig_K`, `layers.{l}.eig_V`
`[Hkv, d]` when the method has an eigen-target, and `layers.{l}.ropemu_K` `[Hkv, d]` when a key head of
the layer is rope-centered (`oscar.core.rope`: the pre-RoPE mean, zero rows for the other heads; the layer's
RoPE is `meta["rope"][l]`). A layer whose keys `auto` gave the per-channel format has its block size in
`meta["key_block"][l]` (0 elsewhere; absent when no layer has it). `meta.json` carries `format_version`,
`oscar_version`, `method`, `model` (`id`, `config_hash`, `num_layers`, `num_kv_heads`,
`head_dim`), `calibration`, `group_size`, `bits`, `choices` (for `auto`), `tensors_sha256`
(the digest of the safetensors file it was written with, so a mixed-up pair is refused) and
`meta_sha256` (the digest of `meta.json`'s own content without this field, so an edited or
damaged `meta.json` is refused: integrity against accidents, not a signature).
The safetensors file is replaced first and `meta.json` last, each atomically. A loader that
names the method it will run refuses an artifact made with other settings (`METHOD_FIELDS`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from oscar import __version__
from oscar.core.rope import RopeSpec
from oscar.core.stats import atomic_write, atomic_write_text

ARTIFACT_FORMAT_VERSION = 1
TENSORS_FILE = "rotations.safetensors"
META_FILE = "meta.json"
_REQUIRED = ("R_K", "R_V", "mu_K", "mu_V", "rho_K", "rho_V")
_OPTIONAL = ("eig_K", "eig_V", "ropemu_K")


# Method settings an artifact's tensors depend on, with the defaults `oscar.core.calibration` builds
# with when a field is absent; rho_k/rho_v matter only with clip=fixed. sink, recent, page_size
# and the like act at run time and may differ.
METHOD_FIELDS = {"key_rotation": "identity", "value_rotation": "identity", "key_target": "query",
                 "value_target": "output", "center": False, "clip": "fit", "seed": 0,
                 "rope_center": True, "channel_block": 0, "select_by": "distortion", "select_price": 0.0}
FIXED_CLIP_FIELDS = {"rho_k": 1.0, "rho_v": 1.0}
# what chooses each layer's key format between per-token and per-channel keys: moot without per-channel candidates
# (channel_block 0), so an artifact of `auto method.channel_block=0` matches whatever these say
SELECTION_FIELDS = ("select_by", "select_price")


class ArtifactMismatch(ValueError):
    """The artifact does not belong to the model (or settings) it is being loaded for."""


class ArtifactCorrupt(ArtifactMismatch):
    """An artifact file cannot be read as written (truncated, damaged or edited); an `ArtifactMismatch`
    so that every caller that refuses a mismatched artifact refuses a damaged one the same way."""


def model_config_hash(
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    rope_theta: float | None = None,
    rope_scaling: dict[str, Any] | None = None,
) -> str:
    """Short sha256 of the architecture fields an artifact depends on (layers, heads, dims, RoPE)."""
    rope = {k: v for k, v in (rope_scaling or {}).items() if k != "rope_theta" and v is not None}
    if rope.get("rope_type") == "default" or rope.get("type") == "default":
        rope = {k: v for k, v in rope.items() if k not in ("rope_type", "type")}
    fields = {
        "num_layers": int(num_layers),
        "num_heads": int(num_heads),
        "num_kv_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "hidden_size": int(hidden_size),
        "rope_theta": None if rope_theta is None else float(rope_theta),
        "rope_scaling": rope,
    }
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def model_config_fields(config: Any) -> dict[str, Any]:
    """Architecture fields of a transformers-style config (duck-typed; no transformers import).

    Reads `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads` (defaults to the
    query heads), `head_dim` (defaults to `hidden_size // num_attention_heads`), `hidden_size`,
    and RoPE from `rope_parameters` (transformers 5) or `rope_theta` / `rope_scaling` (4.x).
    Accepts a model (uses its `.config`).
    """
    cfg = getattr(config, "config", config)
    get = cfg.get if isinstance(cfg, dict) else lambda k, default=None: getattr(cfg, k, default)
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    kv = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or hidden // heads
    params = get("rope_parameters") or {}
    if not isinstance(params, dict):
        params = dict(params)
    theta = params.get("rope_theta", get("rope_theta"))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"} or (get("rope_scaling") or {})
    return {
        "num_layers": int(get("num_hidden_layers")),
        "num_heads": heads,
        "num_kv_heads": int(kv),
        "head_dim": int(head_dim),
        "hidden_size": hidden,
        "rope_theta": theta,
        "rope_scaling": dict(scaling),
    }


def config_hash_of(config: Any) -> str:
    """`model_config_hash` of a transformers-style config or model."""
    return model_config_hash(**model_config_fields(config))


@dataclass
class CalibrationArtifact:
    """Per-layer rotations, means, clip ratios and eigenvalues, with the JSON metadata."""

    R_K: list[torch.Tensor]
    R_V: list[torch.Tensor]
    mu_K: list[torch.Tensor]
    mu_V: list[torch.Tensor]
    rho_K: list[torch.Tensor]
    rho_V: list[torch.Tensor]
    eig_K: list[Optional[torch.Tensor]] = field(default_factory=list)
    eig_V: list[Optional[torch.Tensor]] = field(default_factory=list)
    ropemu_K: list[Optional[torch.Tensor]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.R_K)
        for name in _OPTIONAL:
            if not getattr(self, name):
                setattr(self, name, [None] * n)
        self.validate()

    def key_block(self, layer: int) -> int:
        """Tokens per block of the layer's per-channel keys (`meta["key_block"]`), 0 for per-token keys."""
        blocks = self.meta.get("key_block") or []
        if not blocks:
            return 0
        if len(blocks) != self.num_layers:
            raise ValueError(f"meta key_block lists {len(blocks)} layers, the artifact has {self.num_layers}")
        return int(blocks[layer])

    def key_rope(self, layer: int) -> Any:
        """`(RopeSpec, pre-RoPE means [Hkv, d])` of a layer with rope-centered key heads, else None."""
        mean = self.ropemu_K[layer]
        if mean is None or not bool(mean.any()):
            return None
        specs = self.meta.get("rope") or []
        if layer >= len(specs) or not specs[layer]:
            raise ValueError(f"layer {layer} has rope-centered keys but meta.json records no RoPE for it")
        return RopeSpec.from_json(specs[layer]), mean

    @property
    def num_layers(self) -> int:
        """Number of layers `L`."""
        return len(self.R_K)

    @property
    def num_kv_heads(self) -> int:
        """KV heads per layer `Hkv`."""
        return int(self.R_K[0].shape[0])

    @property
    def head_dim(self) -> int:
        """Head dimension `d`."""
        return int(self.R_K[0].shape[-1])

    def validate(self) -> None:
        """Check counts, shapes, finiteness and orthogonality of every tensor."""
        n = len(self.R_K)
        if n == 0:
            raise ValueError("an artifact needs at least one layer")
        for name in (*_REQUIRED, *_OPTIONAL):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} layers, R_K has {n}")
        hkv, d = int(self.R_K[0].shape[0]), int(self.R_K[0].shape[-1])
        shapes = {"R_K": (hkv, d, d), "R_V": (hkv, d, d), "mu_K": (hkv, d), "mu_V": (hkv, d),
                  "rho_K": (hkv,), "rho_V": (hkv,), "eig_K": (hkv, d), "eig_V": (hkv, d), "ropemu_K": (hkv, d)}
        for name, shape in shapes.items():
            for layer, t in enumerate(getattr(self, name)):
                if t is None:
                    continue
                if tuple(t.shape) != shape:
                    raise ValueError(f"layers.{layer}.{name} has shape {tuple(t.shape)}, expected {shape}")
                if not torch.isfinite(t).all():
                    raise ValueError(f"layers.{layer}.{name} contains non-finite values")
        eye = torch.eye(d, dtype=torch.float64)
        for name in ("R_K", "R_V"):
            for layer, r in enumerate(getattr(self, name)):
                r64 = r.to(torch.float64)
                err = float((r64.transpose(1, 2) @ r64 - eye).abs().max())
                if err > 1e-4:
                    raise ValueError(f"layers.{layer}.{name} is not orthogonal (max |R^T R - I| = {err:.2e})")
        for name in ("rho_K", "rho_V"):
            for layer, r in enumerate(getattr(self, name)):
                if bool((r <= 0).any()) or bool((r > 1).any()):
                    raise ValueError(f"layers.{layer}.{name} = {r.tolist()} must lie in (0, 1]")

    def layer(self, layer: int) -> dict[str, Optional[torch.Tensor]]:
        """Tensors of one layer by name (`R_K`, `R_V`, `mu_K`, ...)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range 0..{self.num_layers - 1}")
        return {name: getattr(self, name)[layer] for name in (*_REQUIRED, *_OPTIONAL)}

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat float32 `layers.{l}.<name>` dictionary for safetensors."""
        out: dict[str, torch.Tensor] = {}
        for layer in range(self.num_layers):
            for name, t in self.layer(layer).items():
                if t is not None:
                    out[f"layers.{layer}.{name}"] = t.detach().to(torch.float32).cpu().contiguous()
        return out


def build_meta(
    *,
    method: dict[str, Any],
    model_id: str,
    config_hash: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    group_size: int,
    bits: int,
    calibration: dict[str, Any] | None = None,
    choices: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `meta.json` dictionary (docs/DESIGN.md) with format and package versions filled in."""
    meta = {
        "format_version": ARTIFACT_FORMAT_VERSION,
        "oscar_version": __version__,
        "method": method,
        "model": {
            "id": model_id,
            "config_hash": config_hash,
            "num_layers": int(num_layers),
            "num_kv_heads": int(num_kv_heads),
            "head_dim": int(head_dim),
        },
        "calibration": calibration or {},
        "group_size": int(group_size),
        "bits": int(bits),
        "choices": choices or [],
    }
    if extra:
        meta.update(extra)
    return meta


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_artifact(artifact: CalibrationArtifact, directory: str | os.PathLike) -> Path:
    """Write `rotations.safetensors` then `meta.json` atomically into `directory`."""
    from safetensors.torch import save_file

    artifact.validate()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(artifact.meta)
    model = dict(meta.get("model", {}))
    for key, value in (("num_layers", artifact.num_layers), ("num_kv_heads", artifact.num_kv_heads), ("head_dim", artifact.head_dim)):
        if key in model and int(model[key]) != value:
            raise ValueError(f"meta model.{key}={model[key]} disagrees with the tensors ({value})")
        model[key] = value
    meta["model"] = model
    meta.setdefault("format_version", ARTIFACT_FORMAT_VERSION)
    tensors = artifact.to_tensors()
    digest: dict[str, str] = {}

    def write_tensors(tmp: Path) -> None:
        save_file(tensors, str(tmp), metadata={"format": "oscar-rotations", "format_version": str(ARTIFACT_FORMAT_VERSION)})
        digest["sha"] = _sha256_file(tmp)

    atomic_write(out / TENSORS_FILE, write_tensors)
    meta["tensors_sha256"] = digest["sha"]
    meta = json.loads(json.dumps(meta, default=str))  # exactly what a reader will parse
    meta["meta_sha256"] = meta_digest(meta)
    atomic_write_text(out / META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return out


def meta_digest(meta: dict[str, Any]) -> str:
    """sha256 of a `meta.json` dictionary in canonical JSON, without its `meta_sha256` field."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _method_value(method: Any, key: str, default: Any) -> Any:
    getter = method.get if hasattr(method, "get") else lambda k, d=None: getattr(method, k, d)
    value = getter(key, default)
    value = default if value is None else value
    if key == "clip" and str(value) == "paper":  # the method's published choice, resolved as it runs
        value = getter("paper_clip", default) or default
    if isinstance(default, bool):
        return bool(value)
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return type(default)(value)
    return str(value)


def method_differences(recorded: Any, method: Any) -> dict[str, tuple[Any, Any]]:
    """`{field: (recorded, requested)}` for the `METHOD_FIELDS` where the two methods differ."""
    fields = dict(METHOD_FIELDS)
    if "fixed" in (_method_value(recorded, "clip", "fit"), _method_value(method, "clip", "fit")):
        fields.update(FIXED_CLIP_FIELDS)
    if not _method_value(recorded, "channel_block", 0) and not _method_value(method, "channel_block", 0):
        for key in SELECTION_FIELDS:  # per-token keys only: there is no key format to select
            fields.pop(key)
    out = {}
    for key, default in fields.items():
        a, b = _method_value(recorded, key, default), _method_value(method, key, default)
        if a != b:
            out[key] = (a, b)
    return out


def _read_meta(meta_path: Path) -> dict[str, Any]:
    """`meta.json` parsed and checked against its own digest; `ArtifactCorrupt` names the file and the fix."""
    fix = ("recalibrate (python -m oscar calibrate model=<model> method=<method> force=true) "
           "or restore both artifact files from where they were made")
    try:
        meta = json.loads(meta_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactCorrupt(f"{meta_path} is not valid JSON ({exc}): the file is truncated or damaged; {fix}") from exc
    if not isinstance(meta, dict):
        raise ArtifactCorrupt(f"{meta_path} holds a JSON {type(meta).__name__}, expected an object; {fix}")
    recorded = meta.get("meta_sha256")
    if recorded is None:
        raise ArtifactCorrupt(f"{meta_path} has no meta_sha256 (written by an older oscar or by hand); {fix}")
    if recorded != meta_digest(meta):
        raise ArtifactCorrupt(
            f"{meta_path} does not match its meta_sha256 {str(recorded)[:16]}...: it was edited or damaged after "
            f"it was written; {fix}"
        )
    return meta


def artifact_path(artifacts_dir: str | os.PathLike, model: str, method: str) -> Path:
    """Where the artifact of ``method`` on ``model`` lives: ``<artifacts_dir>/<model>/<method>/`` (the one rule the
    CLI, the engine, the workflow and the benchmarks use)."""
    return Path(str(artifacts_dir)) / str(model) / str(method)


def artifact_dir(cfg: Any) -> Path:
    """`artifact_path` of a composed configuration (``artifacts_dir``, ``model.name``, ``method.name``)."""
    return artifact_path(cfg.artifacts_dir, cfg.model.name, cfg.method.name)


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """An artifact directory's `meta.json`, checked against its own digest (without loading the tensors)."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(f"calibration artifact {directory} has no {META_FILE}; create it with "
                                "python -m oscar calibrate model=<model> method=<method>")
    return _read_meta(path)


def _check(what: str, found: Any, expected: Any, path: Path) -> None:
    if expected is not None and found != expected:
        raise ArtifactMismatch(
            f"calibration artifact {path} was made for {what}={found!r}, but the model has {what}={expected!r}; "
            "recalibrate for this model (python -m oscar calibrate ...) or load the matching artifact"
        )


def load_artifact(
    directory: str | os.PathLike,
    model: Any = None,
    *,
    config_hash: str | None = None,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    method: Any = None,
) -> CalibrationArtifact:
    """Read an artifact and refuse a mismatch with `model` (a transformers-style model or config),
    with the method it will run (`method`, a method config: the `METHOD_FIELDS`) or with the
    explicitly given fields, naming both values."""
    from safetensors import safe_open

    src = Path(directory)
    meta_path, tensor_path = src / META_FILE, src / TENSORS_FILE
    for p in (meta_path, tensor_path):
        if not p.is_file():
            raise FileNotFoundError(f"calibration artifact file {p} is missing (written by `python -m oscar calibrate`)")
    meta = _read_meta(meta_path)
    if meta.get("format_version") != ARTIFACT_FORMAT_VERSION:
        raise ArtifactMismatch(
            f"{meta_path}: format_version={meta.get('format_version')!r}, this oscar reads {ARTIFACT_FORMAT_VERSION}"
        )
    recorded = meta.get("tensors_sha256")
    if recorded is not None:
        actual = _sha256_file(tensor_path)
        if actual != recorded:
            raise ArtifactMismatch(
                f"{tensor_path} has sha256 {actual[:16]}..., but {meta_path} was written with {recorded[:16]}...: "
                "the two files do not belong together"
            )
    info = meta.get("model", {})
    if model is not None:
        fields = model_config_fields(model)
        config_hash = config_hash if config_hash is not None else model_config_hash(**fields)
        num_layers = num_layers if num_layers is not None else fields["num_layers"]
        num_kv_heads = num_kv_heads if num_kv_heads is not None else fields["num_kv_heads"]
        head_dim = head_dim if head_dim is not None else fields["head_dim"]
    _check("config_hash", info.get("config_hash"), config_hash, src)
    _check("num_layers", info.get("num_layers"), num_layers, src)
    _check("num_kv_heads", info.get("num_kv_heads"), num_kv_heads, src)
    _check("head_dim", info.get("head_dim"), head_dim, src)
    _check("group_size", meta.get("group_size"), group_size, src)
    _check("bits", meta.get("bits"), bits, src)
    if method is not None:
        recorded = meta.get("method") or {}
        diff = method_differences(recorded, method)
        if diff:
            made = ", ".join(f"{k}={a!r}" for k, (a, _) in diff.items())
            asked = ", ".join(f"{k}={b!r}" for k, (_, b) in diff.items())
            name = _method_value(method, "name", "?")
            raise ArtifactMismatch(
                f"calibration artifact {src} was made for method {_method_value(recorded, 'name', '?')!r} with {made}, "
                f"but method {name!r} is asked to run with {asked}; recalibrate for these settings "
                f"(python -m oscar calibrate model=<model> method={name} with the same overrides, force=true) "
                "or run the method as it was calibrated"
            )

    n_layers = int(info["num_layers"])
    data: dict[str, list] = {name: [] for name in (*_REQUIRED, *_OPTIONAL)}
    with safe_open(str(tensor_path), framework="pt") as fh:
        keys = set(fh.keys())
        for layer in range(n_layers):
            for name in (*_REQUIRED, *_OPTIONAL):
                key = f"layers.{layer}.{name}"
                if key in keys:
                    data[name].append(fh.get_tensor(key))
                elif name in _REQUIRED:
                    raise ArtifactMismatch(f"{tensor_path} lacks tensor {key}")
                else:
                    data[name].append(None)
    art = CalibrationArtifact(meta=meta, **data)
    _check("num_kv_heads (tensors)", art.num_kv_heads, info.get("num_kv_heads"), src)
    _check("head_dim (tensors)", art.head_dim, info.get("head_dim"), src)
    return art


__all__ = [
    "ARTIFACT_FORMAT_VERSION",
    "ArtifactCorrupt",
    "ArtifactMismatch",
    "METHOD_FIELDS",
    "SELECTION_FIELDS",
    "CalibrationArtifact",
    "build_meta",
    "config_hash_of",
    "load_artifact",
    "meta_digest",
    "method_differences",
    "model_config_fields",
    "model_config_hash",
    "save_artifact",
]

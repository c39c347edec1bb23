"""Calibration facade: statistics (`oscar.core.stats`), clip fitting and candidates (`oscar.core.clipfit`),
the artifact (`oscar.core.artifact`), and `build_artifact`, which turns statistics and a method
configuration into the per-layer rotations, means and clip ratios of an artifact.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from oscar.core.artifact import (
    ARTIFACT_FORMAT_VERSION,
    ArtifactMismatch,
    CalibrationArtifact,
    build_meta,
    config_hash_of,
    load_artifact,
    model_config_fields,
    model_config_hash,
    save_artifact,
)
from oscar.core.clipfit import (
    KEY_TARGETS,
    VALUE_TARGETS,
    Candidate,
    ClipFit,
    SelectBy,
    Selection,
    candidates,
    fit_clip_ratio,
    fit_layer_clip,
    geometric_mean,
    layer_rotations,
    make_candidate,
    measured_distortion,
    quantization_error,
    rotation_seed,
    select_candidate,
    select_layer,
    stats_rope,
    target_matrix,
    weighted_distortion,
)
from oscar.core.stats import CalibrationStats, attention_output, token_hash

CLIP_MODES = ("fit", "fixed", "none")


def _get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def _plain(value: Any) -> Any:
    """JSON-ready copy of a mapping/sequence tree (dicts, lists, DictConfig, ListConfig)."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if hasattr(value, "__iter__"):
        return [_plain(v) for v in value]
    return value


def build_artifact(
    method: Mapping[str, Any],
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    group_size: int,
    stats: CalibrationStats | None = None,
    clip_grid_k: Sequence[float] = (1.0,),
    clip_grid_v: Sequence[float] = (1.0,),
    model_id: str = "",
    config_hash: str = "",
    calibration: dict[str, Any] | None = None,
    select_by: SelectBy | None = None,
    key_formats: Sequence[bool] | None = None,
    memo: dict | None = None,
) -> CalibrationArtifact:
    """Rotations, means and clip ratios of every layer for a method config (dict or DictConfig).

    Reads `key_rotation`, `value_rotation` (an `oscar.core.rotation` kind or `auto`), `key_target`,
    `value_target`, `center`, `bits`, `clip` (`fit`: grid search on held-back rows of `stats`;
    `fixed`: `rho_k`/`rho_v`; `none`: 1.0), `seed`. `group_size` is the effective group size
    (`oscar.models.methods.effective_group_size`). `auto` picks, per (layer, KV head) and side, the
    candidate (`oscar.core.clipfit.candidates`) with the lowest measured distortion, each candidate
    with its own fitted clip ratio, and records the choices in the metadata. `channel_block` (`auto`
    only; 0 = off) adds the per-channel key candidates over blocks of that many tokens; a layer whose keys
    take them is listed in `meta["key_block"]` (per layer: the block, 0 for per-token keys). `select_by`
    (`oscar.core.clipfit.SelectBy`, opt-in, `auto` only): each (layer, KV head, side) chooses by its score
    instead of the measured distortion. `key_formats` (`auto` with `channel_block > 0`, one entry per layer):
    True / False imposes per-channel / per-token keys on that layer (`method.select_by=kl` chooses them by the
    model's next-token KL, `oscar.models.select`); each head still takes its best candidate of that format.
    `memo` (`select_layer`'s, one dict per statistics and method): calls that differ only by `key_formats` reuse
    the per-(layer, side) selections.
    """
    bits = int(_get(method, "bits", 2))
    clip = str(_get(method, "clip", "fit"))
    if clip not in CLIP_MODES:
        raise ValueError(f"clip={clip!r}; valid modes are {CLIP_MODES}")
    center = bool(_get(method, "center", False))
    rope_center = bool(_get(method, "rope_center", True))
    seed = int(_get(method, "seed", 0))
    channel_block = int(_get(method, "channel_block", 0))
    kinds = {"key": str(_get(method, "key_rotation", "identity")), "value": str(_get(method, "value_rotation", "identity"))}
    targets = {"key": str(_get(method, "key_target", "query")), "value": str(_get(method, "value_target", "output"))}
    fixed = {"key": float(_get(method, "rho_k", 1.0)), "value": float(_get(method, "rho_v", 1.0))}
    grids = {"key": list(clip_grid_k), "value": list(clip_grid_v)}
    if stats is not None and (stats.num_layers, stats.num_kv_heads, stats.head_dim) != (num_layers, num_kv_heads, head_dim):
        raise ValueError(
            f"statistics have (L, Hkv, d)=({stats.num_layers}, {stats.num_kv_heads}, {stats.head_dim}), "
            f"the model has ({num_layers}, {num_kv_heads}, {head_dim})"
        )
    if "auto" in kinds.values() and kinds["key"] != kinds["value"]:
        raise ValueError(f"auto must apply to both sides, got key_rotation={kinds['key']!r}, value_rotation={kinds['value']!r}")
    if kinds["key"] == "auto" and stats is None:
        raise ValueError("method auto needs calibration statistics with held-back rows")
    if channel_block < 0 or (channel_block and kinds["key"] != "auto"):
        raise ValueError(f"channel_block={channel_block}: per-channel key candidates are an auto setting (a positive "
                         "number of tokens, 0 = off); other methods have per-token keys")
    if key_formats is not None and (not channel_block or len(key_formats) != num_layers):
        raise ValueError(f"key_formats ({len(key_formats)} entries) imposes each layer's key format: it needs "
                         f"channel_block > 0 (got {channel_block}) and one entry per layer ({num_layers})")

    # layers the cache never quantizes (sliding-window layers, recorded by `dump`): no selection or clip fit
    skip = set((stats.meta.get("window_layers") or []) if stats is not None else [])
    out: dict[str, list] = {n: [] for n in ("R_K", "R_V", "mu_K", "mu_V", "rho_K", "rho_V", "eig_K", "eig_V", "ropemu_K")}
    ropes: list[dict[str, Any] | None] = []
    key_block: list[int] = []
    choices: list[dict[str, Any]] = []
    for layer in range(num_layers):
        per_side: dict[str, dict[str, Any]] = {}
        rope_mean: torch.Tensor | None = None
        for side, tag in (("key", "K"), ("value", "V")):
            if layer in skip and (kinds[side] == "auto" or clip == "fit"):
                rot = {"R": torch.eye(head_dim, dtype=torch.float64).expand(num_kv_heads, -1, -1).clone(),
                       "mu": torch.zeros(num_kv_heads, head_dim, dtype=torch.float64), "eig": None}
                rho = torch.ones(num_kv_heads)
            elif kinds[side] == "auto":
                grid = grids[side] if clip == "fit" else [fixed[side] if clip == "fixed" else 1.0]
                centers = None if rope_center or side == "value" else (False, True)
                sel = select_layer(stats, layer, side, grid, bits=bits, group_size=group_size, centers=centers,  # type: ignore[arg-type]
                                   channel_block=channel_block, select_by=select_by,
                                   key_format=None if key_formats is None or side == "value" else bool(key_formats[layer]),
                                   memo=memo)
                rot = {
                    "R": torch.stack([s.candidate.R for s in sel]),
                    "mu": torch.stack([s.candidate.mu for s in sel]),
                    "eig": None,
                }
                if all(s.candidate.eig is not None for s in sel):
                    rot["eig"] = torch.stack([s.candidate.eig for s in sel])  # type: ignore[misc]
                if any(s.candidate.rope_mean is not None for s in sel):
                    rope_mean = torch.stack([
                        s.candidate.rope_mean if s.candidate.rope_mean is not None else torch.zeros(head_dim, dtype=torch.float64)
                        for s in sel
                    ])
                rho = torch.tensor([s.clip.rho for s in sel])
                per_side[side] = {"sel": sel}
            else:
                rot = layer_rotations(
                    side, kinds[side], head_dim=head_dim, num_kv_heads=num_kv_heads, stats=stats, layer=layer,
                    target=targets[side], center=center, group_size=group_size, seed=seed,
                )
                if clip == "fit":
                    if stats is None:
                        raise ValueError("clip=fit needs calibration statistics with held-back rows; use clip=fixed or none")
                    fits = fit_layer_clip(stats, layer, side, rot["R"], rot["mu"], grids[side], bits=bits, group_size=group_size)  # type: ignore[arg-type]
                    rho = torch.tensor([f.rho for f in fits])
                else:
                    rho = torch.full((num_kv_heads,), fixed[side] if clip == "fixed" else 1.0)
            out[f"R_{tag}"].append(rot["R"].to(torch.float32))
            out[f"mu_{tag}"].append(rot["mu"].to(torch.float32))
            out[f"eig_{tag}"].append(None if rot["eig"] is None else rot["eig"].to(torch.float32))
            out[f"rho_{tag}"].append(rho.to(torch.float32))
        out["ropemu_K"].append(None if rope_mean is None else rope_mean.to(torch.float32))
        key_block.append(int(per_side["key"]["sel"][0].candidate.block) if "key" in per_side else 0)
        spec = stats_rope(stats, layer) if rope_mean is not None else None  # type: ignore[arg-type]
        ropes.append(None if spec is None else spec.to_json())
        if "key" in per_side:
            for h, (sk, sv) in enumerate(zip(per_side["key"]["sel"], per_side["value"]["sel"])):
                choices.append({
                    "layer": layer, "head": h,
                    "key_target": sk.candidate.target, "value_target": sv.candidate.target, "key_block": sk.candidate.block,
                    "center_k": sk.candidate.center, "center_v": sv.candidate.center,
                    "rho_k": sk.clip.rho, "rho_v": sv.clip.rho,
                    "key_distortion": sk.clip.distortion, "value_distortion": sv.clip.distortion,
                    "key_table": sk.table, "value_table": sv.table,
                })
    method_dict = _plain(method)
    meta = build_meta(
        method=method_dict, model_id=model_id, config_hash=config_hash, num_layers=num_layers,
        num_kv_heads=num_kv_heads, head_dim=head_dim, group_size=group_size, bits=bits,
        calibration=calibration, choices=choices,
    )
    if any(r is not None for r in ropes):
        meta["rope"] = ropes
    if skip:
        meta["window_layers"] = sorted(skip)
    if any(key_block):
        meta["key_block"] = key_block
    for side in ("eig_K", "eig_V"):
        if any(t is None for t in out[side]):
            out[side] = [None] * num_layers
    return CalibrationArtifact(meta=meta, **out)


__all__ = [
    "ARTIFACT_FORMAT_VERSION",
    "ArtifactMismatch",
    "CLIP_MODES",
    "CalibrationArtifact",
    "CalibrationStats",
    "Candidate",
    "ClipFit",
    "KEY_TARGETS",
    "Selection",
    "VALUE_TARGETS",
    "attention_output",
    "build_artifact",
    "build_meta",
    "candidates",
    "config_hash_of",
    "fit_clip_ratio",
    "fit_layer_clip",
    "geometric_mean",
    "layer_rotations",
    "load_artifact",
    "make_candidate",
    "measured_distortion",
    "model_config_fields",
    "model_config_hash",
    "quantization_error",
    "rotation_seed",
    "save_artifact",
    "select_candidate",
    "select_layer",
    "target_matrix",
    "token_hash",
    "weighted_distortion",
]

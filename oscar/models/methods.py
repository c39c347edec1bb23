"""Method configuration -> per (layer, KV head) key/value rotations, means and clip ratios.

A method (`conf/method/*.yaml`) is a cache configuration. Methods without calibration (`bf16`,
`int2`, `quarot`, `saw_int4`, `turboquant`, `kivi2`) get their rotations built in code from the
seed; `oscar*` and `auto` need calibration statistics (`python -m oscar dump`). The numerical
work is the math core's (`oscar.core.calibration.build_artifact`); this module validates the method,
applies the effective group size, and turns a method into an artifact in two steps that match
the pipeline stages: `rotations` (eigenbases and candidates, clip ratios left at 1) and `clip`
(per-head clip fits on held-back rows for `clip: fit`, or the fixed ratios).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

import oscar.core.calibration
from oscar.cache.formats import KINDS, format_class, group_of, record_format
from oscar.core.calibration import build_artifact
from oscar.core.clipfit import candidate_label, center_suffix
from oscar.core.files import atomic_write_text
from oscar.core.rotation import ROTATION_KINDS, NEEDS_COVARIANCE

ROTATION_CHOICES = (*ROTATION_KINDS, "auto")
CLIP_MODES = ("fit", "fixed", "none", "paper")
PAPER_CLIP_MODES = ("fit", "fixed", "none")
KEY_TARGETS = ("query", "raw", "geomean")
VALUE_TARGETS = ("output", "raw", "geomean")
# what chooses each layer's key format under `auto` with channel_block > 0: the measured distortion of the
# held-back rows (oscar.core.clipfit.select_layer), or the model's next-token KL (oscar.models.select)
SELECT_BY = ("distortion", "kl")


class MethodError(ValueError):
    """A method configuration that OSCAR cannot build."""


class CalibrationMissing(FileNotFoundError):
    """A method that needs calibration statistics or an artifact that does not exist yet."""


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if isinstance(cfg, Mapping) or hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def _rotated(method_cfg: Any) -> bool:
    """Whether the method's format reads rotations, means and clip ratios (`oscar.cache.formats`)."""
    kind = str(_get(method_cfg, "kind", "rotated"))
    return kind in KINDS and format_class(kind).rotated


def effective_group_size(method_cfg: Any, head_dim: int) -> int:
    """`min(method.group_size, head_dim)` (docs/DESIGN.md "Effective group size"); refuses non-divisors."""
    try:
        return group_of(method_cfg, head_dim)
    except ValueError as err:
        raise MethodError(str(err)) from None


def clip_mode(method_cfg: Any) -> str:
    """The clip policy a method runs with: `fit`, `fixed` or `none`.

    `method.clip` is the same for every method by default (`fit`: a clip ratio per layer, KV head
    and side fitted on held-back rows by measured distortion), so rows of a table differ only by
    their rotation and format. `clip=paper` selects each method's own published choice
    (`method.paper_clip`: unclipped for int2, quarot, saw_int4; fitted for oscar*). Kinds without a
    clip ratio in their format (`bf16`; `kivi`, whose min/max groups run along tokens; `turboquant`,
    whose Lloyd-Max codebook fixes its own range) always run with `none`.
    """
    if not _rotated(method_cfg):
        return "none"
    clip = str(_get(method_cfg, "clip", "fit"))
    if clip == "paper":
        clip = str(_get(method_cfg, "paper_clip", "fit"))
    return clip


def validate_method(method_cfg: Any) -> None:
    """Refuse unknown kinds, rotations, targets and clip modes, naming the valid options."""
    name = _get(method_cfg, "name", "?")
    kind = str(_get(method_cfg, "kind", "rotated"))
    if kind not in KINDS:
        raise MethodError(f"method {name!r}: unknown kind {kind!r}; valid: {', '.join(KINDS)}")
    for side in ("key_rotation", "value_rotation"):
        value = str(_get(method_cfg, side, "identity"))
        if value not in ROTATION_CHOICES:
            raise MethodError(f"method {name!r}: {side}={value!r}; valid: {', '.join(ROTATION_CHOICES)}")
    kt, vt = str(_get(method_cfg, "key_target", "query")), str(_get(method_cfg, "value_target", "output"))
    if kt not in KEY_TARGETS:
        raise MethodError(f"method {name!r}: key_target={kt!r}; valid: {', '.join(KEY_TARGETS)}")
    if vt not in VALUE_TARGETS:
        raise MethodError(f"method {name!r}: value_target={vt!r}; valid: {', '.join(VALUE_TARGETS)}")
    clip = str(_get(method_cfg, "clip", "fit"))
    if clip not in CLIP_MODES:
        raise MethodError(f"method {name!r}: clip={clip!r}; valid: {', '.join(CLIP_MODES)}")
    paper = str(_get(method_cfg, "paper_clip", "fit"))
    if paper not in PAPER_CLIP_MODES:
        raise MethodError(f"method {name!r}: paper_clip={paper!r}; valid: {', '.join(PAPER_CLIP_MODES)}")
    auto = [str(_get(method_cfg, s, "identity")) == "auto" for s in ("key_rotation", "value_rotation")]
    if any(auto) and not all(auto):
        raise MethodError(f"method {name!r}: auto must apply to both key_rotation and value_rotation")
    block, page = int(_get(method_cfg, "channel_block", 0)), int(_get(method_cfg, "page_size", 64))
    if block < 0 or (block and not all(auto)):
        raise MethodError(f"method {name!r}: channel_block={block}; per-channel key candidates are an auto setting "
                          "(a positive number of tokens; 0 = off)")
    if block and page % block:
        raise MethodError(f"method {name!r}: channel_block={block} must divide page_size={page} (a key block lives in one page)")
    select_by = str(_get(method_cfg, "select_by", "distortion"))
    if select_by not in SELECT_BY:
        raise MethodError(f"method {name!r}: select_by={select_by!r}; valid: {', '.join(SELECT_BY)}")
    if select_by == "kl" and not all(auto):
        raise MethodError(f"method {name!r}: select_by=kl chooses each layer's key format between per-token and "
                          "per-channel keys: it is an auto setting (key_rotation=auto, value_rotation=auto)")
    price = float(_get(method_cfg, "select_price", 0.0))
    if not price >= 0.0:
        raise MethodError(f"method {name!r}: select_price={price}; valid: a number >= 0 (nats of next-token KL per "
                          "extra bit per cached element that a per-channel layer must buy)")


def needs_statistics(method_cfg: Any) -> bool:
    """True when the method's rotations, means or clip ratios come from calibration statistics."""
    if not _rotated(method_cfg):
        return False
    rotations = {str(_get(method_cfg, s, "identity")) for s in ("key_rotation", "value_rotation")}
    return (
        bool(rotations & {*NEEDS_COVARIANCE, "auto"})
        or bool(_get(method_cfg, "center", False))
        or clip_mode(method_cfg) == "fit"
    )


def _method_dict(method_cfg: Any, **overrides: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    data = OmegaConf.to_container(method_cfg, resolve=True) if isinstance(method_cfg, DictConfig) else dict(method_cfg)
    if not _rotated(data):  # formats without rotations store none: identity, uncentered
        data = {**data, "key_rotation": "identity", "value_rotation": "identity", "center": False}
    data["clip"] = clip_mode(data)
    data.update(overrides)
    return data  # type: ignore[return-value]


def build_rotations(
    method_cfg: Any,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    stats: Any = None,
    clip_grid_k: Any = (1.0,),
    clip_grid_v: Any = (1.0,),
    model_id: str = "",
    config_hash: str = "",
    calibration: dict[str, Any] | None = None,
    key_formats: Any = None,
    memo: dict | None = None,
) -> Any:
    """Stage `rotations`: the method's per-head rotations and means; clip ratios 1 except for `auto`.

    `auto` selects each head's candidate with its own fitted clip ratio (the selection is defined
    under real clipped quantization), so its ratios are already final here. `key_formats` (per layer, True =
    per-channel keys) imposes the layers' key formats (`oscar.models.select`, `method.select_by=kl`); `memo`: one
    dict shared by the calls that differ only by `key_formats` (each layer's selections computed once).
    """
    validate_method(method_cfg)
    if needs_statistics(method_cfg) and stats is None:
        raise CalibrationMissing(
            f"method {_get(method_cfg, 'name', '?')!r} needs calibration statistics; run "
            "python -m oscar dump (or calibrate) for this model first"
        )
    is_auto = str(_get(method_cfg, "key_rotation", "identity")) == "auto"
    method = _method_dict(method_cfg) if is_auto else _method_dict(method_cfg, clip="none")
    art = build_artifact(
        method,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        group_size=effective_group_size(method_cfg, head_dim),
        stats=stats,
        clip_grid_k=list(clip_grid_k),
        clip_grid_v=list(clip_grid_v),
        model_id=model_id,
        config_hash=config_hash,
        calibration=calibration,
        key_formats=key_formats,
        memo=memo,
    )
    art.meta["method"] = _method_dict(method_cfg)
    record_format(art, method_cfg)  # meta.json names the cache format the artifact was calibrated for
    return art


def fit_clip(artifact: Any, method_cfg: Any, *, stats: Any = None, clip_grid_k: Any, clip_grid_v: Any) -> Any:
    """Stage `clip`: set each head's clip ratios on a rotations artifact (fit, fixed or none)."""
    validate_method(method_cfg)
    clip = clip_mode(method_cfg)
    # sliding-window layers (recorded by `dump`) are never quantized: no fit, ratio 1, not counted on edges
    skip = set((stats.meta.get("window_layers") or []) if stats is not None else [])
    fitted = [layer for layer in range(artifact.num_layers) if layer not in skip]

    def edges() -> dict[str, int]:
        return grid_edges([artifact.rho_K[l] for l in fitted], [artifact.rho_V[l] for l in fitted], clip_grid_k, clip_grid_v)

    if str(_get(method_cfg, "key_rotation", "identity")) == "auto":
        # auto chose each head's candidate together with its clip ratio (same grid, rows and
        # metric as a refit here), so the ratios of the rotations stage are final
        artifact.meta["clip"] = {"mode": clip, "grid_k": list(clip_grid_k), "grid_v": list(clip_grid_v), "fits": "selected with the rotation (auto)"}
        if clip == "fit" and fitted:
            artifact.meta["clip"]["edges"] = edges()
        return artifact
    bits = int(_get(method_cfg, "bits", 2))
    hkv = artifact.num_kv_heads
    g = effective_group_size(method_cfg, artifact.head_dim)
    fits_meta: list[dict[str, Any]] = []
    for layer in range(artifact.num_layers):
        for side, tag, grid, fixed in (
            ("key", "K", clip_grid_k, float(_get(method_cfg, "rho_k", 1.0))),
            ("value", "V", clip_grid_v, float(_get(method_cfg, "rho_v", 1.0))),
        ):
            if clip == "fit" and layer in skip:
                rho = torch.ones(hkv, dtype=torch.float32)
            elif clip == "fit":
                if stats is None:
                    raise CalibrationMissing("clip=fit needs calibration statistics with held-back rows (python -m oscar dump)")
                # looked up on its module at each call: the clip verb counts these calls for its progress
                fits = oscar.core.calibration.fit_layer_clip(
                    stats, layer, side, getattr(artifact, f"R_{tag}")[layer].to(torch.float64),
                    getattr(artifact, f"mu_{tag}")[layer].to(torch.float64), list(grid), bits=bits, group_size=g,
                )
                rho = torch.tensor([f.rho for f in fits], dtype=torch.float32)
                fits_meta += [
                    {"layer": layer, "head": h, "side": side, "rho": f.rho, "distortion": f.distortion}
                    for h, f in enumerate(fits)
                ]
            else:
                rho = torch.full((hkv,), fixed if clip == "fixed" else 1.0, dtype=torch.float32)
            getattr(artifact, f"rho_{tag}")[layer] = rho
    artifact.meta["clip"] = {"mode": clip, "grid_k": list(clip_grid_k), "grid_v": list(clip_grid_v), "fits": fits_meta}
    if skip:
        artifact.meta["clip"]["skipped_window_layers"] = sorted(skip)
    if clip == "fit" and fitted:
        artifact.meta["clip"]["edges"] = edges()
    artifact.validate()
    return artifact


def grid_edges(rho_k: Any, rho_v: Any, grid_k: Any, grid_v: Any) -> dict[str, int]:
    """How many (layer, KV head) fits sit on an edge of their clip grid, per side.

    `low` counts the grid's smallest ratio (the optimum may lie below the grid: widen it);
    `high` counts ratio 1 or the grid's largest (no clipping: the physical end, not a grid artifact
    when the grid reaches 1). `heads` is the number of fits per side.
    """
    out: dict[str, int] = {}
    for side, rhos, grid in (("key", rho_k, grid_k), ("value", rho_v, grid_v)):
        vals = torch.cat([torch.as_tensor(r, dtype=torch.float32).flatten() for r in rhos])
        lo, hi = float(min(grid)), float(max(grid))
        out[f"{side}_low"] = int((vals <= lo + 1e-6).sum()) if len(grid) > 1 else 0
        out[f"{side}_high"] = int((vals >= hi - 1e-6).sum())
        out[f"{side}_heads"] = int(vals.numel())
    return out


def in_code_artifact(method_cfg: Any, *, num_layers: int, num_kv_heads: int, head_dim: int, **kwargs: Any) -> Any:
    """The complete artifact of a method that needs no statistics (rotations from the seed, fixed clip)."""
    if needs_statistics(method_cfg):
        raise CalibrationMissing(
            f"method {_get(method_cfg, 'name', '?')!r} needs calibration; run python -m oscar calibrate method="
            f"{_get(method_cfg, 'name', '?')}"
        )
    art = build_rotations(method_cfg, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, **kwargs)
    return fit_clip(art, method_cfg, clip_grid_k=(1.0,), clip_grid_v=(1.0,))


def auto_choices_table(artifact: Any) -> list[dict[str, Any]]:
    """Flat rows (layer, head, key/value choice, clip, distortion) of an `auto` artifact's choices."""
    rows = []
    for c in artifact.meta.get("choices", []):
        rows.append({
            "layer": c["layer"], "head": c["head"],
            "key_choice": candidate_label(c["key_target"], c["center_k"], int(c.get("key_block", 0))),
            "value_choice": c["value_target"] + center_suffix(c["center_v"]),
            "rho_k": c.get("rho_k"), "rho_v": c.get("rho_v"),
            "key_distortion": c["key_distortion"], "value_distortion": c["value_distortion"],
        })
    return rows


def _oscar_reference(table: list[dict[str, Any]], target: str) -> float | None:
    for row in table:
        if row["target"] == target and not row["center"]:
            return float(row["distortion"])
    return None


def auto_choices_rows(artifact_meta: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (layer, KV head) of an `auto` artifact: the winners and their distortion relative to
    OSCAR's own target (`query` keys / `output` values, uncentered, with its fitted clip)."""
    rows = []
    for c in artifact_meta.get("choices", []):
        ref_k = _oscar_reference(c.get("key_table", []), "query")
        ref_v = _oscar_reference(c.get("value_table", []), "output")
        rows.append({
            "layer": int(c["layer"]),
            "head": int(c["head"]),
            "key_choice": candidate_label(c["key_target"], c["center_k"], int(c.get("key_block", 0))),
            "rho_k": c.get("rho_k"),
            "key_distortion": float(c["key_distortion"]),
            "key_vs_oscar": float(c["key_distortion"]) / ref_k if ref_k else None,
            "value_choice": c["value_target"] + center_suffix(c["center_v"]),
            "rho_v": c.get("rho_v"),
            "value_distortion": float(c["value_distortion"]),
            "value_vs_oscar": float(c["value_distortion"]) / ref_v if ref_v else None,
        })
    return rows


def write_auto_choices(artifact_meta: dict[str, Any], prefix: str | Path, title: str = "", note: str = "") -> tuple[Path, Path]:
    """Write `<prefix>.csv` (per layer and head) and `<prefix>.md` (counts and per-layer summary)."""
    import csv
    import io
    import math
    from collections import Counter

    rows = auto_choices_rows(artifact_meta)
    if not rows:
        raise MethodError("the artifact has no auto choices (method is not auto?)")
    prefix = Path(prefix)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    csv_path = prefix.parent / (prefix.name + ".csv")  # not with_suffix: names like "qwen2.5-coder" have dots
    atomic_write_text(csv_path, buf.getvalue())

    def geo(values: list[float]) -> float:
        vals = [v for v in values if v and v > 0]
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")

    cal = artifact_meta.get("calibration", {})
    lines = [
        f"# `auto` choices{': ' + title if title else ''}",
        "",
        f"Model `{artifact_meta.get('model', {}).get('id', '?')}`, group size {artifact_meta.get('group_size')}, "
        f"{artifact_meta.get('bits')} bits; calibration `{cal.get('data_id', '?')}` {cal.get('tokens', '?')} tokens "
        f"(hash {cal.get('token_hash', '?')}), selection on {cal.get('holdout_tokens', '?')} held-back tokens.",
        "Distortion: mean squared logit error (keys, metric C_Q) / output error (values, metric C_S) after real "
        "INT quantization with each candidate's fitted clip. `vs OSCAR`: geometric mean over heads of "
        "distortion(choice) / distortion(OSCAR target, uncentered); below 1 means `auto` improves on OSCAR.",
        *([note] if note else []),
        "",
        "| side | choice | heads |",
        "|---|---|---|",
    ]
    for side in ("key", "value"):
        for choice, n in Counter(r[f"{side}_choice"] for r in rows).most_common():
            lines.append(f"| {side} | {choice} | {n} |")
    lines += [
        "",
        f"Geometric mean vs OSCAR: keys {geo([r['key_vs_oscar'] for r in rows]):.3f}, "
        f"values {geo([r['value_vs_oscar'] for r in rows]):.3f}.",
        "",
        "| layer | key choices (per KV head) | keys vs OSCAR | value choices (per KV head) | values vs OSCAR |",
        "|---|---|---|---|---|",
    ]
    for layer in sorted({r["layer"] for r in rows}):
        lr = [r for r in rows if r["layer"] == layer]
        lines.append(
            f"| {layer} | {', '.join(r['key_choice'] for r in lr)} | {geo([r['key_vs_oscar'] for r in lr]):.3f} "
            f"| {', '.join(r['value_choice'] for r in lr)} | {geo([r['value_vs_oscar'] for r in lr]):.3f} |"
        )
    md_path = prefix.parent / (prefix.name + ".md")
    atomic_write_text(md_path, "\n".join(lines) + "\n")
    return csv_path, md_path

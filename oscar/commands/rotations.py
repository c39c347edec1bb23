"""`python -m oscar rotations [overrides] [force=true]`: eigenbases and the method's rotations.

Reads the statistics of `dump` and writes `<results_dir>/rotations/<model>/<method>/` (or
`output=`) in the artifact format with clip ratios 1 (for `auto`: each head's chosen candidate
with its own fitted ratio, since the choice is made under real clipped quantization). Methods
that need no calibration are built in code from the seed. `auto` with `method.select_by=kl` (and
`channel_block > 0`) loads the model and chooses each layer's key format by next-token KL on the
calibration corpus's held-back windows (`oscar.models.select`); the artifact's `meta["selection"]` records it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import oscar.core.calibration
from oscar.commands._stage import (
    run_stage_verb,
    StageResult,
    dump_hash,
    recorded_hash,
    rotations_dir,
    rotations_hash,
    Progress,
    count_calls,
    single_thread,
    stats_dir,
)
from oscar.core.artifact import config_hash_of, save_artifact
from oscar.core.stats import CalibrationStats
from oscar.data.corpora import calibration_splits
from oscar.models import load_model
from oscar.models.methods import CalibrationMissing, build_rotations, needs_statistics
from oscar.models.select import select_key_formats


def load_stats(cfg: Any, path: Path | None = None) -> Any:
    """The `dump` statistics of a configuration, refusing missing or stale ones with the fix."""
    src = Path(path) if path is not None else stats_dir(cfg)
    if not (src / "stats.json").is_file():
        raise CalibrationMissing(
            f"no calibration statistics at {src}; run: python -m oscar dump model={cfg.model.name} "
            f"calibration={cfg.calibration.name} (or python -m oscar calibrate ...)"
        )
    found = recorded_hash(src / "stats.json", "meta", "stage_hash")
    if found != dump_hash(cfg):
        raise CalibrationMissing(
            f"statistics at {src} were made with configuration hash {found}, the current model/calibration "
            f"configuration hashes to {dump_hash(cfg)}; rerun: python -m oscar dump model={cfg.model.name} force=true"
        )
    return CalibrationStats.load(src)


def model_geometry(cfg: Any, stats: Any) -> dict[str, Any]:
    """Layers, KV heads, head_dim and config hash, from the statistics or (without them) the model entry."""
    if stats is not None:
        meta = stats.meta.get("model", {})
        return {
            "num_layers": stats.num_layers, "num_kv_heads": stats.num_kv_heads, "head_dim": stats.head_dim,
            "config_hash": meta.get("config_hash", ""),
        }
    model, _ = load_model(cfg.model, device="cpu")
    fields = config_hash_of(model)
    return {
        "num_layers": int(cfg.model.num_layers), "num_kv_heads": int(cfg.model.num_kv_heads),
        "head_dim": int(cfg.model.head_dim), "config_hash": fields,
    }


def calibration_meta(stats: Any) -> dict[str, Any]:
    """The `calibration` block of an artifact's meta (data id, tokens, token hash, seed)."""
    return dict(stats.meta.get("calibration", {})) if stats is not None else {}


def run_rotations(cfg: Any, *, force: bool = False, out: Path | None = None, stats: Any = None) -> StageResult:
    """Stage `rotations` for a composed configuration."""
    t0 = time.perf_counter()
    target = Path(out) if out is not None else rotations_dir(cfg)
    h = rotations_hash(cfg)
    if not force and recorded_hash(target / "meta.json", "pipeline", "rotations_hash") == h and (target / "rotations.safetensors").is_file():
        return StageResult("rotations", target, True, time.perf_counter() - t0, h)
    if stats is None and needs_statistics(cfg.method):
        stats = load_stats(cfg)
    geom = model_geometry(cfg, stats)
    built: dict[tuple[bool, ...] | None, Any] = {}
    memo: dict = {}  # select_by=kl builds several key-format sets: each layer's selections are computed once

    def build(key_formats: list[bool] | None = None) -> Any:
        key = None if key_formats is None else tuple(key_formats)
        if key not in built:
            steps = Progress(f"rotations {cfg.model.name}/{cfg.method.name} (layer, side)", 2 * int(geom["num_layers"]))
            with single_thread(), count_calls(steps, oscar.core.calibration, ("select_layer", "layer_rotations")):
                built[key] = build_rotations(
                    cfg.method,
                    num_layers=geom["num_layers"], num_kv_heads=geom["num_kv_heads"], head_dim=geom["head_dim"],
                    stats=stats, clip_grid_k=list(cfg.calibration.clip_grid_k), clip_grid_v=list(cfg.calibration.clip_grid_v),
                    model_id=str(cfg.model.name), config_hash=geom["config_hash"], calibration=calibration_meta(stats),
                    key_formats=key_formats, memo=memo,
                )
        return built[key]

    if str(cfg.method.get("select_by", "distortion")) == "kl" and int(cfg.method.get("channel_block", 0) or 0):
        art = kl_selected(cfg, stats, build)
    else:
        art = build()
    art.meta["pipeline"] = {"rotations_hash": h, "stats_hash": dump_hash(cfg) if stats is not None else None}
    save_artifact(art, target)
    return StageResult("rotations", target, False, time.perf_counter() - t0, h)


def kl_selected(cfg: Any, stats: Any, build: Any) -> Any:
    """The `auto` artifact whose layers' key formats next-token KL chose (`oscar.models.select`) on the held-back
    windows of the calibration corpus (the same tokens the statistics' held-back rows come from)."""
    model, tokenizer = load_model(cfg.model, device=str(cfg.device) if str(cfg.device) != "auto" else None)
    splits = calibration_splits(tokenizer, cfg.calibration)
    made_on = calibration_meta(stats).get("token_hash")
    if made_on is not None and made_on != splits.hash():
        raise CalibrationMissing(f"the statistics were made on calibration tokens {made_on}, the corpus now gives "
                                 f"{splits.hash()}; rerun: python -m oscar dump model={cfg.model.name} force=true")
    skip = (stats.meta.get("window_layers") or []) if stats is not None else []
    passes = Progress(f"select_by=kl {cfg.model.name}/{cfg.method.name} (decode-equivalent passes)",
                      int(model.config.num_hidden_layers) + 3 - len(skip))
    choice = select_key_formats(model, splits.holdout, cfg.method, build, skip=skip, step=passes.step)
    art = build(choice.formats)
    art.meta["selection"] = choice.to_meta()
    return art


# verb flags and defaults, listed by `--help`
HELP_FLAGS = {"force": False}


def main(argv: list[str]) -> int:
    """Compose the configuration, run `rotations`, print where they are."""
    return run_stage_verb("rotations", argv, run_rotations)

"""`python -m oscar clip [overrides] [force=true]`: fit clip ratios, write the calibration artifact.

Reads the `rotations` output and the `dump` statistics (held-back rows, metrics) and writes the
final artifact `<artifacts_dir>/<model>/<method>/` (`rotations.safetensors` + `meta.json`, or
`output=`): clip ratios fitted per (layer, KV head) for `clip: fit`, fixed or 1 otherwise.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import oscar.core.calibration
from oscar.commands._stage import (
    run_stage_verb,
    StageResult,
    clip_hash,
    recorded_hash,
    rotations_dir,
    rotations_hash,
    Progress,
    count_calls,
    single_thread,
)
from oscar.commands.rotations import load_stats
from oscar.core.artifact import artifact_dir, load_artifact, save_artifact
from oscar.models.methods import CalibrationMissing, clip_mode, fit_clip


def run_clip(cfg: Any, *, force: bool = False, out: Path | None = None, stats: Any = None, rotations: Path | None = None) -> StageResult:
    """Stage `clip` for a composed configuration."""
    t0 = time.perf_counter()
    target = Path(out) if out is not None else artifact_dir(cfg)
    h = clip_hash(cfg)
    if not force and recorded_hash(target / "meta.json", "pipeline", "clip_hash") == h and (target / "rotations.safetensors").is_file():
        return StageResult("clip", target, True, time.perf_counter() - t0, h)
    src = Path(rotations) if rotations is not None else rotations_dir(cfg)
    found = recorded_hash(src / "meta.json", "pipeline", "rotations_hash")
    if found is None:
        raise CalibrationMissing(
            f"no rotations at {src}; run: python -m oscar rotations model={cfg.model.name} method={cfg.method.name}"
        )
    if found != rotations_hash(cfg):
        raise CalibrationMissing(
            f"rotations at {src} were made with configuration hash {found}, the current configuration hashes to "
            f"{rotations_hash(cfg)}; rerun: python -m oscar rotations model={cfg.model.name} method={cfg.method.name} force=true"
        )
    art = load_artifact(src)
    clip = clip_mode(cfg.method)
    if stats is None and clip == "fit":
        stats = load_stats(cfg)

    steps = Progress(f"clip {cfg.model.name}/{cfg.method.name} (layer, side)", 2 * art.num_layers)
    with single_thread(), count_calls(steps, oscar.core.calibration, ("fit_layer_clip",)):
        art = fit_clip(
            art, cfg.method, stats=stats,
            clip_grid_k=list(cfg.calibration.clip_grid_k), clip_grid_v=list(cfg.calibration.clip_grid_v),
        )
    art.meta["pipeline"] = {**art.meta.get("pipeline", {}), "clip_hash": h}
    art.meta.pop("tensors_sha256", None)
    save_artifact(art, target)
    return StageResult("clip", target, False, time.perf_counter() - t0, h)


# verb flags and defaults, listed by `--help`
HELP_FLAGS = {"force": False}


def main(argv: list[str]) -> int:
    """Compose the configuration, run `clip`, print where the artifact is."""
    return run_stage_verb("clip", argv, run_clip)

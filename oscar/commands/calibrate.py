"""`python -m oscar calibrate [overrides] [force=true]`: `dump` + `rotations` + `clip` in one process.

Each stage is skipped when its output exists with the same configuration hash (unless
`force=true`). `output=` redirects the final artifact; statistics and rotations keep their
standard paths under `results_dir`. Methods that need no statistics skip `dump`. For `auto`,
the per-(layer, head) choices are also written as `choices.csv` / `choices.md` beside the
artifact, and to `<report>.csv` / `<report>.md` when `report=<path prefix>` is given.
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path
from typing import Any

from oscar.commands._stage import StageResult, pop_flags
from oscar.commands.clip import run_clip
from oscar.commands.dump import run_dump
from oscar.commands.rotations import load_stats, run_rotations
from oscar.config import ConfigError, compose
from oscar.models.methods import needs_statistics, validate_method, write_auto_choices


def run_calibrate(cfg: Any, *, force: bool = False, out: Path | None = None) -> list[StageResult]:
    """All three stages; the statistics are loaded once and shared."""
    validate_method(cfg.method)
    results = []
    stats = None
    if needs_statistics(cfg.method):
        results.append(run_dump(cfg, force=force))
        stats = load_stats(cfg, results[-1].path)
    results.append(run_rotations(cfg, force=force, stats=stats))
    results.append(run_clip(cfg, force=force, out=out, stats=stats, rotations=results[-1].path))
    if str(cfg.method.key_rotation) == "auto":
        write_choices(results[-1].path, results[-1].path / "choices", str(cfg.model.name))
    return results


def write_choices(artifact: Path, prefix: Path, title: str, note: str = "") -> tuple[Path, Path]:
    """Tables of an `auto` artifact's per-(layer, head) choices (`oscar.models.methods.write_auto_choices`)."""
    import json

    meta = json.loads((Path(artifact) / "meta.json").read_text())
    return write_auto_choices(meta, prefix, title, note)


# verb flags and defaults, listed by `--help`
HELP_FLAGS = {"force": False, "report": ""}


def main(argv: list[str]) -> int:
    """Compose the configuration, run the three stages, print a summary with timings."""
    try:
        flags, overrides = pop_flags(argv, {"force": False, "report": ""})
        cfg = compose(overrides)
    except ConfigError as exc:
        print(f"oscar calibrate: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        results = run_calibrate(cfg, force=bool(flags["force"]), out=Path(str(cfg.output)) if cfg.output else None)
        if flags["report"]:
            if str(cfg.method.key_rotation) != "auto":
                raise ValueError(f"report= writes auto choices; method {cfg.method.name!r} is not auto")
            note = f"Produced by `python -m oscar calibrate {' '.join(overrides)}` on {platform.machine()} ({platform.processor() or 'cpu'})."
            for path in write_choices(results[-1].path, Path(flags["report"]), str(cfg.model.name), note):
                print(f"report    {path}")
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"oscar calibrate: {exc}", file=sys.stderr)
        return 1
    for r in results:
        state = "up to date (skipped)" if r.skipped else f"{r.seconds:.1f} s"
        print(f"{r.stage:9s} {r.path}  {state}")
    print(f"calibrate: {cfg.model.name} / {cfg.method.name} done in {time.perf_counter() - t0:.1f} s")
    return 0

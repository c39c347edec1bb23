"""Helpers shared by the calibration verbs: verb-only flags, atomic writes, stage skip logic."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from oscar.config import ConfigError, compose, config_hash

TRUE = {"true", "1", "yes", "on"}
FALSE = {"false", "0", "no", "off"}


def pop_flags(argv: list[str], defaults: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Split verb-only flags (`force=true`) from Hydra overrides; flags keep the type of their default."""
    flags = dict(defaults)
    rest: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in defaults:
            default = defaults[key]
            if isinstance(default, bool):
                low = value.lower()
                if low not in TRUE | FALSE:
                    raise ConfigError(f"flag {key}={value!r}: expected true or false")
                flags[key] = low in TRUE
            elif isinstance(default, int):
                try:
                    flags[key] = int(value)
                except ValueError:
                    raise ConfigError(f"flag {key}={value!r}: expected an integer") from None
                if flags[key] < 0:
                    raise ConfigError(f"flag {key}={value!r}: must be >= 0")
            else:
                flags[key] = value
        else:
            rest.append(arg)
    return flags, rest


def read_json(path: Path) -> Any:
    """JSON content of a file, or None when it does not exist."""
    return json.loads(path.read_text()) if path.is_file() else None


STAGE_VERSION = 1
DUMP_VERSION = 2  # 2: pre-RoPE key sums and held-back row positions (rope-centered candidates)


@dataclass
class StageResult:
    """Outcome of one pipeline stage: where its output is, whether it was skipped, how long it took."""

    stage: str
    path: Path
    skipped: bool
    seconds: float
    stage_hash: str


def _plain(cfg: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def dump_hash(cfg: Any) -> str:
    """Hash of everything the statistics depend on: the model entry and the calibration data."""
    cal = {k: v for k, v in _plain(cfg.calibration).items() if k not in ("clip_grid_k", "clip_grid_v")}
    return config_hash({"stage": "dump", "version": STAGE_VERSION, "dump_version": DUMP_VERSION, "model": _plain(cfg.model), "calibration": cal})


def rotations_hash(cfg: Any) -> str:
    """Hash of the statistics plus the method (and the clip grids, which `auto` selects with)."""
    grids = {"k": list(cfg.calibration.clip_grid_k), "v": list(cfg.calibration.clip_grid_v)}
    return config_hash({"stage": "rotations", "version": STAGE_VERSION, "stats": dump_hash(cfg), "method": _plain(cfg.method), "grids": grids})


def clip_hash(cfg: Any) -> str:
    """Hash of the rotations plus the clip settings."""
    grids = {"k": list(cfg.calibration.clip_grid_k), "v": list(cfg.calibration.clip_grid_v)}
    return config_hash({"stage": "clip", "version": STAGE_VERSION, "rotations": rotations_hash(cfg), "grids": grids})


def stats_dir(cfg: Any) -> Path:
    """`<results_dir>/stats/<model>/<calibration>/`."""
    return Path(str(cfg.results_dir)) / "stats" / str(cfg.model.name) / str(cfg.calibration.name)


def rotations_dir(cfg: Any) -> Path:
    """`<results_dir>/rotations/<model>/<method>/` (rotations before clip fitting)."""
    return Path(str(cfg.results_dir)) / "rotations" / str(cfg.model.name) / str(cfg.method.name)


def recorded_hash(meta_file: Path, *keys: str) -> str | None:
    """A stage hash recorded in a JSON file (nested keys), or None when absent."""
    data = read_json(meta_file)
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data if isinstance(data, str) else None


class single_thread:
    """Context: run torch on one intra-op thread (the clip/auto stages are thousands of tiny ops,
    where thread hand-offs cost more than they save: 14 s vs 164 s measured on a loaded 2-core CPU)."""

    def __enter__(self) -> "single_thread":
        import torch

        self._previous = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        import torch

        torch.set_num_threads(self._previous)


def run_stage_verb(name: str, argv: list[str], runner: Any, *, takes_out: bool = True) -> int:
    """Shared `main` of the stage verbs: compose the config, run `runner(cfg, force=, [out=])`,
    print where the output is; a configuration error exits with 2, a failure of the stage with 1,
    each with the reason on one line."""
    import sys

    try:
        flags, overrides = pop_flags(argv, {"force": False})
        cfg = compose(overrides)
    except ConfigError as exc:
        print(f"oscar {name}: {exc}", file=sys.stderr)
        return 2
    try:
        kwargs: dict[str, Any] = {"force": bool(flags["force"])}
        if takes_out:
            kwargs["out"] = Path(str(cfg.output)) if cfg.output else None
        result = runner(cfg, **kwargs)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"oscar {name}: {exc}", file=sys.stderr)
        return 1
    state = "up to date (skipped)" if result.skipped else f"written in {result.seconds:.1f} s"
    print(f"{name}: {result.path} {state}")
    return 0


class Progress:
    """Line-based progress with elapsed time and ETA on stderr (readable in a job's log file, unlike a
    redrawn bar): at most one line per `every_s` seconds, plus the last step."""

    def __init__(self, label: str, total: int, every_s: float = 5.0, stream: Any = None, clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.every_s = label, max(1, int(total)), every_s
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.start = clock()
        self.last = -float("inf")
        self.done = 0

    def step(self, n: int = 1) -> None:
        """Count `n` finished steps and print a line when it is time."""
        self.done += n
        now = self.clock()
        if now - self.last < self.every_s and self.done < self.total:
            return
        self.last = now
        elapsed = now - self.start
        eta = elapsed / self.done * max(0, self.total - self.done)
        print(f"{self.label}: {min(self.done, self.total)}/{self.total} ({100 * min(self.done, self.total) // self.total}%), "
              f"{elapsed:.0f} s elapsed, ETA {eta:.0f} s", file=self.stream, flush=True)


@contextlib.contextmanager
def count_calls(progress: Progress, module: Any, names: tuple[str, ...]) -> Iterator[Progress]:
    """Feed `progress` one step per call of the per-(layer, side) functions `module.<name>` while the
    block runs (a stage's loop looks them up in their module at call time); restored afterwards."""
    originals = {name: getattr(module, name) for name in names}

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            progress.step()
            return out

        return call

    try:
        for name, fn in originals.items():
            setattr(module, name, counted(fn))
        yield progress
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)

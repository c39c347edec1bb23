"""Plan the workflow's cells from the composed configuration (imported by workflow/rules/common.smk).

The Snakefile composes the configuration once per distinct cell through `oscar.config`, writes
each cell's resolved configuration as a file (only when its content changed), and looks up the
command-line overrides of a job by its output path. The library never imports this module.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from oscar.core.artifact import artifact_path
from oscar.config import Composer, ConfigError, ResourcesConfig, config_hash, to_dict, write_resolved, write_text_if_changed

# Overrides that select a value of a grid axis instead of a setting of every cell.
AXIS_KEYS = {"model": "models", "method": "methods", "benchmark": "benchmarks", "seed": "seeds"}

# Default resources per workflow stage when the experiment does not set them.
DEFAULT_RESOURCES = {
    "dump": ResourcesConfig(threads=2, mem_mb=4000, runtime=30),
    "calibrate": ResourcesConfig(threads=2, mem_mb=4000, runtime=30),
    "eval": ResourcesConfig(threads=2, mem_mb=4000, runtime=120),
    "fidelity": ResourcesConfig(threads=2, mem_mb=4000, runtime=60),
    "report": ResourcesConfig(threads=1, mem_mb=2000, runtime=10),
    "kernels": ResourcesConfig(threads=4, mem_mb=16000, runtime=60, gpu=1),
}

# Sections of a cell's resolved configuration file (the study's tables and tracking do not
# change a cell's outputs, so editing them reruns nothing).
CELL_SECTIONS_DROPPED = ("experiment", "tracking")
ARTIFACTS_DIR = "results/calibration"  # the workflow's artifacts_dir (artifact_path gives each artifact's folder)
# Sub-configurations a calibration stage depends on: a change elsewhere does not recalibrate.
STATS_KEYS = ("model", "calibration", "device", "backend")
ARTIFACT_KEYS = ("model", "method", "calibration", "device", "backend")
# Method fields that shape the cache at run time but not the calibration artifact.
RUNTIME_ONLY_METHOD_FIELDS = ("sink", "recent", "page_size")


def parse_user_overrides(value: Any) -> list[str]:
    """Normalise `--config overrides=...` (a YAML list, one string, or nothing) to a list of strings."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        return [part.strip() for part in _split_top_level(text) if part.strip()]
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value if str(v).strip()]
    raise ConfigError(f"config 'overrides' must be a list of Hydra overrides, got {value!r}")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets (so `x=[1,2]` stays whole)."""
    parts, depth, current = [], 0, []
    for char in text:
        if char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def split_axis_overrides(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """Separate grid-axis selections (`model=X`, `method=Y`, `seed=3`) from per-cell settings."""
    axes: dict[str, str] = {}
    rest: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in AXIS_KEYS:
            if "," in value:
                raise ConfigError(
                    f"override {item!r}: one value per axis (sweeps are tables in conf/experiment/, not multirun)"
                )
            axes[key] = value
        else:
            rest.append(item)
    return axes, rest


@dataclass(frozen=True)
class Cell:
    """One job of a table: a (model, method[+variant], benchmark or corpus, seed) evaluation."""

    table: str
    kind: str  # eval | fidelity
    model: str
    method: str
    variant: str
    item: str  # benchmark (eval) or corpus (fidelity)
    seed: int
    overrides: tuple[str, ...]
    flags: tuple[str, ...] = ()  # verb flags, passed through to `oscar eval` / `oscar fidelity`

    @property
    def method_label(self) -> str:
        """The method path component: `method` or `method+variant`."""
        return f"{self.method}+{self.variant}" if self.variant else self.method

    @property
    def result_dir(self) -> str:
        """Directory of the cell's result files (DESIGN.md, "Result files")."""
        if self.kind == "eval":
            return f"results/eval/{self.model}/{self.method_label}/{self.item}/seed{self.seed}"
        return f"results/fidelity/{self.model}/{self.method_label}/{self.item}"

    @property
    def config_path(self) -> str:
        """Resolved configuration of the cell (an input of its job)."""
        if self.kind == "eval":
            return f"results/config/eval/{self.model}/{self.method_label}/{self.item}/seed{self.seed}.yaml"
        return f"results/config/fidelity/{self.model}/{self.method_label}/{self.item}.yaml"


@dataclass
class Calibration:
    """A calibration artifact and the statistics it is computed from."""

    model: str
    label: str  # method path component of the artifact
    stats_label: str  # calibration path component of the statistics
    overrides: tuple[str, ...]

    @property
    def artifact_dir(self) -> str:
        return str(artifact_path(ARTIFACTS_DIR, self.model, self.label))

    @property
    def config_path(self) -> str:
        return f"results/config/calibration/{self.model}/{self.label}.yaml"

    @property
    def stats_dir(self) -> str:
        return f"results/stats/{self.model}/{self.stats_label}"

    @property
    def stats_config_path(self) -> str:
        return f"results/config/stats/{self.model}/{self.stats_label}.yaml"


@dataclass
class TablePlan:
    """All cells of one table or figure, and its display settings."""

    name: str
    kind: str
    spec: dict[str, Any]
    cells: list[Cell] = field(default_factory=list)

    def to_json(self, experiment: str) -> str:
        """Stable JSON of the table plan, read by `oscar aggregate` and `oscar report`."""
        cells = []
        for cell in self.cells:
            record = asdict(cell)
            record["overrides"] = list(cell.overrides)
            record["flags"] = list(cell.flags)
            record.update(method_label=cell.method_label, result_dir=cell.result_dir, config_path=cell.config_path)
            if cell.kind == "eval":
                record["benchmark"] = cell.item
            else:
                record["corpus"] = cell.item
            cells.append(record)
        payload = {"experiment": experiment, "table": self.name, "kind": self.kind, "spec": self.spec, "cells": cells}
        return json.dumps(payload, indent=1, sort_keys=True) + "\n"


class Plan:
    """The workflow's cells, calibrations and tables for one composed experiment.

    Tables are planned on demand (`table(name)`), so a run that asks for one table composes only
    its cells; looking up a path that no planned table holds plans the rest. With `root`, every
    resolved configuration and table plan is written there as soon as it is planned (only files
    whose content changed are rewritten).
    """

    def __init__(self, user_overrides: list[str], conf_dir: str | None = None, root: str | Path | None = None) -> None:
        self.user_overrides = list(user_overrides)
        self.root = Path(root) if root is not None else None
        self.axes, self.settings = split_axis_overrides(self.user_overrides)
        # settings of the study (`experiment.*`) shape the grid; every other one goes to each cell
        self.cell_settings = [s for s in self.settings if not s.lstrip("+~").startswith("experiment")]
        self.tables: dict[str, TablePlan] = {}  # planned so far
        self.cells: dict[str, Cell] = {}  # result_dir -> cell
        self.calibrations: dict[str, Calibration] = {}  # artifact_dir -> calibration
        self.stats: dict[str, Calibration] = {}  # stats_dir -> one calibration using it
        self.cell_calibration: dict[str, Calibration] = {}  # result_dir -> the artifact it reads
        self._configs: dict[str, DictConfig] = {}  # config path -> resolved config
        self._owner: dict[str, str] = {}  # config path -> table that defined it first
        self._written: set[str] = set()
        self._composer = Composer(**({"conf_dir": conf_dir} if conf_dir else {}))
        with self._composer:
            # axis selections are composed once here too, so a bad one fails before any planning
            self.base = self._composer.compose(self.settings + [f"{k}={v}" for k, v in self.axes.items()])
        self.experiment = str(self.base.experiment.name)
        for key, fixed in (("results_dir", "results"), ("artifacts_dir", ARTIFACTS_DIR)):
            if str(self.base[key]) != fixed:
                raise ConfigError(
                    f"{key}={self.base[key]!r}: the workflow keeps its files under {fixed!r} of its working "
                    "directory; run it elsewhere with `snakemake --directory DIR` instead"
                )
        self.table_names = [str(n) for n in self.base.experiment.tables]

    def table(self, name: str) -> TablePlan:
        """The plan of one table, composing its cells the first time it is asked for."""
        if name not in self.tables:
            if name not in self.table_names:
                raise KeyError(name)
            with self._composer:
                self._plan_table(name)
            if self.root is not None:
                self._flush(name)
        return self.tables[name]

    def plan_all(self) -> None:
        """Plan every table of the experiment (checks that no two tables disagree on a path)."""
        for name in self.table_names:
            self.table(name)

    def find(self, mapping: str, key: str) -> Any:
        """`cells`, `calibrations`, `stats` or `cell_calibration` entry, planning more tables if needed."""
        found = getattr(self, mapping).get(key)
        if found is None and len(self.tables) < len(self.table_names):
            self.plan_all()
            found = getattr(self, mapping).get(key)
        return found

    def shared_prefill_groups(self) -> dict[str, list[Cell]]:
        """Eval cells whose benchmark asks for one shared BF16 prefill per prompt (`benchmark.extra.shared_prefill`),
        grouped per table, model, benchmark and seed: each group is one job (`oscar eval-shared`). Only tables that
        mention the setting are planned here."""
        groups: dict[str, list[Cell]] = {}
        for name in self.table_names:
            if "shared_prefill" not in json.dumps(to_dict(self.base.experiment.tables[name])):
                continue
            for cell in self.table(name).cells:
                extra = self._configs[cell.config_path].benchmark.extra
                if cell.kind == "eval" and bool(extra.get("shared_prefill", False)):
                    groups.setdefault(f"{name}_{cell.model}_{cell.item}_seed{cell.seed}", []).append(cell)
        return groups

    # ----- composition ---------------------------------------------------------------------------

    def _grid(self, table: DictConfig, axis: str) -> list[Any]:
        """Values of one grid axis: the user's selection, else the table's list, else the experiment's."""
        key = AXIS_KEYS[axis]
        if axis in self.axes:
            return [int(self.axes[axis])] if axis == "seed" else [self.axes[axis]]
        values = list(table[key]) if key in table and len(table[key]) else list(self.base.experiment[key])
        if not values:
            raise ConfigError(f"experiment {self.experiment!r}: no {key} for a table (set experiment.{key})")
        return values

    def _overrides(self, groups: list[str], extra: list[str], variant: list[str]) -> list[str]:
        """Override order: group choices, experiment, table, the user's settings, then the variant's."""
        return groups + list(self.base.experiment.overrides) + extra + self.cell_settings + variant

    def _plan_table(self, name: str) -> None:
        table = self.base.experiment.tables[name]
        spec = to_dict(table)
        plan = TablePlan(name=name, kind=str(table.kind), spec=spec)
        self.tables[name] = plan
        if table.kind == "kernels":
            return
        models = self._grid(table, "model")
        methods = self._grid(table, "method")
        seeds = self._grid(table, "seed") if table.kind == "eval" else self._grid(table, "seed")[:1]
        # (kind, item) pairs: an eval table may also hold fidelity cells (its `corpora`), one per method
        if table.kind == "eval":
            items = [self.axes["benchmark"]] if "benchmark" in self.axes else list(table.benchmarks) or list(
                self.base.experiment.benchmarks
            )
            if not items:
                raise ConfigError(f"experiment.tables.{name}: an eval table needs benchmarks")
            # a `benchmark=X` selection asks for that benchmark's cells only
            corpora = [] if "benchmark" in self.axes else list(table.corpora)
            pairs = [("eval", b) for b in items] + [("fidelity", c) for c in corpora]
        else:
            items = list(table.corpora)
            if not items:
                raise ConfigError(f"experiment.tables.{name}: a fidelity table needs corpora")
            pairs = [("fidelity", c) for c in items]
        variants = {str(v.name): (list(v.overrides), list(v.flags)) for v in table.variants} or {"": ([], [])}
        for model in models:
            for method in methods:
                for variant, (variant_overrides, variant_flags) in variants.items():
                    for kind, item in pairs:
                        # an eval table's fidelity cells live under <method>+<table> (fidelity tables own the plain path)
                        label = variant if kind == plan.kind else "-".join(x for x in (variant, name) if x)
                        for seed in seeds if kind == "eval" else seeds[:1]:
                            self._add_cell(plan, model, method, label, variant_overrides, variant_flags, item,
                                           int(seed), kind)

    def _add_cell(
        self,
        plan: TablePlan,
        model: str,
        method: str,
        variant: str,
        variant_overrides: list[str],
        variant_flags: list[str],
        item: str,
        seed: int,
        kind: str,
    ) -> None:
        groups = [f"model={model}", f"method={method}"]
        if kind == "eval":
            groups.append(f"benchmark={item}")
        extra = list(plan.spec["overrides"]) + list((plan.spec.get("item_overrides") or {}).get(item, []))
        table_flags = list(plan.spec["flags"]) if kind == plan.kind else []
        item_flags = list((plan.spec.get("item_flags") or {}).get(item, []))
        flags = _merge_flags(table_flags + item_flags + variant_flags + ([f"corpus={item}"] if kind == "fidelity" else []))
        overrides = self._overrides(groups, extra, variant_overrides) + [f"seed={seed}"]
        cfg = self._composer.compose(overrides, tables=False)
        calib = None
        if cfg.method.needs_calibration:
            calib_overrides = self._calibration_names(cfg, groups, method, variant or plan.name)
            if calib_overrides:
                overrides += calib_overrides
                cfg = self._composer.compose(overrides, tables=False)
            calib = Calibration(model, str(cfg.method.name), str(cfg.calibration.name), _calibration_overrides(overrides))
        cell = Cell(plan.name, kind, model, method, variant, item, seed, tuple(overrides), flags)
        self._register_config(cell.config_path, _cell_view(cfg, flags), plan.name)
        self.cells.setdefault(cell.result_dir, cell)
        plan.cells.append(cell)
        if calib is not None:
            self._register_config(calib.config_path, OmegaConf.create(_artifact_view(cfg)), plan.name)
            self._register_config(calib.stats_config_path, OmegaConf.create(_stats_view(cfg)), plan.name)
            calib = self.calibrations.setdefault(calib.artifact_dir, calib)
            self.stats.setdefault(calib.stats_dir, calib)
            self.cell_calibration[cell.result_dir] = calib

    def _calibration_names(self, cfg: DictConfig, groups: list[str], method: str, suffix: str) -> list[str]:
        """Name overrides that give a cell its own calibration artifact (and statistics) when needed.

        The plain artifact `results/calibration/<model>/<method>/` is the one the experiment's own
        settings give, shared by every cell whose calibration inputs match it (run-time windows
        do not count). A table or variant that changes calibration inputs calibrates under
        `method.name=<method>+<variant>` (statistics under `calibration.name=<name>+<variant>`);
        the verbs derive their paths from these names.
        """
        canonical = self._composer.compose(self._overrides(groups[:2], [], []), tables=False)
        names = []
        if _artifact_view(cfg) != _artifact_view(canonical):
            names.append(f"method.name={method}+{suffix}")
        if _stats_view(cfg) != _stats_view(canonical):
            names.append(f"calibration.name={cfg.calibration.name}+{suffix}")
        return names

    def _register_config(self, path: str, cfg: DictConfig, table: str) -> None:
        """Remember a resolved config per path; two tables that disagree on one path are an error."""
        known = self._configs.get(path)
        if known is not None and config_hash(known) != config_hash(cfg):
            raise ConfigError(
                f"tables {self._owner[path]!r} and {table!r} define {path} with different settings; "
                "give one of them a variant so the cells get their own paths"
            )
        self._configs.setdefault(path, cfg)
        self._owner.setdefault(path, table)

    # ----- outputs -------------------------------------------------------------------------------

    def _flush(self, table: str) -> None:
        """Write the configs registered so far and the plan of `table` under `root`."""
        for path, cfg in self._configs.items():
            if path not in self._written:
                write_resolved(cfg, self.root / path)
                self._written.add(path)
        write_text_if_changed(self.root / self.table_plan_path(table), self.tables[table].to_json(self.experiment))

    def write_configs(self, root: str | Path = ".") -> int:
        """Write every resolved config planned so far (only those whose content changed); returns how many changed."""
        root = Path(root)
        return sum(write_resolved(cfg, root / path) for path, cfg in self._configs.items())

    def write_table_plans(self, root: str | Path = ".") -> None:
        """Write `results/plan/<experiment>/<table>.json` for every planned table (only when changed)."""
        for name, table in self.tables.items():
            write_text_if_changed(Path(root) / self.table_plan_path(name), table.to_json(self.experiment))

    def table_plan_path(self, table: str) -> str:
        """Where the plan of a table is written."""
        return f"results/plan/{self.experiment}/{table}.json"

    def resources(self, stage: str) -> ResourcesConfig:
        """Resources of a workflow stage: the experiment's setting, else the default."""
        configured = self.base.experiment.resources.get(stage)
        if configured is not None:
            return ResourcesConfig(**to_dict(configured))
        return DEFAULT_RESOURCES[stage]



def _calibration_overrides(overrides: list[str]) -> tuple[str, ...]:
    """The overrides a calibration job gets: only what can change statistics or the artifact.

    Keeping the others (benchmark settings, run-time windows, the eval seed) out of the job's
    parameters means changing them reruns evaluation cells but never recalibrates.
    """
    kept = []
    for item in overrides:
        key = item.partition("=")[0].lstrip("+~")
        root, _, leaf = key.partition(".")
        if root not in STATS_KEYS and root not in ARTIFACT_KEYS:
            continue
        if root == "method" and leaf in RUNTIME_ONLY_METHOD_FIELDS:
            continue
        kept.append(item)
    return tuple(kept)


def _cell_view(cfg: DictConfig, flags: tuple[str, ...]) -> DictConfig:
    """What a cell's resolved configuration file holds: everything that can change its outputs."""
    view = {k: v for k, v in to_dict(cfg).items() if k not in CELL_SECTIONS_DROPPED}
    view["verb_flags"] = dict(f.split("=", 1) for f in flags)
    return OmegaConf.create(view)


def _merge_flags(flags: list[str]) -> tuple[str, ...]:
    """Verb flags `key=value`, later ones winning, in first-seen key order."""
    merged: dict[str, str] = {}
    for flag in flags:
        key, sep, value = flag.partition("=")
        if not sep or not key:
            raise ConfigError(f"verb flag {flag!r} is not key=value")
        merged[key] = value
    return tuple(f"{k}={v}" for k, v in merged.items())


def _artifact_view(cfg: DictConfig) -> dict[str, Any]:
    """The settings a calibration artifact depends on (not the cache's run-time windows, not names)."""
    view = {k: _section(cfg, k) for k in ARTIFACT_KEYS}
    view["method"] = {k: v for k, v in view["method"].items() if k not in (*RUNTIME_ONLY_METHOD_FIELDS, "name")}
    view["calibration"] = {k: v for k, v in view["calibration"].items() if k != "name"}
    return view


def _stats_view(cfg: DictConfig) -> dict[str, Any]:
    """The settings activation statistics depend on."""
    view = {k: _section(cfg, k) for k in STATS_KEYS}
    view["calibration"] = {k: v for k, v in view["calibration"].items() if k != "name"}
    return view


def _section(cfg: DictConfig, key: str) -> Any:
    value = cfg[key]
    return to_dict(value) if isinstance(value, DictConfig) else value

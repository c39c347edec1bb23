"""Model registry: one YAML file per model in `conf/model/`, validated by `ModelConfig`."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from oscar.config import CONF_DIR, ModelConfig

MODEL_CONF_DIR = CONF_DIR / "model"


class UnknownModel(KeyError):
    """A model name with no file in `conf/model/`."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


def available_models(conf_dir: Path = MODEL_CONF_DIR) -> list[str]:
    """Names of every registered model (the `conf/model/*.yaml` stems), sorted."""
    return sorted(p.stem for p in conf_dir.glob("*.yaml"))


def get_model_config(name: str, conf_dir: Path = MODEL_CONF_DIR) -> DictConfig:
    """The validated configuration of the registered model `name`."""
    path = conf_dir / f"{name}.yaml"
    if not path.is_file():
        raise UnknownModel(f"unknown model {name!r}; registered models: {', '.join(available_models(conf_dir))}")
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    OmegaConf.to_container(cfg, throw_on_missing=True)
    if cfg.name != name:
        raise ValueError(f"{path} declares name {cfg.name!r}; it must equal the file stem {name!r}")
    return cfg  # type: ignore[return-value]


def offline_models(conf_dir: Path = MODEL_CONF_DIR) -> list[str]:
    """Registered models installable from packages on this machine."""
    return [n for n in available_models(conf_dir) if get_model_config(n, conf_dir).offline]

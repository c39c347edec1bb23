"""Model registry, adapters and loading (GGUF packages offline, Hugging Face ids online)."""

from oscar.models.adapters import (
    ADAPTERS,
    ModelAdapter,
    ModelDims,
    UnsupportedModel,
    check_head_dim,
    check_supported,
    get_adapter,
    is_supported_head_dim,
    layer_windows,
)
from oscar.models.loading import ModelNotInstalled, install_command, load_model, model_dims
from oscar.models.registry import UnknownModel, available_models, get_model_config

__all__ = [
    "ADAPTERS",
    "ModelAdapter",
    "ModelDims",
    "ModelNotInstalled",
    "UnknownModel",
    "UnsupportedModel",
    "available_models",
    "check_head_dim",
    "check_supported",
    "get_adapter",
    "get_model_config",
    "install_command",
    "is_supported_head_dim",
    "layer_windows",
    "load_model",
    "model_dims",
]

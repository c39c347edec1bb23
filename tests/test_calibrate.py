"""Calibration stages end to end on a tiny random Qwen3 (head_dim 128, GQA 2) loaded through the
online path (a local snapshot in `model.hf_id`): dump -> rotations -> clip, resume, errors."""

from __future__ import annotations

import json
import random

import pytest
import torch

from oscar.core.artifact import ArtifactMismatch, load_artifact
from oscar.commands import calibrate as calibrate_cmd
from oscar.commands.calibrate import run_calibrate
from oscar.commands.clip import run_clip
from oscar.commands.dump import run_dump
from oscar.commands.rotations import run_rotations
from oscar.config import ConfigError, compose
from oscar.models.methods import CalibrationMissing
from oscar.models import load_model
from oscar.models.tiny import save_random_model
from oscar.core.rotation import bit_reversal, hadamard
from oscar.core.stats import CalibrationStats

WORDS = "alpha beta gamma delta key value query cache token rotate quantize group head layer model text".split()


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib")
    snapshot = save_random_model("qwen3", root / "qwen3", seed=0, num_heads=4, num_kv_heads=2, head_dim=128, hidden_size=256)
    rng = random.Random(0)
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(rng.choice(WORDS) for _ in range(4000)))
    return root, snapshot, corpus


def _cfg(tiny_setup, results, *extra: str):
    root, snapshot, corpus = tiny_setup
    return compose([
        "model=qwen3-8b", f"model.hf_id={snapshot}", "model.num_layers=2", "model.num_heads=4",
        "model.num_kv_heads=2", "model.head_dim=128", "model.hidden_size=256", "model.dtype=float32",
        "calibration.corpus=file", f"calibration.path={corpus}", "calibration.num_tokens=128",
        "calibration.seq_len=64", "calibration.holdout_tokens=64", f"results_dir={results}", "device=cpu", *extra,
    ])


def test_pipeline_writes_a_loadable_artifact(tiny_setup, tmp_path, capsys):
    cfg = _cfg(tiny_setup, tmp_path, "method=oscar")
    results = run_calibrate(cfg)
    # rotations and clip report their (layer, side) steps with an ETA on stderr, ending at 100%
    err = capsys.readouterr().err
    for stage in ("rotations", "clip"):
        lines = [x for x in err.splitlines() if x.startswith(f"{stage} qwen3-8b/oscar")]
        assert lines and lines[-1].endswith("ETA 0 s") and ": 4/4 (100%)" in lines[-1], err
    assert [r.stage for r in results] == ["dump", "rotations", "clip"]
    assert not any(r.skipped for r in results)
    stats_dir, art_dir = results[0].path, results[2].path
    assert stats_dir == tmp_path / "stats" / "qwen3-8b" / "default"
    assert art_dir == tmp_path / "calibration" / "qwen3-8b" / "oscar"

    stats = CalibrationStats.load(stats_dir)
    assert stats.meta["calibration"]["tokens"] == 128
    assert stats.meta["calibration"]["holdout_tokens"] == 64
    assert int(stats.layers[0]["n_K"][0]) == 128 and int(stats.layers[0]["n_Q"][0]) == 2 * 128
    assert stats.samples[1]["K_samples"].shape == (2, 64, 128)  # held-back rows, not in the sums

    model, _ = load_model(cfg.model)
    art = load_artifact(art_dir, model=model)
    assert art.meta["calibration"]["token_hash"] == stats.meta["calibration"]["token_hash"]
    assert art.meta["group_size"] == 128 and art.meta["bits"] == 2
    for layer in range(2):
        hp = hadamard(128) @ bit_reversal(128)
        for h in range(2):  # OSCAR: R = U.H.P with U an eigenbasis of C_Q / n_Q (keys), C_S / n_S (values)
            for side, which in (("K", "Q"), ("V", "S")):
                c = stats.second_moment(layer, which)[h]
                u = getattr(art, f"R_{side}")[layer][h].double() @ hp.T
                eig = torch.linalg.eigvalsh(c).flip(0)
                torch.testing.assert_close(getattr(art, f"eig_{side}")[layer][h].double(), eig, rtol=1e-5, atol=1e-6 * float(eig[0]))
                torch.testing.assert_close(u.T @ c @ u, torch.diag(eig), rtol=0, atol=1e-5 * float(eig[0]))
        for rho, grid in ((art.rho_K[layer], cfg.calibration.clip_grid_k), (art.rho_V[layer], cfg.calibration.clip_grid_v)):
            assert all(min(abs(r - g) for g in grid) < 1e-6 for r in rho.tolist()), (rho, list(grid))


def test_stages_resume_and_rerun_on_change(tiny_setup, tmp_path):
    cfg = _cfg(tiny_setup, tmp_path, "method=oscar_hp")
    first = run_calibrate(cfg)
    again = run_calibrate(cfg)
    assert all(r.skipped for r in again)
    forced = run_calibrate(cfg, force=True)
    assert not any(r.skipped for r in forced)
    changed = _cfg(tiny_setup, tmp_path, "method=oscar_hp", "calibration.num_tokens=96")
    rerun = run_calibrate(changed)
    assert not rerun[0].skipped and rerun[0].stage_hash != first[0].stage_hash
    assert CalibrationStats.load(rerun[0].path).meta["calibration"]["tokens"] == 96


@pytest.mark.slow
def test_deterministic_for_a_seed(tiny_setup, tmp_path):
    arts = []
    for sub in ("a", "b"):
        cfg = _cfg(tiny_setup, tmp_path / sub, "method=oscar_raw")
        arts.append(load_artifact(run_calibrate(cfg)[-1].path))
    for name in ("R_K", "R_V", "rho_K", "rho_V"):
        for x, y in zip(getattr(arts[0], name), getattr(arts[1], name)):
            assert torch.equal(x, y), name


def test_auto_records_choices_no_worse_than_oscar(tiny_setup, tmp_path):
    # per-channel candidates chosen by distortion (the default select_by=kl has its own test below)
    cfg = _cfg(tiny_setup, tmp_path, "method=auto", "method.channel_block=64", "method.select_by=distortion")
    art_dir = run_calibrate(cfg)[-1].path
    meta = json.loads((art_dir / "meta.json").read_text())
    choices = meta["choices"]
    assert {(c["layer"], c["head"]) for c in choices} == {(l, h) for l in range(2) for h in range(2)}
    chosen_k, oscar_ks = {0: 0.0, 1: 0.0}, {0: 0.0, 1: 0.0}
    for c in choices:
        oscar_k = [r["distortion"] for r in c["key_table"] if r["target"] == "query" and not r["center"] and "block" not in r][0]
        oscar_v = [r["distortion"] for r in c["value_table"] if r["target"] == "output" and not r["center"]][0]
        assert c["value_distortion"] <= oscar_v
        # one key format per layer: each head's best candidate of the layer's format, the layer no worse than OSCAR
        same_format = [r["distortion"] for r in c["key_table"] if r.get("block", 0) == c["key_block"]]
        assert c["key_distortion"] == min(same_format)
        chosen_k[c["layer"]] += c["key_distortion"]
        oscar_ks[c["layer"]] += oscar_k
        # 4 targets x (none, mean, rope-centered: Qwen3 RoPE is known), plus 2 per-channel targets x (none, rope)
        assert len(c["key_table"]) == 12 + 4
    assert all(chosen_k[layer] <= oscar_ks[layer] for layer in chosen_k)
    art = load_artifact(art_dir)
    for c in choices:  # the constant mean is stored for `+center`, the pre-RoPE mean for `+rope`
        mu = art.mu_K[c["layer"]][c["head"]]
        assert bool(mu.abs().sum() > 0) == (c["center_k"] is True)
        rope = art.ropemu_K[c["layer"]]
        assert (rope is not None and bool(rope[c["head"]].abs().sum() > 0)) == (c["center_k"] == "rope")
    csv_lines = (art_dir / "choices.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(choices)
    assert "Geometric mean vs OSCAR" in (art_dir / "choices.md").read_text()


def test_methods_without_calibration_skip_dump(tiny_setup, tmp_path):
    cfg = _cfg(tiny_setup, tmp_path, "method=quarot", "method.clip=paper")  # QuaRot as published: unclipped
    results = run_calibrate(cfg)
    assert [r.stage for r in results] == ["rotations", "clip"]
    art = load_artifact(results[-1].path)
    assert torch.allclose(art.R_K[0][0].double(), hadamard(128), atol=1e-7)
    assert art.rho_K[0].tolist() == [1.0, 1.0]
    assert not (tmp_path / "stats").exists()


def test_missing_and_stale_statistics_are_refused(tiny_setup, tmp_path):
    cfg = _cfg(tiny_setup, tmp_path, "method=oscar")
    with pytest.raises(CalibrationMissing, match="python -m oscar dump model=qwen3-8b"):
        run_rotations(cfg)
    with pytest.raises(CalibrationMissing, match="python -m oscar rotations"):
        run_clip(cfg)
    run_dump(cfg)
    stale = _cfg(tiny_setup, tmp_path, "method=oscar", "calibration.seed=5")
    with pytest.raises(CalibrationMissing, match="force=true"):
        run_rotations(stale)


def test_artifact_of_another_geometry_is_refused(tiny_setup, tmp_path):
    cfg = _cfg(tiny_setup, tmp_path, "method=quarot", "method.clip=none")
    art_dir = run_calibrate(cfg)[-1].path
    other = save_random_model("qwen3", tmp_path / "other", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=128, hidden_size=256)
    from oscar.models.tiny import tiny_model_cfg

    model, _ = load_model(tiny_model_cfg("qwen3", other))
    with pytest.raises(ArtifactMismatch, match="num_layers|config_hash"):
        load_artifact(art_dir, model=model)


def test_output_override_and_cli_main(tiny_setup, tmp_path, capsys):
    root, snapshot, corpus = tiny_setup
    out = tmp_path / "custom"
    argv = [
        "model=qwen3-8b", f"model.hf_id={snapshot}", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.head_dim=128", "model.hidden_size=256", "model.dtype=float32", "calibration.corpus=file",
        f"calibration.path={corpus}", "calibration.num_tokens=128", "calibration.seq_len=64",
        "calibration.holdout_tokens=64", f"results_dir={tmp_path}", "device=cpu", "method=oscar_hp", f"output={out}",
    ]
    assert calibrate_cmd.main(argv) == 0
    assert (out / "rotations.safetensors").is_file() and (out / "meta.json").is_file()
    assert "calibrate: qwen3-8b / oscar_hp done" in capsys.readouterr().out
    assert calibrate_cmd.main([*argv[:-1], "method=oscar_hp", "report=x"]) == 1
    assert "not auto" in capsys.readouterr().err


def test_unknown_model_names_the_options():
    with pytest.raises(ConfigError, match="smollm2-135m"):
        compose(["model=gpt-5"])


def test_diagnostic_samples_are_bounded_raw_rows(tiny_setup, tmp_path):
    from safetensors.torch import load_file

    cfg = _cfg(tiny_setup, tmp_path, "method=oscar", "calibration.sample_rows=80")
    result = run_dump(cfg)
    samples = load_file(str(result.path / "samples.safetensors"))
    assert samples["layers.1.Q"].shape == (4, 80, 128) and samples["layers.1.K"].shape == (2, 80, 128)
    assert samples["layers.0.S"].shape == (4, 80, 128) and samples["layers.0.V"].dtype == torch.float32
    stats = CalibrationStats.load(result.path)
    assert stats.meta["diagnostic_samples"]["rows"] == 80
    k = samples["layers.1.K"].double()  # the first 64 rows are the first calibration window: its C_K share
    assert float((k[0].T @ k[0]).trace()) < float(stats.layers[1]["C_K"][0].trace())


def test_dump_records_pre_rope_key_sums_and_held_back_positions(tiny_setup, tmp_path):
    result = run_dump(_cfg(tiny_setup, tmp_path, "method=auto"))
    stats = CalibrationStats.load(result.path)
    for layer in range(2):
        assert stats.has_pre_rope(layer)
        spec = stats.meta["rope"][layer]
        assert len(spec["inv_freq"]) == 64 and spec["scaling"] == 1.0 and spec["head_dim"] == 128
        # RoPE is orthogonal: turning every key back to position 0 keeps its energy (float64 sums)
        t = stats.layers[layer].tensors
        torch.testing.assert_close(torch.diagonal(t["C_Kpre"], dim1=-2, dim2=-1).sum(-1),
                                   torch.diagonal(t["C_K"], dim1=-2, dim2=-1).sum(-1), rtol=1e-6, atol=0)
        assert stats.sample_pos[layer].tolist() == list(range(64))  # one held-back window from position 0
    assert stats.meta["window_layers"] == []  # Qwen3: full attention everywhere


def test_auto_select_by_kl_chooses_each_layers_key_format_through_the_pipeline(tiny_setup, tmp_path, capsys):
    overrides = ["method=auto", "method.channel_block=16", "method.sink=4", "method.recent=16"]
    cfg = _cfg(tiny_setup, tmp_path, *overrides, "method.select_by=kl")
    art_dir = run_calibrate(cfg)[-1].path
    assert "select_by=kl qwen3-8b/auto (decode-equivalent passes)" in capsys.readouterr().err
    meta = json.loads((art_dir / "meta.json").read_text())
    sel = meta["selection"]
    assert sel["by"] == "kl" and sel["price"] == 0.0 and sel["positions"] == 63 - 20
    assert [m["layer"] for m in sel["layers"]] == [0, 1] and all(m["measured"] for m in sel["layers"])
    formats = [bool(b) for b in meta.get("key_block", [0, 0])]
    chosen = [m["channel"] for m in sel["layers"]]
    assert formats == (chosen if sel["kept"] == "chosen" else [sel["kept"] == "all_channel"] * 2)
    assert [bool(c["key_block"]) for c in meta["choices"] if c["head"] == 0] == formats
    # the artifact runs for the method it was selected with, and refuses the distortion-selected one
    model, _ = load_model(cfg.model)
    load_artifact(art_dir, model=model, method=cfg.method)
    with pytest.raises(ArtifactMismatch, match="select_by"):
        load_artifact(art_dir, model=model, method=_cfg(tiny_setup, tmp_path, *overrides, "method.select_by=distortion").method)

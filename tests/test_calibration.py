"""Tests of calibration statistics, distortion, clip fitting, auto candidates and the artifact."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from oscar.core.calibration import (
    ArtifactMismatch,
    CalibrationArtifact,
    CalibrationStats,
    attention_output,
    build_artifact,
    build_meta,
    candidates,
    config_hash_of,
    fit_clip_ratio,
    geometric_mean,
    load_artifact,
    measured_distortion,
    model_config_fields,
    model_config_hash,
    quantization_error,
    rotation_seed,
    save_artifact,
    select_candidate,
    target_matrix,
    token_hash,
)
from oscar.core.quant import dequantize, quantize
from oscar.core.rotation import build_rotation, eigenbasis, random_orthogonal


pytestmark = pytest.mark.usefixtures("single_thread")


B, H, HKV, T, D = 2, 6, 2, 24, 64


def _qkvo(seed: int, t: int = T, d: int = D, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, t, d, generator=gen, dtype=dtype) * torch.linspace(2.0, 0.2, d, dtype=dtype)
    k = torch.randn(B, HKV, t, d, generator=gen, dtype=dtype) * torch.linspace(0.3, 2.5, d, dtype=dtype) + 0.5
    v = torch.randn(B, HKV, t, d, generator=gen, dtype=dtype)
    return q, k, v, attention_output(q, k, v)


def _filled_stats(num_layers: int = 2, max_samples: int = 40, seed: int = 0) -> CalibrationStats:
    stats = CalibrationStats(num_layers, H, HKV, D, max_samples=max_samples)
    for layer in range(num_layers):
        q, k, v, o = _qkvo(seed + layer)
        stats.update(layer, q, k, v, o)
        _, k2, v2, _ = _qkvo(seed + 100 + layer)
        stats.add_samples(layer, k2, v2)
    return stats


def test_attention_output_matches_explicit_softmax_with_gqa_causal_and_mask():
    q, k, v, o = _qkvo(1)
    group = H // HKV
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    expected = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v.repeat_interleave(group, 1)
    assert torch.allclose(o, expected, atol=1e-12, rtol=0)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :5] = False  # left padding of the second sequence
    om = attention_output(q, k, v, mask=mask)
    allowed = causal & mask[:, None, None, :]
    ref = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(group, 1)
    assert torch.allclose(om[1, :, 5:], ref[1, :, 5:], atol=1e-12, rtol=0)
    assert torch.allclose(om[0], expected[0], atol=1e-12, rtol=0)


def test_statistics_equal_explicit_gqa_sums_with_mask():
    q, k, v, o = _qkvo(2)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, -7:] = False
    stats = CalibrationStats(1, H, HKV, D)
    stats.update(0, q, k, v, o, mask=mask)
    group = H // HKV
    for h in range(HKV):
        heads = range(h * group, (h + 1) * group)
        q_rows = torch.cat([q[b, j][mask[b]] for b in range(B) for j in heads])
        o_rows = torch.cat([o[b, j][mask[b]] for b in range(B) for j in heads])
        k_rows = torch.cat([k[b, h][mask[b]] for b in range(B)])
        v_rows = torch.cat([v[b, h][mask[b]] for b in range(B)])
        for name, rows in (("Q", q_rows), ("S", o_rows), ("K", k_rows), ("V", v_rows)):
            assert torch.allclose(stats.layers[0][f"C_{name}"][h], rows.T @ rows, atol=1e-10, rtol=1e-12)
            assert torch.allclose(stats.layers[0][f"m_{name}"][h], rows.sum(0), atol=1e-10, rtol=1e-12)
            assert int(stats.count(0, name)[h]) == rows.shape[0]
        assert torch.allclose(stats.second_moment(0, "K", centered=True)[h], torch.cov(k_rows.T, correction=0), atol=1e-10)
        assert torch.allclose(stats.mean(0, "Q")[h], q_rows.mean(0), atol=1e-12)
    assert int(stats.count(0, "Q")[0]) == group * (2 * T - 7)


def test_statistics_merge_equals_one_pass_and_float32_inputs_accumulate_in_float64():
    q, k, v, o = _qkvo(3, dtype=torch.float32)
    whole = CalibrationStats(1, H, HKV, D)
    whole.update(0, q, k, v, o)
    first, second = CalibrationStats(1, H, HKV, D), CalibrationStats(1, H, HKV, D)
    first.update(0, q[:1], k[:1], v[:1], o[:1])
    second.update(0, q[1:], k[1:], v[1:], o[1:])
    first += second
    for name, value in whole.layers[0].tensors.items():
        assert value.dtype in (torch.float64, torch.int64)
        assert torch.allclose(first.layers[0][name].double(), value.double(), rtol=1e-12, atol=1e-9), name
    with pytest.raises(ValueError, match="cannot merge"):
        first.merge(CalibrationStats(1, H, HKV, 32))


def test_statistics_input_checks():
    stats = CalibrationStats(2, H, HKV, D)
    q, k, v, o = _qkvo(4)
    with pytest.raises(ValueError, match="layer=2"):
        stats.update(2, q=q)
    with pytest.raises(ValueError, match=r"does not match \[B, 2, T, 64\]"):
        stats.update(0, k=q)
    with pytest.raises(ValueError, match="attention mask of shape"):
        stats.update(0, k=k, mask=torch.ones(B, T + 1))
    bad = k.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        stats.update(0, k=bad)
    with pytest.raises(ValueError, match="no rows accumulated for statistic S"):
        stats.second_moment(1, "S")
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        CalibrationStats(1, 6, 4, 64)


def test_samples_are_capped_and_merge_up_to_the_cap():
    stats = CalibrationStats(1, H, HKV, D, max_samples=30)
    _, k, v, _ = _qkvo(5)
    stats.add_samples(0, k, v)  # 48 valid rows per head, keeps 30
    assert stats.samples[0]["K_samples"].shape == (HKV, 30, D)
    assert torch.equal(stats.samples[0]["K_samples"][1, :T], k[0, 1].float())
    other = CalibrationStats(1, H, HKV, D, max_samples=30)
    other.add_samples(0, k[:, :, :3], v[:, :, :3])
    small = CalibrationStats(1, H, HKV, D, max_samples=30)
    small.add_samples(0, k[:, :, :5], v[:, :, :5])
    small.merge(other)
    assert small.samples[0]["V_samples"].shape == (HKV, 16, D)


def test_statistics_save_load_round_trip_exact(tmp_path):
    stats = _filled_stats()
    stats.meta["model"] = "synthetic"
    stats.save(tmp_path / "s")
    back = CalibrationStats.load(tmp_path / "s")
    assert back.meta == {"model": "synthetic"} and back.max_samples == 40
    for layer in range(2):
        for name, value in stats.layers[layer].tensors.items():
            assert torch.equal(back.layers[layer][name], value)
        for name, value in stats.samples[layer].items():
            assert torch.equal(back.samples[layer][name], value)
    header = json.loads((tmp_path / "s" / "stats.json").read_text())
    assert header["num_kv_heads"] == HKV and header["tokens"] == B * T
    assert not list((tmp_path / "s").glob("*.tmp"))
    with pytest.raises(FileNotFoundError, match="stats.json"):
        CalibrationStats.load(tmp_path / "missing")


def test_measured_distortion_is_the_mean_squared_logit_error_over_real_queries():
    gen = torch.Generator().manual_seed(6)
    queries = torch.randn(300, D, generator=gen, dtype=torch.float64) * torch.linspace(3, 0.1, D, dtype=torch.float64)
    keys = torch.randn(50, D, generator=gen) * torch.linspace(0.2, 2, D) + 0.3
    metric = queries.T @ queries / queries.shape[0]
    r = random_orthogonal(D, 1)
    mu = keys.mean(0)
    dist = measured_distortion(keys, r, metric, mu=mu, rho=0.95, bits=2, group_size=32)
    # explicit: quantize the rotated centered keys, rotate back, add the mean, compare logits
    q = quantize((keys - mu) @ r.float(), 2, 32, clip_ratio=0.95)
    k_hat = dequantize(q).double() @ r.float().double().T + mu.double()
    logit_err = queries @ (k_hat - keys.double()).T
    assert math.isclose(dist, float(logit_err.pow(2).mean()), rel_tol=1e-6)
    err = quantization_error(keys, r, mu, 0.95, 2, 32)
    assert torch.allclose(err, k_hat - keys.double(), atol=1e-5)


def test_fit_clip_ratio_picks_the_grid_minimum_and_clips_outlier_rows():
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(120, D, generator=gen)
    rows[:, 5] *= 12.0  # an outlier channel
    metric = torch.eye(D, dtype=torch.float64)
    r = torch.eye(D, dtype=torch.float64)
    grid = [0.8, 0.9, 0.95, 1.0]
    fit = fit_clip_ratio(rows, r, metric, grid, bits=2, group_size=64)
    assert fit.grid == grid and len(fit.distortions) == 4
    assert fit.distortion == min(fit.distortions) and fit.rho == grid[fit.distortions.index(fit.distortion)]
    assert fit.rho < 1.0 and fit.distortion < fit.distortions[-1]
    assert fit_clip_ratio(rows, r, metric, [1.0], bits=2, group_size=64).rho == 1.0
    with pytest.raises(ValueError, match="clip grid is empty"):
        fit_clip_ratio(rows, r, metric, [], bits=2, group_size=64)


def test_geometric_mean_properties():
    a = build_rotation("random", 8, seed=1)
    lam_a = torch.arange(1, 9, dtype=torch.float64)
    lam_b = torch.arange(8, 0, -1, dtype=torch.float64) ** 2
    ma, mb = (a * lam_a) @ a.T, (a * lam_b) @ a.T
    g = geometric_mean(ma, mb, eps=0.0)
    assert torch.allclose(g, (a * (lam_a * lam_b).sqrt()) @ a.T, atol=1e-10)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 20, generator=gen, dtype=torch.float64), torch.randn(8, 20, generator=gen, dtype=torch.float64)
    p, s = x @ x.T, y @ y.T
    g = geometric_mean(p, s, eps=0.0)
    assert torch.allclose(g @ torch.linalg.inv(p) @ g, s, rtol=1e-8, atol=1e-8)  # the Riccati equation
    m = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    assert torch.allclose(geometric_mean(m.T @ p @ m, m.T @ s @ m, eps=0.0), m.T @ g @ m, rtol=1e-7, atol=1e-7)
    assert torch.allclose(geometric_mean(3 * p, 12 * s, eps=0.0), 6 * g, rtol=1e-9, atol=1e-9)


def test_candidates_cover_targets_and_centering():
    stats = _filled_stats(num_layers=1)
    keys = candidates(stats, 0, 1, "key")
    assert [c.name for c in keys] == [
        "query", "query+center", "raw", "raw+center", "geomean", "geomean+center", "hadamard", "hadamard+center"
    ]
    assert torch.equal(keys[6].R, build_rotation("hp", D))
    assert torch.equal(keys[1].mu, stats.mean(0, "K")[1]) and torch.equal(keys[0].mu, torch.zeros(D, dtype=torch.float64))
    assert torch.equal(keys[0].R, build_rotation("uhp", D, cov=stats.second_moment(0, "Q")[1]))
    assert torch.equal(keys[3].R, build_rotation("uhp", D, cov=stats.second_moment(0, "K", centered=True)[1]))
    assert torch.equal(keys[2].R, build_rotation("uhp", D, cov=stats.second_moment(0, "K")[1]))
    values = candidates(stats, 0, 0, "value", targets=("output", "raw"), centers=(False,))
    assert [c.target for c in values] == ["output", "raw"]
    assert torch.equal(values[0].eig, eigenbasis(stats.second_moment(0, "S")[0])[1])
    with pytest.raises(ValueError, match="unknown key target 'output'"):
        target_matrix(stats, 0, 0, "key", "output", False)


def test_select_candidate_takes_the_lowest_measured_distortion():
    stats = _filled_stats(num_layers=1)
    rows = stats.samples[0]["K_samples"][0]
    metric = stats.second_moment(0, "Q")[0]
    cands = candidates(stats, 0, 0, "key")
    sel = select_candidate(rows, metric, cands, [0.9, 1.0], bits=2, group_size=32)
    assert len(sel.table) == len(cands)
    assert sel.clip.distortion == min(row["distortion"] for row in sel.table)
    assert math.isclose(
        sel.clip.distortion,
        measured_distortion(rows, sel.candidate.R, metric, mu=sel.candidate.mu, rho=sel.clip.rho, bits=2, group_size=32),
    )


def test_build_artifact_oscar_rotations_and_fitted_clip():
    stats = _filled_stats()
    method = {"name": "oscar", "key_rotation": "uhp", "value_rotation": "uhp", "key_target": "query",
              "value_target": "output", "bits": 2, "clip": "fit"}
    art = build_artifact(method, num_layers=2, num_kv_heads=HKV, head_dim=D, group_size=32, stats=stats,
                         clip_grid_k=[0.9, 1.0], clip_grid_v=[0.85, 1.0], model_id="m", config_hash="abc")
    for layer in range(2):
        for h in range(HKV):
            rk = build_rotation("uhp", D, cov=stats.second_moment(layer, "Q")[h]).float()
            rv = build_rotation("uhp", D, cov=stats.second_moment(layer, "S")[h]).float()
            assert torch.equal(art.R_K[layer][h], rk) and torch.equal(art.R_V[layer][h], rv)
            fit = fit_clip_ratio(stats.samples[layer]["K_samples"][h], art.R_K[layer][h], stats.second_moment(layer, "Q")[h],
                                 [0.9, 1.0], mu=art.mu_K[layer][h], bits=2, group_size=32)
            assert float(art.rho_K[layer][h]) == pytest.approx(fit.rho)
        assert torch.equal(art.mu_K[layer], torch.zeros(HKV, D))
        assert art.eig_K[layer] is not None and bool((art.eig_K[layer][:, :-1] >= art.eig_K[layer][:, 1:]).all())
    raw = build_artifact({**method, "key_rotation": "raw_uhp", "value_rotation": "raw_uhp", "center": True, "clip": "fixed",
                          "rho_k": 0.93, "rho_v": 0.9}, num_layers=2, num_kv_heads=HKV, head_dim=D, group_size=32, stats=stats)
    cov_k = stats.second_moment(1, "K", centered=True)[0]
    assert torch.equal(raw.R_K[1][0], build_rotation("uhp", D, cov=cov_k).float())
    assert torch.equal(raw.mu_V[1], stats.mean(1, "V").float())
    assert torch.equal(raw.rho_K[0], torch.full((HKV,), 0.93)) and torch.equal(raw.rho_V[0], torch.full((HKV,), 0.9))


def test_build_artifact_without_statistics_for_code_built_methods():
    for kind in ("identity", "hadamard", "hp", "block_hadamard", "random"):
        art = build_artifact({"key_rotation": kind, "value_rotation": kind, "clip": "none"}, num_layers=2,
                             num_kv_heads=HKV, head_dim=D, group_size=32)
        assert art.eig_K == [None, None] and torch.equal(art.rho_V[1], torch.ones(HKV))
        assert torch.equal(art.R_K[0][1], build_rotation(kind, D, group_size=32, seed=rotation_seed(0, 0, 1, "key")).float())
        assert torch.equal(art.mu_K[1], torch.zeros(HKV, D))
    rnd = build_artifact({"key_rotation": "random", "value_rotation": "random", "clip": "none", "seed": 3}, num_layers=2,
                         num_kv_heads=HKV, head_dim=D, group_size=32)
    assert not torch.equal(rnd.R_K[0][0], rnd.R_K[0][1]) and not torch.equal(rnd.R_K[0][0], rnd.R_V[0][0])
    with pytest.raises(ValueError, match="needs calibration statistics"):
        build_artifact({"key_rotation": "uhp", "value_rotation": "uhp", "clip": "none"}, num_layers=1, num_kv_heads=HKV,
                       head_dim=D, group_size=32)
    with pytest.raises(ValueError, match="clip=fit needs calibration statistics"):
        build_artifact({"key_rotation": "hp", "value_rotation": "hp", "clip": "fit"}, num_layers=1, num_kv_heads=HKV,
                       head_dim=D, group_size=32)


def test_build_artifact_auto_records_choices_and_needs_samples(tmp_path):
    stats = _filled_stats()
    art = build_artifact({"name": "auto", "key_rotation": "auto", "value_rotation": "auto", "clip": "fit"}, num_layers=2,
                         num_kv_heads=HKV, head_dim=D, group_size=32, stats=stats, clip_grid_k=[0.9, 1.0], clip_grid_v=[1.0])
    choices = art.meta["choices"]
    assert len(choices) == 2 * HKV
    for ch in choices:
        assert ch["key_distortion"] == min(row["distortion"] for row in ch["key_table"])
        cand = [c for c in candidates(stats, ch["layer"], ch["head"], "key") if c.target == ch["key_target"] and c.center == ch["center_k"]][0]
        assert torch.equal(art.R_K[ch["layer"]][ch["head"]], cand.R.float())
        assert torch.equal(art.mu_K[ch["layer"]][ch["head"]], cand.mu.float())
    save_artifact(art, tmp_path / "a")
    assert load_artifact(tmp_path / "a").meta["choices"] == json.loads(json.dumps(choices))
    no_samples = _filled_stats(max_samples=0)
    with pytest.raises(ValueError, match="no held-back key rows"):
        build_artifact({"key_rotation": "auto", "value_rotation": "auto"}, num_layers=2, num_kv_heads=HKV, head_dim=D,
                       group_size=32, stats=no_samples)


def _artifact(num_layers: int = 2, d: int = D) -> CalibrationArtifact:
    r = [torch.stack([random_orthogonal(d, 10 * layer + h).float() for h in range(HKV)]) for layer in range(num_layers)]
    meta = build_meta(method={"name": "oscar"}, model_id="toy", config_hash="h1", num_layers=num_layers, num_kv_heads=HKV,
                      head_dim=d, group_size=32, bits=2, calibration={"data": "x", "tokens": 10, "token_hash": "t"})
    return CalibrationArtifact(
        R_K=r, R_V=[x.flip(0) for x in r], mu_K=[torch.randn(HKV, d) for _ in r], mu_V=[torch.zeros(HKV, d) for _ in r],
        rho_K=[torch.full((HKV,), 0.95) for _ in r], rho_V=[torch.full((HKV,), 0.9) for _ in r],
        eig_K=[torch.rand(HKV, d) for _ in r], meta=meta,
    )


def test_artifact_round_trip_is_exact_and_json_plus_safetensors(tmp_path):
    art = _artifact()
    save_artifact(art, tmp_path / "a")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["meta.json", "rotations.safetensors"]
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    assert meta["model"] == {"id": "toy", "config_hash": "h1", "num_layers": 2, "num_kv_heads": HKV, "head_dim": D}
    assert meta["format_version"] == 1 and meta["group_size"] == 32 and meta["bits"] == 2 and "oscar_version" in meta
    back = load_artifact(tmp_path / "a", config_hash="h1", num_layers=2, num_kv_heads=HKV, head_dim=D, group_size=32, bits=2)
    for name in ("R_K", "R_V", "mu_K", "mu_V", "rho_K", "rho_V", "eig_K"):
        for a, b in zip(getattr(art, name), getattr(back, name)):
            assert torch.equal(a, b)
    assert back.eig_V == [None, None]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a" / "rotations.safetensors"), framework="pt") as fh:
        assert "layers.1.R_V" in fh.keys() and "layers.0.eig_V" not in fh.keys()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"config_hash": "other"}, r"config_hash='h1', but the model has config_hash='other'"),
        ({"num_layers": 3}, r"num_layers=2, but the model has num_layers=3"),
        ({"num_kv_heads": 8}, r"num_kv_heads=2, but the model has num_kv_heads=8"),
        ({"head_dim": 128}, r"head_dim=64, but the model has head_dim=128"),
        ({"group_size": 64}, r"group_size=32, but the model has group_size=64"),
    ],
)

def test_artifact_mismatch_is_refused_naming_both_values(tmp_path, kwargs, message):
    save_artifact(_artifact(), tmp_path / "a")
    with pytest.raises(ArtifactMismatch, match=message):
        load_artifact(tmp_path / "a", **kwargs)


def test_artifact_refuses_tampered_tensors_and_bad_contents(tmp_path):
    save_artifact(_artifact(), tmp_path / "a")
    save_artifact(_artifact(num_layers=2), tmp_path / "b")
    (tmp_path / "a" / "rotations.safetensors").write_bytes((tmp_path / "b" / "rotations.safetensors").read_bytes())
    with pytest.raises(ArtifactMismatch, match="do not belong together"):
        load_artifact(tmp_path / "a")
    art = _artifact()
    art.R_K[0] = art.R_K[0] * 1.1
    with pytest.raises(ValueError, match="layers.0.R_K is not orthogonal"):
        save_artifact(art, tmp_path / "c")
    art = _artifact()
    art.rho_V[1] = torch.full((HKV,), 1.5)
    with pytest.raises(ValueError, match=r"layers.1.rho_V = \[1.5, 1.5\] must lie in \(0, 1\]"):
        art.validate()
    with pytest.raises(FileNotFoundError, match="meta.json"):
        load_artifact(tmp_path / "nothing")


def test_model_config_hash_from_transformers_style_configs(tmp_path):
    v5 = SimpleNamespace(num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=HKV, head_dim=D, hidden_size=384,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    v4 = SimpleNamespace(num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=HKV, hidden_size=384,
                         rope_theta=10000.0, rope_scaling=None)
    f5, f4 = model_config_fields(v5), model_config_fields(v4)
    assert f5["head_dim"] == f4["head_dim"] == D
    assert config_hash_of(v5) == config_hash_of(v4) == model_config_hash(2, H, HKV, D, 384, 10000.0)
    assert config_hash_of(SimpleNamespace(config=v5)) == config_hash_of(v5)
    assert model_config_hash(2, H, HKV, D, 384, 500000.0) != model_config_hash(2, H, HKV, D, 384, 10000.0)
    yarn = dict(vars(v5), rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0})
    assert config_hash_of(yarn) != config_hash_of(v5)
    art = _artifact()
    art.meta["model"]["config_hash"] = config_hash_of(v5)
    save_artifact(art, tmp_path / "a")
    assert load_artifact(tmp_path / "a", model=SimpleNamespace(config=v5)).num_layers == 2
    other = SimpleNamespace(config=SimpleNamespace(**{**vars(v5), "num_key_value_heads": 3}))
    with pytest.raises(ArtifactMismatch, match="config_hash"):
        load_artifact(tmp_path / "a", model=other)


def test_token_hash_is_stable_and_sensitive():
    ids = torch.arange(100)
    assert token_hash(ids) == token_hash(ids.to(torch.int32)) == token_hash(ids.clone())
    assert token_hash(ids) != token_hash(ids.flip(0))
    assert len(token_hash(ids)) == 16


def test_build_artifact_imposes_each_layers_key_format_and_keeps_the_heads_best_of_it():
    stats = _filled_stats(num_layers=2, max_samples=40)
    method = {"name": "auto", "key_rotation": "auto", "value_rotation": "auto", "clip": "fit", "channel_block": 8}
    kw = dict(num_layers=2, num_kv_heads=HKV, head_dim=D, group_size=32, stats=stats, clip_grid_k=[0.9, 1.0], clip_grid_v=[1.0])
    memo: dict = {}
    free = build_artifact(method, memo=memo, **kw)
    assert set(memo) == {(0, "key"), (0, "value"), (1, "key"), (1, "value")}
    for formats in ([True, False], [False, True]):
        art = build_artifact(method, key_formats=formats, memo=memo, **kw)
        fresh = build_artifact(method, key_formats=formats, **kw)  # the memo only saves the second selection
        assert art.meta["choices"] == fresh.meta["choices"]
        assert all(torch.equal(a, b) for a, b in zip(art.R_K + art.rho_K, fresh.R_K + fresh.rho_K))
        assert art.meta["key_block"] == [8 if f else 0 for f in formats]
        for c in art.meta["choices"]:
            same = [r["distortion"] for r in c["key_table"] if bool(r.get("block", 0)) == formats[c["layer"]]]
            assert c["key_block"] == (8 if formats[c["layer"]] else 0) and c["key_distortion"] == min(same)
        # values do not depend on the keys' format
        for layer in range(2):
            assert torch.equal(art.R_V[layer], free.R_V[layer]) and torch.equal(art.rho_V[layer], free.rho_V[layer])
    with pytest.raises(ValueError, match=r"key_formats \(2 entries\).*channel_block > 0 \(got 0\)"):
        build_artifact({**method, "channel_block": 0}, key_formats=[True, False], **kw)
    with pytest.raises(ValueError, match=r"one entry per layer \(2\)"):
        build_artifact(method, key_formats=[True], **kw)

"""Method configs -> rotations, means and clip ratios: validation, in-code methods, stats-based methods."""

from __future__ import annotations

import functools

import pytest
import torch

from oscar.commands._stage import single_thread
from oscar.config import compose
from oscar.models.methods import (
    CalibrationMissing,
    MethodError,
    auto_choices_rows,
    build_rotations,
    clip_mode,
    effective_group_size,
    fit_clip,
    grid_edges,
    in_code_artifact,
    needs_statistics,
    validate_method,
    write_auto_choices,
)
from oscar.core.clipfit import measured_distortion
from oscar.core.rotation import bit_reversal, block_hadamard, build_rotation, hadamard
from oscar.core.stats import CalibrationStats

ALL_METHODS = ["bf16", "int2", "quarot", "saw_int4", "turboquant", "kivi2", "oscar", "oscar_center", "oscar_hp",
               "oscar_raw", "oscar_up", "oscar_uh", "auto"]
GEOM = dict(num_layers=2, num_kv_heads=2, head_dim=64)


@functools.lru_cache(maxsize=None)
def method(name: str, *overrides: str):
    return compose([f"method={name}", *[f"method.{o}" for o in overrides]]).method


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny quantizations: one intra-op thread is much faster on a shared CPU."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def stats():
    """Synthetic statistics with anisotropic q/k/v/outputs and held-back rows."""
    gen = torch.Generator().manual_seed(0)
    st = CalibrationStats(2, 4, 2, 64, max_samples=128)
    scales = torch.logspace(0, -2, 64, dtype=torch.float64)
    for layer in range(2):
        for _ in range(2):
            q = torch.randn(1, 4, 200, 64, generator=gen, dtype=torch.float64) * scales
            k = torch.randn(1, 2, 200, 64, generator=gen, dtype=torch.float64) * scales.flip(0) + 0.3
            v = torch.randn(1, 2, 200, 64, generator=gen, dtype=torch.float64) - 0.2
            s = torch.randn(1, 4, 200, 64, generator=gen, dtype=torch.float64) * scales
            st.update(layer, q=q, k=k, v=v, attn_out=s)
        st.add_samples(layer, k[:, :, :128], v[:, :, :128])
    return st


@pytest.mark.parametrize("name", ALL_METHODS)
def test_every_configured_method_validates(name):
    validate_method(method(name))


def test_statistics_needed_exactly_where_the_method_uses_them():
    need = {n: needs_statistics(method(n)) for n in ALL_METHODS}
    # the default clip policy is the same for every method (fitted): every clipped format reads held-back rows
    assert {n for n, v in need.items() if not v} == {"bf16", "turboquant", "kivi2"}
    paper = {n: needs_statistics(method(n, "clip=paper")) for n in ALL_METHODS}
    assert {n for n, v in paper.items() if not v} == {"bf16", "int2", "quarot", "saw_int4", "turboquant", "kivi2"}
    assert not needs_statistics(method("oscar_hp", "clip=fixed"))
    assert not needs_statistics(method("quarot", "clip=none"))


def test_clip_policy_is_shared_and_the_paper_choice_is_a_named_variant():
    rotated = [n for n in ALL_METHODS if n not in ("bf16", "kivi2", "turboquant")]
    assert {clip_mode(method(n)) for n in rotated} == {"fit"}
    assert {n: clip_mode(method(n, "clip=paper")) for n in ("int2", "quarot", "saw_int4", "oscar", "auto")} == {
        "int2": "none", "quarot": "none", "saw_int4": "none", "oscar": "fit", "auto": "fit"}
    assert {clip_mode(method(n, "clip=fixed")) for n in rotated} == {"fixed"}
    # formats without a clip ratio run unclipped whatever the policy
    assert {clip_mode(method(n, c)) for n in ("bf16", "kivi2", "turboquant") for c in ("clip=fit", "clip=paper")} == {"none"}
    with pytest.raises(MethodError, match="paper_clip='sometimes'; valid: fit, fixed, none"):
        validate_method(method("quarot", "paper_clip=sometimes"))


def test_grid_edges_count_fits_on_either_end():
    rho_k = [torch.tensor([0.5, 0.7]), torch.tensor([1.0, 0.5])]
    rho_v = [torch.tensor([0.9, 0.9]), torch.tensor([0.9, 1.0])]
    grid = [0.5, 0.7, 0.9, 1.0]
    assert grid_edges(rho_k, rho_v, grid, grid) == {
        "key_low": 2, "key_high": 1, "key_heads": 4, "value_low": 0, "value_high": 1, "value_heads": 4}


@pytest.mark.parametrize(
    "override, match",
    [
        ("key_rotation=uhq", "valid: identity, hadamard"),
        ("value_target=query", "valid: output, raw, geomean"),
        ("key_target=output", "valid: query, raw, geomean"),
        ("clip=auto", "valid: fit, fixed, none, paper"),
        ("kind=lloyd", "valid: bf16, rotated, rotated_channel, kivi, turboquant"),
        ("value_rotation=hadamard", "auto must apply to both"),
    ],
)
def test_invalid_methods_name_the_valid_options(override, match):
    base = "auto" if "value_rotation" in override else "oscar"
    with pytest.raises(MethodError, match=match):
        validate_method(method(base, override))


def test_effective_group_size():
    assert effective_group_size(method("oscar"), 64) == 64
    assert effective_group_size(method("oscar"), 128) == 128
    assert effective_group_size(method("kivi2"), 128) == 32
    with pytest.raises(MethodError, match=r"group_size 48 does not divide head_dim 64; valid group sizes: \[4, 8, 16, 32, 64\]"):
        effective_group_size(method("oscar", "group_size=48"), 64)


def test_in_code_methods_match_their_definitions():
    quarot = in_code_artifact(method("quarot", "clip=paper"), **GEOM)
    int2 = in_code_artifact(method("int2", "clip=none"), **GEOM)
    saw = in_code_artifact(method("saw_int4", "group_size=32", "clip=paper"), **GEOM)
    bf16 = in_code_artifact(method("bf16"), **GEOM)
    for layer in range(2):
        for h in range(2):
            assert torch.allclose(quarot.R_K[layer][h].double(), hadamard(64), atol=1e-7)
            assert torch.equal(int2.R_V[layer][h], torch.eye(64))
            assert torch.allclose(saw.R_K[layer][h].double(), block_hadamard(64, 32), atol=1e-7)
            assert torch.equal(bf16.R_K[layer][h], torch.eye(64))
        assert quarot.rho_K[layer].tolist() == [1.0, 1.0]
        assert torch.equal(quarot.mu_K[layer], torch.zeros(2, 64))
    assert quarot.meta["method"]["name"] == "quarot"


def test_random_rotations_are_seeded_per_layer_and_head():
    # a rotated-format method with random rotations (TurboQuant's own quantizers draw theirs; its artifact holds none)
    rand = ("key_rotation=random", "value_rotation=random", "clip=none")
    a = in_code_artifact(method("int2", *rand), **GEOM)
    b = in_code_artifact(method("int2", *rand), **GEOM)
    c = in_code_artifact(method("int2", *rand, "seed=1"), **GEOM)
    assert torch.equal(a.R_K[0], b.R_K[0])
    assert not torch.equal(a.R_K[0], c.R_K[0])
    assert not torch.allclose(a.R_K[0][0], a.R_K[0][1]) and not torch.allclose(a.R_K[0][0], a.R_K[1][0])
    assert not torch.allclose(a.R_K[0][0], a.R_V[0][0])
    r = a.R_K[1][1].double()
    torch.testing.assert_close(r.T @ r, torch.eye(64, dtype=torch.float64), atol=1e-6, rtol=0)


def test_calibrated_methods_refuse_missing_statistics():
    with pytest.raises(CalibrationMissing, match="python -m oscar dump"):
        build_rotations(method("oscar"), **GEOM)
    with pytest.raises(CalibrationMissing, match="needs calibration"):
        in_code_artifact(method("oscar_raw"), **GEOM)


def test_targets_follow_the_method(stats):
    hp = hadamard(64) @ bit_reversal(64)
    oscar = build_rotations(method("oscar"), stats=stats, **GEOM)
    raw = build_rotations(method("oscar_raw"), stats=stats, **GEOM)
    center = build_rotations(method("oscar_center"), stats=stats, **GEOM)
    for layer in range(2):
        for h in range(2):
            for art, side, which in ((oscar, "K", "Q"), (oscar, "V", "S"), (raw, "K", "K"), (raw, "V", "V")):
                want = build_rotation("uhp", 64, cov=stats.second_moment(layer, which)[h])
                torch.testing.assert_close(getattr(art, f"R_{side}")[layer][h].double(), want, atol=1e-6, rtol=0)
            torch.testing.assert_close(center.mu_K[layer][h].double(), stats.mean(layer, "K")[h], atol=1e-6, rtol=0)
        assert oscar.rho_K[layer].tolist() == [1.0, 1.0]  # rotations stage: clip not fitted yet
        assert torch.equal(oscar.mu_V[layer], torch.zeros(2, 64))
    torch.testing.assert_close(
        build_rotations(method("oscar_hp", "clip=fixed"), **GEOM).R_K[0][0].double(), hp, atol=1e-7, rtol=0
    )


def test_fit_clip_modes(stats):
    grid_k, grid_v = [0.9, 0.95, 1.0], [0.85, 0.9, 1.0]
    fixed = fit_clip(build_rotations(method("oscar", "clip=fixed"), stats=stats, **GEOM), method("oscar", "clip=fixed"),
                     clip_grid_k=grid_k, clip_grid_v=grid_v)
    assert torch.allclose(fixed.rho_K[1], torch.tensor([0.96, 0.96])) and torch.allclose(fixed.rho_V[1], torch.tensor([0.92, 0.92]))
    art = build_rotations(method("oscar"), stats=stats, **GEOM)
    fitted = fit_clip(art, method("oscar"), stats=stats, clip_grid_k=grid_k, clip_grid_v=grid_v)
    metric = stats.second_moment(0, "Q")[1]
    rows = stats.samples[0]["K_samples"][1]
    per_rho = {g: measured_distortion(rows, fitted.R_K[0][1].double(), metric, rho=g, group_size=64) for g in grid_k}
    assert float(fitted.rho_K[0][1]) == pytest.approx(min(per_rho, key=per_rho.get))
    assert fitted.meta["clip"]["mode"] == "fit" and len(fitted.meta["clip"]["fits"]) == 2 * 2 * 2
    with pytest.raises(CalibrationMissing, match="clip=fit needs"):
        fit_clip(art, method("oscar"), clip_grid_k=grid_k, clip_grid_v=grid_v)


def test_auto_choices_tables(stats, tmp_path):
    art = build_rotations(method("auto"), stats=stats, clip_grid_k=[0.95, 1.0], clip_grid_v=[0.9, 1.0], **GEOM)
    rows = auto_choices_rows(art.meta)
    assert len(rows) == 4 and {r["layer"] for r in rows} == {0, 1}
    assert all(r["key_vs_oscar"] <= 1.0 and r["value_vs_oscar"] <= 1.0 for r in rows)
    csv_path, md_path = write_auto_choices(art.meta, tmp_path / "choices_qwen2.5-coder", "synthetic")
    assert csv_path.name == "choices_qwen2.5-coder.csv"
    assert len(csv_path.read_text().splitlines()) == 5
    md = md_path.read_text()
    counts = [int(line.rsplit("|", 2)[1]) for line in md.splitlines() if line.startswith("| key |")]
    assert sum(counts) == 4
    with pytest.raises(MethodError, match="no auto choices"):
        write_auto_choices(build_rotations(method("oscar"), stats=stats, **GEOM).meta, tmp_path / "x")


def test_sliding_window_layers_get_no_selection_and_no_clip_fit(stats):
    """`dump` records the layers the cache never quantizes; auto selects and clips only the others."""
    import copy

    windowed = copy.copy(stats)
    windowed.meta = {**stats.meta, "window_layers": [0]}
    art = fit_clip(build_rotations(method("auto"), stats=windowed, clip_grid_k=[0.8, 1.0], clip_grid_v=[0.9, 1.0], **GEOM),
                   method("auto"), stats=windowed, clip_grid_k=[0.8, 1.0], clip_grid_v=[0.9, 1.0])
    assert {c["layer"] for c in art.meta["choices"]} == {1} and art.meta["window_layers"] == [0]
    assert torch.equal(art.R_K[0], torch.eye(64).expand(2, 64, 64)) and torch.equal(art.rho_K[0], torch.ones(2))
    assert art.meta["clip"]["edges"]["key_heads"] == 2  # layer 1 only
    osc = fit_clip(build_rotations(method("oscar"), stats=windowed, **GEOM), method("oscar"), stats=windowed,
                   clip_grid_k=[0.5, 0.8], clip_grid_v=[0.5, 0.8])
    assert torch.equal(osc.rho_V[0], torch.ones(2)) and bool((osc.rho_V[1] < 1).all())
    assert {f["layer"] for f in osc.meta["clip"]["fits"]} == {1} and osc.meta["clip"]["skipped_window_layers"] == [0]


def test_select_by_names_its_valid_values_and_is_an_auto_setting():
    validate_method(method("auto", "channel_block=32", "select_by=kl", "select_price=0.01"))
    validate_method(method("auto", "channel_block=0", "select_by=kl"))  # per-token keys only: nothing to select
    with pytest.raises(MethodError, match="select_by='task'; valid: distortion, kl"):
        validate_method(method("auto", "select_by=task"))
    with pytest.raises(MethodError, match=r"select_by=kl .* it is an auto setting"):
        validate_method(method("oscar", "select_by=kl"))
    with pytest.raises(MethodError, match="select_price=-1.0; valid: a number >= 0"):
        validate_method(method("auto", "channel_block=32", "select_by=kl", "select_price=-1"))


def test_auto_defaults_to_per_channel_candidates_chosen_by_kl_and_old_hashes_stay_reachable():
    """`auto` now defaults to per-channel key candidates (channel_block 32) chosen by next-token KL; the select keys
    are left out of resolved files and hashes at their neutral value and wherever they are moot (channel_block 0), so
    `auto method.channel_block=0` has the hash of the per-token `auto` of the committed reports, and
    `method.select_by=distortion` that of the distortion-selected per-channel `auto`."""
    from omegaconf import OmegaConf

    from oscar.config import config_hash, to_dict

    cfg = compose(["method=auto"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    assert (plain["method"]["channel_block"], plain["method"]["select_by"], plain["method"]["select_price"]) == (32, "kl", 0.0)
    assert to_dict(cfg)["method"]["select_by"] == "kl"
    strip = lambda d, **m: {**d, "method": {**{k: v for k, v in d["method"].items()  # noqa: E731
                                               if k not in ("select_by", "select_price")}, **m}}
    token = compose(["method=auto", "method.channel_block=0"])
    old_token = strip(plain, channel_block=0)  # the resolved file of the per-token default, before the select keys
    assert to_dict(token) == old_token and config_hash(token) == config_hash(old_token)
    assert config_hash(compose(["method=auto", "method.channel_block=0", "method.select_by=distortion"])) == config_hash(token)
    dist = compose(["method=auto", "method.select_by=distortion"])
    assert to_dict(dist) == strip(plain) and config_hash(dist) == config_hash(strip(plain)) != config_hash(cfg)


def test_an_artifact_of_per_token_auto_matches_any_selector_and_a_distortion_one_refuses_kl():
    """The select keys are moot without per-channel candidates: a per-token `auto` artifact (recorded before they
    existed) runs under `auto method.channel_block=0` whatever they say; a per-channel artifact selected by distortion
    is refused by the default `auto` (select_by=kl), naming the field."""
    from oscar.core.artifact import method_differences

    old_token = {"key_rotation": "auto", "value_rotation": "auto", "channel_block": 0}
    assert method_differences(old_token, method("auto", "channel_block=0")) == {}
    assert method_differences(old_token, method("auto")) == {"channel_block": (0, 32), "select_by": ("distortion", "kl")}
    cb32_distortion = {**old_token, "channel_block": 32, "select_by": "distortion"}
    assert method_differences(cb32_distortion, method("auto")) == {"select_by": ("distortion", "kl")}
    assert method_differences(cb32_distortion, method("auto", "select_by=distortion")) == {}

"""Configuration composition: overrides, schema validation, resolved-config files, the fast path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from oscar.config import (
    CONF_DIR,
    Composer,
    ConfigError,
    compose,
    config_hash,
    load_resolved,
    to_dict,
    validate,
    write_resolved,
)


def test_default_composes_with_every_table():
    cfg = compose([])
    assert cfg.model.name == "smollm2-135m"
    assert set(cfg.experiment.tables) >= {"table2", "table3", "table4", "table5", "table6", "table7", "fig2", "fig3", "kernels"}
    assert cfg.experiment.tables.table2.kind == "eval"
    assert cfg.experiment.tables.table4.kind == "fidelity"


@pytest.mark.parametrize("experiment", ["default", "tiny", "paper", "table2", "table3", "fig3", "kernels"])
def test_every_experiment_file_composes(experiment):
    cfg = compose([f"experiment={experiment}"])
    assert cfg.experiment.name == experiment
    assert cfg.experiment.tables, f"experiment {experiment} defines no table"


def test_valid_overrides_apply_with_schema_types():
    cfg = compose(["model=qwen2.5-coder-1.5b", "method=bf16", "method.sink=4", "benchmark.limit=50",
                   "benchmark.context_lengths=[512,1024]"])
    assert cfg.model.name == "qwen2.5-coder-1.5b"
    # bf16.yaml does not mention `sink`; the schema default is overridable all the same
    assert cfg.method.sink == 4 and isinstance(cfg.method.sink, int)
    assert cfg.benchmark.limit == 50
    assert list(cfg.benchmark.context_lengths) == [512, 1024]


def test_free_form_extra_accepts_new_keys():
    cfg = compose(["benchmark.extra.samples_per_length=3"])
    assert cfg.benchmark.extra.samples_per_length == 3


def test_invalid_key_names_key_and_valid_keys():
    with pytest.raises(ConfigError) as err:
        compose(["benchmark.limt=5"])
    assert "benchmark.limt" in str(err.value)
    assert "limit" in str(err.value)  # lists the valid keys


def test_invalid_value_names_key_and_value():
    with pytest.raises(ConfigError) as err:
        compose(["benchmark.limit=abc"])
    assert "abc" in str(err.value) and "benchmark.limit" in str(err.value)
    with pytest.raises(ConfigError, match="method.sink"):
        compose(["method.sink=4.5"])


def test_invalid_group_option_lists_valid_options():
    with pytest.raises(ConfigError) as err:
        compose(["model=nope"])
    assert "model/nope" in str(err.value) and "smollm2-135m" in str(err.value)


def test_sweeps_are_refused():
    with pytest.raises(ConfigError, match="sweep"):
        compose(["method.sink=1,2"])


def test_config_is_read_only():
    cfg = compose([])
    with pytest.raises(Exception):
        cfg.method.sink = 3


@pytest.mark.parametrize(
    "override, message",
    [
        ("experiment.tables.table2.kind=plot", "kind='plot'"),
        ("experiment.tables.table2.rows=[colour]", "axis 'colour'"),
    ],
)
def test_table_schema_checks(override, message):
    with pytest.raises(ConfigError, match=message):
        compose([override])


def test_variant_name_must_be_path_safe():
    data = to_dict(compose([]))
    data["experiment"]["tables"]["table3"]["variants"][0]["name"] = "a/b"
    with pytest.raises(ConfigError, match="path-safe"):
        validate(OmegaConf.create(data))
    data["model"]["num_layers"] = "many"
    with pytest.raises(ConfigError, match="num_layers"):
        validate(OmegaConf.create(data))


def test_write_resolved_only_when_changed(tmp_path):
    path = tmp_path / "cell" / "config.yaml"
    cfg = compose(["method=quarot"])
    assert write_resolved(cfg, path) is True
    stamp = path.stat().st_mtime_ns
    os.utime(path, ns=(stamp - 10_000_000_000, stamp - 10_000_000_000))
    old = path.stat().st_mtime_ns
    assert write_resolved(compose(["method=quarot"]), path) is False
    assert path.stat().st_mtime_ns == old, "an unchanged config must keep its mtime"
    assert write_resolved(compose(["method=quarot", "method.sink=8"]), path) is True
    assert path.stat().st_mtime_ns != old
    assert not list(path.parent.glob(".*.tmp")), "no temp file left behind"


def test_load_resolved_round_trip(tmp_path):
    cfg = compose(["method=oscar", "benchmark.limit=7"])
    path = tmp_path / "c.yaml"
    write_resolved(cfg, path)
    back = load_resolved(path)
    assert config_hash(back) == config_hash(cfg)
    path.write_text(path.read_text().replace("limit: 7", "limit: seven"))
    with pytest.raises(ConfigError, match="limit"):
        load_resolved(path)


def test_fast_cell_path_matches_hydra_for_every_group_option():
    """The workflow's fast composition (no Hydra per cell) equals Hydra's for every group file."""
    with Composer() as composer:
        for group in ("model", "method", "benchmark", "calibration"):
            for option in sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")):
                overrides = [f"{group}={option}", "method.sink=5", "seed=3"]
                fast = to_dict(composer.compose(overrides, tables=False))
                composer._base.clear()
                composer._root = False  # force Hydra
                slow = to_dict(composer.compose(overrides + ["device=auto"], tables=False))
                composer._root = None
                fast.pop("experiment")
                slow.pop("experiment")
                assert fast == slow, f"{group}={option}: fast composition differs from Hydra's"


def test_config_verb_prints_and_fails_on_bad_override(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(CONF_DIR.parent)}
    ok = subprocess.run([sys.executable, "-m", "oscar", "config", "method=quarot", "--format", "flat"],
                        capture_output=True, text=True, env=env, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "method.key_rotation=hadamard" in ok.stdout.splitlines()
    bad = subprocess.run([sys.executable, "-m", "oscar", "config", "benchmark.limt=3"],
                         capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 2 and "benchmark.limt" in bad.stderr
    out = tmp_path / "resolved.yaml"
    wrote = subprocess.run([sys.executable, "-m", "oscar", "config", "--output", str(out)],
                           capture_output=True, text=True, env=env, check=False)
    assert wrote.returncode == 0 and load_resolved(out).model.name == "smollm2-135m"


def test_cli_lists_workflow_verbs():
    from oscar.cli import VERBS

    for verb in ("aggregate", "report", "config"):
        assert verb in VERBS
        assert Path(CONF_DIR.parent, "oscar", "commands", f"{verb}.py").is_file()

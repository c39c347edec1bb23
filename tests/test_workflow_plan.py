"""The workflow's plan: cells fanned out from the composed configuration, paths, calibrations, overrides."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "workflow" / "scripts"))

from omegaconf import OmegaConf  # noqa: E402

from oscar.config import ConfigError, validate  # noqa: E402
from oscar_plan import Plan, parse_user_overrides, split_axis_overrides  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return Plan(["experiment=tiny"])


def test_parse_user_overrides_forms():
    assert parse_user_overrides(None) == []
    assert parse_user_overrides(["model=a", " benchmark.limit=5 "]) == ["model=a", "benchmark.limit=5"]
    assert parse_user_overrides("[model=a,x=[1,2]]") == ["model=a", "x=[1,2]"]
    with pytest.raises(ConfigError):
        parse_user_overrides(5)


def test_axis_overrides_are_split_from_settings():
    axes, rest = split_axis_overrides(["model=m", "method.sink=4", "seed=2", "benchmark=mmlu"])
    assert axes == {"model": "m", "seed": "2", "benchmark": "mmlu"} and rest == ["method.sink=4"]
    with pytest.raises(ConfigError, match="one value per axis"):
        split_axis_overrides(["method=a,b"])


def test_tiny_table2_cells_and_paths(tiny):
    cells = tiny.table("table2").cells
    methods = ("bf16", "int2", "oscar")
    assert {(c.kind, c.method, c.item, c.seed) for c in cells} == {
        (kind, m, item, 0) for m in methods for kind, item in (("eval", "mmlu"), ("fidelity", "paul_graham"))}
    kl = next(c for c in cells if c.kind == "fidelity" and c.method == "int2")
    assert kl.result_dir == "results/fidelity/smollm2-135m/int2+table2/paul_graham"  # table4 owns the plain path
    assert dict(f.split("=") for f in kl.flags) == {"windows": "1", "seq_len": "256", "modes": "decode_equivalent",
                                                    "attention": "false", "corpus": "paul_graham"}
    oscar = next(c for c in cells if c.method == "oscar" and c.kind == "eval")
    assert oscar.result_dir == "results/eval/smollm2-135m/oscar/mmlu/seed0"
    assert oscar.config_path == "results/config/eval/smollm2-135m/oscar/mmlu/seed0.yaml"
    # table overrides, item overrides, experiment overrides, then the seed
    assert "method.sink=4" in oscar.overrides and "benchmark.limit=2" in oscar.overrides
    assert oscar.overrides[-1] == "seed=0"
    assert tiny.cell_calibration[oscar.result_dir].artifact_dir == "results/calibration/smollm2-135m/oscar"
    # the shared clip policy (fitted) gives int2 a calibration too; only the BF16 cache has none
    int2 = next(c for c in cells if c.method == "int2")
    assert tiny.cell_calibration[int2.result_dir].artifact_dir == "results/calibration/smollm2-135m/int2"
    assert all(c.result_dir not in tiny.cell_calibration for c in cells if c.method == "bf16")


def test_variants_get_their_own_paths_and_share_calibration_when_possible(tiny):
    t5 = {c.variant: c for c in tiny.table("table5").cells}
    assert t5["s4-r16"].result_dir == "results/fidelity/smollm2-135m/oscar+s4-r16/paul_graham"
    # run-time windows do not change the calibration artifact: shared with the plain one
    assert tiny.cell_calibration[t5["s4-r16"].result_dir].artifact_dir == "results/calibration/smollm2-135m/oscar"
    t6 = {c.variant: c for c in tiny.table("table6").cells}
    clip = tiny.cell_calibration[t6["k0.92-v0.88"].result_dir]
    assert clip.artifact_dir == "results/calibration/smollm2-135m/oscar+k0.92-v0.88"
    assert "method.name=oscar+k0.92-v0.88" in t6["k0.92-v0.88"].overrides
    assert clip.stats_dir == "results/stats/smollm2-135m/default", "same calibration data: shared statistics"
    t7 = {c.variant: c for c in tiny.table("table7").cells}
    small = tiny.cell_calibration[t7["pg-256"].result_dir]
    assert small.stats_dir == "results/stats/smollm2-135m/default+pg-256"
    assert "calibration.name=default+pg-256" in t7["pg-256"].overrides
    # pg-512 equals the experiment's own calibration size: the plain artifact and statistics
    assert tiny.cell_calibration[t7["pg-512"].result_dir].artifact_dir == "results/calibration/smollm2-135m/oscar"


def test_fidelity_cells_carry_verb_flags(tiny):
    cell = next(c for c in tiny.table("fig3").cells if c.method == "oscar")
    assert cell.variant == "ctx256"
    assert dict(f.split("=") for f in cell.flags) == {"windows": "1", "seq_len": "256", "modes": "decode_equivalent",
                                                      "corpus": "paul_graham"}


def test_resolved_configs_written_once_and_readable(tiny, tmp_path):
    tiny.plan_all()
    assert tiny.write_configs(tmp_path) > 0
    assert tiny.write_configs(tmp_path) == 0, "unchanged configs are not rewritten"
    cell = tiny.table("table2").cells[0]
    data = OmegaConf.to_container(OmegaConf.load(tmp_path / cell.config_path))
    assert data.pop("verb_flags") == {}
    cfg = validate(data)  # the rest is a schema-valid configuration
    assert cfg.method.name == cell.method and cfg.benchmark.limit == 2
    text = (tmp_path / cell.config_path).read_text()
    assert "tables:" not in text and "tracking:" not in text, "study tables do not belong in a cell's config"
    calib = tiny.calibrations["results/calibration/smollm2-135m/oscar"]
    assert "sink" not in (tmp_path / calib.config_path).read_text(), "run-time windows do not change an artifact"
    tiny.write_table_plans(tmp_path)
    plan = json.loads((tmp_path / "results/plan/tiny/table2.json").read_text())
    assert plan["experiment"] == "tiny" and len(plan["cells"]) == 6  # 3 eval cells + 3 KL (fidelity) cells
    assert {"result_dir", "config_path", "method_label", "benchmark", "flags"} <= set(plan["cells"][0])


def test_user_axis_override_replaces_the_grid():
    plan = Plan(["experiment=tiny", "method=quarot", "benchmark.limit=1"])
    cells = plan.table("table2").cells
    assert [(c.method, c.kind) for c in cells] == [("quarot", "eval"), ("quarot", "fidelity")]
    assert cells[0].overrides.index("benchmark.limit=1") > cells[0].overrides.index("benchmark.limit=2"), \
        "the user's settings come after the table's"


@pytest.mark.parametrize("bad, needle", [
    ("benchmark.limt=5", "benchmark.limt"),
    ("benchmark.limit=abc", "abc"),
    ("model=nope", "model/nope"),
    ("results_dir=elsewhere", "--directory"),
    ("method.sink=-5", "method.sink=-5 is not valid; valid: >= 0"),  # values too, before any job is planned
    ("benchmark.limit=-3", "benchmark.limit=-3 is not valid"),
])
def test_invalid_user_override_names_the_problem(bad, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("/", "/")):
        Plan(["experiment=tiny", bad])


def test_conflicting_tables_are_refused():
    plan = Plan(["experiment=tiny", "experiment.tables.fig2.flags=['windows=3']"])
    with pytest.raises(ConfigError, match="different settings"):
        plan.plan_all()

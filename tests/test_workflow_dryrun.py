"""The Snakemake workflow: lint, dry runs of every target, the cluster profile, bad overrides."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = shutil.which("snakemake")
TARGETS = ["reproduce_table2", "reproduce_table3", "reproduce_table4", "reproduce_table5", "reproduce_table6",
           "reproduce_table7", "reproduce_fig2", "reproduce_fig3", "reproduce_kernels", "all"]

pytestmark = pytest.mark.skipif(SNAKEMAKE is None, reason="snakemake is not installed")


def snakemake(workdir: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run snakemake on this repository's Snakefile with `workdir` as its working directory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [SNAKEMAKE, "--snakefile", str(ROOT / "Snakefile"), "--directory", str(workdir), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False,
    )


def job_counts(output: str) -> dict[str, int]:
    """The `Job stats` table of a dry run."""
    table = output.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, flags=re.M)}


def test_lint_is_clean(tmp_path):
    out = snakemake(tmp_path, "--lint")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Congratulations, your workflow is in a good condition!" in out.stdout + out.stderr


def test_dry_run_of_every_target_on_the_default(tmp_path):
    out = snakemake(tmp_path, "-n", *TARGETS)
    assert out.returncode == 0, out.stdout + out.stderr
    counts = job_counts(out.stdout)
    for target in TARGETS:
        assert counts.get(target) == 1, f"{target} missing from the dry run: {counts}"
    # table2 alone is 6 methods x 4 benchmarks; the other tables add their own cells
    assert counts["eval_cell"] >= 24 and counts["fidelity_cell"] > 0
    assert counts["dump"] >= 1 and counts["clip"] == counts["rotations"]
    assert counts["aggregate_table"] == counts["report_table"] == counts["track_table"] == 8
    # no GPU on this host: the kernel benchmark is skipped, not scheduled
    assert "bench_kernels" not in counts
    cfg = tmp_path / "results/config/eval/smollm2-135m/oscar/mmlu/seed0.yaml"
    assert cfg.is_file(), "the resolved config of each cell is written before any job runs"


@pytest.mark.slow
def test_paper_config_dry_run(tmp_path):
    out = snakemake(tmp_path, "-n", "reproduce_table2", "--config", "overrides=[experiment=paper]")
    assert out.returncode == 0, out.stdout + out.stderr
    counts = job_counts(out.stdout)
    assert counts["eval_cell"] == 3 * 6 * 5 * 3  # models x methods x benchmarks x seeds
    assert "gpu=1" in out.stdout, "paper jobs ask for a GPU"


def test_cluster_profile_dry_run(tmp_path):
    out = snakemake(tmp_path, "-n", "--profile", str(ROOT / "workflow/profiles/slurm"), "reproduce_table2",
                    "--config", "overrides=[experiment=tiny]")
    assert out.returncode == 0, out.stdout + out.stderr
    counts = job_counts(out.stdout)
    assert counts["eval_cell"] == 3
    assert re.search(r"resources: .*mem_mb=4000.*runtime=120", out.stdout) or "runtime=120" in out.stdout


def test_local_profile_dry_run_table2_shape(tmp_path):
    out = snakemake(tmp_path, "-n", "--profile", str(ROOT / "workflow/profiles/local"), "reproduce_table2")
    assert out.returncode == 0, out.stdout + out.stderr
    counts = job_counts(out.stdout)
    assert counts["eval_cell"] == 24  # 6 methods x 4 benchmarks x 1 seed
    # under the shared clip policy (fit) every rotation method is calibrated: oscar, oscar_raw, auto, int2,
    # quarot; the BF16 and KIVI caches have no clip ratio and need none
    assert counts["clip"] == 5 and counts["dump"] == 1
    assert "fidelity_cell" not in counts


def test_invalid_override_fails_before_any_job(tmp_path):
    """One real invocation; test_workflow_plan checks the messages of each kind of bad override."""
    override, needle = "benchmark.limt=50", "benchmark.limt"
    out = snakemake(tmp_path, "--cores", "1", "reproduce_table2", "--config", f"overrides=[{override}]")
    assert out.returncode != 0
    assert needle in out.stdout + out.stderr
    assert "no job was run" in out.stdout + out.stderr
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").rglob("result.json"))
    assert not (tmp_path / "logs").exists()


def test_user_override_reaches_the_jobs(tmp_path):
    out = snakemake(tmp_path, "-n", "-p", "reproduce_table2",
                    "--config", "overrides=[model=qwen2.5-coder-1.5b,benchmark.limit=50]")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "results/eval/qwen2.5-coder-1.5b/oscar/mmlu/seed0/result.json" in out.stdout
    assert "benchmark.limit=50" in out.stdout
    assert "smollm2-135m" not in out.stdout


def test_kernels_target_explains_the_skip(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU host runs the kernel benchmarks instead")
    out = snakemake(tmp_path, "--cores", "1", "reproduce_kernels", "--config", "overrides=[experiment=kernels]")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SKIPPED, no CUDA GPU" in out.stdout + out.stderr

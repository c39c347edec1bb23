# Shared state of the workflow: the composed configuration, the planned cells, helper functions.
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

sys.path.insert(0, str(Path(workflow.basedir) / "workflow" / "scripts"))
from oscar_plan import Plan, parse_user_overrides  # noqa: E402
from oscar.config import ConfigError  # noqa: E402


validate(config, schema="../schemas/config.schema.yaml")

try:
    PLAN = Plan(parse_user_overrides(config.get("overrides")), root=".")
except ConfigError as exc:
    raise WorkflowError(f"invalid configuration, no job was run: {exc}") from None
EXPERIMENT = PLAN.experiment


def _python():
    """Interpreter for `python -m oscar`: the configured one, the env's under --sdm conda, else ours."""
    if config.get("python"):
        return config["python"]
    settings = getattr(workflow, "deployment_settings", None)
    methods = {str(m).lower() for m in getattr(settings, "deployment_method", ()) or ()}
    if any("conda" in m for m in methods):
        return "python"
    return sys.executable


# Jobs call `$OSCAR_PYTHON -m oscar ...`, set by the shell prefix rather than a rule parameter,
# so switching interpreters (or --sdm conda) does not count as a parameter change of every job.
# OSCAR_EXIT_WITH_PARENT: a job ends when snakemake is gone (kill -9), instead of running on orphaned.
shell.prefix(f"set -euo pipefail; export OSCAR_PYTHON={shlex.quote(_python())} OSCAR_EXIT_WITH_PARENT=1; ")


def _gpu_present():
    """True when an NVIDIA GPU answers `nvidia-smi -L` (no torch import at parse time)."""
    if shutil.which("nvidia-smi") is None:
        return False
    probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return probe.returncode == 0 and "GPU" in probe.stdout


HAS_GPU = _gpu_present()
KERNELS_MESSAGE = (
    f"reproduce_kernels: kernel benchmarks written to reports/{EXPERIMENT}/kernels.csv"
    if HAS_GPU
    else "reproduce_kernels: SKIPPED, no CUDA GPU on this host (nvidia-smi found none); "
    "run it on a GPU host: snakemake --cores all reproduce_kernels"
)


wildcard_constraints:
    model=r"[^/]+",
    method=r"[^/]+",
    benchmark=r"[^/]+",
    corpus=r"[^/]+",
    calibration=r"[^/]+",
    table=r"[^/]+",
    experiment=r"[^/]+",
    seed=r"\d+",


def res(stage, key):
    """One resource value of a workflow stage (threads, mem_mb, runtime, gpu)."""
    return getattr(PLAN.resources(stage), key)


def gpu_tracking():
    """The `python -m oscar gpu` keys that mirror a GPU table into the plan's MLflow store (or not)."""
    if not PLAN.base.tracking.enabled:
        return "tracking=false"
    return quoted([f"mlflow_uri={PLAN.base.tracking.uri}"])


def quoted(overrides):
    """Shell-quoted Hydra overrides."""
    return " ".join(shlex.quote(o) for o in overrides)


def _not_planned(key, what):
    return WorkflowError(
        f"{key} is not a {what} of experiment {EXPERIMENT!r}; "
        "ask for a named target (reproduce_table2, ...) or add it to conf/experiment/"
    )


def table_plan(table):
    """The plan of one table (composed on first use); a bad configuration stops before any job."""
    try:
        return PLAN.table(table)
    except KeyError:
        raise _not_planned(table, "table") from None
    except ConfigError as exc:
        raise WorkflowError(f"invalid configuration, no job was run: {exc}") from None


def _find(mapping, key, what):
    try:
        found = PLAN.find(mapping, key)
    except ConfigError as exc:
        raise WorkflowError(f"invalid configuration, no job was run: {exc}") from None
    if found is None:
        raise _not_planned(key, what)
    return found


def eval_cell(wildcards):
    """The planned eval cell of a job's wildcards."""
    key = f"results/eval/{wildcards.model}/{wildcards.method}/{wildcards.benchmark}/seed{wildcards.seed}"
    return _find("cells", key, "planned eval cell")


def fidelity_cell(wildcards):
    """The planned fidelity cell of a job's wildcards."""
    key = f"results/fidelity/{wildcards.model}/{wildcards.method}/{wildcards.corpus}"
    return _find("cells", key, "planned fidelity cell")


def calibration_of(wildcards):
    """The planned calibration artifact of a job's wildcards."""
    return _find("calibrations", f"results/calibration/{wildcards.model}/{wildcards.method}", "planned calibration")


def stats_of(wildcards):
    """The planned statistics of a job's wildcards."""
    return _find("stats", f"results/stats/{wildcards.model}/{wildcards.calibration}", "planned statistics")


def artifact_for(cell):
    """The calibration artifact a cell reads, or None when its method builds rotations in code."""
    return PLAN.cell_calibration.get(cell.result_dir)


def table_targets(table):
    """Files that finish one table or figure: its cells, report files, figure, MLflow mirror."""
    plan = table_plan(table)
    if plan.kind == "kernels":
        return kernel_targets()
    stem = f"reports/{EXPERIMENT}/{table}"
    targets = [f"{stem}.csv", f"{stem}.md", f"{stem}.tex"]
    if plan.spec.get("figure"):
        targets.append(f"{stem}.png")
    if PLAN.base.tracking.enabled:
        targets.append(f"results/tracking/{EXPERIMENT}/{table}.json")
    # the cells themselves are targets too: a deleted cell is recomputed (alone), then the table
    return targets + [f"{cell.result_dir}/result.json" for cell in plan.cells]


def all_targets():
    """Every table and figure of the experiment, and the kernel benchmarks where a GPU is present."""
    targets = []
    for name in PLAN.table_names:
        if table_plan(name).kind != "kernels":
            targets += table_targets(name)
    return targets + kernel_targets()


def kernel_targets():
    """Kernel benchmark outputs where a GPU is present, nothing otherwise."""
    if not HAS_GPU or "kernels" not in PLAN.table_names:
        return []
    return [f"reports/{EXPERIMENT}/kernels.csv"]


def _artifact_input(cell):
    calib = artifact_for(cell)
    return [f"{calib.artifact_dir}/meta.json"] if calib else []


def _table_cells(wildcards):
    files = []
    for cell in table_plan(wildcards.table).cells:
        files.append(f"{cell.result_dir}/result.json")
        if cell.kind == "fidelity":
            files.append(f"{cell.result_dir}/per_layer.csv")
        else:
            files.append(f"{cell.result_dir}/items.jsonl")
    return files


def _check_experiment(wildcards):
    if wildcards.experiment != EXPERIMENT:
        raise WorkflowError(
            f"reports/{wildcards.experiment}/... belongs to experiment {wildcards.experiment!r}; "
            f"this run composes experiment {EXPERIMENT!r} (pass --config overrides='[experiment={wildcards.experiment}]')"
        )
    table_plan(wildcards.table)
    return PLAN.table_plan_path(wildcards.table)

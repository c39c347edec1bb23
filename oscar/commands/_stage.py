"""Helpers shared by the calibration verbs: verb-only flags, atomic writes, stage skip logic."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

TRUE = {"true", "1", "yes", "on"}
FALSE = {"false", "0", "no", "off"}


def pop_flags(argv: list[str], defaults: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Split verb-only flags (`force=true`) from Hydra overrides; flags keep the type of their default."""
    flags = dict(defaults)
    rest: list[str] = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in defaults:
            default = defaults[key]
            if isinstance(default, bool):
                low = value.lower()
                if low not in TRUE | FALSE:
                    raise ValueError(f"flag {key}={value!r}: expected true or false")
                flags[key] = low in TRUE
            elif isinstance(default, int):
                flags[key] = int(value)
            else:
                flags[key] = value
        else:
            rest.append(arg)
    return flags, rest


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON through a temp file in the same folder and `os.replace`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_json(path: Path) -> Any:
    """JSON content of a file, or None when it does not exist."""
    return json.loads(path.read_text()) if path.is_file() else None

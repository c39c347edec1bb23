"""Per-process state of the SGLang plugin: the one module that ``plugin``, ``pool`` and ``backend`` read.

``ensure_state`` validates the ``OSCAR_*`` settings against the model once per process (the launching
process in the start-up check, each scheduler process when its pool is built); the pool and the backend
read what it set through ``current_state``. Nothing here imports sglang.
"""

from __future__ import annotations

import os
from typing import Any

BACKEND = "oscar"
ENV_ACTIVE = "OSCAR_SERVE_ACTIVE"
ENV_FOLD = "OSCAR_FOLD"

_STATE: dict[str, Any] = {}


def active() -> bool:
    """True in a server started with ``--attention-backend oscar`` (set by the start-up check)."""
    return os.environ.get(ENV_ACTIVE) == "1"


def set_active(on: bool) -> None:
    """Mark this process (and the processes it starts) as serving with the oscar backend, or not."""
    os.environ[ENV_ACTIVE] = "1" if on else "0"


def ensure_state(hf_config: Any) -> dict[str, Any]:
    """Settings, rotations and the served cache format (`oscar.cache.formats`) of this process, validated
    against ``hf_config`` once."""
    if not _STATE:
        # local: keeps torch out of import time (oscar.serve.plugin, SGLang's entry point, imports this module)
        from oscar.serve.settings import OscarServeError, ServeSettings, validate

        settings = ServeSettings.from_env()
        rotations, fmt = validate(settings, hf_config)
        fold = os.environ.get(ENV_FOLD, "1")
        if fold not in ("0", "1"):
            raise OscarServeError(f"{ENV_FOLD}={fold!r} is not valid; use 1 (fold R_V into o_proj) or 0")
        _STATE.update(settings=settings, rotations=rotations, format=fmt, fold=fold == "1")
    return _STATE


def current_state() -> dict[str, Any]:
    """The state set up by ``ensure_state`` in this process (the pool and backend read it)."""
    if not _STATE:
        raise RuntimeError("the oscar plugin has no settings in this process: ensure_state() did not run "
                           "(was the pool built without the plugin's hooks?)")
    return _STATE


def reset_state() -> None:
    """Forget the settings of this process (tests that serve two configurations in one process)."""
    _STATE.clear()


__all__ = ["BACKEND", "ENV_ACTIVE", "ENV_FOLD", "active", "current_state", "ensure_state", "reset_state", "set_active"]

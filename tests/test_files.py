"""The one atomic writer (`oscar.core.files`): modes, no partial files, used everywhere; and the GPU benchmark's
entry path importing nothing the bare GPU machine lacks (omegaconf, hydra)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oscar.core.files import atomic_write, atomic_write_bytes, atomic_write_csv, atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_writer_gives_the_umask_mode_and_leaves_no_temp(tmp_path, umask_022):
    atomic_write_text(tmp_path / "a" / "t.md", "x\n")
    atomic_write_bytes(tmp_path / "b.bin", b"\0\1")
    atomic_write_json(tmp_path / "c.json", {"b": 1, "a": [1.5]})
    atomic_write_csv(tmp_path / "d.csv", [{"x": 1}, {"y": 2, "x": 3}], keys=["y"])
    atomic_write(tmp_path / "e.png", lambda p: p.write_bytes(b"png" + p.suffix.encode()))
    for name in ("a/t.md", "b.bin", "c.json", "d.csv", "e.png"):
        assert _mode(tmp_path / name) == 0o644, name
    assert json.loads((tmp_path / "c.json").read_text()) == {"a": [1.5], "b": 1}
    assert (tmp_path / "d.csv").read_text().splitlines() == ["y,x", ",1", "2,3"]
    assert (tmp_path / "e.png").read_bytes() == b"png.png"  # the temp file keeps the suffix (savefig's format)
    assert sorted(p.name for p in tmp_path.rglob(".*")) == []


def test_a_failing_writer_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "r.json"
    atomic_write_text(target, "old")

    def fail(p: Path) -> None:
        p.write_text("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(target, fail)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_reports_and_benchmarks_write_through_the_helper(tmp_path, umask_022):
    from oscar.bench.kernels import report as kernel_report
    from oscar.bench.throughput import report as throughput_report

    throughput_report.write_csv(tmp_path / "grid.csv", [{"model": "m", "batch": 1}])
    assert _mode(tmp_path / "grid.csv") == 0o644
    assert kernel_report.atomic_write_csv is atomic_write_csv and kernel_report.atomic_write_text is atomic_write_text
    # one helper: no other module of the package (or the benchmark scripts) makes its own temp files
    offenders = [str(p.relative_to(ROOT)) for folder in ("oscar", "benchmarks") for p in (ROOT / folder).rglob("*.py")
                 if p.name != "files.py" and "mkstemp(" in p.read_text()]
    assert offenders == []


_BLOCK = r"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("omegaconf", "hydra"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the bare GPU machine lacks it)", name=name)
        return None
sys.meta_path.insert(0, Block())
"""


def test_gpu_kernels_runs_without_omegaconf(tmp_path):
    """The whole entry path of `python -m oscar gpu kernels` with omegaconf and hydra unimportable (one
    process: the verb's bad-argument and no-GPU exits, after every import it makes)."""
    out = tmp_path / "k"
    code = _BLOCK + textwrap.dedent(f"""
        try:
            import omegaconf
        except ModuleNotFoundError as exc:
            print("blocker:", exc)
        import oscar.core.files, oscar.bench.kernels.timing, oscar.cache.paged, oscar.bench.throughput.report
        from oscar.cli import main
        print("bogus rc", main(["gpu", "kernels", "bogus=1"]))
        print("run rc", main(["gpu", "kernels", "out={out}", "tracking=false"]))
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "blocker: No module named 'omegaconf' (blocked" in proc.stdout  # the blocker works
    assert "bogus rc 2" in proc.stdout and "unknown argument 'bogus=1'" in proc.stderr
    # without a GPU the table stops before timing (exit 1, nothing written), after the whole import path ran
    assert "run rc 1" in proc.stdout and "CUDA device" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()

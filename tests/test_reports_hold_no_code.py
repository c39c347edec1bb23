"""Reports hold results, not code (issue 41): no tracked file under `reports/` is a script, a patch or a notebook.

A study's script lives in `benchmarks/studies/` (its docstring names the report it writes) and the report keeps the
command that made it; a kernel experiment's patch stays in git history, named by its commit in the report.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CODE_SUFFIXES = (".py", ".sh", ".patch", ".ipynb")


def _tracked(folder: str) -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    proc = subprocess.run(["git", "ls-files", "-z", "--", folder], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()[:200]}")
    return [p for p in proc.stdout.split("\0") if p]


def test_reports_track_no_code_files() -> None:
    offenders = [p for p in _tracked("reports") if p.lower().endswith(CODE_SUFFIXES)]
    assert offenders == [], (
        "code under reports/ (move a study's script to benchmarks/studies/ and keep its command in the report's "
        f"markdown; delete patches, naming their commit in the report): {offenders}")


def test_every_study_script_names_its_report() -> None:
    studies = [p for p in _tracked("benchmarks/studies") if p.endswith((".py", ".sh"))]
    assert studies, "benchmarks/studies/ holds the studies' scripts"
    for rel in studies:
        text = (ROOT / rel).read_text()
        assert "reports/" in text, f"{rel}: its header names the report it writes"
        assert "/work/" not in text, f"{rel}: a hard-coded checkout path"

"""The interpreter fallback of the Triton kernels (oscar.kernels._runtime) leaves Triton's language namespaces as it
found them. Triton's interpreter patches `triton.language` for nested `@triton.jit` helper calls without restoring it;
in a process that then launches compiled kernels (CUDA tests after CPU ones on a GPU host, where TRITON_INTERPRET is
not set) they failed with a CompilationError at the first integer expression (H200 run of 2026-12-03,
reports/kernels/pytest_cuda_rerun.log). The check runs in a child process without TRITON_INTERPRET, as on a GPU host:
there a CPU-tensor launch goes through `_InterpretedLaunch`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r"""
import json, torch
from oscar.cache import paged
from oscar.kernels import _runtime
from oscar.kernels.segments import HeadTransform

spaces = _runtime._language_namespaces()
before = [dict(vars(obj)) for obj in spaces]
x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
ident = HeadTransform(torch.eye(64).expand(2, 64, 64).contiguous())
pages = {b: paged.QuantPages.empty(2, 2, 16, 64, 2, 64, torch.device("cpu"), "rows") for b in ("triton", "torch")}
for backend, p in pages.items():
    paged.rotate_quantize_pack(x, torch.arange(8), p, ident, backend=backend)
out = {"compiled_mode": type(__import__("oscar.kernels.quantize", fromlist=["x"])._rotate_quantize_kernel).__name__,
       "same_codes": bool(torch.equal(pages["triton"].codes, pages["torch"].codes)),
       "added": [n for obj, saved in zip(spaces, before) for n in vars(obj) if n not in saved],
       "replaced": [n for obj, saved in zip(spaces, before) for n, v in saved.items() if vars(obj).get(n) is not v]}
print(json.dumps(out))
"""


def test_an_interpreted_launch_leaves_triton_language_unpatched():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["compiled_mode"] == "JITFunction"  # the GPU host's path: compiled-mode kernels, interpreted launch
    assert out["same_codes"]  # the launch ran, as its twin
    assert out["added"] == [] and out["replaced"] == []


def test_check_formats_its_message_only_when_it_fails() -> None:
    """`check` takes the message as a string or a zero-argument callable; the callable runs only on failure (the
    launchers check their inputs per layer and decode step, and the eager step is host-bound)."""
    import pytest

    from oscar.kernels._runtime import check

    check(True, lambda: f"{1 / 0}")  # a message that would raise if formatted
    with pytest.raises(ValueError, match="^page_size=24 must be a power of two$"):
        check(False, lambda: f"page_size={24} must be a power of two")
    with pytest.raises(ValueError, match="^plain$"):
        check(False, "plain")


def test_launcher_checks_format_messages_lazily() -> None:
    """No `check(cond, f"...")` in kernels/: an f-string message is formatted on every call even when the check holds
    (about 1-2 us each, 30-40 checks per launch, a launch per layer and step); such messages go in a `lambda:`."""
    import ast
    from pathlib import Path

    eager = []
    for path in sorted((Path(__file__).resolve().parents[1] / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "check"
                    and len(node.args) == 2 and not isinstance(node.args[1], (ast.Constant, ast.Lambda))):
                eager.append(f"{path.name}:{node.lineno}")
    assert not eager, f"checks that format their message on every call: {eager}"

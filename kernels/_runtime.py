"""Launch helpers shared by the kernels: interpreter fallback for CPU tensors and input checks."""

from __future__ import annotations

from typing import Any

import torch
import triton

_INTERPRETED: dict[int, Any] = {}


def _interpreted(fn: Any) -> Any:
    from triton.runtime.interpreter import InterpretedFunction

    key = id(fn)
    if key not in _INTERPRETED:
        _INTERPRETED[key] = InterpretedFunction(fn)
    return _INTERPRETED[key]


class _InterpretedLaunch:
    """Launch a compiled-mode kernel through the interpreter, nested `@triton.jit` calls included."""

    def __init__(self, kernel: Any, grid: Any) -> None:
        self.kernel, self.grid = kernel, grid

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from triton.runtime.jit import JITFunction

        original = JITFunction.__call__
        JITFunction.__call__ = lambda self, *a, **k: _interpreted(self.fn)(*a, **k)
        try:
            return _interpreted(self.kernel.fn)[self.grid](*args, **kwargs)
        finally:
            JITFunction.__call__ = original


class _Launcher:
    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> _InterpretedLaunch:
        return _InterpretedLaunch(self.kernel, grid)


def launchable(kernel: Any, device: torch.device) -> Any:
    """The kernel to launch for tensors on `device`: the compiled one on CUDA, interpreted on CPU.

    Triton decides between compiling and interpreting when `@triton.jit` runs (module import).
    A process that imported Triton without `TRITON_INTERPRET=1` still runs the kernels on CPU
    tensors: the launch goes through Triton's interpreter, and for its duration calls of
    compiled-mode `@triton.jit` helpers (Triton's own standard library) are interpreted too.
    """
    if device.type == "cuda" or type(kernel).__name__ == "InterpretedFunction":
        return kernel
    if device.type != "cpu":
        raise ValueError(f"Triton kernels run on cuda (compiled) or cpu (interpreted) tensors, got device {device}")
    return _Launcher(kernel)


def check(cond: bool, message: str) -> None:
    """Raise ValueError(message) unless `cond`."""
    if not cond:
        raise ValueError(message)


def is_pow2(n: int) -> bool:
    """True for positive powers of two."""
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    """Smallest power of two >= n."""
    return triton.next_power_of_2(max(1, int(n)))

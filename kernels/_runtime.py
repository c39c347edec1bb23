"""Launch helpers shared by the kernels: interpreter fallback for CPU tensors and input checks."""

from __future__ import annotations

from typing import Any, Callable, Union

import torch
import triton

_INTERPRETED: dict[int, Any] = {}


def _interpreted(fn: Any) -> Any:
    from triton.runtime.interpreter import InterpretedFunction

    key = id(fn)
    if key not in _INTERPRETED:
        _INTERPRETED[key] = InterpretedFunction(fn)
    return _INTERPRETED[key]


def _language_namespaces() -> list[Any]:
    """What Triton's interpreter patches while it runs a kernel: `triton.language`, its core and math modules, and
    the tensor classes (`triton.runtime.interpreter._patch_lang`)."""
    import triton.language as tl

    return [tl, tl.core, tl.math, tl.tensor, tl.core.tensor_descriptor_base]


def _restore_namespaces(saved: list[tuple[Any, dict[str, Any]]]) -> None:
    """Put back every attribute the interpreter replaced or added (its nested helper calls patch `triton.language`
    without restoring it, which breaks later compiled launches in the same process, e.g. CUDA tests after CPU ones)."""
    for obj, before in saved:
        now = vars(obj)
        for name in [n for n in now if n not in before]:
            delattr(obj, name)
        for name, value in before.items():
            if now.get(name) is not value:
                setattr(obj, name, value)


class _InterpretedLaunch:
    """Launch a compiled-mode kernel through the interpreter, nested `@triton.jit` calls included; Triton's
    language namespaces are left as they were found."""

    def __init__(self, kernel: Any, grid: Any) -> None:
        self.kernel, self.grid = kernel, grid

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from triton.runtime.jit import JITFunction

        saved = [(obj, dict(vars(obj))) for obj in _language_namespaces()]
        original = JITFunction.__call__
        JITFunction.__call__ = lambda self, *a, **k: _interpreted(self.fn)(*a, **k)
        try:
            return _interpreted(self.kernel.fn)[self.grid](*args, **kwargs)
        finally:
            JITFunction.__call__ = original
            _restore_namespaces(saved)


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


def check(cond: bool, message: Union[str, Callable[[], str]]) -> None:
    """Raise ValueError(message) unless `cond`. ``message`` may be a zero-argument callable (``lambda: f"..."``): it is
    formatted only when the check fails (the launchers' checks run per layer and step: eager decode is host-bound)."""
    if not cond:
        raise ValueError(message() if callable(message) else message)


def is_pow2(n: int) -> bool:
    """True for positive powers of two."""
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    """Smallest power of two >= n."""
    return triton.next_power_of_2(max(1, int(n)))

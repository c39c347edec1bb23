"""Test-only stand-in for SGLang's native ``sgl_kernel`` package (CUDA builds only).

SGLang's CPU path (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``) imports names from
``sgl_kernel`` at module level but, with ``--attention-backend torch_native`` or ``oscar``, never
calls them. Every attribute resolves to a function that raises if it is ever called, so a test
that reaches a native kernel fails loudly instead of computing something wrong. Never install this
next to the real package or on a GPU host.
"""

from __future__ import annotations

from typing import Any, Callable

__version__ = "0.0.0+standin"
STANDIN = True


def _missing(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is the test-only CPU stand-in "
            "(envs/serve/sgl-kernel-standin); install the real sglang-kernel on a CUDA host"
        )

    call.__name__ = call.__qualname__ = name
    return call


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)

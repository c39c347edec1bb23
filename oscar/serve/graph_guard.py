"""A guard for code that must run inside a CUDA-graph capture: it fails on what a capture cannot record.

SGLang captures the decode step (the pool's write, the backend's metadata and attention) once per batch size and
replays it. A captured step may launch kernels and allocate from the graph's private pool, nothing else:

- **host syncs** (``.item()``, ``bool(tensor)``, ``.tolist()``, ``nonzero`` and other ops whose output shape
  depends on the data): refused during capture ("operation not permitted when stream is capturing");
- **host data** (``torch.tensor([...])``, a tensor moved from the CPU to the device): a host-to-device copy from
  pageable memory, refused during capture;
- **tensors that outlive the step** (a table built at first use and kept in a module cache): under capture they
  live in the graph's private pool, which every replay rewrites; the same table read by an eager forward later
  reads garbage. What a step needs is built when the pool or backend starts.

`CaptureGuard` records all three while a step runs (a ``TorchDispatchMode``, so it sees every aten op, on the CPU as
on the GPU) and `check()` raises naming each violation and where it happened (the innermost frame of ``oscar`` or
``kernels``). On the CPU a host-to-device copy cannot be seen as such (every tensor is on the host): the guard sees
``torch.tensor`` and module tables instead, which is how such copies arise; on the GPU it also sees the device
change. The CPU serve suite runs a decode step of every pool format under it (tests/serve/test_graph_guard.py);
the CUDA tests run the real capture.
"""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_aten = torch.ops.aten
SYNC_OPS = {_aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten.unique_consecutive,
            _aten._unique2, _aten.unique_dim, _aten.is_nonzero, _aten.equal}
HOST_DATA_OPS = {_aten.lift_fresh, _aten.lift_fresh_copy}
COPY_OPS = {_aten._to_copy, _aten.copy_, _aten._copy_from}
# repeat_interleave syncs only where it reads a tensor of repeats to size its output without an output_size
_SIZED_BY_DATA = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}


def _syncs(func: Any, kwargs: dict) -> bool:
    """Whether an aten op waits for the device (its output's shape or value read on the host)."""
    if func in _SIZED_BY_DATA:
        return kwargs.get("output_size") is None
    return func.overloadpacket in SYNC_OPS


OWN_CODE = ("/oscar/", "/kernels/")


def _where() -> str:
    """The innermost frame of the project's own code (``oscar/``, ``kernels/``), outside this module."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if any(p in name for p in OWN_CODE) and not name.endswith("graph_guard.py"):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "outside oscar"


class CaptureViolation(AssertionError):
    """A step did what a CUDA-graph capture cannot record (the message lists each violation and where)."""


class CaptureGuard(TorchDispatchMode):
    """Record host syncs, host data and tensors that outlive the step while the ``with`` block runs; `check()`
    raises `CaptureViolation` if any. ``keep`` (`keep(t)`) names tensors the step returns on purpose (its output),
    which are not counted as outliving it."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []
        self._new: list[tuple[weakref.ref, str]] = []
        self._new_ptrs: set[int] = set()
        self._kept: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if _syncs(func, kwargs):
            self.violations.append(f"host sync ({func}) at {_where()}")
        elif packet in HOST_DATA_OPS:
            self.violations.append(f"tensor from host data ({func}: torch.tensor or a Python list) at {_where()}")
        out = func(*args, **kwargs)
        if packet in COPY_OPS:
            src = args[1] if packet is not _aten._to_copy else args[0]
            dst = out if packet is _aten._to_copy else args[0]
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.device != dst.device:
                self.violations.append(f"copy {src.device} -> {dst.device} ({func}) at {_where()}")
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs or ptr in self._new_ptrs:  # a new allocation, or a view of one
                    self._new_ptrs.add(ptr)
                    self._new.append((weakref.ref(t), f"{func} at {_where()}"))
        return out

    def keep(self, *tensors: Any) -> None:
        """Tensors the step returns (its outputs): their storage may outlive the step."""
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._kept.add(t.untyped_storage().data_ptr())

    def outliving(self) -> list[str]:
        """Where the tensors made during the step that are still alive (and not kept) were made."""
        gc.collect()
        seen, out = set(), []
        for ref, where in self._new:
            t = ref()
            if t is None or t.untyped_storage().data_ptr() in self._kept or where in seen:
                continue
            seen.add(where)
            out.append(f"tensor {tuple(t.shape)} {t.dtype} made during the step outlives it: {where}")
        return out

    def check(self, what: str = "the step") -> None:
        problems = list(dict.fromkeys(self.violations)) + self.outliving()
        if problems:
            raise CaptureViolation(f"{what} cannot run inside a CUDA-graph capture ({len(problems)} problems):\n  "
                                   + "\n  ".join(problems))


__all__ = ["CaptureGuard", "CaptureViolation"]

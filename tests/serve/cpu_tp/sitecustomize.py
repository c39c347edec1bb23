"""Test-only: lets SGLang 0.5.23's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) start with ``--tp-size 2``.

SGLang builds a PyNccl communicator for every parallel group unless its platform says otherwise
(``parallel_state.init_model_parallel_group``: ``use_pynccl = not (npu or xpu or mooncake)``), and PyNccl
needs a CUDA device, so a CPU TP group fails at start-up ("Expected a cuda device, but got: cpu"). On a CPU
engine this module turns PyNccl off for those groups; their collectives then go through the groups' gloo
device group (``GroupCoordinator.all_reduce`` of a CPU tensor), which is what SGLang's CPU path uses without
its native shared-memory all-reduce. Put on ``PYTHONPATH`` of the serving processes only by
``tests/serve/test_engine_tp.py``; it patches nothing when the CPU engine is off.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "sglang.srt.distributed.parallel_state"


class _NoPyncclOnCpu(importlib.abc.MetaPathFinder):
    """Wraps ``init_model_parallel_group`` with ``use_pynccl=False`` once its module is executed."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 (the finder protocol)
        if name != _TARGET or os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001, ANN202
            run(module)
            build = module.init_model_parallel_group

            def init_model_parallel_group(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                kwargs["use_pynccl"] = False
                return build(*args, **kwargs)

            module.init_model_parallel_group = init_model_parallel_group

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _NoPyncclOnCpu())

"""Experiment-only measurements: no GPU table runs them and no committed table depends on them.

Each answered one question of a kernel or cache change and is kept so that its report can be reproduced:

- ``v11_bench``: the warp-specialized v11 decode kernel (``oscar.kernels.decode_v11``) against v10 and cuDNN BF16,
  accuracy, times and achieved bandwidth per key format (reports/kernels/v11/);
- ``sass_stats``: registers, spills, shared memory and main-loop SASS instructions of the decode and demotion kernels,
  compiled for Hopper without a GPU (docs/KERNELS.md, reports/kernels/v11/);
- ``cpu_cache_step``: the CPU decode step of one cache layer at the continuous-batching HumanEval cells' shapes,
  before and after a cache change (reports/throughput/cpu_cache_step.{md,csv}).

Run each with ``python -m oscar.bench.experimental.<name>``; the module docstrings give the options.
"""

"""The kernel table (``python -m oscar gpu kernels``): paged decode attention against BF16 SDPA, one process.

``spec`` (the table's options, requirements and steps, light), ``options`` (the variants and the option checks),
``timing`` (the timers, workloads and the run: ``time_calls`` replays a CUDA graph over input sets larger than L2)
and ``report`` (``decode_attention.{csv,md,png}`` and the MLflow mirror).
"""

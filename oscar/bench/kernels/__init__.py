"""The kernel table (``python -m oscar gpu kernels``): paged decode attention against BF16 SDPA, one process.

``spec``: the table's options, its timers (``time_calls``: CUDA-graph replays over input sets larger than L2),
workloads and report (``decode_attention.{csv,md,png}``).
"""

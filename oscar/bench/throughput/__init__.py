"""The throughput table (``python -m oscar gpu throughput``): end-to-end decode steps of random-weight models.

``spec`` (the table's options, requirements and steps, light), ``options`` (the run's flags and the checks of the
table's keys), ``run`` (settings, the timed points, the largest batch that fits, the GPU check and the CSV files),
``decode`` (random-weight models of real architectures, device caches, CUDA-graph timing and the step's split) and
``report`` (``throughput.{md,png}`` and the MLflow mirror).
"""

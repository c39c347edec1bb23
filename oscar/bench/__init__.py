"""Measuring: one subpackage per GPU table behind ``python -m oscar gpu <table>``.

``kernels``, ``serving``, ``prefix``, ``correctness``, ``accuracy``, ``throughput``: each holds its light ``spec``
(the options, requirements and steps ``tables`` runs), its measuring code and its report. Shared by all:
``tables`` (the table runner), ``host`` (what a table needs on this host, the hardware record) and ``mirror`` (the
MLflow mirror). ``experimental``: experiment-only measurements behind no table.
"""

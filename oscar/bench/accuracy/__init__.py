"""The accuracy table on a GPU (``python -m oscar gpu accuracy table=niah|humaneval``): the shared-prefill eval cells
of ``experiment=coder`` on CUDA with the embedded engine, or served through SGLang (``engine=sglang``).

``spec`` (the table's options, requirements and steps, light), ``cells`` (the eval cells of each table and the
served commands) and ``report`` (``<table>.{md,csv,png}``, ``<table>_served.{md,csv}``).
"""

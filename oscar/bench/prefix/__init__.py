"""The prefix table (``python -m oscar gpu prefix``): the prefix-hit sweep (paper Fig. 6) through SGLang's Engine.

``spec`` (the table's options, requirements and steps, light), ``sweep`` (one engine process: the sweep, the hit
check and the profiled hits), ``profile`` (where a hit's time goes: the traces' summary) and ``report``
(``prefix_sweep.{csv,md,png}``).
"""

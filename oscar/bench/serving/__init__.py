"""The serving table (``python -m oscar gpu serving``): SGLang's one-batch decode step, OSCAR against SGLang's BF16.

``spec`` (the table's options, requirements and steps, light), ``one_batch`` (one backend process: SGLang's
``load_model`` and decode step with the plugin loaded), ``synthetic`` (decode timing on a synthetic state and the
step profile), ``timing_artifact`` (seeded random rotations for dummy weights; the prefix table uses it too) and
``report`` (``decode.{csv,md,png}``, ``profile.{csv,md}``).
"""

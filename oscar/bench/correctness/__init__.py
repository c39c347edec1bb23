"""The correctness table (``python -m oscar gpu correctness``): the SGLang plugin on a GPU against its references.

``spec`` (the table's options, requirements and steps, light, and the summary CSV), ``pool_check`` (the pool's
CUDA decode path against the torch twin), ``real_weights`` (SmolLM2-135M served against SGLang's BF16 and the
embedded engine; its report ``gpu_correctness.{json,md}``) and ``compare`` (the tolerances and the teacher-forced
check, shared with the serving tests).
"""

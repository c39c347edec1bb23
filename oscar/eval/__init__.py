"""Benchmarks, graders, sandboxed code execution, fidelity diagnostics, lm-eval model."""

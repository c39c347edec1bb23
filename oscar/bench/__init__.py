"""Measuring: throughput profiles, kernel benchmarks, SGLang timing and the GPU tables."""

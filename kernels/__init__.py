"""Triton kernels, imported as `oscar.kernels` (this folder is mapped into the library).

Each kernel has a torch twin in the library with the same signature; the twin is the
specification. Kernels import torch and triton only.
"""

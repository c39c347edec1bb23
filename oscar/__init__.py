"""OSCAR: offline spectral covariance-aware rotations for 2-bit KV-cache quantization."""

__version__ = "0.1.0"

"""OSCAR: offline spectral covariance-aware rotations for 2-bit KV-cache quantization."""

import os

# One MKL code path on every x86 vendor. MKL picks its LAPACK/BLAS kernels by processor (Intel's AVX-512 branch
# on a Xeon, another on an AMD EPYC), and the two round differently: enough to move an INT2 code across a rounding
# boundary and change a calibrated rotation's last bits. MKL reads MKL_CBWR at its first call, so this must run
# before torch does any linear algebra (importing `oscar` first is enough; `.ci/run`, the Makefile and the tests'
# conftest set it too). AVX2 is the newest branch both vendors of our machines share. A user's own setting wins.
os.environ.setdefault("MKL_CBWR", "AVX2")

__version__ = "0.1.0"

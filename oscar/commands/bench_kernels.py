"""`python -m oscar bench-kernels [output=CSV] [key=value ...]`: time the GPU kernels against BF16 SDPA.

Keys and defaults: `oscar.bench.kernel_bench.DEFAULTS` (head_dims, batches, contexts, layout=mma|rows, parts, ...);
what is timed and written: `oscar.bench.kernel_bench`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from oscar.bench.kernel_bench import DEFAULTS, run


def _parse(argv: list[str]) -> dict[str, Any]:
    opts = dict(DEFAULTS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in DEFAULTS:
            raise ValueError(f"bench-kernels: unknown argument {arg!r}; valid keys: {', '.join(DEFAULTS)}")
        opts[key] = type(DEFAULTS[key])(value) if not isinstance(DEFAULTS[key], str) else value
    return opts


def main(argv: list[str]) -> int:
    """Entry point of the `bench-kernels` verb."""
    try:
        opts = _parse(argv)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    t0 = time.time()
    rc = run(opts)
    print(f"bench-kernels: {time.time() - t0:.0f} s", file=sys.stderr)
    return rc

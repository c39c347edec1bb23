"""Run the paged INT2 decode attention a few times on one shape, for Nsight Compute (`ncu`) to profile.

Usage (GPU machine, checkout importable as `oscar` with `oscar.kernels`):
    ncu --clock-control none -k regex:_planes_kernel -c 1 --section SpeedOfLight \
        python3 benchmarks/profile_decode.py batch=8 context=32768 head_dim=128

Kernel options left out take the kernel's defaults (``planes=0`` selects the v7 word path, whose split
kernel is ``_partial_kernel``; ``layout=mma`` the CUDA kernel ``oscar_decode_mma`` of ``oscar.kernels.decode_mma``,
the random codes being valid in either layout).
"""

from __future__ import annotations

import sys

import torch

from oscar.bench.kernel_bench import DEFAULTS, _int2_inputs
from oscar.kernels.decode_attention import paged_decode_attention


def main(argv: list[str]) -> int:
    """Parse `key=value` (batch, context, head_dim; kernel options block_n, num_warps, num_stages, fast_unpack,
    planes, num_splits), run 3 calls."""
    args = {"batch": 8, "context": 32768, "head_dim": 128}
    options = ("block_n", "num_warps", "num_stages", "fast_unpack", "planes", "num_splits", "layout", "mma_warps",
               "mma_stages", "mma_min_blocks", "rope", "rope_blocks")
    kernel: dict = {}
    for a in argv:
        k, _, v = a.partition("=")
        if k not in args and k not in options:
            raise SystemExit(f"unknown argument {a!r}; valid keys: {', '.join([*args, *options])}")
        if k in args:
            args[k] = int(v)
        else:
            kernel[k] = bool(int(v)) if k in ("fast_unpack", "planes") else v if k == "layout" else int(v)
    opts = dict(DEFAULTS)
    kp, vp, tables, int_len, kt, vt, segs, qs, _ = _int2_inputs(args["batch"], args["context"], 32, 8,
                                                                args["head_dim"], opts, 1)
    if kernel.pop("rope", 0):  # rope-centered keys (the mma layout's kernel)
        d = args["head_dim"]
        kernel.update(rope_mu=0.5 * torch.randn(8, d, device="cuda"), rope_pos0=opts["sink"],
                      rope_freq=1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    for _ in range(3):
        paged_decode_attention(qs[0], kp.codes, kp.scale, kp.zero, vp.codes, vp.scale, vp.zero, tables[0], int_len,
                               bits=kp.bits, group_size=kp.group_size, R_K=kt.R, mu_K=kt.mu, R_V=vt.R, mu_V=vt.mu,
                               **kernel, **segs[0])
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

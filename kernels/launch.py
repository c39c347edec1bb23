"""Launch settings of each kernel family, one frozen value per family (torch and triton not needed).

A field left at ``None`` takes the measured default of its launcher (``decode_rows.default_config``,
``decode_mma.default_num_splits``, ``quantize.ROW_PATH_MAX_ROWS``); every value is checked here, and the
launcher checks what depends on the shapes (shared memory, page sizes). docs/KERNELS.md has the measurements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(cls: str, name: str, value: object, ok: bool, valid: str) -> None:
    if not ok:
        raise ValueError(f"{cls}({name}={value!r}) is not valid; {name} must be {valid}")


def _pow2(x: object) -> bool:
    return _is_int(x) and x > 0 and (x & (x - 1)) == 0


def _optional_bool(cls: str, name: str, value: object) -> None:
    _check(cls, name, value, value is None or isinstance(value, bool), "None (the default) or a bool")


@dataclass(frozen=True)
class RowsLaunch:
    """Launch of the Triton decode kernel over row-layout pages (``oscar.kernels.decode_rows``).

    ``num_splits``: split-K programs per (sequence, KV head); ``block_n``: rows per block (a power of two >= 16);
    ``span_pages``: a block may cover several pages (else it stays within one); ``fuse_bf16``: the BF16 chunks run
    as extra programs of the split-K launch; ``planes``: the bit-plane path (default where one group spans a row
    of >= 32 bytes; ``False`` forces the word path); ``warps``, ``stages``: of the split-K kernel; ``maxnreg``: its
    register cap (GPU). ``None`` fields follow ``default_config``.
    """

    num_splits: Optional[int] = None
    block_n: Optional[int] = None
    span_pages: Optional[bool] = None
    fuse_bf16: Optional[bool] = None
    planes: Optional[bool] = None
    warps: int = 4
    stages: int = 2
    maxnreg: Optional[int] = None

    def __post_init__(self) -> None:
        c = type(self).__name__
        _check(c, "num_splits", self.num_splits, self.num_splits is None or (_is_int(self.num_splits)
                                                                           and 1 <= self.num_splits <= 4096),
               "None or an int in [1, 4096]")
        _check(c, "block_n", self.block_n, self.block_n is None or (_pow2(self.block_n) and 16 <= self.block_n <= 256),
               "None or a power of two in [16, 256]")
        for name in ("span_pages", "fuse_bf16", "planes"):
            _optional_bool(c, name, getattr(self, name))
        _check(c, "warps", self.warps, self.warps in (1, 2, 4, 8, 16) and _is_int(self.warps), "one of 1, 2, 4, 8, 16")
        _check(c, "stages", self.stages, _is_int(self.stages) and 1 <= self.stages <= 8, "an int in [1, 8]")
        _check(c, "maxnreg", self.maxnreg,
               self.maxnreg is None or (_is_int(self.maxnreg) and 24 <= self.maxnreg <= 255),
               "None or a register count in [24, 255]")


ROPE_BLOCKS = (4, 8, 16, 32)  # blocks of a warp per turn of the rope term's fragments (decode_mma.cu's RT)


@dataclass(frozen=True)
class MmaLaunch:
    """Launch of the CUDA decode kernel over fragment-order pages (``oscar.kernels.decode_mma``).

    ``num_splits``: split-K CTAs per (sequence, KV head) (default ``default_num_splits``; at most 254);
    ``warps``: per CTA (2, 4, 8; at least d/32); ``stages``: of each warp's cp.async ring (2-6; default 4 or the
    most that fit ``shared_limit``); ``min_blocks``: CTAs per SM the register allocation must allow (1-8);
    ``carveout``: percent of the SM's memory asked for as shared memory (None: the driver's choice);
    ``rope_blocks``: a warp's blocks per turn of the rope term (rope-centered keys; one of ``ROPE_BLOCKS``).
    """

    num_splits: Optional[int] = None
    warps: int = 8
    stages: Optional[int] = None
    min_blocks: int = 2
    carveout: Optional[int] = None
    rope_blocks: int = 8

    def __post_init__(self) -> None:
        c = type(self).__name__
        _check(c, "num_splits", self.num_splits, self.num_splits is None or (_is_int(self.num_splits)
                                                                           and 1 <= self.num_splits <= 254),
               "None or an int in [1, 254]")
        _check(c, "warps", self.warps, _is_int(self.warps) and self.warps in (2, 4, 8), "one of 2, 4, 8")
        _check(c, "stages", self.stages, self.stages is None or (_is_int(self.stages) and 2 <= self.stages <= 6),
               "None or an int in [2, 6]")
        _check(c, "min_blocks", self.min_blocks, _is_int(self.min_blocks) and 1 <= self.min_blocks <= 8,
               "an int in [1, 8]")
        _check(c, "carveout", self.carveout, self.carveout is None or (_is_int(self.carveout)
                                                                     and 0 <= self.carveout <= 100),
               "None or a percentage in [0, 100]")
        _check(c, "rope_blocks", self.rope_blocks, _is_int(self.rope_blocks) and self.rope_blocks in ROPE_BLOCKS,
               f"one of {ROPE_BLOCKS}")


@dataclass(frozen=True)
class QuantizeLaunch:
    """Launch of the Triton rotate-clip-quantize-pack kernel (``oscar.kernels.quantize``).

    ``block_t``: rows per program on the block path (a power of two); ``warps``: of the block path (the row path
    runs on one warp, measured fastest); ``row_path``: one program per row and head (default: launches of at most
    ``ROW_PATH_MAX_ROWS`` rows, a demotion step).
    """

    block_t: int = 16
    warps: int = 8
    row_path: Optional[bool] = None

    def __post_init__(self) -> None:
        c = type(self).__name__
        _check(c, "block_t", self.block_t, _pow2(self.block_t) and self.block_t <= 128, "a power of two in [1, 128]")
        _check(c, "warps", self.warps, _is_int(self.warps) and self.warps in (1, 2, 4, 8, 16), "one of 1, 2, 4, 8, 16")
        _optional_bool(c, "row_path", self.row_path)


__all__ = ["MmaLaunch", "QuantizeLaunch", "ROPE_BLOCKS", "RowsLaunch"]

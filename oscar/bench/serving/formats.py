"""The served formats a timing artifact records (``oscar.bench.serving.timing_artifact``) and the page size each is
served at. Light (no torch): the serving table checks ``formats=`` and builds its command lines with them.
"""

from __future__ import annotations

FORMATS = ("token", "channel", "mixed", "rope")
CHANNEL_BLOCK = 32  # auto's default method.channel_block


def format_page_size(fmt: str, page_size: int) -> int:
    """The page size a format is served at: per-channel blocks live in one page (a multiple of the block)."""
    if fmt in ("channel", "mixed"):
        return max(page_size, CHANNEL_BLOCK) // CHANNEL_BLOCK * CHANNEL_BLOCK
    return page_size

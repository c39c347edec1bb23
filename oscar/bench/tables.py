"""The GPU tables behind ``python -m oscar gpu <table>``: one subpackage per table, one way to run each.

``TABLES`` names each table's spec module (``oscar.bench.<table>.spec``: light, so that ``gpu --help`` lists every
table without torch or omegaconf); the table's measuring and report code live beside it. A spec module defines
``AREA`` (its folder under ``reports/``), ``SUMMARY``, ``DEFAULTS`` (its ``key=value`` options; a value's type is its
default's), ``stem(opts)`` (the name of its files), ``needs(opts)`` (the ``oscar.bench.host.Need`` list checked
before any work), ``measure(opts, out, env)`` (the GPU work: raw rows and ``<stem>_env.json`` under ``out``),
``report(out, opts)`` (table .md/.csv/.png from the raw rows; runs anywhere) and ``track(out, opts, uri)`` (the
MLflow mirror). ``run`` strings them together.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path
from typing import Any

from oscar.bench import host
from oscar.core.files import atomic_write_json

# table -> its spec module
TABLES: dict[str, str] = {
    "kernels": "oscar.bench.kernels.spec",
    "serving": "oscar.bench.serving.spec",
    "prefix": "oscar.bench.prefix.spec",
    "correctness": "oscar.bench.correctness.spec",
    "accuracy": "oscar.bench.accuracy.spec",
    "throughput": "oscar.bench.throughput.spec",
    "soak": "oscar.bench.soak.spec",
}
# keys every table takes
COMMON: dict[str, Any] = {
    "out": "",  # folder of the table's files (default reports/<area>)
    "report_only": False,  # rebuild .md/.csv/.png (and MLflow) from the raw rows already under out
    "tracking": True,  # mirror into MLflow when mlflow is importable
    "mlflow_uri": "sqlite:///mlflow.db",
    "compare": "",  # a committed table (CSV) to set the new numbers against
}
TRUE, FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


class UsageError(ValueError):
    """A bad table name or key=value (exit status 2)."""


def module(table: str) -> Any:
    if table not in TABLES:
        raise UsageError(f"unknown table {table!r}; valid tables: {', '.join(TABLES)}")
    return importlib.import_module(TABLES[table])


def defaults(table: str) -> dict[str, Any]:
    return {**COMMON, **module(table).DEFAULTS}


def _convert(key: str, value: str, default: Any) -> Any:
    if isinstance(default, bool):
        low = value.lower()
        if low not in TRUE | FALSE:
            raise UsageError(f"{key}={value!r}: expected true or false")
        return low in TRUE
    if isinstance(default, int):
        try:
            return int(value)
        except ValueError:
            raise UsageError(f"{key}={value!r}: expected an integer") from None
    if isinstance(default, float):
        try:
            return float(value)
        except ValueError:
            raise UsageError(f"{key}={value!r}: expected a number") from None
    return value


def parse(table: str, argv: list[str]) -> dict[str, Any]:
    """``key=value`` arguments over the table's defaults; unknown keys and bad values raise ``UsageError``."""
    opts = defaults(table)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in opts:
            raise UsageError(f"gpu {table}: unknown argument {arg!r}; valid keys: {', '.join(opts)}")
        opts[key] = _convert(key, value, opts[key])
    return opts


def out_dir(table: str, opts: dict[str, Any]) -> Path:
    return Path(opts["out"] or Path("reports") / module(table).AREA)


def run(table: str, argv: list[str], command: str) -> int:
    """Check the requirements, measure, write the report and mirror it; returns a process exit code."""
    mod = module(table)
    opts = parse(table, argv)
    out = out_dir(table, opts)
    stem = mod.stem(opts)
    if not opts["report_only"]:
        try:
            needs = host.require(mod.needs(opts), table)
        except ValueError as exc:  # a bad option the table found while listing its needs
            raise UsageError(f"gpu {table}: {exc}") from None
        for n in needs:
            print(f"  ok  {n.name}: {n.found}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        sglang = next((n.found.split()[0] for n in needs if n.name == "sglang"), None)
        env = host.hardware(command, sglang=sglang)
        env["options"] = {k: v for k, v in opts.items() if k not in COMMON}
        t0 = time.time()
        mod.measure(opts, out, env)
        env["wall_s"] = round(time.time() - t0, 1)
        atomic_write_json(out / f"{stem}_env.json", env)
        print(f"gpu {table}: measured in {env['wall_s']:.0f} s", flush=True)
    try:
        paths = mod.report(out, opts)
    except FileNotFoundError as exc:
        print(f"oscar gpu {table}: {exc}", file=sys.stderr)
        return 1
    print("wrote " + ", ".join(str(p) for p in paths))
    if opts["tracking"]:
        try:
            parent = mod.track(out, opts, str(opts["mlflow_uri"]))
            print(f"MLflow: experiment oscar/gpu/{table}, parent run {parent}")
        except ImportError:
            print(f"MLflow is not installed here: tracking skipped (where it is: python -m oscar gpu {table} "
                  f"report_only=true out={out})", file=sys.stderr)
    return 0

"""`python -m oscar gpu <table> [key=value ...]`: one command per GPU table (benchmarks/README.md lists them).

Each table checks what it needs first (CUDA device, SGLang and its version, the model, free GPU memory) and
names what is missing, then measures, writes `reports/<area>/` (table .md, .csv, .png with the command and the
hardware) and mirrors the runs into MLflow (`oscar/gpu/<table>`). `report_only=true` rebuilds the report and
the MLflow runs from the raw rows already under `out=` (no GPU needed). The measuring code: `oscar.bench.<table>`.
"""

from __future__ import annotations

import argparse
import sys

from oscar.bench import tables
from oscar.bench.host import MissingRequirement


def _epilog() -> str:
    lines = ["tables, their keys and defaults (key=value; every table also takes "
             + " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in tables.COMMON.items()) + "):"]
    for name in tables.TABLES:
        mod = tables.module(name)
        lines.append(f"  {name} -> reports/{mod.AREA}/: {mod.SUMMARY}")
        keys = " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in mod.DEFAULTS.items())
        lines.append(f"      {keys}")
    lines += ["", "examples:", "  python -m oscar gpu kernels", "  python -m oscar gpu serving real=1x100000 "
              "synthetic=1x100000 profile= backends=oscar,flashinfer out=reports/serving/check",
              "  python -m oscar gpu serving report_only=true out=reports/serving",
              "", "exit codes: 0 success, 1 a requirement is missing or the work failed, 2 invalid usage"]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oscar gpu", description=__doc__.splitlines()[0].split(": ", 1)[1],
                                epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", choices=list(tables.TABLES), help="the table to measure")
    p.add_argument("options", nargs="*", metavar="key=value", help="the table's keys (below)")
    return p


def main(argv: list[str]) -> int:
    """Entry point of the `gpu` verb."""
    if argv and argv[0] not in tables.TABLES and not argv[0].startswith("-"):
        print(f"oscar gpu: unknown table {argv[0]!r}; valid tables: {', '.join(tables.TABLES)}", file=sys.stderr)
        return 2
    args = parser().parse_args(argv)
    command = "python -m oscar gpu " + " ".join(argv)
    try:
        return tables.run(args.table, args.options, command)
    except tables.UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    except MissingRequirement as exc:
        print(exc, file=sys.stderr)
        return 1

"""`python -m oscar aggregate --plan results/plan/<exp>/<table>.json --output results/tables/<exp>/<table>.csv`

Reads every cell's `result.json` named by a table plan into one long CSV (one row per cell and
metric). A missing or malformed result names the cell.
"""

from __future__ import annotations

import argparse
import sys

from oscar.eval.reporting import ReportError, TablePlan, aggregate, write_csv


def main(argv: list[str]) -> int:
    """Aggregate one table's cells; returns a process exit code."""
    parser = argparse.ArgumentParser(prog="python -m oscar aggregate", description=__doc__.splitlines()[0],
                                     epilog="example: python -m oscar aggregate --plan results/plan/default/table2.json --output /tmp/table2.csv")
    parser.add_argument("--plan", required=True, help="table plan JSON written by the workflow")
    parser.add_argument("--output", required=True, help="long CSV to write")
    parser.add_argument("--root", default=".", help="directory the plan's paths are relative to")
    args = parser.parse_args(argv)
    try:
        plan = TablePlan.load(args.plan)
        frame = aggregate(plan, root=args.root)
    except ReportError as exc:
        print(f"oscar aggregate: {exc}", file=sys.stderr)
        return 1
    write_csv(frame, args.output)
    print(f"oscar aggregate: {len(plan.cells)} cells, {len(frame)} metric rows -> {args.output}")
    return 0

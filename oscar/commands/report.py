"""`python -m oscar report --plan P --table T --output-dir reports/<exp> [--formats csv md tex png] [--track]`

Renders one aggregated table as CSV, Markdown, LaTeX and its figure (PNG), and with `--track`
mirrors the table's cells into MLflow (one experiment per table, a parent run linking one run
per cell). The tracking URI comes from the composed configuration (`tracking.uri`), or `--uri`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from oscar.config import CONF_DIR, compose
from oscar.core.files import atomic_write_text
from oscar.eval.reporting import (
    ReportError,
    TablePlan,
    render_csv,
    render_figure,
    render_latex,
    render_markdown,
    summarize,
)
from oscar.eval.tracking import mirror_table, write_receipt

FORMATS = ("csv", "md", "tex", "png")


def main(argv: list[str]) -> int:
    """Render and/or track one table; returns a process exit code."""
    parser = argparse.ArgumentParser(prog="python -m oscar report", description=__doc__.splitlines()[0],
                                     epilog="example: python -m oscar report --plan results/plan/default/table2.json --table results/tables/default/table2.csv --output-dir /tmp/reports")
    parser.add_argument("--plan", required=True, help="table plan JSON written by the workflow")
    parser.add_argument("--table", help="long CSV from `oscar aggregate` (needed to render)")
    parser.add_argument("--output-dir", help="folder for <table>.csv/.md/.tex/.png")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--root", default=".", help="directory the plan's paths are relative to")
    parser.add_argument("--track", action="store_true", help="mirror the table's cells into MLflow")
    parser.add_argument("--track-output", help="JSON receipt of the MLflow run ids (with --track)")
    parser.add_argument("--uri", help="MLflow tracking URI (default: tracking.uri of the configuration)")
    parser.add_argument("--experiment-prefix", help="MLflow experiment names <prefix>/<table> (default oscar/<experiment>)")
    args = parser.parse_args(argv)
    try:
        plan = TablePlan.load(args.plan)
        if args.table:
            if not args.output_dir:
                parser.error("--table needs --output-dir")
            _render(plan, args)
        if args.track:
            _track(plan, args)
    except ReportError as exc:
        print(f"oscar report: {exc}", file=sys.stderr)
        return 1
    if not args.table and not args.track:
        parser.error("nothing to do: give --table (render) and/or --track")
    return 0


def _render(plan: TablePlan, args: argparse.Namespace) -> None:
    long = pd.read_csv(args.table, keep_default_na=False, na_values={"value": [""], "n": [""], "wall_s": [""]})
    summary = summarize(plan, long)
    out = Path(args.output_dir)
    renderers = {"csv": render_csv, "md": render_markdown, "tex": render_latex}
    for fmt in args.formats:
        path = out / f"{plan.table}.{fmt}"
        if fmt == "png":
            render_figure(plan, summary, path, root=args.root)
        else:
            atomic_write_text(path, renderers[fmt](plan, summary))
        print(f"oscar report: {path}")


def _track(plan: TablePlan, args: argparse.Namespace) -> None:
    uri = args.uri
    if uri is None:
        uri = str(compose([f"experiment={plan.experiment}"] if _is_experiment(plan.experiment) else []).tracking.uri)
    reports = sorted(str(p) for p in Path(args.root, "reports", plan.experiment).glob(f"{plan.table}.*"))
    receipt = mirror_table(plan, uri, root=args.root, report_files=reports, prefix=args.experiment_prefix)
    if args.track_output:
        write_receipt(receipt, args.track_output)
    print(f"oscar report: {len(receipt['children'])} runs under {receipt['experiment']} ({uri})")


def _is_experiment(name: str) -> bool:
    return (CONF_DIR / "experiment" / f"{name}.yaml").is_file()

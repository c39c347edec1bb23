"""Tables and figures from cell results: aggregation into a long table, then CSV, Markdown, LaTeX, PNG.

A *table plan* (written by the workflow, `results/plan/<experiment>/<table>.json`) lists the cells
of one table and how to show them (`rows`, `columns`, `metrics`). `aggregate` reads each cell's
`result.json` into one long CSV (one row per cell and metric); `summarize` averages seeds and
`render_*` lay the summary out. Output files are written atomically.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

# Aliases tried, in order, when a table asks for a metric a result does not name exactly.
METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    "acc": ("acc", "accuracy", "pass@1", "pass_at_1", "exact_match", "em", "score"),
    "kl": ("kl", "kl.next_token", "kl_next_token", "kl.token", "next_token_kl"),
    "ppl": ("ppl", "perplexity"),
}
# result.json metric -> column of per_layer.csv (`oscar fidelity`).
PER_LAYER_COLUMNS = {"mse.qk": "qk_mse", "mse.sv": "sv_mse", "mse.k": "k_mse", "mse.v": "v_mse", "kl.attn": "attn_kl"}
CELL_KEYS = ("model", "method", "variant", "method_label", "benchmark", "corpus", "seed")
LONG_COLUMNS = [*CELL_KEYS, "metric", "value", "n", "stand_in_for", "wall_s", "result"]


class ReportError(ValueError):
    """A table plan or a result file that cannot be reported, named in the message."""


@dataclass
class TablePlan:
    """A table plan as written by the workflow."""

    experiment: str
    table: str
    kind: str
    spec: dict[str, Any]
    cells: list[dict[str, Any]]

    @classmethod
    def load(cls, path: str | Path) -> "TablePlan":
        """Read `results/plan/<experiment>/<table>.json`."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            return cls(data["experiment"], data["table"], data["kind"], data["spec"], data["cells"])
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ReportError(f"cannot read table plan {path}: {exc}") from exc


# ----- atomic files ------------------------------------------------------------------------------


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write text through a temp file in the same folder and `os.replace`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_result(result_dir: str | Path) -> dict[str, Any]:
    """A cell's `result.json`, checked for a `metrics` mapping."""
    path = Path(result_dir) / "result.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"cannot read cell result {path}: {exc}") from exc
    if not isinstance(data.get("metrics"), dict):
        raise ReportError(f"{path} has no 'metrics' mapping (keys: {sorted(data)})")
    return data


def numeric_metrics(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Flatten nested metric mappings to dotted names and keep finite numbers (bools excluded)."""
    flat: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(numeric_metrics(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            flat[name] = float(value)
    return flat


def pick_metric(available: Iterable[str], wanted: str) -> str | None:
    """The result metric a table's `wanted` name refers to: exact, then aliases, then `wanted.` prefix."""
    names = list(available)
    for candidate in (wanted, *METRIC_ALIASES.get(wanted, ())):
        if candidate in names:
            return candidate
    for candidate in (wanted, *METRIC_ALIASES.get(wanted, ())):
        prefixed = sorted(n for n in names if n.startswith(candidate + ".") or n.startswith(candidate + "_"))
        if prefixed:
            return prefixed[0]
    return None


# ----- aggregation -------------------------------------------------------------------------------


def aggregate(plan: TablePlan, root: str | Path = ".") -> pd.DataFrame:
    """Long table of a plan's cells: one row per (cell, metric) with every numeric metric."""
    rows: list[dict[str, Any]] = []
    for cell in plan.cells:
        result_dir = Path(root) / cell["result_dir"]
        result = read_result(result_dir)
        base = {key: cell.get(key) for key in CELL_KEYS}
        base["variant"] = base["variant"] or ""
        base.update(
            n=result.get("n"),
            stand_in_for=result.get("stand_in_for") or "",
            wall_s=result.get("wall_s"),
            result=str(Path(cell["result_dir"]) / "result.json"),
        )
        for metric, value in sorted(numeric_metrics(result["metrics"]).items()):
            rows.append({**base, "metric": metric, "value": value})
    return pd.DataFrame(rows, columns=LONG_COLUMNS)


def write_csv(frame: pd.DataFrame, path: str | Path) -> None:
    """Write a frame as CSV atomically."""
    write_text_atomic(path, frame.to_csv(index=False))


# ----- summary -----------------------------------------------------------------------------------


def summarize(plan: TablePlan, long: pd.DataFrame) -> pd.DataFrame:
    """Mean, std and count over seeds of the table's metrics, keyed by its row and column axes.

    Each wanted metric is matched per cell (exact name, alias, or prefix); a cell that has none of
    a wanted metric is an error naming the cell and the metrics it does have.
    """
    wanted = list(plan.spec.get("metrics") or ["acc"])
    keys = [k for k in (*plan.spec.get("rows", ["method"]), *plan.spec.get("columns", [])) if k != "metric"]
    picked = []
    long = long.fillna({"variant": "", "benchmark": "", "corpus": ""})
    for result, group in long.groupby("result", sort=False):
        available = set(group["metric"])
        for name in wanted:
            metric = pick_metric(available, name)
            if metric is None:
                raise ReportError(
                    f"{result}: no metric matching {name!r} for table {plan.table}; it has {sorted(available)}"
                )
            row = group[group["metric"] == metric].iloc[0].to_dict()
            values = dict(zip(group["metric"], group["value"]))
            row.update(metric=name, source_metric=metric, ci_lo=values.get(f"{metric}.ci_lo", math.nan),
                       ci_hi=values.get(f"{metric}.ci_hi", math.nan))
            picked.append(row)
    frame = pd.DataFrame(picked)
    group_keys = [*keys, "metric"]
    summary = (
        frame.groupby(group_keys, sort=False, dropna=False)
        .agg(mean=("value", "mean"), std=("value", "std"), seeds=("value", "size"), n=("n", "max"),
             stand_in_for=("stand_in_for", "first"), source_metric=("source_metric", "first"),
             ci_lo=("ci_lo", "mean"), ci_hi=("ci_hi", "mean"))
        .reset_index()
    )
    summary["std"] = summary["std"].fillna(0.0)
    return summary


def _format_value(metric: str, mean: float, std: float, seeds: int, ci: tuple[float, float] = (math.nan, math.nan)) -> str:
    """`mean`, `mean ± std` over seeds, or `mean [lo, hi]` with a one-seed confidence interval."""
    percent = metric == "acc" or metric.startswith("acc.")
    def fmt(x: float) -> str:
        return f"{x * 100:.1f}" if percent else f"{x:.4g}"
    text = fmt(mean)
    if seeds > 1:
        text += f" ± {fmt(std)}"
    elif not any(math.isnan(c) for c in ci):
        text += f" [{fmt(ci[0])}, {fmt(ci[1])}]"
    return text


def _label(values: tuple[Any, ...]) -> str:
    return " / ".join(str(v) for v in values if str(v) != "")


def pivot(plan: TablePlan, summary: pd.DataFrame) -> tuple[list[str], list[str], list[list[str]], list[list[float]]]:
    """Lay a summary out as (row labels, column labels, formatted cells, numeric means) in plan order."""
    rows = list(plan.spec.get("rows", ["method"]))
    columns = list(plan.spec.get("columns", ["benchmark"]))
    if "metric" not in rows and "metric" not in columns:
        columns = [*columns, "metric"] if len(set(summary["metric"])) > 1 else columns
    row_keys = list(dict.fromkeys(tuple(r[k] for k in rows) for _, r in summary.iterrows()))
    col_keys = list(dict.fromkeys(tuple(r[k] for k in columns) for _, r in summary.iterrows()))
    lookup = {
        (tuple(r[k] for k in rows), tuple(r[k] for k in columns)): r for _, r in summary.iterrows()
    }
    cells, means = [], []
    for rk in row_keys:
        text_row, mean_row = [], []
        for ck in col_keys:
            record = lookup.get((rk, ck))
            if record is None:
                text_row.append("–")
                mean_row.append(math.nan)
            else:
                ci = (float(record.get("ci_lo", math.nan)), float(record.get("ci_hi", math.nan)))
                text_row.append(_format_value(record["metric"], record["mean"], record["std"], int(record["seeds"]), ci))
                mean_row.append(float(record["mean"]))
        cells.append(text_row)
        means.append(mean_row)
    col_labels = [_column_label(columns, ck, summary) for ck in col_keys]
    return [_label(rk) for rk in row_keys], col_labels, cells, means


def _column_label(axes: list[str], key: tuple[Any, ...], summary: pd.DataFrame) -> str:
    label = _label(key)
    if "benchmark" in axes:
        bench = key[axes.index("benchmark")]
        stand_in = summary.loc[summary["benchmark"] == bench, "stand_in_for"]
        if len(stand_in) and str(stand_in.iloc[0]):
            label += f" (for {stand_in.iloc[0]})"
    if "metric" in axes and key[axes.index("metric")] == "acc":
        label += " %"
    return label


def _best(means: list[list[float]], lower_is_better: bool) -> set[tuple[int, int]]:
    """Positions of the best value of each column."""
    best: set[tuple[int, int]] = set()
    for j in range(len(means[0]) if means else 0):
        column = [(means[i][j], i) for i in range(len(means)) if not math.isnan(means[i][j])]
        if len(column) < 2:
            continue
        if len({value for value, _ in column}) == 1:
            continue  # a tie across the whole column marks nothing
        target = min(column)[0] if lower_is_better else max(column)[0]
        best.update((i, j) for value, i in column if value == target)
    return best


def notes(plan: TablePlan, summary: pd.DataFrame) -> list[str]:
    """Footnotes: stand-in benchmarks, seed averaging, metric sources."""
    lines = []
    stand_ins = sorted({(b, s) for b, s in zip(summary.get("benchmark", []), summary["stand_in_for"]) if s})
    for bench, target in stand_ins:
        lines.append(f"{bench} is an offline stand-in for {target}.")
    seeds = int(summary["seeds"].max()) if len(summary) else 0
    if seeds > 1:
        lines.append(f"Mean ± std over {seeds} seeds.")
    elif summary["ci_lo"].notna().any():
        lines.append("[lo, hi]: 95% bootstrap confidence interval.")
    sources = sorted({f"{m} = {s}" for m, s in zip(summary["metric"], summary["source_metric"]) if m != s})
    if sources:
        lines.append("Metrics: " + ", ".join(sources) + ".")
    direction = "lower" if plan.spec.get("lower_is_better") else "higher"
    lines.append(f"Best per column in bold ({direction} is better; ties unmarked).")
    return lines


# ----- renderers ---------------------------------------------------------------------------------


def render_markdown(plan: TablePlan, summary: pd.DataFrame) -> str:
    """GitHub Markdown table with a title and footnotes."""
    row_labels, col_labels, cells, means = pivot(plan, summary)
    best = _best(means, bool(plan.spec.get("lower_is_better")))
    head = " / ".join(plan.spec.get("rows", ["method"]))
    lines = [f"### {plan.spec.get('title') or plan.table} ({plan.experiment})", ""]
    if plan.spec.get("caption"):
        lines += [str(plan.spec["caption"]), ""]
    lines.append("| " + " | ".join([head, *col_labels]) + " |")
    lines.append("|" + "---|" * (len(col_labels) + 1))
    for i, label in enumerate(row_labels):
        shown = [f"**{c}**" if (i, j) in best else c for j, c in enumerate(cells[i])]
        lines.append("| " + " | ".join([label, *shown]) + " |")
    lines.append("")
    lines += [f"- {note}" for note in notes(plan, summary)]
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
                  "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}"}


def latex_escape(text: str) -> str:
    """Escape LaTeX special characters."""
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in str(text)).replace("±", r"$\pm$").replace("–", "--")


def render_latex(plan: TablePlan, summary: pd.DataFrame) -> str:
    """A booktabs `table` environment with caption and label."""
    row_labels, col_labels, cells, means = pivot(plan, summary)
    best = _best(means, bool(plan.spec.get("lower_is_better")))
    head = " / ".join(plan.spec.get("rows", ["method"]))
    lines = [
        r"\begin{table}[t]",
        r"\centering",
        r"\begin{tabular}{l" + "r" * len(col_labels) + "}",
        r"\toprule",
        " & ".join(latex_escape(x) for x in [head, *col_labels]) + r" \\",
        r"\midrule",
    ]
    for i, label in enumerate(row_labels):
        shown = [rf"\textbf{{{latex_escape(c)}}}" if (i, j) in best else latex_escape(c) for j, c in enumerate(cells[i])]
        lines.append(" & ".join([latex_escape(label), *shown]) + r" \\")
    title = str(plan.spec.get("title") or plan.table).rstrip(".") + "."
    caption = " ".join(x for x in [title, str(plan.spec.get("caption") or ""), *notes(plan, summary)] if x)
    lines += [
        r"\bottomrule",
        r"\end{tabular}",
        rf"\caption{{{latex_escape(caption)}}}",
        rf"\label{{tab:{plan.experiment}-{plan.table}}}",
        r"\end{table}",
    ]
    return "\n".join(lines) + "\n"


def render_csv(plan: TablePlan, summary: pd.DataFrame) -> str:
    """Tidy CSV of the summary (numeric mean, std, seeds, items per cell)."""
    columns = [c for c in (*CELL_KEYS, "metric", "source_metric", "mean", "std", "ci_lo", "ci_hi", "seeds", "n", "stand_in_for")
               if c in summary.columns]
    return summary[columns].to_csv(index=False)


# ----- figures -----------------------------------------------------------------------------------


def render_figure(plan: TablePlan, summary: pd.DataFrame, path: str | Path, root: str | Path = ".") -> None:
    """Draw the plan's figure (`bar`, `line` or `per_layer`) as a PNG, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = plan.spec.get("figure") or "bar"
    metrics = list(dict.fromkeys(summary["metric"]))
    if kind in ("per_layer", "by_position"):
        fig = _per_layer_figure(plan, plt, root, by_position=kind == "by_position")
    else:
        fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
        for ax, metric in zip(axes[0], metrics):
            part = summary[summary["metric"] == metric]
            if kind == "line":
                _line(ax, plan, part, metric)
            elif kind == "bar":
                _bars(ax, plan, part, metric)
            else:
                raise ReportError(
                    f"table {plan.table}: figure {kind!r} is not valid; valid: bar, line, per_layer, by_position"
                )
        fig.suptitle(f"{plan.spec.get('title') or plan.table} ({plan.experiment})")
        fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _series_keys(plan: TablePlan) -> tuple[list[str], list[str]]:
    rows = [k for k in plan.spec.get("rows", ["method"]) if k != "metric"]
    cols = [k for k in plan.spec.get("columns", ["benchmark"]) if k != "metric"]
    return rows, cols


def _line(ax: Any, plan: TablePlan, part: pd.DataFrame, metric: str) -> None:
    rows, cols = _series_keys(plan)
    for key, group in part.groupby(rows, sort=False):
        xs = [_label(tuple(r[c] for c in cols)) for _, r in group.iterrows()]
        ax.errorbar(xs, group["mean"], yerr=group["std"], marker="o", capsize=3, label=_label(_tuple(key)))
    ax.set_xlabel(" / ".join(cols))
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _bars(ax: Any, plan: TablePlan, part: pd.DataFrame, metric: str) -> None:
    rows, cols = _series_keys(plan)
    groups = list(dict.fromkeys(_label(tuple(r[c] for c in cols)) for _, r in part.iterrows())) or [""]
    series = list(part.groupby(rows, sort=False))
    width = 0.8 / max(len(series), 1)
    for s, (key, group) in enumerate(series):
        lookup = {_label(tuple(r[c] for c in cols)): (r["mean"], r["std"]) for _, r in group.iterrows()}
        xs = [g + s * width for g in range(len(groups))]
        ys = [lookup.get(g, (math.nan, 0))[0] for g in groups]
        es = [lookup.get(g, (0, 0))[1] for g in groups]
        ax.bar(xs, ys, width, yerr=es, capsize=2, label=_label(_tuple(key)))
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, rotation=20)
    ax.set_ylabel(metric)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)


def _tuple(key: Any) -> tuple[Any, ...]:
    return key if isinstance(key, tuple) else (key,)


def _per_layer_figure(plan: TablePlan, plt: Any, root: str | Path, by_position: bool = False) -> Any:
    """Curves from each cell's per_layer.csv, one line per cell.

    `per_layer`: one panel per wanted metric, layer on the x axis. `by_position`: attention KL
    per position bucket (`attn_kl@lo-hi` columns) averaged over layers, position on the x axis.
    """
    frames = []
    for cell in plan.cells:
        path = Path(root) / cell["result_dir"] / "per_layer.csv"
        try:
            frame = pd.read_csv(path)
        except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
            raise ReportError(f"cannot read {path}: {exc}") from exc
        if "layer" not in frame.columns:
            raise ReportError(f"{path} has no 'layer' column (columns: {list(frame.columns)})")
        frame["label"] = cell["method_label"]
        frames.append(frame)
    from matplotlib.ticker import MaxNLocator

    data = pd.concat(frames, ignore_index=True)
    title = f"{plan.spec.get('title') or plan.table} ({plan.experiment})"
    if by_position:
        buckets = [c for c in data.columns if str(c).startswith("attn_kl@")]
        if not buckets:
            raise ReportError(f"per_layer.csv of table {plan.table} has no attn_kl@<lo>-<hi> columns: {list(data.columns)}")
        fig, ax = plt.subplots(figsize=(6, 4))
        mids = [sum(int(x) for x in c.split("@", 1)[1].split("-")) / 2 for c in buckets]
        for label, group in data.groupby("label", sort=False):
            ax.plot(mids, [group[c].mean() for c in buckets], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("token position")
        ax.set_ylabel("attention KL to BF16 (mean over layers)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(title)
        fig.tight_layout()
        return fig
    wanted = list(plan.spec.get("metrics") or [])
    fig, axes = plt.subplots(1, len(wanted), figsize=(5.5 * len(wanted), 4), squeeze=False)
    for ax, name in zip(axes[0], wanted):
        candidates = [c for c in data.columns if c not in ("layer", "label")]
        column = PER_LAYER_COLUMNS.get(name) if PER_LAYER_COLUMNS.get(name) in candidates else pick_metric(candidates, name)
        if column is None:
            raise ReportError(f"per_layer.csv of table {plan.table} has no column matching {name!r}: {candidates}")
        for label, group in data.groupby("label", sort=False):
            per_layer = group.groupby("layer")[column].mean()
            ax.plot(per_layer.index, per_layer.values, marker=".", label=label)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel(column)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _save(fig: Any, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=150, metadata={"Software": None})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

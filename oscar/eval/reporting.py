"""Tables and figures from cell results: aggregation into a long table, then CSV, Markdown, LaTeX, PNG.

A *table plan* (written by the workflow, `results/plan/<experiment>/<table>.json`) lists the cells
of one table and how to show them (`rows`, `columns`, `metrics`). `aggregate` reads each cell's
`result.json` into one long CSV (one row per cell and metric); `summarize` averages seeds and
`render_*` lay the summary out. Output files are written atomically.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from oscar.core.files import atomic_write, atomic_write_text
from oscar.eval.cells import cell_config_hash
from oscar.eval.stats import bootstrap_mean_ci

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
    """Long table of a plan's cells: one row per (cell, metric) with every numeric metric.

    A cell whose recorded configuration hash differs from the one its planned configuration gives is
    refused (never aggregated). With `spec.reference` (a method), each eval cell also gets
    `agree` and `prefix` against that method's cell of the same model, benchmark, variant and seed
    (see `reference_metrics`).
    """
    rows: list[dict[str, Any]] = []
    reference = str(plan.spec.get("reference") or "")
    by_key = {_reference_key(c): c for c in plan.cells if c.get("kind", "eval") == "eval" and c.get("method") == reference}
    for cell in plan.cells:
        result_dir = Path(root) / cell["result_dir"]
        result = read_result(result_dir)
        check_config_hash(cell, result, root)
        base = {key: cell.get(key) for key in CELL_KEYS}
        base["variant"] = base["variant"] or ""
        base.update(
            n=result.get("n"),
            stand_in_for=result.get("stand_in_for") or "",
            wall_s=result.get("wall_s"),
            result=str(Path(cell["result_dir"]) / "result.json"),
        )
        metrics = numeric_metrics(result["metrics"])
        if reference and cell.get("kind", "eval") == "eval":
            ref_cell = by_key.get(_reference_key(cell))
            if ref_cell is None:
                raise ReportError(f"{cell['result_dir']}: table {plan.table} compares with {reference!r}, "
                                  "but plans no such cell for its model, benchmark, variant and seed")
            metrics.update(reference_metrics(read_records(result_dir), read_records(Path(root) / ref_cell["result_dir"])))
        for metric, value in sorted(metrics.items()):
            rows.append({**base, "metric": metric, "value": value})
    return pd.DataFrame(rows, columns=LONG_COLUMNS)


def _reference_key(cell: dict[str, Any]) -> tuple[Any, ...]:
    return (cell.get("model"), cell.get("benchmark"), cell.get("variant") or "", cell.get("seed"))


def read_records(result_dir: str | Path) -> list[dict[str, Any]]:
    """A cell's `items.jsonl` records."""
    path = Path(result_dir) / "items.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"cannot read item records {path}: {exc}") from exc


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reference_metrics(records: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, float]:
    """Fidelity of a cell's outputs to the reference method's outputs on the same items, with 95%
    bootstrap intervals over items: `agree`, the share of items whose prediction (answer letter,
    completion text) equals the reference's; `prefix`, the mean share of the reference's output
    (in characters) reproduced before the first difference (1 where both are empty). The reference
    cell compared with itself gives exactly 1."""
    ref = {str(r["id"]): str(r.get("prediction", "")) for r in reference}
    pairs = [(str(r.get("prediction", "")), ref[str(r["id"])]) for r in records if str(r["id"]) in ref]
    if not pairs:
        raise ReportError("the cell and its reference cell share no item ids")
    agree = [float(got == want) for got, want in pairs]
    prefix = [1.0 if got == want else _common_prefix(got, want) / max(1, len(want)) for got, want in pairs]
    out: dict[str, float] = {"n_reference": float(len(pairs))}
    for name, values in (("agree", agree), ("prefix", prefix)):
        out[name] = sum(values) / len(values)
        out[f"{name}.ci_lo"], out[f"{name}.ci_hi"] = bootstrap_mean_ci(values)
    return out


def check_config_hash(cell: dict[str, Any], result: dict[str, Any], root: str | Path = ".") -> None:
    """Refuse an eval cell whose `result.json` was made with other settings than the plan's (for example
    an ad-hoc `python -m oscar eval ... output=<cell folder>`): its hash must equal the hash of the
    cell's planned configuration file."""
    if cell.get("kind", "eval") != "eval" or not cell.get("config_path"):
        return
    from omegaconf import OmegaConf

    path = Path(root) / cell["config_path"]
    try:
        planned = OmegaConf.load(str(path))
        expected = cell_config_hash(planned)
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise ReportError(f"cannot read the planned configuration {path} of {cell['result_dir']}: {exc}") from exc
    got = result.get("config_hash")
    if got != expected:
        raise ReportError(
            f"{cell['result_dir']}/result.json was made with other settings (config hash {got}) than the plan "
            f"({expected}, {cell['config_path']}); not aggregated. Recompute it: "
            f"snakemake --cores all --forcerun {cell['result_dir']}/result.json reproduce_<table>"
        )


def write_csv(frame: pd.DataFrame, path: str | Path) -> None:
    """Write a frame as CSV atomically."""
    atomic_write_text(path, frame.to_csv(index=False))


# ----- summary -----------------------------------------------------------------------------------


def summarize(plan: TablePlan, long: pd.DataFrame) -> pd.DataFrame:
    """Mean, std and count over seeds of the table's metrics, keyed by its row and column axes.

    Each wanted metric is matched per cell (exact name, alias, or prefix); a cell that has none of
    a wanted metric is an error naming the cell and the metrics it does have.
    """
    default = list(plan.spec.get("metrics") or ["acc"])
    per_item = dict(plan.spec.get("item_metrics") or {})
    keys = [k for k in (*plan.spec.get("rows", ["method"]), *plan.spec.get("columns", [])) if k != "metric"]
    picked = []
    long = long.fillna({"variant": "", "benchmark": "", "corpus": ""})
    for result, group in long.groupby("result", sort=False):
        available = set(group["metric"])
        first = group.iloc[0]
        wanted = per_item.get(str(first["benchmark"] or first["corpus"]), default)
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


# Table metrics that are shares of items, shown in percent (the name before any "." or "@").
PERCENT_METRICS = ("acc", "accuracy", "pass", "agree", "prefix", "score")


def is_percent(metric: str) -> bool:
    """Whether a table metric is a share of items (shown in %)."""
    return metric.split("@")[0].split(".")[0] in PERCENT_METRICS


def _format_value(metric: str, mean: float, std: float, seeds: int, ci: tuple[float, float] = (math.nan, math.nan)) -> str:
    """`mean`, `mean ± std` over seeds, or `mean [lo, hi]` with a one-seed confidence interval."""
    percent = is_percent(metric)
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
    """Column title: the axis values joined by " / ", a stand-in benchmark marked after its name,
    " %" after a share metric."""
    parts = []
    for axis, value in zip(axes, key):
        if str(value) == "":
            continue
        text = str(value)
        if axis == "benchmark":
            stand_in = summary.loc[summary["benchmark"] == value, "stand_in_for"]
            if len(stand_in) and str(stand_in.iloc[0]):
                text += f" (for {stand_in.iloc[0]})"
        if axis == "metric" and is_percent(text):
            text += " %"
        parts.append(text)
    return " / ".join(parts)


# Metrics where lower is better whatever the table says (divergences, errors, perplexity).
LOWER_IS_BETTER = ("kl", "mse", "ppl")


def _lower_is_better(plan: TablePlan, summary: pd.DataFrame) -> list[bool]:
    """Per column of `pivot`: the table's `lower_is_better`, or True for a divergence/error metric."""
    columns = list(plan.spec.get("columns", ["benchmark"]))
    if "metric" not in plan.spec.get("rows", ["method"]) and "metric" not in columns:
        columns = [*columns, "metric"] if len(set(summary["metric"])) > 1 else columns
    table_default = bool(plan.spec.get("lower_is_better"))
    out = []
    for _, record in summary.drop_duplicates(subset=columns).iterrows():
        metric = str(record["metric"]).split(".")[0]
        out.append(table_default or metric in LOWER_IS_BETTER)
    return out


def _best(means: list[list[float]], lower_is_better: bool | list[bool]) -> set[tuple[int, int]]:
    """Positions of the best value of each column (`lower_is_better` for all columns or per column)."""
    best: set[tuple[int, int]] = set()
    for j in range(len(means[0]) if means else 0):
        lower = lower_is_better[j] if isinstance(lower_is_better, list) else lower_is_better
        column = [(means[i][j], i) for i in range(len(means)) if not math.isnan(means[i][j])]
        if len(column) < 2:
            continue
        if len({value for value, _ in column}) == 1:
            continue  # a tie across the whole column marks nothing
        target = min(column)[0] if lower else max(column)[0]
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
    kinds = {str(m).split(".")[0] for m in summary["metric"]}
    if not plan.spec.get("lower_is_better") and kinds & set(LOWER_IS_BETTER):
        direction += f", except {', '.join(sorted(kinds & set(LOWER_IS_BETTER)))}: lower"
    lines.append(f"Best per column in bold ({direction} is better; ties unmarked).")
    return lines


# ----- renderers ---------------------------------------------------------------------------------


def render_markdown(plan: TablePlan, summary: pd.DataFrame) -> str:
    """GitHub Markdown table with a title and footnotes."""
    row_labels, col_labels, cells, means = pivot(plan, summary)
    best = _best(means, _lower_is_better(plan, summary))
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
    best = _best(means, _lower_is_better(plan, summary))
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
        ncols = min(3, len(metrics))
        nrows = -(-len(metrics) // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4 * nrows), squeeze=False)
        for ax in axes.flat[len(metrics):]:
            ax.set_visible(False)
        for ax, metric in zip(axes.flat, metrics):
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
    """Grouped bars of one metric: shares in %, error bars = std over seeds or, with one seed, the 95%
    interval (said in the axis label); every bar carries its value, so a zero bar is visible."""
    rows, cols = _series_keys(plan)
    scale = 100.0 if is_percent(metric) else 1.0

    def group_label(record: Any) -> str:
        parts = []
        for c in cols:
            value = str(record[c])
            if c == "benchmark" and value and str(record.get("stand_in_for") or ""):
                value += f"\n(stand-in for {record['stand_in_for']})"
            parts.append(value)
        return _label(tuple(parts))

    groups = list(dict.fromkeys(group_label(r) for _, r in part.iterrows())) or [""]
    series = list(part.groupby(rows, sort=False))
    width = 0.8 / max(len(series), 1)
    one_seed = bool(len(part)) and int(part["seeds"].max()) == 1
    for s, (key, group) in enumerate(series):
        lookup = {}
        for _, r in group.iterrows():
            mean = float(r["mean"]) * scale
            if one_seed and not math.isnan(float(r.get("ci_lo", math.nan))):
                err = (mean - float(r["ci_lo"]) * scale, float(r["ci_hi"]) * scale - mean)
            else:
                err = (float(r["std"]) * scale, float(r["std"]) * scale)
            lookup[group_label(r)] = (mean, err)
        xs = [g + s * width for g in range(len(groups))]
        ys = [lookup.get(g, (math.nan, (0, 0)))[0] for g in groups]
        lo = [max(0.0, lookup.get(g, (0, (0, 0)))[1][0]) for g in groups]
        hi = [max(0.0, lookup.get(g, (0, (0, 0)))[1][1]) for g in groups]
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=_label(_tuple(key)))
        ax.bar_label(bars, labels=["" if math.isnan(y) else f"{y:.3g}" for y in ys], fontsize=6, padding=1)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, rotation=20, fontsize=8)
    unit = "%" if scale == 100.0 else ("nats" if metric.split(".")[0] == "kl" else "")
    spread = "95% bootstrap interval, one seed" if one_seed else "± std over seeds"
    ax.set_ylabel(f"{metric}{f' ({unit})' if unit else ''}; bars: {spread}", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)


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
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=150, metadata={"Software": None}))

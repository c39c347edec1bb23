"""The kernel table's report: ``<stem>.csv`` (one row per shape), ``<stem>.md`` and ``<stem>.png`` from the raw rows
and the env record of the run, and the MLflow mirror (experiment ``oscar/gpu/kernels``). Runs anywhere (no torch).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from oscar.bench import host, mirror
from oscar.bench.kernels.options import LABELS, VARIANTS
from oscar.core.files import atomic_write, atomic_write_csv, atomic_write_text


def _read_csv(path: Path) -> list[dict[str, Any]]:
    def conv(k: str, v: str) -> Any:
        if v == "":
            return None
        if k in ("head_dim", "batch", "context", "rows", "sets", "bytes"):
            return int(float(v))
        try:
            return float(v)
        except ValueError:
            return v
    with open(path, newline="") as fh:
        return [{k: conv(k, v) for k, v in r.items()} for r in csv.DictReader(fh)]


def wide_rows(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per shape: the BF16 baselines and each variant's time, speed-up and bandwidth fraction."""
    shapes: dict[tuple, dict[str, Any]] = {}
    for r in raw:
        key = (r["head_dim"], r["batch"], r["context"])
        row = shapes.setdefault(key, {"head_dim": key[0], "batch": key[1], "context": key[2], "cudnn_us": r["cudnn_us"],
                                      "flash_us": r["flash_us"], "bf16_best_us": r["bf16_best_us"],
                                      "copy_tb_s": r["copy_tb_s"]})
        if r["status"] != "ok":
            row[f"{r['variant']}_status"] = r["status"]
            continue
        row[f"{r['variant']}_us"] = r["us"]
        row[f"{r['variant']}_speedup"] = r["speedup"]
        row[f"{r['variant']}_bw_frac"] = r["bw_frac"]
    out = list(shapes.values())
    for row in out:
        if row.get("int2_us") and row.get("int2_rope_us"):
            row["rope_over_plain"] = row["int2_rope_us"] / row["int2_us"]
    return sorted(out, key=lambda r: (-r["head_dim"], r["context"], r["batch"]))


def _f(x: Any, nd: int = 1, suffix: str = "") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}{suffix}"


def markdown_table(rows: list[dict[str, Any]], names: list[str]) -> list[str]:
    """The table: BF16 baselines, each variant's microseconds, speed-ups over the best BF16, INT2's bandwidth."""
    rope = "int2" in names and "int2_rope" in names
    head = ["d", "batch", "context", "cuDNN", "flash", *[LABELS.get(n, n) for n in names]]
    head += ["rope / plain"] if rope else []
    head += [f"{LABELS.get(n, n)} x best BF16" for n in names if not n.endswith("_rows")]
    head += [f"{LABELS.get(names[0], names[0])} of copy bw"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["head_dim"]), str(r["batch"]), str(r["context"]), _f(r["cudnn_us"]), _f(r["flash_us"])]
        cells += [_f(r.get(f"{n}_us")) or str(r.get(f"{n}_status", ""))[:30] for n in names]
        cells += [_f(r.get("rope_over_plain"), 2)] if rope else []
        cells += [_f(r.get(f"{n}_speedup"), 2, "x") for n in names if not n.endswith("_rows")]
        frac = r.get(f"{names[0]}_bw_frac")
        cells += ["" if frac is None else f"{100 * frac:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def quantize_lines(q_rows: list[dict[str, Any]], rows: list[dict[str, Any]], env: dict[str, Any],
                   layer_weight_mb: float) -> list[str]:
    """The quantization kernels, with the demotion's share of the fastest INT2 attention and of a layer step
    (``layer_weight_mb``: one layer's BF16 weights, read at copy bandwidth; the run's record wins)."""
    bw = float(env.get("copy_tb_s") or float("nan")) * 1e12
    weight_mb = float(env.get("layer_weight_mb", layer_weight_mb))
    weights_us = weight_mb * 1e6 / bw * 1e6
    lines = ["| kind | d | batch | rows | us | share of attention + demotion (fastest INT2 of that batch) | share of a "
             f"layer step (+ {weight_mb:.0f} MB of BF16 weights at copy "
             "bandwidth, Qwen3-8B) |", "|---|---|---|---|---|---|---|"]
    for r in q_rows:
        share = layer = ""
        if r["kind"] == "demote":
            att = [x["int2_us"] for x in rows if x["batch"] == r["batch"] and x["head_dim"] == r["head_dim"]
                   and x.get("int2_us")]
            if att and r["us"] == r["us"]:
                share = f"{100 * r['us'] / (r['us'] + min(att)):.1f}%"
                layer = f"{100 * r['us'] / (r['us'] + min(att) + weights_us):.1f}%"
        lines.append(f"| {r['kind']} | {r['head_dim']} | {r['batch']} | {r['rows']} | {_f(r['us'])} | {share} | "
                     f"{layer} |")
    return lines


def compare_lines(rows: list[dict[str, Any]], ref_path: Path, names: list[str]) -> list[str]:
    """New against a committed table of the same shapes: ratio new / old per column (median, range, within 5%)."""
    ref = {(r["head_dim"], r["batch"], r["context"]): r for r in _read_csv(ref_path)}
    for r in ref.values():  # the committed v10 table named the row-layout INT4 column int4_rows_v8
        for k in [k for k in r if "_rows_v8_" in k]:
            r.setdefault(k.replace("_rows_v8_", "_rows_"), r[k])
    cols = [("cudnn_us", "cuDNN"), ("flash_us", "flash")] + [(f"{n}_us", LABELS.get(n, n)) for n in names]
    lines = [f"New / committed (`{ref_path}`), per column over the shapes both have (1.00 = the same time):", "",
             "| column | shapes | median | min | max | within +-5% |", "|---|---|---|---|---|---|"]
    per_shape = []
    for key, label in cols:
        ratios = []
        for r in rows:
            old = ref.get((r["head_dim"], r["batch"], r["context"]), {}).get(key)
            if r.get(key) and old:
                ratios.append(r[key] / old)
        if ratios:
            within = sum(abs(x - 1) <= 0.05 for x in ratios)
            lines.append(f"| {label} | {len(ratios)} | {statistics.median(ratios):.3f} | {min(ratios):.3f} | "
                         f"{max(ratios):.3f} | {within}/{len(ratios)} |")
    first = names[0]
    for r in rows:
        old = ref.get((r["head_dim"], r["batch"], r["context"]), {})
        if r.get(f"{first}_us") and old.get(f"{first}_us"):
            per_shape.append(f"| {r['head_dim']} | {r['batch']} | {r['context']} | {_f(old.get('cudnn_us'))} | "
                             f"{_f(r['cudnn_us'])} | {_f(old[f'{first}_us'])} | {_f(r[f'{first}_us'])} | "
                             f"{r[f'{first}_us'] / old[f'{first}_us']:.3f} |")
    if per_shape:
        label = LABELS.get(first, first)
        lines += ["", f"| d | batch | context | cuDNN committed | cuDNN now | {label} committed | {label} now | "
                  f"{label} now / committed |", "|---|---|---|---|---|---|---|---|", *per_shape]
    return lines


def write_report(out: Path, opts: dict[str, Any]) -> list[Path]:
    """``<stem>.csv``, ``<stem>.md`` and ``<stem>.png`` from the raw rows and the env record of the run (``opts``: the
    table's options; the stem is ``name=``)."""
    name = str(opts["name"])
    raw_path = out / f"{name}_rows.csv"
    if not raw_path.is_file():
        raise FileNotFoundError(f"{raw_path}: no raw rows (run `python -m oscar gpu kernels out={out}` on a GPU first)")
    env = host.read_env(out / f"{name}_env.json")
    raw = _read_csv(raw_path)
    rows = wide_rows(raw)
    names = list(dict.fromkeys(r["variant"] for r in raw))
    written = [out / f"{name}.csv", out / f"{name}.md"]
    atomic_write_csv(written[0], rows)
    q_path = out / f"{name}_quantize.csv"
    q_rows = _read_csv(q_path) if q_path.is_file() else []
    shape = env.get("shape", {k: opts[k] for k in ("q_heads", "kv_heads", "sink", "recent", "page_size")})
    md = [f"# Decode attention: paged {', '.join(LABELS.get(n, n) for n in names)} vs BF16 SDPA", "",
          host.hardware_line(env) + f" Copy bandwidth (read + write, measured in the run): "
          f"{float(env.get('copy_tb_s', float('nan'))):.2f} TB/s.", "",
          f"Command: `{env.get('command', '?')}`", "",
          f"One layer, {shape['q_heads']} query heads over {shape['kv_heads']} KV heads, one query per sequence; "
          f"sink {shape['sink']} + quantized pages of {shape['page_size']} tokens + recent {shape['recent']}, BF16 "
          "windows. Times in microseconds per call: median of CUDA-graph replays over input sets larger than L2, every "
          "column of a row in the same process on the same random codes (`oscar.bench.kernels.timing`). Baseline: the "
          "faster of torch SDPA's cuDNN and flash backends on the BF16 K/V of the same context. Variants "
          "(`oscar.cache.paged.decode_attention`, default launch): "
          + "; ".join(f"{LABELS.get(n, n)} = `{json.dumps(env.get('variants', {}).get(n, VARIANTS.get(n, {})))}`"
                      for n in names) + ". Bandwidth fraction: the variant's bytes / time / copy bandwidth.", ""]
    acc = env.get("rel_err_vs_twin")
    if acc:
        md += ["Against the float32 dequantize-then-attend twin on the same pages (batch 4, 8k; largest relative "
               "error per head; test tolerance 1.5e-2): " + ", ".join(
                   f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in acc.items()) + ".", ""]
    if env.get("stopped_before"):
        md += [f"The time budget stopped the run before {env['stopped_before']}.", ""]
    md += markdown_table(rows, names)
    if q_rows:
        md += ["", "Quantization kernels (rotation + centering + clip + pack into the mma pages; demotion: K and V of "
               "one token per sequence in one launch, 16 launches per graph replay, time per launch):", ""]
        md += quantize_lines(q_rows, rows, env, float(opts["layer_weight_mb"]))
    if opts.get("compare"):
        md += ["", "## Against the committed numbers", ""] + compare_lines(rows, Path(opts["compare"]), names)
    if opts.get("notes") and Path(opts["notes"]).is_file():
        md += ["", Path(opts["notes"]).read_text().rstrip()]
    atomic_write_text(written[1], "\n".join(md) + "\n")
    try:
        plot(rows, names, out / f"{name}.png")
        written.append(out / f"{name}.png")
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    print("\n".join(md))
    return written


def plot(rows: list[dict[str, Any]], names: list[str], path: Path) -> None:
    """Speed-up over the best BF16 against context, one panel per (head_dim, variant), one line per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [n for n in names if not n.endswith("_rows")] or names
    dims = sorted({r["head_dim"] for r in rows}, reverse=True) or [128]
    fig, axes = plt.subplots(len(dims), len(shown), figsize=(5 * len(shown), 4 * len(dims)), squeeze=False,
                             sharey=True)
    for i, d in enumerate(dims):
        for j, n in enumerate(shown):
            ax = axes[i][j]
            for B in sorted({r["batch"] for r in rows}):
                rs = sorted([r for r in rows if r["head_dim"] == d and r["batch"] == B and r.get(f"{n}_speedup")],
                            key=lambda r: r["context"])
                if rs:
                    ax.plot([r["context"] // 1024 for r in rs], [r[f"{n}_speedup"] for r in rs], marker="o",
                            label=f"batch {B}")
            ax.axhline(1, color="black", lw=0.5)
            ax.set(xscale="log", xlabel="context (k tokens)", ylabel="speed-up vs best BF16 SDPA",
                   title=f"{LABELS.get(n, n)}, head_dim {d}")
            if ax.get_lines():
                ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)


def track(out: Path, opts: dict[str, Any], uri: str) -> str:
    """MLflow: experiment ``oscar/gpu/kernels``, a parent run with the report, one child run per shape."""
    name = str(opts["name"])
    rows = _read_csv(out / f"{name}.csv")
    cells = []
    for r in rows:
        metrics = {"perf.cudnn_us": r.get("cudnn_us"), "perf.flash_us": r.get("flash_us")}
        for k, v in r.items():
            if k.endswith("_us") and k not in ("cudnn_us", "flash_us", "bf16_best_us"):
                metrics[f"perf.{k}"] = v
            elif k.endswith("_speedup"):
                metrics[f"perf.{k}"] = v
        cells.append(mirror.Cell(f"d{r['head_dim']}/b{r['batch']}/T{r['context']}",
                                 {"head_dim": r["head_dim"], "batch": r["batch"], "context": r["context"]}, metrics))
    files = [out / f"{name}{suffix}" for suffix in (".md", ".csv", ".png", "_rows.csv", "_quantize.csv", "_env.json")]
    return mirror.mirror("kernels", cells, files, host.read_env(out / f"{name}_env.json"), uri)

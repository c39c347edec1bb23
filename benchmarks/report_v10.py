"""reports/kernels/decode_attention.{csv,png} and the Markdown table of its v10 section, from one run of
bench_decode_v10.py (CPU; no GPU needed).

Usage: python benchmarks/report_v10.py reports/kernels/v10/decode_v10_run2.csv reports/kernels/decode_attention
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from oscar.core.files import atomic_write, atomic_write_csv as _write_csv, atomic_write_text as _write_atomic

COLUMNS = {  # output column -> variant of bench_decode_v10.py
    "int2": {"layout": "mma"},
    "int2_rope": {"layout": "mma", "rope": True, "rope_blocks": 8},
    "int2_rope16": {"layout": "mma", "rope": True, "rope_blocks": 16},
    "int2_carveout44": {"layout": "mma", "mma_carveout": 44},
    "int2_rope_carveout44": {"layout": "mma", "rope": True, "rope_blocks": 8, "mma_carveout": 44},
    "int4": {"bits": 4, "layout": "mma"},
    "int4_rows_v8": {"bits": 4},
}


def wide_rows(path: Path) -> list[dict]:
    """One row per shape: BF16 baselines, each variant's time, speedup and bandwidth fraction."""
    shapes: dict[tuple, dict] = {}
    names = {json.dumps(v, sort_keys=True): k for k, v in COLUMNS.items()}
    with open(path) as fh:
        for r in csv.DictReader(fh):
            key = (int(r["head_dim"]), int(r["batch"]), int(r["context"]))
            row = shapes.setdefault(key, {"head_dim": key[0], "batch": key[1], "context": key[2],
                                          "cudnn_us": float(r["cudnn_us"]), "flash_us": float(r["flash_us"]),
                                          "bf16_best_us": float(r["bf16_best_us"]), "copy_tb_s": float(r["copy_tb_s"])})
            col = names.get(r["variant"])
            if col is None or r["status"] != "ok":
                continue
            row[f"{col}_us"] = float(r["us"])
            row[f"{col}_speedup"] = float(r["speedup"])
            row[f"{col}_bw_frac"] = float(r["bw_frac"])
    out = list(shapes.values())
    for row in out:
        if "int2_us" in row and "int2_rope_us" in row:
            row["rope_over_plain"] = row["int2_rope_us"] / row["int2_us"]
    return sorted(out, key=lambda r: (-r["head_dim"], r["context"], r["batch"]))


def markdown(rows: list[dict]) -> str:
    head = ("| d | batch | context | cuDNN | flash | INT2 | INT2 + rope | rope / plain | INT4 | INT4 rows (v8) "
            "| INT2 x best BF16 | INT2 + rope x | INT4 x | INT2 of copy bw |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        g = r.get
        lines.append(f"| {r['head_dim']} | {r['batch']} | {r['context']} | {r['cudnn_us']:.1f} | {r['flash_us']:.1f} | "
                     f"{g('int2_us', float('nan')):.1f} | {g('int2_rope_us', float('nan')):.1f} | "
                     f"{g('rope_over_plain', float('nan')):.2f} | {g('int4_us', float('nan')):.1f} | "
                     f"{g('int4_rows_v8_us', float('nan')):.1f} | {g('int2_speedup', float('nan')):.2f}x | "
                     f"{g('int2_rope_speedup', float('nan')):.2f}x | {g('int4_speedup', float('nan')):.2f}x | "
                     f"{100 * g('int2_bw_frac', float('nan')):.0f}% |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Speedup over the best BF16 against context, per batch: INT2, INT2 + rope-centered keys, INT4."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["head_dim"] for r in rows}, reverse=True)
    kinds = (("int2", "INT2"), ("int2_rope", "INT2 + rope-centered keys"), ("int4", "INT4"))
    fig, axes = plt.subplots(len(dims), len(kinds), figsize=(15, 4 * len(dims)), squeeze=False, sharey=True)
    for i, d in enumerate(dims):
        for j, (col, label) in enumerate(kinds):
            ax = axes[i][j]
            for B in sorted({r["batch"] for r in rows}):
                rs = sorted([r for r in rows if r["head_dim"] == d and r["batch"] == B and f"{col}_speedup" in r],
                            key=lambda r: r["context"])
                if rs:
                    ax.plot([r["context"] // 1024 for r in rs], [r[f"{col}_speedup"] for r in rs], marker="o",
                            label=f"batch {B}")
            ax.axhline(1, color="black", lw=0.5)
            ax.axhline(5 if col != "int4" else 2.5, color="gray", ls="--", lw=1)  # issue 22's targets
            ax.set(xscale="log", xlabel="context (k tokens)", ylabel="speedup vs best BF16 SDPA",
                   title=f"{label}, head_dim {d}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100))


def main(argv: list[str]) -> int:
    src, stem = Path(argv[0]), Path(argv[1])
    rows = wide_rows(src)
    _write_csv(stem.with_suffix(".csv"), rows)
    plot(rows, stem.with_suffix(".png"))
    table = markdown(rows)
    _write_atomic(stem.parent / (stem.name + "_v10_table.md"), table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

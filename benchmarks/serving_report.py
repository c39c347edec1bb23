"""The serving table from the rows of ``benchmarks/gpu_serving.sh``: reports/serving/decode.{csv,md,png}.

    python benchmarks/serving_report.py ROWS.jsonl [ROWS2.jsonl ...] --out reports/serving

One CSV row per (cache, backend, batch, context) with ``decode_ms`` (median ms per decode step, SGLang's
``bench_one_batch`` timing), ``prefill_s``, ``cuda_graph``, ``status`` (ok | capacity | oom | failed: not in the
rows) and the job's decode tokens/s; the markdown adds OSCAR's speed-up over the best BF16 backend at each
shape and the greedy-token agreement of each OSCAR row with the BF16 rows of the same prompts (the prompts
are seeded, so rows of one shape share them).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

COLUMNS = ("cache", "backend", "batch", "context", "decode_ms", "prefill_s", "cuda_graph", "status", "tokens_per_s",
           "max_total_num_tokens", "page_size", "tag", "device")
MD_COLUMNS = ("cache", "backend", "tag", "batch", "context", "decode_ms", "prefill_s", "cuda_graph", "status",
              "tokens_per_s", "max_total_num_tokens")
REPRODUCE = ("bash benchmarks/gpu_serving.sh   # on the H200 machine, from a checkout holding the sglang 0.5.17 "
             "bundle at .dev/sglang-gpu; then python benchmarks/serving_report.py reports/serving/serving_rows.jsonl")


def load_rows(paths: list[Path]) -> list[dict[str, Any]]:
    """Rows of the JSON-lines files; a later row of the same (tag, batch, context) replaces an earlier one."""
    rows: dict[tuple, dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows[(r.get("tag"), r["batch"], r["context"])] = r
    return list(rows.values())


def _fmt(x: Any, nd: int = 2) -> str:
    return "" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in sorted(rows, key=lambda r: (r["batch"], r["context"], r["cache"], r["backend"], r.get("tag", ""))):
        ms = r.get("decode_ms")
        out.append({**{c: r.get(c) for c in COLUMNS},
                    "tokens_per_s": None if not ms else round(1e3 * r["batch"] / ms, 1),
                    "cuda_graph": str(bool(r.get("cuda_graph"))).lower(),
                    "decode_ms": None if ms is None else round(ms, 3),
                    "prefill_s": None if r.get("prefill_s") is None else round(r["prefill_s"], 3)})
    return out


def speedups(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: OSCAR's decode speed-up over the best BF16 backend measured at the same shape."""
    lines = []
    shapes = sorted({(r["batch"], r["context"]) for r in rows})
    for b, n in shapes:
        at = [r for r in rows if (r["batch"], r["context"]) == (b, n) and r.get("status") == "ok"]
        bf16 = [r for r in at if r["cache"] == "bf16"]
        if not bf16:
            continue
        best = min(bf16, key=lambda r: r["decode_ms"])
        for r in at:
            if r["cache"] == "oscar" and "identity" not in str(r.get("tag", "")):
                lines.append(f"| {b} | {n} | {best['backend']} {best['decode_ms']:.2f} | {r['tag']} {r['decode_ms']:.2f} | "
                             f"{best['decode_ms'] / r['decode_ms']:.2f}x |")
    return lines


def agreement(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: greedy tokens of each OSCAR row against each BF16 row of the same shape."""
    lines = []
    for r in rows:
        if r["cache"] != "oscar" or not r.get("tokens"):
            continue
        for ref in rows:
            if ref["cache"] == "bf16" and (ref["batch"], ref["context"]) == (r["batch"], r["context"]) and ref.get("tokens"):
                a, b = r["tokens"], ref["tokens"]
                same = sum(x == y for x, y in zip(a, b))
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                lines.append(f"| {r['tag']} | {ref['backend']} | {r['batch']} | {r['context']} | {same}/{min(len(a), len(b))} | "
                             f"{'none' if first is None else first} |")
    return lines


def write_png(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oscar.stats import atomic_write

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(max(7.0, 4.5 * len(batches)), 4.0), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for key in sorted({(r["cache"], r["backend"], r.get("tag", "")) for r in rows if r["batch"] == b}):
            pts = sorted((r["context"], r["decode_ms"]) for r in rows
                         if r["batch"] == b and (r["cache"], r["backend"], r.get("tag", "")) == key and r.get("decode_ms"))
            if pts:
                ax.plot([p[0] / 1e3 for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]}/{key[1]} {key[2]}")
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel("decode ms / step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=6)
    fig.suptitle("SGLang 0.5.17 decode step, dummy Qwen3-8B, CUDA graphs", fontsize=10)
    fig.tight_layout()

    def save(tmp: Path) -> None:
        fig.savefig(tmp, dpi=120, format="png")

    atomic_write(path, save)
    plt.close(fig)


def track(out: Path, table: list[dict[str, Any]], uri: str, root: Path = Path(".")) -> str:
    """Mirror the table into MLflow (experiment ``oscar/serving/decode``): a parent run with the report files, one
    child run per row (both replaced on every call). Returns the parent run id."""
    import time

    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from oscar import tracking

    commit = tracking.git_commit(root)
    name = tracking.experiment_name("serving", "decode")
    with tracking.store_lock(uri, root / "results" / "tracking"):
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(name)
        exp_id = found.experiment_id if found else client.create_experiment(name)
        for run in client.search_runs([exp_id], max_results=5000):
            client.delete_run(run.info.run_id)
        now = int(time.time() * 1000)
        base = {"oscar.rule": "serving", "mlflow.source.git.commit": commit, "git_commit": commit}
        parent = client.create_run(exp_id, run_name="serving", tags={tracking.ROLE_TAG: "table", **base}).info.run_id
        for f in ("decode.md", "decode.csv", "decode.png"):
            client.log_artifact(parent, str(out / f), artifact_path="reports")
        for r in table:
            tags = {tracking.ROLE_TAG: "cell", tracking.PARENT_TAG: parent, "oscar.status": str(r["status"]), **base}
            run = client.create_run(exp_id, run_name=f"{r['tag']}/b{r['batch']}/T{r['context']}", tags=tags).info.run_id
            m = {"perf.decode_ms": r["decode_ms"], "perf.prefill_s": r["prefill_s"], "perf.tokens_per_s": r["tokens_per_s"],
                 "mem.max_total_num_tokens": r["max_total_num_tokens"]}
            client.log_batch(run, metrics=[Metric(k, float(v), now, 0) for k, v in m.items() if v is not None],
                             params=[Param(k, str(r[k])) for k in ("cache", "backend", "batch", "context", "cuda_graph",
                                                                   "page_size", "device")])
            client.set_terminated(run)
        client.set_terminated(parent)
    return parent


def main(argv: list[str]) -> int:
    from oscar.stats import atomic_write_text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("reports/serving"))
    ap.add_argument("--notes", type=Path, default=None, help="markdown appended to decode.md (the profile, caveats)")
    ap.add_argument("--mlflow-uri", default=None, help="also mirror the rows into this MLflow tracking URI")
    a = ap.parse_args(argv)
    rows = load_rows(a.rows)
    if not rows:
        raise SystemExit(f"no rows in {[str(p) for p in a.rows]}")
    a.out.mkdir(parents=True, exist_ok=True)
    table = table_rows(rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(table)
    atomic_write_text(a.out / "decode.csv", buf.getvalue())
    dev = sorted({str(r.get("device")) for r in rows})
    md = [f"# SGLang serving: decode step and prefill ({', '.join(dev)})", "",
          "SGLang 0.5.17 `bench_one_batch` timing (`python -m oscar.serve.bench`: the same `latency_test_run_once`, "
          "plugin loaded), `--load-format dummy` Qwen3-8B (bundle config), CUDA graphs on, output 16 tokens, "
          "median decode step. OSCAR: INT2, one group per row, sink 64, recent 256, `--page-size 16`, fragment-order "
          "pages read by the v9 kernel, seeded random dense rotations with means (the kernel work of a calibrated "
          "artifact), radix cache off (refused: see README). Reproduce:", "", "```", REPRODUCE, "```", "",
          "| " + " | ".join(MD_COLUMNS) + " |", "|" + "---|" * len(MD_COLUMNS)]
    for r in table:
        md.append("| " + " | ".join(_fmt(r[c]) for c in MD_COLUMNS) + " |")
    sp = speedups(rows)
    if sp:
        md += ["", "## OSCAR vs the best BF16 backend measured in this run at each shape (decode step)", "",
               "| batch | context | best BF16 ms | OSCAR ms | speed-up |", "|---|---|---|---|---|", *sp]
    ag = agreement(rows)
    if ag:
        md += ["", "## Greedy tokens against BF16 (same seeded prompts; first request of the batch)", "",
               "| OSCAR row | BF16 backend | batch | context | equal tokens | first difference |",
               "|---|---|---|---|---|---|", *ag]
    if a.notes is not None and a.notes.is_file():
        md += ["", a.notes.read_text().rstrip()]
    atomic_write_text(a.out / "decode.md", "\n".join(md) + "\n")
    write_png(rows, a.out / "decode.png")
    print("\n".join(md))
    if a.mlflow_uri:
        print(f"MLflow: parent run {track(a.out, table, a.mlflow_uri)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

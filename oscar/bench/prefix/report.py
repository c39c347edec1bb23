"""The prefix table's report (``python -m oscar gpu prefix``): reports/serving/prefix_sweep.{csv,md,png}.

CSV: one row per (tag, ratio) with the job's time, tokens/s (prompt + output tokens over the job), TTFT (mean,
median, max over its requests) and SGLang's count of cached prompt tokens. Markdown: the table, OSCAR against the
BF16 rows at each ratio (job tokens/s and mean TTFT), and the greedy-token check (one prompt cold, then hitting
its own cached prefix). PNG: job tokens/s and mean TTFT against the shared fraction.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from oscar.bench.host import hardware_line
from oscar.core.files import atomic_write, atomic_write_csv, atomic_write_text

COLUMNS = ("cache", "backend", "tag", "ratio", "shared_tokens", "requests", "input_len", "output_len", "status",
           "job_s", "job_tokens_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_max_s", "cached_tokens", "radix",
           "cuda_graph", "page_size", "device", "sglang")
REPRODUCE = "python -m oscar gpu prefix   # on a GPU host (benchmarks/README.md); report_only=true rebuilds this"


def load(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(sweep rows, check rows); a later row of the same (tag, ratio) replaces an earlier one."""
    sweep: dict[tuple, dict[str, Any]] = {}
    checks: dict[str, dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if r.get("kind") == "check":
                    checks[r["tag"]] = r
                else:
                    sweep[(r["tag"], r["ratio"])] = r
    return sorted(sweep.values(), key=lambda r: (r["ratio"], r["cache"], r["tag"])), list(checks.values())


def _fmt(x: Any) -> str:
    return "" if x is None else f"{x:.3g}" if isinstance(x, float) and abs(x) < 10 else f"{x:.1f}" \
        if isinstance(x, float) else str(x)


def comparison(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: OSCAR against each BF16 row at the same ratio."""
    out = []
    for ratio in sorted({r["ratio"] for r in rows}):
        at = [r for r in rows if r["ratio"] == ratio and r.get("status") == "ok"]
        for o in (r for r in at if r["cache"] == "oscar"):
            for b in (r for r in at if r["cache"] == "bf16"):
                out.append(f"| {ratio:g} | {b['backend']} {b['job_tokens_per_s']:.0f} | {o['job_tokens_per_s']:.0f} | "
                           f"{o['job_tokens_per_s'] / b['job_tokens_per_s']:.2f}x | {b['ttft_mean_s']:.2f} | "
                           f"{o['ttft_mean_s']:.2f} | {b['cached_tokens']} / {o['cached_tokens']} |")
    return out


def _equal_tokens(check: dict[str, Any]) -> str:
    """Greedy tokens of a check row equal cold and on the hit, position by position: ``equal/compared``."""
    a, b = check["cold_tokens"], check["hit_tokens"]
    return f"{sum(x == y for x, y in zip(a, b))}/{min(len(a), len(b))}"


def check_lines(checks: list[dict[str, Any]]) -> list[str]:
    out = []
    for c in checks:
        a, b = c["cold_tokens"], c["hit_tokens"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        gap = c.get("first_logprob_gap")
        out.append(f"| {c['tag']} | {c['input_len']} | {c['cold_cached']} | {c['hit_cached']} | {_equal_tokens(c)} | "
                   f"{'none' if first is None else first} | {'-' if gap is None else f'{gap:.3g}'} | {c['cold_ttft_s']:.2f} | {c['hit_ttft_s']:.2f} |")
    return out


def write_png(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for tag in sorted({r["tag"] for r in rows}):
        pts = sorted((r["ratio"], r["job_tokens_per_s"], r["ttft_mean_s"]) for r in rows
                     if r["tag"] == tag and r.get("status") == "ok")
        if pts:
            axes[0].plot([100 * p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=tag or "untagged")
            axes[1].plot([100 * p[0] for p in pts], [p[2] for p in pts], marker="o", label=tag or "untagged")
    for ax, label in zip(axes, ("job throughput (k tokens/s)", "mean TTFT (s)")):
        ax.set_xlabel("shared prefix (% of each prompt)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
    r0 = rows[0] if rows else {}
    fig.suptitle(f"prefix-hit sweep: {r0.get('requests')} requests x {r0.get('input_len')} tokens, radix cache on, "
                 f"SGLang {r0.get('sglang')}, {r0.get('device')}", fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def write_report(paths: list[Path], out: Path, env: dict[str, Any] | None = None,
                 notes: Path | None = None) -> list[Path]:
    """prefix_sweep.{csv,md,png} from the rows of ``paths``; returns the files written."""
    rows, checks = load(paths)
    if not rows:
        raise ValueError(f"no sweep rows in {[str(p) for p in paths]}")
    out.mkdir(parents=True, exist_ok=True)
    table = [{c: r.get(c) for c in COLUMNS} for r in rows]
    atomic_write_csv(out / "prefix_sweep.csv", table, COLUMNS)
    r0 = rows[0]
    md = [f"# Prefix-hit sweep (paper Fig. 6): {r0['requests']} requests x {r0['input_len']} tokens, radix cache on", ""]
    if env:
        md += [hardware_line(env), "", f"Command: `{env.get('command', '?')}`", ""]
    md += [f"One job per shared fraction: {r0['requests']} prompts of {r0['input_len']} seeded random token ids "
          "whose first `ratio x input_len` tokens are shared, submitted at once to SGLang's offline Engine "
          f"(streaming), {r0['output_len']} greedy output tokens each, the cache flushed before each job; "
          f"SGLang {r0.get('sglang')}, `--load-format dummy` Qwen3-8B, {r0.get('device')}, CUDA graphs for decode. "
          "`job_tokens_per_s` = (prompt + output tokens) / job time; `cached_tokens` = SGLang's own count of prompt "
          "tokens served from the radix cache. Reproduce:", "", "```", REPRODUCE, "```", "",
          "| " + " | ".join(COLUMNS[:15]) + " |", "|" + "---|" * 15]
    md += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS[:15]) + " |" for r in table]
    cmp = comparison(rows)
    if cmp:
        md += ["", "## OSCAR against SGLang BF16 in the same run", "",
               "| shared | BF16 job tokens/s | OSCAR job tokens/s | OSCAR / BF16 | BF16 mean TTFT s | OSCAR mean TTFT s | "
               "cached tokens BF16 / OSCAR |", "|---|---|---|---|---|---|---|", *cmp]
    ck = check_lines(checks)
    if ck:
        md += ["", "## Greedy tokens without and with a prefix hit (one prompt, 99% of it then cached)", "",
               "| tag | input | cached (cold) | cached (hit) | equal tokens | first difference | first-token top-2 "
               "log-prob gap | TTFT cold s | TTFT hit s |", "|---|---|---|---|---|---|---|---|---|", *ck,
               "", "A hit reads its prefix as the cache holds it (INT past the sink) where the cold prefill read BF16 "
               "rows (docs/SERVING.md, \"Prefix hits\"): OSCAR's tokens may part; BF16's do not."]
    if notes is not None and notes.is_file():
        md += ["", notes.read_text().rstrip()]
    atomic_write_text(out / "prefix_sweep.md", "\n".join(md) + "\n")
    written = [out / "prefix_sweep.csv", out / "prefix_sweep.md"]
    try:
        write_png(rows, out / "prefix_sweep.png")
        written.append(out / "prefix_sweep.png")
    except ImportError:
        print("matplotlib missing: no prefix_sweep.png", file=sys.stderr)
    print("\n".join(md))
    return written


DEFAULT_COLUMNS = ("tag", "backend", "input_len", "status", "cold_ttft_s", "hit_ttft_s", "hit_cached", "equal_tokens",
                   "max_total_num_tokens", "mem_fraction_static", "chunked_prefill_size", "page_size",
                   "gpu_memory_used_mib", "cuda_graph", "radix", "device", "sglang")


def write_defaults(rows_path: Path, out: Path, env: dict[str, Any] | None = None,
                   notes: Path | None = None) -> list[Path]:
    """prefill_defaults.{csv,md}: one long prompt per backend at SGLang's defaults (``defaults=true``); a backend
    whose engine wrote no row (it failed: out of memory, a crash) is a row with its exit status."""
    _, checks = load([rows_path]) if rows_path.is_file() else ([], [])
    by_tag = {c["tag"]: c for c in checks}
    runs = (env or {}).get("runs") or [{"name": t} for t in by_tag]
    table = []
    for run in runs:
        c = by_tag.get(run["name"])
        if c is None:
            table.append({"tag": run["name"], "status": f"no row (exit {run.get('rc', '?')}; "
                                                        f"logs/prefill_{run['name']}.log)"})
            continue
        table.append({**{k: c.get(k) for k in DEFAULT_COLUMNS}, "status": "ok", "equal_tokens": _equal_tokens(c)})
    if not table:
        raise ValueError(f"{rows_path}: no rows and no runs")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_csv(out / "prefill_defaults.csv", [{k: r.get(k) for k in DEFAULT_COLUMNS} for r in table],
                     DEFAULT_COLUMNS)
    n = next((r["input_len"] for r in table if r.get("input_len")), "?")
    md = [f"# One {n}-token prompt at SGLang's defaults, each cache in turn", ""]
    if env:
        md += [hardware_line(env), "", f"Command: `{env.get('command', '?')}`", ""]
    md += ["Each backend's `sglang.Engine` alone on the GPU with SGLang's own defaults: its memory fraction "
           "(`mem_fraction_static` as SGLang chose it for the card), chunked prefill, context length (the model's), "
           "CUDA graphs and the radix cache on; dummy weights. One prompt of seeded random token ids cold "
           "(`cold_ttft_s`: its prefill through the chunked-prefill loop, then the first token), then the same prompt "
           "again (`hit_ttft_s`, `hit_cached`: its prefix from the radix cache). `max_total_num_tokens`: the pool's "
           "token capacity; `gpu_memory_used_mib`: nvidia-smi after the prompts (used/total). A backend that ran out "
           "of memory or crashed has a row with its exit status. Reproduce:", "",
           "```", "python -m oscar gpu prefix defaults=true requests=1 input_len=128000   # benchmarks/gpu.sh prefix ...",
           "```", "", "| " + " | ".join(DEFAULT_COLUMNS[:14]) + " |", "|" + "---|" * 14]
    md += ["| " + " | ".join(_fmt(r.get(c)) for c in DEFAULT_COLUMNS[:14]) + " |" for r in table]
    if notes is not None and notes.is_file():
        md += ["", notes.read_text().rstrip()]
    atomic_write_text(out / "prefill_defaults.md", "\n".join(md) + "\n")
    print("\n".join(md))
    return [out / "prefill_defaults.csv", out / "prefill_defaults.md"]

"""The serving table's report (``python -m oscar gpu serving``): decode.{csv,md,png} and profile.{csv,md}.

One CSV row per (cache, backend, mode, batch, context) with ``decode_ms`` (median ms per decode step, SGLang's
``bench_one_batch`` timing), ``prefill_s``, ``cuda_graph``, ``radix``, ``status`` (ok | capacity: over the pool's
tokens by ``bench_one_batch``'s rule | oom | failed), ``mode`` (real: prefill forward then decode; synthetic: the
decode steps on a synthetic state, ``oscar.bench.serving.synthetic``), the job's decode tokens/s, the server's token
capacity and the largest batch of that context it holds. The markdown adds the hardware and the command, the grid
(OSCAR against the best BF16 backend of the same mode and shape), the issue's target ratios, the
real-vs-synthetic cross-check, the greedy-token agreement of the real rows (seeded prompts: rows of one shape share
them) and, with ``compare``, the rows set against a committed decode.csv; ``profile_rows.jsonl`` beside the rows
gives profile.{csv,md}: GPU ms per part of the decode step.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any, Optional

from oscar.bench import mirror
from oscar.bench.host import hardware_line
from oscar.bench.serving.trace import kernel_category
from oscar.core.files import atomic_write, atomic_write_csv, atomic_write_text

COLUMNS = ("cache", "format", "backend", "mode", "batch", "context", "decode_ms", "prefill_s", "cuda_graph", "radix", "status",
           "tokens_per_s", "max_total_num_tokens", "max_batch_by_tokens", "page_size", "mem_fraction_static", "tag",
           "device")
MD_COLUMNS = ("cache", "format", "backend", "mode", "batch", "context", "decode_ms", "prefill_s", "cuda_graph", "radix", "status",
              "tokens_per_s", "max_total_num_tokens", "max_batch_by_tokens")
REPRODUCE = "python -m oscar gpu serving   # on a GPU host (benchmarks/README.md); report_only=true rebuilds this"


def load_rows(paths: list[Path]) -> list[dict[str, Any]]:
    """Rows of the JSON-lines files (``mode`` real when absent); a later row of the same (tag, mode, batch,
    context) replaces an earlier one."""
    rows: dict[tuple, dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                r.setdefault("mode", "real")
                rows[(r.get("tag"), r["mode"], r["batch"], r["context"])] = r
    return list(rows.values())


def _fmt(x: Any, nd: int = 2) -> str:
    return "" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def max_batch(r: dict[str, Any]) -> Optional[int]:
    """Requests of this row's context (+ output) that the server's token capacity holds (bench_one_batch's rule)."""
    cap = r.get("max_total_num_tokens")
    return None if cap is None else int(cap) // (int(r["context"]) + int(r.get("output_len") or 16))


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    key = lambda r: (r["batch"], r["context"], r["cache"], r["backend"], r["mode"], r.get("tag", ""))  # noqa: E731
    for r in sorted(rows, key=key):
        ms = r.get("decode_ms")
        out.append({**{c: r.get(c) for c in COLUMNS},
                    "tokens_per_s": None if not ms else round(1e3 * r["batch"] / ms, 1),
                    "cuda_graph": str(bool(r.get("cuda_graph"))).lower(),
                    "radix": "" if r.get("radix") is None else str(bool(r["radix"])).lower(),
                    "max_batch_by_tokens": max_batch(r),
                    "decode_ms": None if ms is None else round(ms, 3),
                    "prefill_s": None if r.get("prefill_s") is None else round(r["prefill_s"], 3)})
    return out


def _ok(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


def _best_bf16(rows: list[dict[str, Any]], **match: Any) -> Optional[dict[str, Any]]:
    bf16 = _ok(rows, cache="bf16", **match)
    return min(bf16, key=lambda r: r["decode_ms"]) if bf16 else None


def _is_main_oscar(r: dict[str, Any]) -> bool:
    return r["cache"] == "oscar" and "identity" not in str(r.get("tag", ""))


def speedups(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: OSCAR's decode speed-up over the best BF16 backend of the same mode at the same shape."""
    lines = []
    for mode, b, n in sorted({(r["mode"], r["batch"], r["context"]) for r in rows}):
        for r in _ok(rows, mode=mode, batch=b, context=n):
            best = _best_bf16(rows, mode=mode, batch=b, context=n, cuda_graph=r.get("cuda_graph"))
            if _is_main_oscar(r) and best is not None:  # against BF16 with the same CUDA-graph setting
                lines.append(f"| {mode} | {b} | {n} | {best['backend']} {best['decode_ms']:.2f} | {r['tag']} "
                             f"{r['decode_ms']:.2f} | {best['decode_ms'] / r['decode_ms']:.2f}x |")
    return lines


def format_ratios(rows: list[dict[str, Any]], ref: str = "rotated") -> list[str]:
    """Markdown lines: each OSCAR format's decode step against the per-token format's (``ref``) at the same mode,
    shape and CUDA-graph setting (the serving issue's "within 10% of the per-token format")."""
    lines = []
    for r in sorted(_ok(rows, cache="oscar"), key=lambda r: (r["mode"], r["batch"], r["context"], r.get("tag", ""))):
        if r.get("format") == ref or not _is_main_oscar(r):
            continue
        base = next(iter(_ok(rows, cache="oscar", format=ref, mode=r["mode"], batch=r["batch"], context=r["context"],
                             cuda_graph=r.get("cuda_graph"))), None)
        if base is not None:
            lines.append(f"| {r['mode']} | {r['batch']} | {r['context']} | {str(bool(r.get('cuda_graph'))).lower()} | "
                         f"{r['format']} {r['decode_ms']:.2f} | {ref} {base['decode_ms']:.2f} | "
                         f"{r['decode_ms'] / base['decode_ms']:.2f}x |")
    return lines


def grid(rows: list[dict[str, Any]], mode: str = "synthetic") -> list[str]:
    """Markdown lines: decode ms of each backend per (batch, context) of one mode (status where it did not run)."""
    of_mode = [r for r in rows if r["mode"] == mode]
    backends = sorted({(r["cache"], r["backend"], r.get("tag", "")) for r in of_mode})
    if not backends:
        return []
    oscar_tags = sorted({t for c, _, t in backends if c == "oscar" and "identity" not in t})
    head = ("| batch | context | " + " | ".join(f"{t or c + '/' + b} ms" for c, b, t in backends) + " | "
            + " | ".join(f"BF16 / {t}" for t in oscar_tags) + " |")
    lines = [head, "|" + "---|" * (len(backends) + 2 + len(oscar_tags))]
    for b, n in sorted({(r["batch"], r["context"]) for r in of_mode}):
        cells = []
        for c, be, tag in backends:
            r = next((x for x in of_mode if (x["cache"], x["backend"], x.get("tag", ""), x["batch"], x["context"])
                      == (c, be, tag, b, n)), None)
            cells.append("" if r is None else f"{r['decode_ms']:.2f}" if r.get("status") == "ok" else r["status"])
        ratios = []
        for t in oscar_tags:  # against the best BF16 backend with the same CUDA-graph setting
            o = next(iter(_ok(of_mode, batch=b, context=n, tag=t)), None)
            best = None if o is None else _best_bf16(of_mode, batch=b, context=n, cuda_graph=o.get("cuda_graph"))
            ratios.append(f"{best['decode_ms'] / o['decode_ms']:.2f}x" if best and o else "")
        lines.append(f"| {b} | {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return lines


def cross_check(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: real prefill-then-decode against the synthetic state at the same shape and backend."""
    lines = []
    for r in sorted(_ok(rows, mode="real"), key=lambda r: (r["backend"], r["batch"], r["context"])):
        syn = _ok(rows, mode="synthetic", tag=r.get("tag"), batch=r["batch"], context=r["context"])
        s = f"{syn[0]['decode_ms']:.2f} | {syn[0]['decode_ms'] / r['decode_ms'] - 1:+.1%}" if syn else " | "
        lines.append(f"| {r['cache']}/{r['backend']} | {r['batch']} | {r['context']} | {r['prefill_s']:.2f} | "
                     f"{r['decode_ms']:.2f} | {s} |")
    return lines


def targets(rows: list[dict[str, Any]], context: int = 100000, batch: int = 32, mode: str = "synthetic") -> list[str]:
    """Markdown lines: the target ratios at ``context`` from the rows of one mode (CUDA graphs on), against BF16
    and, where the run has FP8 rows, against SGLang's FP8 cache."""
    of_mode = [r for r in rows if r["mode"] == mode and r["context"] == context and r.get("cuda_graph", True)]
    lines = []
    for ref, goals in (("bf16", BF16_GOALS), ("fp8", FP8_GOALS)):
        base = [r for r in of_mode if r["cache"] == ref]
        for tag in sorted({r.get("tag", "") for r in of_mode if _is_main_oscar(r)}):
            lines += _targets_of([r for r in of_mode if r.get("tag", "") == tag], base, context, batch, ref, goals)
    return lines


# (batch-1 decode speed-up, largest batch (token capacity), job tokens/s at the largest batches): None = no target
BF16_GOALS = (1.5, 6.0, 4.5)
FP8_GOALS = (1.2, 3.0, None)


def _targets_of(osc: list[dict[str, Any]], base: list[dict[str, Any]], context: int, batch: int, ref: str = "bf16",
                goals: tuple = BF16_GOALS) -> list[str]:
    if not osc or not base:
        return []
    name, label = osc[0].get("tag") or "OSCAR", ref.upper()
    lines = []

    def verdict(ratio: float, goal: Optional[float]) -> tuple[str, str]:
        return ("-", "") if goal is None else (f">= {goal:g}x", "holds" if ratio >= goal else "missed")

    b1 = min(_ok(base, batch=1), key=lambda r: r["decode_ms"], default=None)
    o1 = next(iter(_ok(osc, batch=1)), None)
    if b1 and o1:
        ratio = b1["decode_ms"] / o1["decode_ms"]
        asked, ok = verdict(ratio, goals[0])
        lines.append(f"| {name}: batch 1 decode at {context} vs {label} | {asked} | {b1['backend']} {b1['decode_ms']:.2f} "
                     f"ms / OSCAR {o1['decode_ms']:.2f} ms | {ratio:.2f}x | {ok} |")
    cap_o, cap_b = max(max_batch(r) or 0 for r in osc), max(max_batch(r) or 0 for r in base)
    if cap_b:
        ratio = cap_o / cap_b
        asked, ok = verdict(ratio, goals[1])
        lines.append(f"| {name}: largest batch at {context} (token capacity) vs {label} | {asked} | OSCAR {cap_o} / "
                     f"{label} {cap_b} | {ratio:.2f}x | {ok} |")
    ob = next(iter(_ok(osc, batch=min(batch, cap_o))), None) or max(_ok(osc), key=lambda r: r["batch"], default=None)
    bb = [r for r in _ok(base) if r["batch"] == min(batch, cap_b)]
    if ob and bb:
        best = max(bb, key=lambda r: r["batch"] / r["decode_ms"])
        tps_o, tps_b = 1e3 * ob["batch"] / ob["decode_ms"], 1e3 * best["batch"] / best["decode_ms"]
        ratio = tps_o / tps_b
        asked, ok = verdict(ratio, goals[2])
        lines.append(f"| {name}: job tokens/s at batch {ob['batch']}, {context} ({label} at its largest batch "
                     f"{best['batch']}) | {asked} | OSCAR {tps_o:.0f} / {best['backend']} {label} {tps_b:.0f} tok/s | "
                     f"{ratio:.2f}x | {ok} |")
    return lines


def agreement(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: greedy tokens of each OSCAR row against each BF16 row of the same shape (real rows)."""
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


def write_png(rows: list[dict[str, Any]], path: Path, context: int = 100000) -> None:
    """Decode ms against context, one panel per batch of the grid (batches with at least two contexts), and the
    job's decode tokens/s against batch at ``context``; one colour per cache/backend, dashed: real rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    series = sorted({(r["cache"], r["backend"], r.get("tag", "")) for r in rows})
    colour = {key: f"C{i}" for i, key in enumerate(series)}
    batches = [b for b in sorted({r["batch"] for r in rows})
               if len({r["context"] for r in rows if r["batch"] == b and r.get("decode_ms")}) > 1]
    n = len(batches) + 1
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.8), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for key in series:
            for mode in ("synthetic", "real"):
                pts = sorted((r["context"], r["decode_ms"]) for r in rows if r["batch"] == b and r.get("decode_ms")
                             and r["mode"] == mode and (r["cache"], r["backend"], r.get("tag", "")) == key)
                if pts:
                    ax.plot([p[0] / 1e3 for p in pts], [p[1] for p in pts], color=colour[key],
                            marker="x" if mode == "real" else "o", linestyle="--" if mode == "real" else "-",
                            label=f"{key[2] or key[0] + '/' + key[1]} {mode}")
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel("decode ms / step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=6)
    ax = axes[0][-1]
    for key in series:
        pts = sorted((r["batch"], 1e3 * r["batch"] / r["decode_ms"]) for r in rows if r["context"] == context
                     and r.get("decode_ms") and r["mode"] == "synthetic" and (r["cache"], r["backend"], r.get("tag", "")) == key)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colour[key], marker="o",
                    label=key[2] or f"{key[0]}/{key[1]}")  # the tag: one line per served format
    ax.set_title(f"context {context // 1000}k: job tokens/s (synthetic)")
    ax.set_xlabel("batch (up to the token capacity)")
    ax.set_ylabel("tokens / s")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=6)
    fig.suptitle("SGLang 0.5.17 decode step, dummy Qwen3-8B, CUDA graphs (synthetic state: solid; after a real "
                 "prefill: dashed; missing points: over the token capacity)", fontsize=9)
    fig.tight_layout()

    def save(tmp: Path) -> None:
        fig.savefig(tmp, dpi=110, format="png")

    atomic_write(path, save)
    plt.close(fig)


def track(out: Path, uri: str, env: Optional[dict[str, Any]] = None) -> str:
    """Mirror the table into MLflow (experiment ``oscar/gpu/serving``): a parent run with the report files, one
    child run per row (both replaced on every call). Returns the parent run id."""
    with open(out / "decode.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    cells = []
    for r in table:
        metrics = {"perf.decode_ms": r["decode_ms"], "perf.prefill_s": r["prefill_s"],
                   "perf.tokens_per_s": r["tokens_per_s"], "mem.max_total_num_tokens": r["max_total_num_tokens"],
                   "mem.max_batch_by_tokens": r["max_batch_by_tokens"]}
        params = {k: r[k] for k in ("cache", "backend", "mode", "batch", "context", "cuda_graph", "radix", "page_size",
                                    "device")}
        cells.append(mirror.Cell(f"{r['tag']}/{r['mode']}/b{r['batch']}/T{r['context']}", params, metrics,
                                 {"oscar.status": str(r["status"])}))
    files = [out / f for f in ("decode.md", "decode.csv", "decode.png", "profile.md", "profile.csv", "serving_rows.jsonl",
                               "decode_env.json")]
    return mirror.mirror("serving", cells, files, env or {}, uri)


def compare_lines(rows: list[dict[str, Any]], ref_path: Path) -> list[str]:
    """Markdown lines: each ok row against the committed row of the same (cache, backend, mode, batch, context)."""
    with open(ref_path, newline="") as fh:
        ref = {(r["cache"], r["backend"], r["mode"], int(r["batch"]), int(r["context"])): r for r in csv.DictReader(fh)}
    lines = []
    for r in sorted(_ok(rows), key=lambda r: (r["mode"], r["batch"], r["context"], r["cache"], r["backend"])):
        old = ref.get((r["cache"], r["backend"], r["mode"], int(r["batch"]), int(r["context"])))
        if old is None or not old.get("decode_ms"):
            continue
        o = float(old["decode_ms"])
        p_new, p_old = r.get("prefill_s"), old.get("prefill_s")
        pre = f"{float(p_old):.2f} | {p_new:.2f}" if p_new is not None and p_old else " | "
        lines.append(f"| {r['cache']}/{r['backend']} | {r['mode']} | {r['batch']} | {r['context']} | {o:.2f} | "
                     f"{r['decode_ms']:.2f} | {r['decode_ms'] / o - 1:+.1%} | {pre} |")
    # OSCAR's ratio to the best BF16, committed and now, at the shapes both have
    for mode, b, n in sorted({(r["mode"], r["batch"], r["context"]) for r in _ok(rows)}):
        best, osc = _best_bf16(rows, mode=mode, batch=b, context=n), [r for r in _ok(rows, mode=mode, batch=b, context=n)
                                                                     if _is_main_oscar(r)]
        old = [x for k, x in ref.items() if k[2:] == (mode, b, n) and x.get("decode_ms")]
        old_osc = [x for x in old if x["cache"] == "oscar"]
        old_bf = [x for x in old if x["cache"] == "bf16"]
        if best and osc and old_osc and old_bf:
            ob = min(old_bf, key=lambda x: float(x["decode_ms"]))
            lines.append(f"| OSCAR speed-up vs best BF16 | {mode} | {b} | {n} | "
                         f"{float(ob['decode_ms']) / float(old_osc[0]['decode_ms']):.2f}x | "
                         f"{best['decode_ms'] / osc[0]['decode_ms']:.2f}x |  |  |  |")
    return lines


PROFILE_COLUMNS = ("tag", "backend", "batch", "context", "step", "part", "ms", "kernels", "wall_ms", "gpu_ms")


def profile_parts(p: dict[str, Any], mode: str) -> dict[str, dict[str, float]]:
    """GPU ms and kernels per step of each part of one profiled step kind (graph | eager): the plugin's labelled
    calls kept, the rest re-classified by name with today's ``kernel_category`` (from the per-kernel list, which
    covers the whole step when the step has at most 25 kernel names; the remainder goes to ``unlisted``)."""
    parts: dict[str, dict[str, float]] = {}
    for k in p.get(f"top_{mode}") or []:
        part = k["part"] if k["part"].startswith("oscar.") else kernel_category(k["name"])
        acc = parts.setdefault(part, {"ms": 0.0, "kernels": 0.0})
        acc["ms"] += k["ms"]
        acc["kernels"] += k["calls"]
    rest = p[f"{mode}_gpu_ms"] - sum(v["ms"] for v in parts.values())
    if rest > 1e-3:
        parts["unlisted"] = {"ms": rest, "kernels": 0.0}
    return parts


def write_profile(profiles: list[dict[str, Any]], out: Path) -> list[str]:
    """profile.csv (one row per profiled shape, step kind and part) and profile.md; returns the markdown lines."""
    rows, md = [], ["# The decode step under torch.profiler (GPU ms per part of one step)", "",
                    "`python -m oscar.bench.serving.one_batch --oscar-profile BxN`: on the synthetic state, 2 warm-up"
                    " + 5 timed steps (`wall_ms`, median), then 5 steps under `torch.profiler` (CPU + CUDA), first as"
                    " SGLang's CUDA-graph replay (`graph`), then eager with the decode graph runner set aside "
                    "(`eager`: the plugin's calls are labelled, `oscar.*`, and a kernel is attributed to the label "
                    "around its launch). `gpu_ms`: the sum of the step's kernel times; `wall - gpu`: the GPU idle "
                    "between them (launch gaps; in eager mode the host's Python). Other parts by kernel name "
                    "(`oscar.bench.serving.trace.CATEGORIES`).", ""]
    for p in profiles:
        if p.get("status") != "ok":
            md += [f"- {p['tag']} batch {p['batch']} context {p['context']}: {p.get('status')}", ""]
            continue
        md += [f"## {p['tag']} ({p['cache']}/{p['backend']}), batch {p['batch']}, context {p['context']} "
               f"({p.get('device', '')})", ""]
        for mode in ("graph", "eager"):
            if f"{mode}_gpu_ms" not in p:
                md += [f"- {mode}: {p.get(f'{mode}_error', 'not measured')}", ""]
                continue
            wall, gpu = p[f"{mode}_wall_ms"], p[f"{mode}_gpu_ms"]
            parts = profile_parts(p, mode)
            md += [f"**{mode}**: wall {wall:.2f} ms per step, GPU {gpu:.2f} ms, wall - gpu {wall - gpu:.2f} ms", "",
                   "| part | GPU ms / step | share of GPU | kernels / step |", "|---|---|---|---|"]
            for part, v in sorted(parts.items(), key=lambda kv: -kv[1]["ms"]):
                md.append(f"| {part} | {v['ms']:.3f} | {v['ms'] / gpu:.0%} | {v['kernels']:.0f} |")
                rows.append(dict(tag=p["tag"], backend=p["backend"], batch=p["batch"], context=p["context"], step=mode,
                                 part=part, ms=round(v["ms"], 4), kernels=round(v["kernels"], 1),
                                 wall_ms=round(wall, 3), gpu_ms=round(gpu, 3)))
            md.append("")
        md += ["Top kernels (graph replay):", "", "| GPU ms / step | calls / step | part | kernel |", "|---|---|---|---|"]
        for k in (p.get("top_graph") or [])[:10]:
            part = k["part"] if k["part"].startswith("oscar.") else kernel_category(k["name"])
            md.append(f"| {k['ms']:.3f} | {k['calls']:.0f} | {part} | `{k['name'][:90]}` |")
        md.append("")
        if p.get("host_eager"):
            md += ["Host time of the eager step (`cProfile` over 5 eager steps, unprofiled by torch; own and "
                   "cumulative microseconds per step, the top functions by own time):", "",
                   "| own us / step | cum us / step | calls / step | function |", "|---|---|---|---|"]
            md += [f"| {h['own_us_per_step']:.0f} | {h['cum_us_per_step']:.0f} | {h['calls_per_step']:g} | "
                   f"`{h['function'][:110]}` |" for h in p["host_eager"][:20]]
            md.append("")
    atomic_write_csv(out / "profile.csv", rows, PROFILE_COLUMNS)
    atomic_write_text(out / "profile.md", "\n".join(md) + "\n")
    return md


def _header(rows: list[dict[str, Any]], env: dict[str, Any]) -> list[str]:
    o = env.get("options") or {}
    sink, recent, page = o.get("sink", 64), o.get("recent", 256), o.get("page_size", 16)
    mem, running = o.get("mem_fraction", 0.85), o.get("max_running", 64)
    dev = sorted({str(r.get("device")) for r in rows})
    lines = [f"# SGLang serving: decode step and prefill ({', '.join(dev)})", ""]
    if env:
        lines += [hardware_line(env), "", f"Command: `{env.get('command', '?')}`", ""]
        if env.get("contract"):
            lines += [f"The plugin's SGLang contract (`oscar.serve.contract.check_contract`): {env['contract']}.", ""]
    lines += [f"SGLang `bench_one_batch` timing (`python -m oscar.bench.serving.one_batch`: SGLang's `load_model`, "
              "`latency_test_run_once` and decode step, plugin loaded), `--load-format dummy` weights (the model's "
              "config), CUDA graphs on for decode (one graph per batch size of the rows; rows tagged `_nograph`: "
              f"`--disable-cuda-graph`), `--mem-fraction-static {mem}`, "
              f"`--max-running-requests {running}`, `--disable-radix-cache`, output 16 tokens, median decode step. "
              f"OSCAR: INT2, one group per row, sink {sink}, recent {recent}, `--page-size {page}` (per-channel "
              "formats: pages of whole key blocks of 32, `format` column `rotated_channel`), fragment-order "
              "pages read by the mma CUDA kernel, seeded random dense rotations with means (the kernel work of a "
              "calibrated artifact). Baseline: SGLang's best BF16 backend at each shape (flashinfer; triton beside "
              "it). Rows `real`: prefill forward, then 15 timed decode steps (`bench_one_batch`); rows `synthetic`: "
              "the same decode steps on a synthetic state (SGLang's own allocator and `req_to_token` hold the "
              "batch's slots, the pool holds random valid data, no prefill forward: `oscar/bench/serving/synthetic.py`), "
              "so that every (batch, context) that fits in the pool is measured; `capacity`: over the server's token "
              "capacity by `bench_one_batch`'s rule (batch > capacity // (context + 16)). Reproduce:", "", "```",
              REPRODUCE, "```", ""]
    return lines


def write_report(paths: list[Path], out: Path, env: Optional[dict[str, Any]] = None, notes: Optional[Path] = None,
                 compare: Optional[Path] = None, profile: Optional[Path] = None) -> list[Path]:
    """decode.{csv,md,png} (and profile.{csv,md} from ``profile`` or ``profile_rows.jsonl`` beside the first rows
    file) from the rows of ``paths``; returns the files written."""
    rows = load_rows(paths)
    if not rows:
        raise ValueError(f"no rows in {[str(p) for p in paths]}")
    out.mkdir(parents=True, exist_ok=True)
    table = table_rows(rows)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    w.writerows(table)
    atomic_write_text(out / "decode.csv", buf.getvalue())
    md = _header(rows, env or {})
    tg = targets(rows)
    if tg:
        md += ["## The issue's targets (synthetic-state rows, this run)", "",
               "| target | asked | measured | ratio | |", "|---|---|---|---|---|", *tg, ""]
    gr = grid(rows)
    if gr:
        md += ["## Decode ms per step (synthetic state)", "", *gr, ""]
    cc = cross_check(rows)
    if cc:
        md += ["## Real prefill, then decode (batch 1), and the synthetic state at the same shape", "",
               "| cache/backend | batch | context | prefill s | decode ms (real) | decode ms (synthetic) | synthetic vs real |",
               "|---|---|---|---|---|---|---|", *cc, ""]
    fr = format_ratios(rows)
    if fr:
        md += ["## Each OSCAR format against the per-token format (same mode, shape and CUDA-graph setting)", "",
               "| mode | batch | context | cuda_graph | format ms | per-token ms | ratio |", "|---|---|---|---|---|---|---|",
               *fr, ""]
    sp = speedups(rows)
    if sp:
        md += ["## OSCAR vs the best BF16 backend of the same mode, shape and CUDA-graph setting (decode step)", "",
               "| mode | batch | context | best BF16 ms | OSCAR ms | speed-up |", "|---|---|---|---|---|---|", *sp, ""]
    if compare is not None:
        cl = compare_lines(rows, compare)
        md += [f"## Against the committed numbers (`{compare}`)", "",
               "| cache/backend | mode | batch | context | decode ms committed | decode ms now | now vs committed | "
               "prefill s committed | prefill s now |", "|---|---|---|---|---|---|---|---|---|",
               *(cl or ["| (no common rows) | | | | | | | | |"]), ""]
    ag = agreement(rows)
    if ag:
        md += ["## Greedy tokens against BF16 (real rows: same seeded prompts; first request of the batch)", "",
               "| OSCAR row | BF16 backend | batch | context | equal tokens | first difference |",
               "|---|---|---|---|---|---|", *ag, ""]
    if notes is not None and notes.is_file():  # the reading of the run, before the full table
        md += [notes.read_text().rstrip(), ""]
    md += ["## All rows", "", "| " + " | ".join(MD_COLUMNS) + " |", "|" + "---|" * len(MD_COLUMNS)]
    for r in table:
        md.append("| " + " | ".join(_fmt(r[c]) for c in MD_COLUMNS) + " |")
    atomic_write_text(out / "decode.md", "\n".join(md) + "\n")
    written = [out / "decode.csv", out / "decode.md"]
    try:
        write_png(rows, out / "decode.png")
        written.append(out / "decode.png")
    except ImportError:
        print("matplotlib missing: no decode.png", file=sys.stderr)
    print("\n".join(md))
    prof = profile if profile is not None else paths[0].parent / "profile_rows.jsonl"
    if prof.is_file():
        profiles = [json.loads(x) for x in prof.read_text().splitlines() if x.strip()]
        print("\n".join(write_profile(profiles, out)))
        written += [out / "profile.csv", out / "profile.md"]
    elif profile is not None:
        raise FileNotFoundError(f"profile={profile}: no such file")
    return written

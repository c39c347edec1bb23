"""Where a prefix hit's time goes: the prefix sweep's ``profile`` mode (``python -m oscar gpu prefix profile=1``).

``oscar.bench.prefix.sweep --profile DIR`` times one prompt cold, then hitting its own cached prefix, first
unprofiled (the TTFTs as served), then each under SGLang's ``torch.profiler`` inside the scheduler process
(``Engine.start_profile`` / ``stop_profile``: CPU + CUDA activities; the second hit also with Python stacks), with
the plugin's phases labelled (``OSCAR_PROFILE_LABELS=1``, ``oscar.serve.labels``). This module reads each chrome
trace back into a compact summary (``summarize``) and writes ``prefix_profile.{md,json}`` (``write_profile``):

- the extend forward's window (the first ``oscar.extend`` range's start to the last one's end: the model's layers),
  its host wall time, the GPU time of the kernels launched inside it, its host syncs;
- per ``oscar.*`` label: calls, host ms (inclusive, and self: Python and un-profiled host work of the label itself),
  GPU ms of the kernels launched inside it (innermost label);
- GPU ms by part of the window (the label, else ``oscar.bench.serving.trace.kernel_category``), the top kernels,
  the top host events by self time (with stacks, the top Python functions).

A kernel belongs to the label around its launch (same correlation id), so an unlabelled kernel is the model's
(GEMMs, norms, RoPE) or SGLang's (sampling, metadata). ``wall - gpu`` of the window is the GPU idle inside it: launch
gaps and host syncs. Plain Python (no torch): the report is rebuilt anywhere; the timed extend attention of the hit
by route is ``oscar.bench.prefix.extend_bench`` (its rows' Markdown: ``bench_lines``).
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from oscar.bench.host import hardware_line
from oscar.bench.serving.trace import kernel_category
from oscar.core.files import atomic_write_text

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy")
LABEL_PREFIX = "oscar."


def read_trace(path: Path) -> dict[str, Any]:
    """A chrome trace (``.json`` or ``.json.gz``, as ``torch.profiler`` exports it)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return data if isinstance(data, dict) else {"traceEvents": data}


def find_trace(folder: Path) -> Path:
    """The one trace SGLang's profiler wrote under ``folder`` (rank 0's when several)."""
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith((".json", ".json.gz")))
    if not found:
        raise FileNotFoundError(f"no *.json / *.json.gz trace under {folder} (did the profiler run in the scheduler?)")
    return next((p for p in found if "TP-0" in p.name), found[0])


def _end(e: dict[str, Any]) -> float:
    return float(e["ts"]) + float(e.get("dur", 0.0))


def self_times(events: list[dict[str, Any]]) -> dict[int, float]:
    """Self time (us) of each host event (by ``id``): its duration less its direct children's on the same thread.
    An event's parent is the innermost open event that contains it whole (a ``record_function`` range opens inside
    its Python ``__enter__`` and outlives it: the range is the child of the function around both)."""
    by_thread: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[int, float] = {}
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack: list[dict[str, Any]] = []
        for e in evs:
            t, end, dur = float(e["ts"]), _end(e), float(e.get("dur", 0.0))
            stack = [x for x in stack if _end(x) > t]
            parent = next((x for x in reversed(stack) if _end(x) >= end), None)
            out[id(e)] = dur
            if parent is not None:
                out[id(parent)] -= dur
            stack.append(e)
    return out


def _innermost(ranges: list[dict[str, Any]], pid: Any, tid: Any, t: float) -> Optional[dict[str, Any]]:
    inside = [r for r in ranges if (r.get("pid"), r.get("tid")) == (pid, tid) and float(r["ts"]) <= t <= _end(r)]
    return min(inside, key=lambda r: float(r.get("dur", 0.0))) if inside else None


def _top(acc: dict[Any, list[float]], n: int, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows of ``acc`` (key or key tuple -> values) named by ``keys``, the ``n`` largest by the last value."""
    rows = [dict(zip(keys, (*k, *v))) if isinstance(k, tuple) else dict(zip(keys, (k, *v))) for k, v in acc.items()]
    for r in rows:  # counts
        r.update({c: int(r[c]) for c in ("calls", "kernels") if c in r})
    return sorted(rows, key=lambda r: -r[keys[-1]])[:n]


def summarize(trace: dict[str, Any], top: int = 15) -> dict[str, Any]:
    """The compact summary of one profiled request (see the module docstring); times in ms."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    host = [e for e in events if e.get("cat") in HOST_CATS]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    labels = [e for e in host if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(LABEL_PREFIX)]
    selfs = self_times(host)
    launches = {(e.get("args") or {}).get("correlation"): e for e in host
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and (e.get("args") or {}).get("correlation") is not None}
    extend = [r for r in labels if r["name"] == "oscar.extend"]
    lo = min((float(r["ts"]) for r in extend), default=None)
    hi = max((_end(r) for r in extend), default=None)
    in_window = (lambda t: lo is not None and lo <= t <= hi)  # noqa: E731

    phase: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0.0])  # calls, host, self, gpu, kernels
    for r in labels:
        p = phase[r["name"]]
        p[0] += 1
        p[1] += float(r.get("dur", 0.0)) / 1e3
        p[2] += selfs.get(id(r), 0.0) / 1e3
    parts: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    kernels: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    gpu_ms = gpu_all = 0.0
    for k in gpu:
        dur = float(k.get("dur", 0.0)) / 1e3
        gpu_all += dur
        launch = launches.get((k.get("args") or {}).get("correlation"))
        t = float(launch["ts"]) if launch is not None else float(k["ts"])
        r = _innermost(labels, launch.get("pid"), launch.get("tid"), t) if launch is not None else None
        part = r["name"] if r is not None else kernel_category(str(k.get("name", "")))
        if r is not None:
            phase[r["name"]][3] += dur
            phase[r["name"]][4] += 1
        if in_window(t):
            gpu_ms += dur
            parts[part][0] += dur
            parts[part][1] += 1
            kernels[(str(k.get("name", ""))[:120], part)][0] += dur
            kernels[(str(k.get("name", ""))[:120], part)][1] += 1
    syncs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    host_top: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    py_top: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in host:
        name, cat = str(e.get("name", "")), str(e.get("cat"))
        if cat == "python_function" and not (lo is not None and float(e["ts"]) <= lo and _end(e) >= hi):
            py_top[name[:140]][0] += 1  # not the frames around the whole extend (the scheduler loop, threads)
            py_top[name[:140]][1] += selfs.get(id(e), 0.0) / 1e3
        if not in_window(float(e["ts"])):
            continue
        if name in SYNCS:
            syncs[name][0] += 1
            syncs[name][1] += float(e.get("dur", 0.0)) / 1e3
        if cat != "python_function":
            host_top[(name[:120], cat)][0] += 1
            host_top[(name[:120], cat)][1] += selfs.get(id(e), 0.0) / 1e3
    span = (min(float(e["ts"]) for e in host), max(_end(e) for e in host)) if host else (0.0, 0.0)
    return dict(
        span_ms=(span[1] - span[0]) / 1e3,
        gpu_ms_all=gpu_all,
        extend=None if lo is None else dict(
            wall_ms=(hi - lo) / 1e3, gpu_ms=gpu_ms, start_ms=(lo - span[0]) / 1e3, layers=len(extend),
            syncs={k: dict(calls=int(v[0]), ms=v[1]) for k, v in syncs.items()}),
        phases=[dict(label=k, calls=int(v[0]), host_ms=v[1], self_ms=v[2], gpu_ms=v[3], kernels=int(v[4]))
                for k, v in sorted(phase.items(), key=lambda kv: -kv[1][1])],
        parts=_top({k: [v[1], v[0]] for k, v in parts.items()}, 50, ("part", "kernels", "gpu_ms")),
        top_kernels=_top({k: [v[1], v[0]] for k, v in kernels.items()}, top, ("name", "part", "calls", "gpu_ms")),
        top_host=_top({k: [v[0], v[1]] for k, v in host_top.items()}, top, ("name", "cat", "calls", "self_ms")),
        top_python=_top({k: [v[0], v[1]] for k, v in py_top.items()}, top, ("name", "calls", "self_ms")),
    )


def _f(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def markdown(results: list[dict[str, Any]], header: list[str]) -> list[str]:
    """The profile's markdown: one section per profiled request (``name``, ``ttft_s``, ``cached``, ``summary``)."""
    md = list(header)
    md += ["| request | TTFT s (profiled) | TTFT s (unprofiled) | cached tokens | extend starts at ms | extend wall ms | "
           "extend GPU ms | wall - GPU ms | host syncs in the extend | trace span ms |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s, e = r["summary"], r["summary"].get("extend") or {}
        nsync = sum(v["calls"] for v in (e.get("syncs") or {}).values())
        md.append(f"| {r['name']} | {_f(r.get('ttft_s'))} | {_f(r.get('ttft_unprofiled_s'))} | {r.get('cached')} | "
                  f"{_f(e.get('start_ms', '-'))} | {_f(e.get('wall_ms', '-'))} | {_f(e.get('gpu_ms', '-'))} | "
                  f"{_f(e['wall_ms'] - e['gpu_ms']) if e else '-'} | {nsync} | {_f(s['span_ms'])} |")
    md += ["", "`extend starts at`: from the profiler's start (the request is submitted right after it) to the first "
           "layer's `oscar.extend`: the scheduler's work before the forward (queueing, prefix match, allocation, "
           "metadata). TTFT minus that minus the extend wall: the rest of the forward (lm_head, sampling) and the "
           "output's way back."]
    for r in results:
        s = r["summary"]
        md += ["", f"## {r['name']}", "", "Plugin phases (whole trace; GPU ms of the kernels launched inside, innermost "
               "label):", "", "| label | calls | host ms | host self ms | GPU ms | kernels |", "|---|---|---|---|---|---|"]
        md += [f"| {p['label']} | {p['calls']} | {_f(p['host_ms'])} | {_f(p['self_ms'])} | {_f(p['gpu_ms'])} | "
               f"{p['kernels']} |" for p in s["phases"]]
        if s["parts"]:
            md += ["", "GPU ms by part of the extend forward:", "", "| part | GPU ms | kernels |", "|---|---|---|"]
            md += [f"| {p['part']} | {_f(p['gpu_ms'])} | {p['kernels']} |" for p in s["parts"]]
        if s["top_kernels"]:
            md += ["", "Top kernels of the extend forward:", "", "| kernel | part | GPU ms | calls |", "|---|---|---|---|"]
            md += [f"| `{k['name']}` | {k['part']} | {_f(k['gpu_ms'])} | {k['calls']} |" for k in s["top_kernels"]]
        syncs = (s.get("extend") or {}).get("syncs") or {}
        if syncs:
            md += ["", "Host syncs in the extend forward: " + ", ".join(f"{k} {v['calls']} x ({_f(v['ms'])} ms)"
                                                                      for k, v in syncs.items())]
        if s["top_host"]:
            md += ["", "Top host events of the extend forward by self time:", "", "| event | kind | calls | self ms |",
                   "|---|---|---|---|"]
            md += [f"| `{h['name']}` | {h['cat']} | {h['calls']} | {_f(h['self_ms'])} |" for h in s["top_host"]]
        if s["top_python"]:
            md += ["", "Top Python functions by self time (whole trace, less the frames around the whole extend):", "", "| function | calls | self ms |",
                   "|---|---|---|"]
            md += [f"| `{h['name']}` | {h['calls']} | {_f(h['self_ms'])} |" for h in s["top_python"]]
    return md


def write_profile(results: list[dict[str, Any]], out: Path, header: list[str]) -> list[Path]:
    """``prefix_profile.json`` (``header`` and the summaries) and ``prefix_profile.md`` under ``out``; returns them."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "prefix_profile.json", json.dumps(dict(header=header, results=results), indent=1) + "\n")
    return rewrite(out)


def rewrite(out: Path, env: Optional[dict[str, Any]] = None) -> list[Path]:
    """``prefix_profile.md`` from ``prefix_profile.json`` (with the hardware line of ``env`` when given)."""
    path = out / "prefix_profile.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no profile (run `python -m oscar gpu prefix profile=true out={out}` on a GPU)")
    data = json.loads(path.read_text())
    header = list(data["header"])
    if env:
        header[1:1] = ["", hardware_line(env), "", f"Command: `{env.get('command', '?')}`"]
    md = markdown(data["results"], header)
    bench = out / "prefix_extend_bench.json"
    if bench.is_file():
        md += bench_lines(json.loads(bench.read_text()))
    atomic_write_text(out / "prefix_profile.md", "\n".join(md) + "\n")
    print("\n".join(md[: 4 + len(data["results"]) + len(header)]))
    return [out / "prefix_profile.md", path]


def bench_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown of `extend_bench`'s rows."""
    if not rows:
        return []
    r0 = rows[0]
    md = ["", f"## One layer's extend attention of the hit, by route ({r0['n']} queries x {r0['heads']} heads over "
          f"{r0['prefix']} cached positions, {r0['hkv']} KV heads, d {r0['d']}, {r0['device']})", "",
          "`python -m oscar.bench.prefix.extend_bench`: CUDA events, median of 10. `pages`: the Triton kernel reading "
          "the codes in place (the served route); `dequant`: the pages dequantized once, then SDPA (flash, FP16); "
          "`twin`: torch dequantization (as the old route). `x layers`: the hit's attention if every layer took it.",
          "", "| route | ms per layer | ms x layers | max rel. diff vs pages |", "|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['route']} | {r['error']} | | |")
        else:
            md.append(f"| {r['route']} | {r['ms_per_layer']:.3f} | {r['ms_per_hit']:.1f} | {r['rel_vs_pages']:.2e} |")
    return md


__all__ = ["bench_lines", "find_trace", "markdown", "read_trace", "rewrite", "self_times", "summarize", "write_profile"]

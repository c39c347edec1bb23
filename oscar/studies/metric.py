"""Which selection metric orders the KV-cache methods as HumanEval pass@1 does: a metric that a method (or
`auto`'s per-layer choice) can be tuned on must rank the methods the way the benchmark does.

    python -m oscar.studies.metric --stride 4 --out-dir reports/accuracy/metric

Rows are the HumanEval cells already measured (`reports/accuracy/humaneval.csv` and `windows/`, per-problem
verdicts in their `items.jsonl`): a label `name[@SxW]` is a method with sink/recent S/W (default 16/64, the
table's), `--row LABEL=METHOD,OVERRIDE,...` adds a row made with other settings (e.g. a code-calibrated
artifact). For every row the candidates are computed with the engine's decode-equivalent cache (every position
sees the quantized history as the cache holds it while decoding), on the task's own prompts:

- `kl_task`: next-token KL(BF16 || method), teacher-forced on BF16's greedy completion of each problem (the
  prompt built as the eval builds it: chat template, answer opened with the signature), over the completion's
  positions;
- `top1_task`: share of those positions where the method's argmax is BF16's (agreement of greedy continuations,
  teacher-forced so that one divergence does not decide the rest);
- `attn_task`: relative error of the attention output (the input of `o_proj`, every head) against BF16 at those
  positions, the mean over layers of `sum |a - a_bf16|^2 / sum |a_bf16|^2`;
- `kl_code2k`: the platform's metric, next-token KL over held-out code windows of 2048 tokens (the `code`
  calibration corpus's evaluation split), positions that read quantized history;
- `greedy_same`: share of problems whose free-running greedy completion equals BF16's (read from the eval's own
  records, so it costs a generation run; listed as the upper bound of what agreement can say).

Each candidate's Spearman rank correlation with pass@1 over the rows (error metrics negated, so +1 means the
same order) comes with a 95% bootstrap interval over problems: one resample of the 164 problems gives every
row's pass@1 and, from the resampled problems in the subset, every row's metric.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from oscar.core.files import atomic_write_text
from oscar.config import compose
from oscar.data.corpora import eval_sequences
from oscar.eval.items import prompt_hash
from oscar.eval.runner import generation_prompt
from oscar.eval.runner import prepare_items
from oscar.models import load_model
from oscar.models.adapters import get_adapter
from oscar.models.engine import Engine
from oscar.models.engine import Engine, method_format
from oscar.studies.kl_table import _method_cfg, _rotations
from oscar.studies.kl_table import _method_cfg, kl_and_nll, score_and_bits
from oscar.studies.kl_table import hardware

MODEL = "qwen2.5-coder-0.5b"
TABLE_WINDOWS = (16, 64)  # the HumanEval table's sink/recent (conf/experiment/coder.yaml)
DEFAULT_ROWS = ["bf16", "int2", "auto", "kivi2", "quarot", "oscar", "turboquant", "saw_int4", "auto@16x96", "kivi2@16x32"]
HUMANEVAL_OVERRIDES = ["benchmark=humaneval", "+benchmark.extra.answer_start=function"]
CANDIDATES = {  # name -> (column, higher is better)
    "kl_task": ("KL on the task's completions (nats)", False),
    "top1_task": ("top-1 agreement on the task's completions", True),
    "attn_task": ("attention-output relative error on the task", False),
    "kl_code2k": ("KL on held-out code, 2048-token windows (platform metric)", False),
    "greedy_same": ("greedy completion equal to BF16's (share of problems)", True),
}
N_BOOT = 2000


@dataclass
class RowSpec:
    """One row: its label, method name, sink/recent and extra Hydra overrides of its method and artifact."""

    label: str
    method: str
    sink: int
    recent: int
    overrides: list[str] = field(default_factory=list)


def parse_row(text: str) -> RowSpec:
    """`name[@SxW]` or `LABEL=METHOD[,OVERRIDE...]` (OVERRIDE: a Hydra override, e.g. `method.channel_block=32`,
    `calibration=code`, `results_dir=...`; `method.sink=`/`method.recent=` set the windows)."""
    label, eq, rest = text.partition("=")
    head = label
    sink, recent = TABLE_WINDOWS
    overrides: list[str] = []
    if eq:
        parts = [p for p in rest.split(",") if p]
        if not parts:
            raise ValueError(f"--row {text!r}: expected LABEL=METHOD[,OVERRIDE...], e.g. auto+ch32=auto,method.channel_block=32")
        head, overrides = parts[0], parts[1:]
    name, at, windows = head.partition("@")
    if at:
        s, x, w = windows.partition("x")
        if not (x and s.isdigit() and w.isdigit()):
            raise ValueError(f"row {text!r}: windows {windows!r} must read SxW, e.g. auto@16x96")
        sink, recent = int(s), int(w)
    name = name.split("+")[0]
    kept = []
    for o in overrides:
        key, _, value = o.partition("=")
        if key == "method.sink":
            sink = int(value)
        elif key == "method.recent":
            recent = int(value)
        else:
            kept.append(o)
    return RowSpec(label, name, sink, recent, kept)


# ------------------------------------------------------------------------------------------- pass@1

def pass_records(label: str, roots: Sequence[Path], model: str = MODEL) -> Optional[Path]:
    """The per-problem records of a HumanEval row: `<root>/partial/humaneval_<label>.items.jsonl`, else
    `<root>/**/eval/<model>/<label>/humaneval/seed0/items.jsonl` (first root that has one)."""
    for root in roots:
        flat = root / "partial" / f"humaneval_{label}.items.jsonl"
        if flat.is_file():
            return flat
        for cell in sorted(root.glob(f"**/eval/{model}/{label}/humaneval/seed0/items.jsonl")):
            return cell
    return None


def read_verdicts(path: Path) -> dict[str, dict]:
    """id -> record (the last record of an id wins, as the eval's resume does)."""
    out: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[str(rec["id"])] = rec
    return out


# ------------------------------------------------------------------------------------------ statistics

def ranks(x: Sequence[float]) -> torch.Tensor:
    """Average ranks (ties share the mean rank), float64."""
    v = torch.as_tensor(list(x), dtype=torch.float64)
    order = torch.argsort(v, stable=True)
    r = torch.empty_like(v)
    sv = v[order]
    i = 0
    n = len(v)
    while i < n:
        j = i
        while j + 1 < n and sv[j + 1] == sv[i]:
            j += 1
        r[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return r


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson of average ranks); NaN when either side is constant."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den > 0 else float("nan")


def bootstrap_spearman(
    verdicts: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, in_subset: torch.Tensor, higher_better: bool,
    *, n_boot: int = N_BOOT, seed: int = 0,
) -> tuple[float, float, float]:
    """Spearman of pass@1 with a metric over rows, and its 95% percentile interval over problem resamples.

    `verdicts` `[R, P]` 0/1 per row and problem; `sums`/`counts` `[R, P]` the metric's numerator and weight per
    problem (zero outside the subset); `in_subset` `[P]` bool. One resample of the P problems gives every row's
    pass@1 (mean verdict) and metric (ratio of summed numerators to summed weights over the resampled problems);
    resamples whose metric has no weight are skipped."""
    sign = 1.0 if higher_better else -1.0
    point = spearman(verdicts.double().mean(1).tolist(), (sign * sums.sum(1) / counts.sum(1)).tolist())
    g = torch.Generator().manual_seed(seed)
    p = verdicts.shape[1]
    vals = []
    for _ in range(n_boot):
        idx = torch.randint(0, p, (p,), generator=g)
        w = counts[:, idx].sum(1)
        if bool((w <= 0).any()):
            continue
        acc = verdicts[:, idx].double().mean(1)
        met = sign * sums[:, idx].sum(1) / w
        s = spearman(acc.tolist(), met.tolist())
        if not math.isnan(s):
            vals.append(s)
    if not vals:
        return point, float("nan"), float("nan")
    t = torch.tensor(vals, dtype=torch.float64)
    return point, float(torch.quantile(t, 0.025)), float(torch.quantile(t, 0.975))


def ratio_ci(sums: torch.Tensor, counts: torch.Tensor, *, n_boot: int = N_BOOT, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of `sum(sums) / sum(counts)` over resamples of the problems (1-D tensors)."""
    keep = counts > 0
    s, c = sums[keep].double(), counts[keep].double()
    if s.numel() == 0:
        return float("nan"), float("nan")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, s.numel(), (n_boot, s.numel()), generator=g)
    vals = s[idx].sum(1) / c[idx].sum(1)
    return float(torch.quantile(vals, 0.025)), float(torch.quantile(vals, 0.975))


# ----------------------------------------------------------------------------------- per-sequence metrics

class AttnOutputs:
    """Forward pre-hooks on every layer's `o_proj` that keep its input (the attention output of all heads) at
    chosen positions."""

    def __init__(self, model: Any):

        adapter = get_adapter(model)
        n = len(adapter.layers(model))
        self.positions: Optional[slice] = None
        self.out: list[Optional[torch.Tensor]] = [None] * n
        self.handles = [adapter.projections(model, i)["o"].register_forward_pre_hook(self._hook(i)) for i in range(n)]

    def _hook(self, layer: int) -> Callable:
        def hook(_module: Any, args: tuple) -> None:
            x = args[0]
            self.out[layer] = (x[0] if self.positions is None else x[0, self.positions]).detach().double()
        return hook

    def take(self) -> list[torch.Tensor]:
        """The captured `[T, hidden]` per layer, and reset."""
        out = [t for t in self.out if t is not None]
        self.out = [None] * len(self.out)
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def completion_metrics(ref_logits: torch.Tensor, logits: torch.Tensor, start: int, stop: int) -> dict[str, float]:
    """KL sum and top-1 matches over the positions `start..stop-1` whose logits predict the completion's tokens
    (`[1, T, V]` logits)."""
    lr = torch.log_softmax(ref_logits[0, start:stop].double(), dim=-1)
    lm = torch.log_softmax(logits[0, start:stop].double(), dim=-1)
    kl = (lr.exp() * (lr - lm)).sum(-1)
    same = (lr.argmax(-1) == lm.argmax(-1)).double()
    return {"kl_sum": float(kl.sum()), "top1_sum": float(same.sum()), "n": float(stop - start)}


def attn_error(ref: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> float:
    """Mean over layers of `sum |a - a_ref|^2 / sum |a_ref|^2` (one sequence's positions)."""
    errs = [float(((o - r) ** 2).sum() / (r ** 2).sum().clamp_min(1e-300)) for r, o in zip(ref, out)]
    return sum(errs) / max(len(errs), 1)


# ------------------------------------------------------------------------------------------------ run

def task_sequences(tok: Any, items: Sequence[Any], predictions: dict[str, str], cfg: Any) -> list[dict]:
    """Per problem: the prompt as the eval renders it, its hash, and prompt + BF16 completion token ids."""

    class _Tok:  # generation_prompt reads engine.tokenizer only
        tokenizer = tok

    out = []
    for item in items:
        prompt = generation_prompt(_Tok, cfg, item)
        p_ids = tok(prompt, add_special_tokens=True)["input_ids"]
        c_ids = tok(predictions[item.id], add_special_tokens=False)["input_ids"]
        out.append({"id": item.id, "prompt_hash": prompt_hash(prompt), "ids": torch.tensor(p_ids + c_ids)[None],
                    "start": len(p_ids) - 1, "stop": len(p_ids) + len(c_ids) - 1})
    return out


def build_engines(model: Any, tok: Any, rows: Sequence[RowSpec], results_dir: str, log: Callable = print) -> dict[str, Any]:
    """One engine per row (shared model, values not folded), or the reason it could not be built."""

    engines: dict[str, Any] = {}
    for row in rows:
        sets = {row.method: [f"method.sink={row.sink}", f"method.recent={row.recent}", *row.overrides]}
        try:
            cfg, method = _method_cfg(row.method, None, None, MODEL, results_dir, sets)
            fmt = method_format(method, model)
            rotations = _rotations(cfg, method, model) if fmt.rotated else None
            engines[row.label] = Engine(model, tok, method, rotations)
        except (FileNotFoundError, ValueError) as exc:
            engines[row.label] = f"missing: {exc}"
            log(f"{row.label}: skipped ({exc})")
    return engines


BLOCK = 128  # code KL: positions per bootstrap unit (as oscar.studies.kl_table)


@torch.no_grad()
def measure(
    model: Any, tok: Any, rows: Sequence[RowSpec], engines: dict[str, Any], seqs: Sequence[dict],
    code_windows: Sequence[torch.Tensor], *, model_name: str = MODEL, results_dir: str = "results",
    raw: Optional[dict] = None, save: Optional[Callable[[dict], None]] = None, log: Callable = print,
) -> dict:
    """Per row: `task[problem id]` = {`kl_sum`, `top1_sum`, `n`, `attn`, `bits`} over the completion's positions,
    `code[window]` = [[KL sum, positions], ...] per block of `BLOCK` positions that read quantized history.
    `raw` holds earlier measurements (kept, not recomputed); `save(raw)` runs after every problem and window."""

    raw = raw if raw is not None else {}
    live = [r for r in rows if not isinstance(engines.get(r.label), str)]
    for r in live:
        raw.setdefault(r.label, {}).setdefault("task", {})
        raw[r.label].setdefault("code", {})
    ref_eng = Engine(model, tok, _method_cfg("bf16", None, None, model_name, results_dir)[1])
    hooks = AttnOutputs(model)
    try:
        for i, s in enumerate(seqs):
            todo = [r for r in live if s["id"] not in raw[r.label]["task"]]
            if not todo:
                continue
            t0 = time.perf_counter()
            hooks.positions = slice(s["start"], s["stop"])
            ref = ref_eng.score(s["ids"], mode="decode_equivalent")
            ref_attn = hooks.take()
            for row in todo:
                eng = engines[row.label]
                if not eng.format.quantized:  # the BF16 row is the reference itself
                    m = completion_metrics(ref, ref, s["start"], s["stop"])
                    raw[row.label]["task"][s["id"]] = {**m, "attn": 0.0, "bits": 16.0}
                    continue
                logits, bits = score_and_bits(eng, s["ids"])
                m = completion_metrics(ref, logits, s["start"], s["stop"])
                raw[row.label]["task"][s["id"]] = {**m, "attn": attn_error(ref_attn, hooks.take()), "bits": bits}
            if save is not None:
                save(raw)
            log(f"task {i + 1}/{len(seqs)} {s['id']} ({s['ids'].shape[1]} tokens, {s['stop'] - s['start']} completion, "
                f"{len(todo)} rows) {time.perf_counter() - t0:.1f} s")
        hooks.positions = slice(0, 0)
        for j, ids in enumerate(code_windows):
            key = f"w{j}"
            todo = [r for r in live if key not in raw[r.label]["code"]]
            if not todo:
                continue
            t0 = time.perf_counter()
            ref = ref_eng.score(ids[None], mode="decode_equivalent")
            for row in todo:
                eng = engines[row.label]
                if not eng.format.quantized:
                    raw[row.label]["code"][key] = [[0.0, float(n)] for n in _block_sizes(ids.numel() - 1, BLOCK)]
                    continue
                logits, _ = score_and_bits(eng, ids[None])
                kl, _ = kl_and_nll(ref, logits, ids[None])
                past = kl[row.sink + row.recent if eng.format.quantized else 0:]
                raw[row.label]["code"][key] = [[float(past[a:a + BLOCK].sum()), float(past[a:a + BLOCK].numel())]
                                               for a in range(0, past.numel(), BLOCK)]
                del logits
            hooks.take()
            if save is not None:
                save(raw)
            log(f"code window {j + 1}/{len(code_windows)} ({len(todo)} rows) {time.perf_counter() - t0:.1f} s")
    finally:
        hooks.close()
    return raw


def _block_sizes(n: int, block: int) -> list[int]:
    return [min(block, n - a) for a in range(0, n, block)]


def merge_raw(paths: Sequence[Path]) -> dict:
    """Per-row measurements of several raw files (missing files skipped); a later file adds problems and
    windows to a row, replacing the same ones."""
    out: dict = {}
    for path in paths:
        if not path.is_file():
            continue
        for label, part in json.loads(path.read_text())["rows"].items():
            row = out.setdefault(label, {"task": {}, "code": {}})
            row["task"].update(part.get("task", {}))
            row["code"].update(part.get("code", {}))
    return out


def summarize(
    rows: Sequence[RowSpec], raw: dict, verdicts: dict[str, dict[str, dict]], problem_ids: Sequence[str],
    subset_ids: Sequence[str], bf16_label: str = "bf16", n_boot: int = N_BOOT,
) -> tuple[list[dict], list[dict]]:
    """Table rows (pass@1, every candidate with its interval) and the Spearman lines (candidate, rho, interval).
    The task metrics are taken over the subset problems that every row measured (the same problems for every
    row); the code KL only when every row measured the same windows."""
    measured = [r.label for r in rows if r.label in verdicts and r.label in raw]
    subset_ids = [pid for pid in subset_ids if all(pid in raw[lab]["task"] for lab in measured)]
    if not subset_ids:
        raise ValueError(f"no subset problem was measured for every row ({', '.join(measured)})")
    pos = {pid: k for k, pid in enumerate(problem_ids)}
    sub = torch.zeros(len(problem_ids), dtype=torch.bool)
    for pid in subset_ids:
        sub[pos[pid]] = True
    ref_pred = {pid: rec.get("prediction") for pid, rec in verdicts.get(bf16_label, {}).items()}
    labels = measured
    windows = sorted({w for lab in labels for w in raw[lab].get("code", {})})
    code_ok = bool(windows) and all(all(w in raw[lab]["code"] for w in windows) for lab in labels)
    R, P = len(labels), len(problem_ids)
    ver = torch.full((R, P), float("nan"))
    nums = {k: torch.zeros(R, P, dtype=torch.float64) for k in CANDIDATES if k != "kl_code2k"}
    dens = {k: torch.zeros(R, P, dtype=torch.float64) for k in CANDIDATES if k != "kl_code2k"}
    code_s, code_c = [], []
    table = []
    for a, label in enumerate(labels):
        v, task = verdicts[label], raw[label]["task"]
        for pid, k in pos.items():
            if pid in v:
                ver[a, k] = float(bool(v[pid]["correct"]))
                if pid in ref_pred:
                    nums["greedy_same"][a, k] = float(v[pid].get("prediction") == ref_pred[pid])
                    dens["greedy_same"][a, k] = 1.0
        for pid in subset_ids:
            k, m = pos[pid], task[pid]
            nums["kl_task"][a, k], dens["kl_task"][a, k] = m["kl_sum"], m["n"]
            nums["top1_task"][a, k], dens["top1_task"][a, k] = m["top1_sum"], m["n"]
            nums["attn_task"][a, k], dens["attn_task"][a, k] = m["attn"], 1.0
        bits = [task[pid]["bits"] for pid in subset_ids]
        entry: dict[str, Any] = {"row": label, "n": int((~torch.isnan(ver[a])).sum()), "pass_at_1": float(torch.nanmean(ver[a])),
                                 "bits_per_element": sum(bits) / len(bits), "subset": len(subset_ids)}
        series = {k: (nums[k][a], dens[k][a]) for k in nums}
        if code_ok:
            blocks = torch.tensor([b for w in windows for b in raw[label]["code"][w]], dtype=torch.float64)
            code_s.append(blocks[:, 0])
            code_c.append(blocks[:, 1])
            series["kl_code2k"] = (blocks[:, 0], blocks[:, 1])
        for key, (s_, c_) in series.items():
            if float(c_.sum()) > 0:
                lo, hi = ratio_ci(s_, c_, n_boot=n_boot)
                entry.update({key: float(s_.sum() / c_.sum()), f"{key}_lo": lo, f"{key}_hi": hi})
        table.append(entry)
    if bool(torch.isnan(ver).any()):
        raise ValueError("a row lacks a verdict for some problem: every row needs all problems")
    lines = []
    if R < 3:
        return table, lines
    for key, (_, higher) in CANDIDATES.items():
        if key == "kl_code2k":
            if not code_ok or len({int(c.numel()) for c in code_c}) != 1:
                continue
            point, lo, hi = _spearman_independent(ver, torch.stack(code_s), torch.stack(code_c), higher, n_boot)
        else:
            point, lo, hi = bootstrap_spearman(ver, nums[key], dens[key], sub, higher, n_boot=n_boot)
        lines.append({"candidate": key, "spearman": point, "lo": lo, "hi": hi, "rows": R})
    return table, lines


def _spearman_independent(ver: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, higher: bool,
                          n_boot: int, seed: int = 0) -> tuple[float, float, float]:
    """Spearman of pass@1 with a metric measured on other units (blocks of code positions): problems and blocks
    resampled independently."""
    sign = 1.0 if higher else -1.0
    point = spearman(ver.double().mean(1).tolist(), (sign * sums.sum(1) / counts.sum(1)).tolist())
    g = torch.Generator().manual_seed(seed)
    vals = []
    for _ in range(n_boot):
        ip = torch.randint(0, ver.shape[1], (ver.shape[1],), generator=g)
        iw = torch.randint(0, sums.shape[1], (sums.shape[1],), generator=g)
        w = counts[:, iw].sum(1)
        if bool((w <= 0).any()):
            continue
        s = spearman(ver[:, ip].double().mean(1).tolist(), (sign * sums[:, iw].sum(1) / w).tolist())
        if not math.isnan(s):
            vals.append(s)
    if not vals:
        return point, float("nan"), float("nan")
    t = torch.tensor(vals, dtype=torch.float64)
    return point, float(torch.quantile(t, 0.025)), float(torch.quantile(t, 0.975))


# ------------------------------------------------------------------------------------------- reporting

def write_report(table: list[dict], lines: list[dict], out_dir: Path, command: str, note: str, reading: str = "") -> None:
    """`metric.csv` (rows x candidates), `spearman.csv`, `metric.md` (reading, Spearman lines, table, note, command),
    `metric.png`."""
    import pandas as pd

    out_dir.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(table)
    atomic_write_text(out_dir / "metric.csv", df.to_csv(index=False))
    atomic_write_text(out_dir / "spearman.csv", pd.DataFrame(lines).to_csv(index=False))

    def cell(e: dict, k: str, fmt: str) -> str:
        if k not in e or e[k] is None or (isinstance(e[k], float) and math.isnan(e[k])):
            return "-"
        return fmt.format(e[k]) + (f" [{fmt.format(e[k + '_lo'])}, {fmt.format(e[k + '_hi'])}]" if f"{k}_lo" in e else "")

    fmts = {"kl_task": "{:.4f}", "top1_task": "{:.3f}", "attn_task": "{:.4f}", "kl_code2k": "{:.4f}", "greedy_same": "{:.3f}"}
    md = ["# A selection metric that predicts HumanEval pass@1 (Qwen2.5-Coder-0.5B-Instruct)", ""]
    if reading:
        md += [reading.strip(), ""]
    md += [note, "", f"Command: `{command}`", "", "## Spearman rank correlation with pass@1 over the rows", "",
          "| candidate | Spearman [95% CI] | rows |", "|---|---|---|"]
    for ln in sorted(lines, key=lambda x: -x["spearman"]):
        md.append(f"| {CANDIDATES[ln['candidate']][0]} (`{ln['candidate']}`) | {ln['spearman']:+.3f} "
                  f"[{ln['lo']:+.3f}, {ln['hi']:+.3f}] | {ln['rows']} |")
    md += ["", "## Rows", "", "| row | pass@1 | bits/element (task) | " + " | ".join(f"`{k}`" for k in CANDIDATES) + " |",
           "|---|---|---|" + "---|" * len(CANDIDATES)]
    for e in sorted(table, key=lambda x: -x["pass_at_1"]):
        md.append(f"| {e['row']} | {100 * e['pass_at_1']:.1f} | {e['bits_per_element']:.2f} | "
                  + " | ".join(cell(e, k, fmts[k]) for k in CANDIDATES) + " |")
    atomic_write_text(out_dir / "metric.md", "\n".join(md) + "\n")
    _plot(table, lines, out_dir / "metric.png")


def _plot(table: list[dict], lines: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("kl_task", "top1_task", "attn_task", "kl_code2k") if all(k in e for e in table)]
    if not keys:
        return
    rho = {ln["candidate"]: ln for ln in lines}
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), squeeze=False)
    for ax, k in zip(axes[0], keys):
        x = [e[k] for e in table]
        y = [100 * e["pass_at_1"] for e in table]
        ax.scatter(x, y, s=18)
        for e, xi, yi in zip(table, x, y):
            ax.annotate(e["row"], (xi, yi), fontsize=7, xytext=(3, 2), textcoords="offset points")
        if k != "top1_task":
            ax.set_xscale("log")
        r = rho.get(k)
        ax.set_title(f"{k}: Spearman {r['spearman']:+.2f}" if r else k, fontsize=9)
        ax.set_xlabel(CANDIDATES[k][0], fontsize=8)
        ax.set_ylabel("HumanEval pass@1 (%)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    """Command line entry point."""

    p = argparse.ArgumentParser(prog="python -m oscar.studies.metric", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, help="row labels name[@SxW] (default: the 10 HumanEval rows)")
    p.add_argument("--row", nargs="*", default=[], metavar="LABEL=METHOD,OVERRIDE",
                   help="extra rows made with other settings, e.g. auto+ch32=auto,method.channel_block=32,results_dir=R")
    p.add_argument("--records", nargs="+", default=["reports/accuracy", "reports/accuracy/windows"],
                   help="where the rows' HumanEval records are (partial/humaneval_<label>.items.jsonl or eval/.../items.jsonl)")
    p.add_argument("--stride", type=int, default=4, help="metric subset: every stride-th problem (HumanEval/0, /stride, ...)")
    p.add_argument("--limit", type=int, default=0, help="at most this many subset problems (0: all)")
    p.add_argument("--code-windows", type=int, default=3, help="held-out code windows of --code-len tokens (0: skip)")
    p.add_argument("--code-len", type=int, default=2048)
    p.add_argument("--results-dir", default="results", help="calibration artifacts: <dir>/calibration/<model>/<method>/")
    p.add_argument("--out-dir", default="reports/accuracy/metric")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-boot", type=int, default=N_BOOT)
    p.add_argument("--raw", nargs="+", default=None, help="per-(row, problem) measurements, kept between runs (default "
                   "<out-dir>/raw.json): what they hold is not recomputed; new ones are saved to the first file (runs of "
                   "different rows in parallel: one file each, merged with --report-only --raw A B)")
    p.add_argument("--reading", default=None, help="markdown file with the reading, placed at the top of metric.md")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report from --raw")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [parse_row(r) for r in args.rows] + [parse_row(r) for r in args.row]
    roots = [Path(r) for r in args.records]
    verdicts: dict[str, dict[str, dict]] = {}
    for r in rows:
        path = pass_records(r.label, roots)
        if path is None:
            p.error(f"row {r.label!r}: no HumanEval records under {', '.join(map(str, roots))}")
        verdicts[r.label] = read_verdicts(path)
    if "bf16" not in verdicts:
        p.error("the rows must include bf16 (its greedy completions are the teacher-forced text)")
    cfg = compose([f"model={MODEL}", f"results_dir={args.results_dir}", *HUMANEVAL_OVERRIDES, "benchmark.limit=164"])
    model, tok = load_model(cfg.model, device="cpu")
    items, _ = prepare_items(cfg, tok)
    problem_ids = [it.id for it in items]
    subset = items[::max(1, args.stride)]
    if args.limit:
        subset = subset[: args.limit]
    out_dir = Path(args.out_dir)
    raw_path = Path(args.raw[0]) if args.raw else out_dir / "raw.json"
    seqs = task_sequences(tok, subset, {pid: rec["prediction"] for pid, rec in verdicts["bf16"].items()}, cfg)
    mismatch = [s["id"] for s in seqs if verdicts["bf16"][s["id"]]["prompt_hash"] != s["prompt_hash"]]
    if mismatch:
        raise SystemExit(f"prompts differ from the eval's (prompt_hash) for {mismatch[:5]}: not the task's prompts")
    t0 = time.perf_counter()
    raw = merge_raw([raw_path] + [Path(x) for x in (args.raw or [])[1:]])
    if not args.report_only:
        code_cfg = compose([f"model={MODEL}", "calibration=code"]).calibration
        code = eval_sequences(tok, code_cfg, args.code_windows * args.code_len, seq_len=args.code_len) if args.code_windows else []
        engines = build_engines(model, tok, rows, args.results_dir)
        out_dir.mkdir(parents=True, exist_ok=True)

        def save(r: dict) -> None:
            atomic_write_text(raw_path, json.dumps({"rows": r}))

        raw = measure(model, tok, rows, engines, seqs, code, results_dir=args.results_dir, raw=raw, save=save,
                      log=lambda msg: print(msg, flush=True))
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_dir / "raw.json", json.dumps({"rows": raw}))
    table, lines = summarize(rows, raw, verdicts, problem_ids, [s["id"] for s in seqs], n_boot=args.n_boot)
    n_sub = table[0]["subset"] if table else 0
    for e in table:
        e["spec"] = next(f"{r.method} {r.sink}/{r.recent} {' '.join(r.overrides)}".strip() for r in rows if r.label == e["row"])
    done = {e["row"] for e in table}
    kept = [s for s in seqs if all(s["id"] in raw[lab]["task"] for lab in done)]
    tokens = sum(int(s["ids"].shape[1]) for s in kept)
    note = (
        f"Hardware: {hardware()}" + ("" if args.report_only else f"; {time.perf_counter() - t0:.0f} s for the measurements")
        + f". Model: {MODEL} (GGUF Q4_K_M "
        "dequantized to float32; BF16 = a BF16 KV cache over these weights). Rows: the HumanEval cells with pass@1 measured "
        "on all 164 problems (`../humaneval.csv`; `@16x96`/`@16x32` rows from `../windows/`, measured on an H200), "
        "each cache set up as its cell (sink/recent, artifact under --results-dir, calibrated on the default essays). "
        f"Task metrics on every {args.stride}th problem measured for every row ({n_sub} problems: "
        f"{', '.join(s['id'].split('/')[-1] for s in kept)}; {tokens} tokens: chat prompt + BF16's "
        "greedy completion from its records, prompts checked against the records' prompt hashes), decode-equivalent "
        "cache, over the completion's positions. "
        + ("Code KL: the `code` corpus's held-out windows, positions t >= sink + recent, in blocks of "
           f"{BLOCK} positions. " if any(raw[e['row']].get("code") for e in table) else "Code KL: not measured in this run. ")
        + "Intervals: 95% percentile "
        f"bootstrap over problems ({args.n_boot} resamples, seed 0; code KL: over blocks). Spearman: error metrics "
        "negated, so +1 = the order of pass@1; its interval resamples the 164 problems once for every row's pass@1 "
        "and the subset's metric together (`greedy_same`: all 164 problems; code KL: problems and blocks independently)."
    )
    command = "python -m oscar.studies.metric " + " ".join(sys.argv[1:] if argv is None else argv)
    reading = Path(args.reading).read_text() if args.reading else ""
    write_report(table, lines, out_dir, command, note, reading)
    for ln in lines:
        print(f"{ln['candidate']:12s} Spearman {ln['spearman']:+.3f} [{ln['lo']:+.3f}, {ln['hi']:+.3f}]")
    print(f"wrote {out_dir}/metric.md, metric.csv, metric.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

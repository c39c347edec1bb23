"""Next-token KL to the BF16 cache and perplexity of every KV-cache method, decode-equivalent teacher forcing.

    python -m oscar.studies.kl_table --models smollm2-135m qwen2.5-coder-0.5b \\
        --results-dir results --out reports/methods/kl_ppl

For each model, held-out Paul Graham essay windows (disjoint from the calibration and held-back
tokens, `oscar.data.corpora.eval_sequences`) go through the model once per method with the cache in
decode-equivalent mode: position `t` sees the BF16 sink, the quantized history `[S0, t-W]` and the
BF16 recent window, exactly as while decoding token by token. The reference is the BF16 cache.
The headline KL averages the positions that read quantized history (`t >= S0 + W`); the average
over all positions (which includes the first `S0 + W`, identical to BF16) is a second column.
Every method runs under the same clip policy (`method.clip`, default `fit`); a method written
`name:clip` (e.g. `quarot:paper`, `oscar:none`) runs with that policy instead.
Calibrated methods read their artifact from `<results-dir>/calibration/<model>/<method>/`
(`python -m oscar calibrate`); a method whose artifact is missing is reported as such.
`name@S0/W` (e.g. `auto@64/128`) runs the same artifact with other BF16 windows, hence other bits per
element. Each model's goal line asks whether `auto` is at least as good as every other 2-bit method at no
more bits per element: for each other method, the best `auto` row (any window setting) holding no more bits
than it must have no higher KL (`goal_lines`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from oscar.cache.formats import REGISTRY, format_class
from oscar.config import compose
from oscar.core.artifact import artifact_dir
from oscar.core.files import atomic_write_text
from oscar.data.corpora import eval_sequences
from oscar.eval.fidelity import block_bootstrap_ci
from oscar.models import load_model
from oscar.models.generate import cache_kwarg
from oscar.models.methods import CLIP_MODES, clip_mode, needs_statistics

DEFAULT_METHODS = [
    "bf16", "int2", "quarot", "saw_int4", "turboquant", "kivi2",
    "oscar", "oscar_center", "oscar_hp", "oscar_raw", "auto", "auto@0/128", "int2:paper", "quarot:paper",
]


def kl_and_nll(ref_logits: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(ref || method) of next-token distributions and the method's NLL of the next
    token, float64 `[T-1]`, computed in chunks of positions to bound memory."""
    kls, nlls = [], []
    t = logits.shape[1] - 1
    for a in range(0, t, chunk):
        e = min(t, a + chunk)
        lr = torch.log_softmax(ref_logits[0, a:e].double(), dim=-1)
        lm = torch.log_softmax(logits[0, a:e].double(), dim=-1)
        kls.append((lr.exp() * (lr - lm)).sum(dim=-1))
        nlls.append(-lm.gather(-1, ids[0, a + 1 : e + 1, None].to(lm.device)).squeeze(-1))
    return torch.cat(kls), torch.cat(nlls)


BLOCK = 128  # tokens per bootstrap unit: next-token KLs are correlated over nearby positions
N_BOOT = 2000


def mean_ci(per_window: list[torch.Tensor]) -> tuple[float, float, float]:
    """Mean per token and its 95% block-bootstrap interval (``oscar.eval.fidelity.block_bootstrap_ci``, blocks
    of ``BLOCK`` positions within each window, seed 0: every method of a model draws the same blocks, so
    intervals of differences are paired); NaNs when there are no tokens."""
    if sum(int(v.numel()) for v in per_window) == 0:
        return float("nan"), float("nan"), float("nan")
    lo, hi = block_bootstrap_ci([v.double() for v in per_window], block=BLOCK, n_boot=N_BOOT, seed=0)
    return float(torch.cat(per_window).double().mean()), lo, hi


def split_spec(spec: str) -> tuple[str, Optional[str]]:
    """`name[:clip][@S0/W]` -> (method name, clip policy or None); refuses an unknown policy or malformed windows."""
    head, _, windows = spec.partition("@")
    name, _, clip = head.partition(":")
    if clip and clip not in CLIP_MODES:
        raise ValueError(f"method spec {spec!r}: clip policy {clip!r} is not one of {', '.join(CLIP_MODES)}")
    if windows and not re.fullmatch(r"\d+/\d+", windows):
        raise ValueError(f"method spec {spec!r}: windows {windows!r} must read S0/W, e.g. auto@0/128")
    return name, (clip or None)


def spec_windows(spec: str) -> Optional[tuple[int, int]]:
    """The `(S0, W)` of a `name[:clip]@S0/W` spec, or None."""
    split_spec(spec)
    _, _, windows = spec.partition("@")
    if not windows:
        return None
    s0, w = windows.split("/")
    return int(s0), int(w)


def parse_sets(items: Optional[list[str]]) -> dict[str, list[str]]:
    """`--set NAME.KEY=VALUE` items -> {method name: ["method.KEY=VALUE", ...]} (Hydra overrides of that method)."""
    out: dict[str, list[str]] = {}
    for item in items or []:
        head, sep, value = item.partition("=")
        name, dot, key = head.partition(".")
        if not (sep and dot and name and key):
            raise ValueError(f"--set {item!r}: expected METHOD.KEY=VALUE, e.g. auto.channel_block=64")
        out.setdefault(name, []).append(f"method.{key}={value}")
    return out


def _method_cfg(spec: str, sink: Optional[int], recent: Optional[int], model: str, results_dir: str,
                sets: Optional[dict[str, list[str]]] = None) -> Any:
    from omegaconf import OmegaConf

    name, clip = split_spec(spec)
    cfg = compose([f"model={model}", f"method={name}", f"results_dir={results_dir}"] + list((sets or {}).get(name, [])))
    method = OmegaConf.to_container(cfg.method, resolve=True)
    if clip is not None:
        method["clip"] = clip
    windowed = format_class(str(method["kind"]), f"method spec {spec!r}").windowed
    if windowed:
        if sink is not None:
            method["sink"] = sink
        if recent is not None:
            method["recent"] = recent
    own = spec_windows(spec)
    if own is not None:
        if not windowed:
            raise ValueError(f"method spec {spec!r}: only methods of a windowed format ("
                             f"{', '.join(k for k, c in REGISTRY.items() if c.windowed)}) take S0/W windows")
        method["sink"], method["recent"] = own
    return cfg, OmegaConf.create(method)


def hardware() -> str:
    """One line describing where this ran."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, CPU float32 weights"


def _rotations(cfg: Any, method: Any, model: Any) -> Any:
    """Per-layer cache state of a rotated method: in code when its clip policy needs no statistics, else
    from its artifact (fitted under `method.clip=fit`); a `:none` variant of a calibrated method reads the
    artifact and sets every clip ratio to 1."""
    # local: keeps transformers out of import time
    from oscar.models.engine import rotations_from_artifact, rotations_in_code

    if not needs_statistics(method):
        return rotations_in_code(method, model)
    rotations = rotations_from_artifact(artifact_dir(cfg), method, model)
    meta = json.loads((artifact_dir(cfg) / "meta.json").read_text())
    made_with = str(meta.get("clip", {}).get("mode", "fit"))
    wanted = clip_mode(method)
    if wanted == made_with:
        return rotations
    if wanted == "none":
        for r in rotations:
            r.rho_k, r.rho_v = torch.ones_like(r.rho_k), torch.ones_like(r.rho_v)
        return rotations
    raise ValueError(f"artifact {artifact_dir(cfg)} was fitted with clip={made_with!r}; {method.name} with clip={wanted!r} needs its own calibration")


def clip_edges(cfg: Any, method: Any) -> Optional[dict[str, Any]]:
    """Grid-edge counts of a fitted artifact (`meta.clip.edges`), with the grid ends; None when not fitted."""
    path = artifact_dir(cfg) / "meta.json"
    if clip_mode(method) != "fit" or not path.is_file():
        return None
    clip = json.loads(path.read_text()).get("clip", {})
    if "edges" not in clip:
        return None
    return {**clip["edges"], "grid_k": [min(clip["grid_k"]), max(clip["grid_k"])], "grid_v": [min(clip["grid_v"]), max(clip["grid_v"])]}


@torch.no_grad()
def score_and_bits(eng: Any, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Decode-equivalent logits of one window and the bits per cached K/V element the cache holds after it
    (`OscarCache.bits_per_element`: BF16 windows, INT pages with their scale/zero, page slack; the accounting
    of the format for the simulated KIVI / TurboQuant caches)."""
    cache = eng.new_cache("decode_equivalent")
    out = eng.model(input_ids=ids.to(eng.device), use_cache=True, **{cache_kwarg(eng.model): cache})
    return out.logits, float(cache.bits_per_element())


def paired(kl_a: list[torch.Tensor], start_a: int, kl_b: list[torch.Tensor], start_b: int) -> tuple[float, float, float]:
    """Mean of `a - b` over the positions where both read quantized history (from the later start), with its
    paired 95% block-bootstrap interval."""
    start = max(start_a, start_b)
    return mean_ci([a[start:].double() - b[start:].double() for a, b in zip(kl_a, kl_b)])


def _paired_to_reference(rows: list[dict[str, Any]], per_method: dict[str, tuple[list[torch.Tensor], int]], model: str, reference: str) -> None:
    """Fill the paired difference to ``reference`` (same resampled blocks, positions where both read quantized
    history) into every row of ``model`` that lacks it, once the reference row exists; a study stopped early
    keeps the differences of the rows it finished."""
    ref = per_method.get(reference)
    if ref is None:
        return
    for row in rows:
        if row["model"] != model or row["method"] == reference or row["method"] not in per_method or "diff_past" in row:
            continue
        kl_m, start_m = per_method[row["method"]]
        d_mean, d_lo, d_hi = paired(kl_m, start_m, ref[0], ref[1])
        row.update(diff_ref=reference, diff_past=d_mean, diff_past_lo=d_lo, diff_past_hi=d_hi, diff_from=max(start_m, ref[1]))


def run(
    models: list[str],
    methods: list[str],
    *,
    num_tokens: int,
    seq_len: int,
    sink: Optional[int],
    recent: Optional[int],
    results_dir: str,
    log=print,
    on_row=None,
    reference: str = "auto",
    sets: Optional[dict[str, list[str]]] = None,
) -> list[dict[str, Any]]:
    """One row per (model, method): KL over the positions that read quantized history and over all positions,
    with 95% block-bootstrap intervals, the paired difference to ``reference`` (over the positions where both
    read quantized history, same resampled blocks), measured bits per element, PPL, wall time.
    `on_row(rows)` is called after every row (the command line rewrites its tables each time); `sets` are extra
    Hydra overrides per method name (`parse_sets`), e.g. auto's `method.channel_block=64`."""
    # local: keeps transformers out of import time
    from oscar.models.engine import Engine, method_format

    rows: list[dict[str, Any]] = []
    for model_name in models:
        per_method: dict[str, tuple[list[torch.Tensor], int]] = {}
        base = compose([f"model={model_name}", f"results_dir={results_dir}"])
        model, tok = load_model(base.model, device="cpu")
        windows = eval_sequences(tok, base.calibration, num_tokens, seq_len=seq_len)
        refs = []
        for ids in windows:
            eng = Engine(model, tok, _method_cfg("bf16", sink, recent, model_name, results_dir)[1])
            refs.append(eng.score(ids[None], mode="decode_equivalent"))
        for spec in methods:
            cfg, method = _method_cfg(spec, sink, recent, model_name, results_dir, sets)
            fmt = method_format(method, model)
            row: dict[str, Any] = {"model": model_name, "method": spec, "kind": fmt.kind, "bits": int(method.bits),
                                   "clip": clip_mode(method)}
            if fmt.quantized:
                row.update(sink=fmt.sink, recent=fmt.recent)
            t0 = time.perf_counter()
            try:
                rotations = _rotations(cfg, method, model) if fmt.rotated else None
                eng = Engine(model, tok, method, rotations)
            except (FileNotFoundError, ValueError) as exc:
                row["status"] = f"missing artifact: {exc}"
                log(f"{model_name:22s} {spec:14s} skipped ({exc})")
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
                continue
            edges = clip_edges(cfg, method)
            if edges:
                row.update({f"edge_{k}": v for k, v in edges.items() if not k.startswith("grid")},
                           grid_k=str(edges["grid_k"]), grid_v=str(edges["grid_v"]))
            kl_all, kl_past, nll, bpe = [], [], [], []
            window_end = (row.get("sink", 0) or 0) + (row.get("recent", 0) or 0)
            for ids, ref in zip(windows, refs):
                logits, bits = score_and_bits(eng, ids[None])
                kl, nl = kl_and_nll(ref, logits, ids[None])
                kl_all.append(kl)
                kl_past.append(kl[window_end:])
                nll.append(nl)
                bpe.append(bits)
                del logits
            kl_cat, past_cat, nll_cat = torch.cat(kl_all), torch.cat(kl_past), torch.cat(nll)
            _, all_lo, all_hi = mean_ci(kl_all)
            _, past_lo, past_hi = mean_ci(kl_past)
            row.update(kl_lo=all_lo, kl_hi=all_hi, kl_past_lo=past_lo, kl_past_hi=past_hi)
            per_method[spec] = (kl_all, window_end)
            row.update(
                status="ok",
                kl=float(kl_cat.mean()),
                kl_past_window=float(past_cat.mean()) if past_cat.numel() else float("nan"),
                bits_per_element=sum(bpe) / len(bpe),
                ppl=math.exp(float(nll_cat.mean())),
                tokens=int(sum(w.numel() for w in windows)),
                positions_quantized=int(past_cat.numel()),
                windows=len(windows),
                seconds=round(time.perf_counter() - t0, 1),
            )
            log(f"{model_name:22s} {spec:14s} KL(quantized history) {row['kl_past_window']:.4f}  KL(all) {row['kl']:.4f}  "
                f"bits/elem {row['bits_per_element']:.2f}  PPL {row['ppl']:.3f}  ({row['seconds']} s)")
            rows.append(row)
            _paired_to_reference(rows, per_method, model_name, reference)  # as soon as both rows exist
            if on_row is not None:
                on_row(rows)
        del model
    return rows


def _ci(r: Any, key: str, lo: str, hi: str, signed: bool = False) -> str:
    """``value [lo, hi]`` with four decimals; ``-`` where the row has no value (older CSVs: no interval)."""
    def num(k):
        v = r.get(k)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    v, a, b = num(key), num(lo), num(hi)
    if v is None:
        return "-"
    fmt = "{:+.4f}" if signed else "{:.4f}"
    return fmt.format(v) + (f" [{fmt.format(a)}, {fmt.format(b)}]" if a is not None and b is not None else "")


def _num(r: Any, key: str) -> Optional[float]:
    v = r.get(key)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _paired(other: Any, cand: Any) -> Optional[tuple[float, float, float]]:
    """KL(other) - KL(cand), paired, with its interval, from whichever of the two rows was measured against the
    other (`diff_ref`); None when neither was."""
    def num(r: Any, k: str) -> Optional[float]:
        v = r.get(k)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    if str(other.get("diff_ref")) == str(cand["method"]) and num(other, "diff_past") is not None:
        return num(other, "diff_past"), num(other, "diff_past_lo"), num(other, "diff_past_hi")  # type: ignore[return-value]
    if str(cand.get("diff_ref")) == str(other["method"]) and num(cand, "diff_past") is not None:
        return -num(cand, "diff_past"), -num(cand, "diff_past_hi"), -num(cand, "diff_past_lo")  # type: ignore[operator]
    return None


def goal_lines(part: Any, candidate: str = "auto") -> list[str]:
    """Whether the ``candidate`` family (``auto`` and its window variants ``auto@S/W``) is at least as good as
    every other 2-bit method at no more bits per element: for each other method, the candidate row with the
    lowest KL over quantized-history positions among those holding no more bits per element than it.
    Says by how much each comparison misses (KL, bits) and gives the paired difference (other minus the
    candidate row) where one of the two rows was measured against the other; a miss on points whose paired
    interval includes 0 is reported as a tie (``candidate`` may name a window variant, e.g. ``auto@64/128``:
    its family, ``auto``, is what is searched; so is ``auto+ch32@0/160``, a row label for an artifact made with
    other settings, e.g. `--set auto.channel_block=32`, given when runs are merged: `--merge CSV::auto=auto+ch32`)."""
    ok = part[(part["status"] == "ok") & (part["kind"] != "bf16")]
    if "bits_per_element" not in ok:
        return []
    candidate = re.split(r"[:@+]", candidate)[0]  # a window variant (`@S0/W`) or a labelled artifact (`+label`) names its family
    is_cand = ok["method"].astype(str).str.split(r"[:@+]").str[0] == candidate
    cands, others = ok[is_cand], ok[~is_cand & (ok["bits"] == 2)]
    if cands.empty or others.empty:
        return []
    rows, met, missed, tied = [], 0, [], []
    for _, o in others.sort_values("kl_past_window").iterrows():
        fit = cands[cands["bits_per_element"] <= o["bits_per_element"] + 1e-9]
        if fit.empty:
            low = cands.loc[cands["bits_per_element"].idxmin()]
            missed.append(str(o["method"]))
            rows.append(f"| {o['method']} | {o['bits_per_element']:.2f} | {o['kl_past_window']:.4f} | - | - | missed: no "
                        f"{candidate} row at <= {o['bits_per_element']:.2f} bits (lowest: {low['method']} at {low['bits_per_element']:.2f}) |")
            continue
        c = fit.loc[fit["kl_past_window"].idxmin()]
        good = c["kl_past_window"] <= o["kl_past_window"]
        met += int(good)
        diff = _paired(o, c)
        paired = "-" if diff is None else "{:+.4f} [{:+.4f}, {:+.4f}]".format(*diff)
        verdict = "met"
        if not good:
            by = f"{c['kl_past_window'] - o['kl_past_window']:.4f} nats ({c['kl_past_window'] / o['kl_past_window']:.2f}x)"
            if diff is not None and diff[1] <= 0 <= diff[2]:
                tied.append(str(o["method"]))
                verdict = f"tie: {by} higher on points, the paired interval includes 0"
            else:
                missed.append(str(o["method"]))
                verdict = f"missed by {by}"
        rows.append(f"| {o['method']} | {o['bits_per_element']:.2f} | {o['kl_past_window']:.4f} | {c['method']} at "
                    f"{c['bits_per_element']:.2f} bits: {c['kl_past_window']:.4f} | {paired} | {verdict} |")
    head = (f"Goal for {candidate} (KL <= every other 2-bit method at no more bits per element): "
            + ("met against all " if not missed and not tied else "") + f"{met} of {len(others)} methods"
            + (" met" if missed or tied else "")
            + (f"; tied within the paired interval against {', '.join(tied)}" if tied else "")
            + (f"; missed against {', '.join(missed)}" if missed else "") + ".")
    return [head, "", f"| other method | its bits/element | its KL | best {candidate} row at no more bits | other minus {candidate}, "
            "paired [95% CI] | verdict |", "|---|---|---|---|---|---|", *rows]


def edge_lines(df: Any) -> list[str]:
    """Table of how many fitted clip ratios sit on an edge of the grid, per model and method."""
    if "edge_key_low" not in df:
        return []
    part = df[df["edge_key_low"].notna()] if "edge_key_low" in df else df.iloc[0:0]
    if part.empty:
        return []
    lines = ["## Fitted clip ratios on the grid's edges", "",
             "Per (layer, KV head) and side: `low` = at the smallest ratio of the grid (the optimum may lie below it), "
             "`1.0` = no clipping (the physical end of the range, not a grid artifact).", "",
             "| model | method | key grid | keys at low / at 1.0 / heads | value grid | values at low / at 1.0 / heads |",
             "|---|---|---|---|---|---|"]
    for _, r in part.iterrows():
        lines.append(f"| {r['model']} | {r['method']} | {r.get('grid_k', '')} | {int(r['edge_key_low'])} / {int(r['edge_key_high'])} / "
                     f"{int(r['edge_key_heads'])} | {r.get('grid_v', '')} | {int(r['edge_value_low'])} / {int(r['edge_value_high'])} / "
                     f"{int(r['edge_value_heads'])} |")
    return lines + [""]


def write_tables(rows: list[dict[str, Any]], out: Path, command: str, note: str) -> None:
    """`<out>.csv` and `<out>.md` (atomic writes)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    atomic_write_text(out.parent / (out.name + ".csv"), df.to_csv(index=False))  # not with_suffix: "qwen2.5-..." has dots
    lines = ["# Next-token KL to the BF16 cache and perplexity, decode-equivalent teacher forcing", "", note, "", f"Command: `{command}`", ""]
    for model, part in df.groupby("model", sort=False):
        refs = list(dict.fromkeys(str(x) for x in part.get("diff_ref", pd.Series(dtype=object)).dropna()))
        mixed = len(refs) > 1  # merged runs measured against different references: each cell names its own
        ref = "the named reference" if mixed else (refs[0] if refs else "auto")
        lines += [f"## {model}", "",
                  "| method | clip | sink/recent | windows x tokens | bits/element (measured) | KL, positions reading quantized "
                  f"history [95% CI] | KL, all positions [95% CI] | KL minus {ref}, paired [95% CI] | PPL |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for _, r in part.iterrows():
            if r.get("status") != "ok":
                lines.append(f"| {r['method']} | {r.get('clip', '')} | | | | {r.get('status')} | | | |")
                continue
            sink, recent = r.get("sink"), r.get("recent")
            known = sink is not None and recent is not None and not (isinstance(sink, float) and math.isnan(sink))
            win = f"{int(sink)}/{int(recent)}" if known else "-"
            bpe = _num(r, "bits_per_element")
            nwin, ntok = _num(r, "windows"), _num(r, "tokens")
            size = f"{int(nwin)} x {int(ntok) // int(nwin)}" if nwin and ntok else "-"
            diff = _ci(r, 'diff_past', 'diff_past_lo', 'diff_past_hi', signed=True)
            if mixed and diff != "-":
                diff += f" vs {r['diff_ref']}"
            lines.append(f"| {r['method']} | {r.get('clip', '')} | {win} | {size} | {'-' if bpe is None else f'{bpe:.2f}'} | "
                         f"{_ci(r, 'kl_past_window', 'kl_past_lo', 'kl_past_hi')} | {_ci(r, 'kl', 'kl_lo', 'kl_hi')} | "
                         f"{diff} | {r['ppl']:.3f} |")
        lines.append("")
        goal = goal_lines(part.reset_index(drop=True), "auto")
        if goal:
            lines += goal + [""]
    lines += edge_lines(df)
    atomic_write_text(out.parent / (out.name + ".md"), "\n".join(lines) + "\n")


def merge_rows(entries: list[str]) -> list[dict]:
    """The rows of several runs' CSVs, in order; a later run's row replaces an earlier one of the same model and
    method. An entry `PATH::OLD=NEW` renames method family OLD to NEW in that file's rows (window suffixes kept:
    `auto@0/160` becomes `auto+ch32@0/160` under `::auto=auto+ch32`; paired references `diff_ref` too), so rows of
    an artifact made with other settings stay apart from the default one."""
    import pandas as pd

    merged: dict[tuple[str, str], dict] = {}
    for entry in entries:
        path, _, rename = entry.partition("::")
        old, eq, new = rename.partition("=")
        if rename and (not eq or not old or not new):
            raise ValueError(f"--merge {entry!r}: a rename is PATH::OLD=NEW (e.g. kl.csv::auto=auto+ch32)")
        for row in pd.read_csv(path).to_dict("records"):
            if rename:
                for key in ("method", "diff_ref"):
                    name = row.get(key)
                    if isinstance(name, str) and re.split(r"[:@]", name)[0] == old:
                        row[key] = new + name[len(old):]
            merged[(str(row["model"]), str(row["method"]))] = row  # a replaced row keeps its place
    return list(merged.values())


def main(argv: Optional[list[str]] = None) -> int:
    """Command line entry point."""
    p = argparse.ArgumentParser(prog="python -m oscar.studies.kl_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens per model")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per teacher-forced window")
    p.add_argument("--sink", type=int, default=None, help="override S0 of the INT methods (default: method config, 64)")
    p.add_argument("--recent", type=int, default=None, help="override W of the INT methods (default: method config, 256)")
    p.add_argument("--results-dir", default="results", help="where calibration artifacts live (<dir>/calibration/...)")
    p.add_argument("--out", default="reports/methods/kl_ppl", help="output path without suffix (.csv and .md)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--merge", nargs="+", default=None, metavar="CSV",
                   help="only combine earlier runs' CSVs into --out (a later row replaces an earlier one of the same "
                        "model and method; CSV::OLD=NEW renames a method family, e.g. kl.csv::auto=auto+ch32)")
    p.add_argument("--note", default="", help="extra sentence for the table header (e.g. what could not be measured)")
    p.add_argument("--reference", default="auto", help="method the paired KL differences are taken against")
    p.add_argument("--set", nargs="+", default=None, metavar="METHOD.KEY=VALUE",
                   help="method setting for every row of that method (and its artifact), e.g. auto.channel_block=64")
    args = p.parse_args(argv)
    if "bf16" in args.methods and args.methods[0] != "bf16":
        args.methods.remove("bf16")
        args.methods.insert(0, "bf16")
    torch.set_num_threads(args.threads)
    note = (
        f"Hardware: {hardware()}. Weights: GGUF Q4 packages dequantized to dense float32 (ASSETS.md); "
        "the reference is a BF16 KV cache over these same weights. Text: held-out Paul Graham essay windows "
        "(disjoint from calibration and held-back tokens). KL is mean next-token KL(BF16 || method) in nats over "
        "the positions that read quantized history (t >= S0 + W: the first S0 + W positions of a window see only "
        "BF16 rows and are identical to the reference); the all-position average is the second column. "
        "Clip policy: the same for every method (`clip` column: `fit` = one ratio per layer, KV head and side "
        "fitted on held-back calibration rows by measured distortion, grid 0.50-1.00); `name:paper` rows run "
        "the method's published choice (unclipped baselines); KIVI-2 and TurboQuant have no clip ratio in their "
        "format. KIVI-2 and TurboQuant are accuracy-only simulations (quantize-dequantize at the method's "
        "boundaries). Bits per element: measured from the cache after each window (BF16 windows, INT pages with "
        "their bf16 scale and zero, page slack; the format's accounting for the simulations), averaged over windows. "
        f"Intervals: 95% percentile bootstrap over blocks of {BLOCK} consecutive positions ({N_BOOT} resamples, "
        "seed 0, the same resamples for every method of a model, so the differences are paired); a difference "
        "is taken over the positions where both methods read quantized history."
    )
    if args.note:
        note += " " + args.note
    command = "python -m oscar.studies.kl_table " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.merge:
        import pandas as pd

        command = f"python -m oscar.studies.kl_table --merge {' '.join(args.merge)} --out {args.out}"
        try:
            rows = merge_rows(args.merge)
        except (OSError, ValueError) as exc:
            p.error(str(exc))
        write_tables(rows, Path(args.out), command, note)
        print(f"wrote {args.out}.csv and {args.out}.md")
        return 0
    rows = run(
        args.models, args.methods, num_tokens=args.tokens, seq_len=args.seq_len, sink=args.sink, recent=args.recent,
        results_dir=args.results_dir, on_row=lambda rows: write_tables(rows, Path(args.out), command, note),
        reference=args.reference, sets=parse_sets(args.set),
    )
    write_tables(rows, Path(args.out), command, note)
    print(f"wrote {args.out}.csv and {args.out}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

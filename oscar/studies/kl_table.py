"""Next-token KL to the BF16 cache and perplexity of every KV-cache method, decode-equivalent teacher forcing.

    python -m oscar.studies.kl_table --models smollm2-135m qwen2.5-coder-0.5b \\
        --results-dir results --out reports/methods/kl_ppl

For each model, held-out Paul Graham essay windows (disjoint from the calibration and held-back
tokens, `oscar.data.corpora.eval_sequences`) go through the model once per method with the cache in
decode-equivalent mode: position `t` sees the BF16 sink, the quantized history `[S0, t-W]` and the
BF16 recent window, exactly as while decoding token by token. The reference is the BF16 cache.
Calibrated methods read their artifact from `<results-dir>/calibration/<model>/<method>/`
(`python -m oscar calibrate`); a method whose artifact is missing is reported as such.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

DEFAULT_METHODS = [
    "bf16", "int2", "quarot", "saw_int4", "turboquant", "kivi2",
    "oscar", "oscar_center", "oscar_hp", "oscar_raw", "oscar_uh", "oscar_up", "auto",
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
    from oscar.eval.fidelity import block_bootstrap_ci

    if sum(int(v.numel()) for v in per_window) == 0:
        return float("nan"), float("nan"), float("nan")
    lo, hi = block_bootstrap_ci([v.double() for v in per_window], block=BLOCK, n_boot=N_BOOT, seed=0)
    return float(torch.cat(per_window).double().mean()), lo, hi


def _method_cfg(name: str, sink: Optional[int], recent: Optional[int], model: str, results_dir: str) -> Any:
    from omegaconf import OmegaConf

    from oscar.config import compose

    cfg = compose([f"model={model}", f"method={name}", f"results_dir={results_dir}"])
    method = OmegaConf.to_container(cfg.method, resolve=True)
    if str(method["kind"]) in ("rotated", "turboquant"):
        if sink is not None:
            method["sink"] = sink
        if recent is not None:
            method["recent"] = recent
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
    reference: str = "oscar",
) -> list[dict[str, Any]]:
    """One row per (model, method): KL (all positions and positions past the windows) with 95% block-bootstrap
    intervals, the paired difference of KL past the windows to ``reference`` (same resampled blocks), PPL,
    wall time. `on_row(rows)` is called after every row (the command line rewrites its tables each time)."""
    from oscar.config import compose
    from oscar.data.corpora import eval_sequences
    from oscar.engine import Engine, artifact_dir, rotations_from_artifact
    from oscar.models import load_model

    rows: list[dict[str, Any]] = []
    for model_name in models:
        past_by_method: dict[str, list[torch.Tensor]] = {}
        base = compose([f"model={model_name}", f"results_dir={results_dir}"])
        model, tok = load_model(base.model, device="cpu")
        windows = eval_sequences(tok, base.calibration, num_tokens, seq_len=seq_len)
        refs = []
        for ids in windows:
            eng = Engine(model, tok, _method_cfg("bf16", sink, recent, model_name, results_dir)[1])
            refs.append(eng.score(ids[None], mode="decode_equivalent"))
        for name in methods:
            cfg, method = _method_cfg(name, sink, recent, model_name, results_dir)
            row: dict[str, Any] = {"model": model_name, "method": name, "kind": str(method.kind), "bits": int(method.bits)}
            if str(method.kind) in ("rotated", "turboquant"):
                row.update(sink=int(method.sink), recent=int(method.recent))
            elif str(method.kind) == "kivi":
                row.update(sink=0, recent=int(method.recent))
            t0 = time.perf_counter()
            try:
                rotations = None
                if str(method.kind) == "rotated" and bool(method.needs_calibration):
                    rotations = rotations_from_artifact(artifact_dir(cfg), method, model)
                eng = Engine(model, tok, method, rotations)
            except FileNotFoundError as exc:
                row["status"] = f"missing artifact: {exc}"
                log(f"{model_name:22s} {name:14s} skipped ({exc})")
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
                continue
            kl_all, kl_past, nll = [], [], []
            window_end = (row.get("sink", 0) or 0) + (row.get("recent", 0) or 0)
            for ids, ref in zip(windows, refs):
                logits = eng.score(ids[None], mode="decode_equivalent")
                kl, nl = kl_and_nll(ref, logits, ids[None])
                kl_all.append(kl)
                kl_past.append(kl[window_end:])
                nll.append(nl)
                del logits
            kl_cat, past_cat, nll_cat = torch.cat(kl_all), torch.cat(kl_past), torch.cat(nll)
            _, all_lo, all_hi = mean_ci(kl_all)
            _, past_lo, past_hi = mean_ci(kl_past)
            row.update(kl_lo=all_lo, kl_hi=all_hi, kl_past_lo=past_lo, kl_past_hi=past_hi)
            past_by_method[name] = kl_past
            row.update(
                status="ok",
                kl=float(kl_cat.mean()),
                kl_past_window=float(past_cat.mean()) if past_cat.numel() else float("nan"),
                ppl=math.exp(float(nll_cat.mean())),
                tokens=int(sum(w.numel() for w in windows)),
                windows=len(windows),
                seconds=round(time.perf_counter() - t0, 1),
            )
            log(f"{model_name:22s} {name:14s} KL {row['kl']:.4f}  KL(past window) {row['kl_past_window']:.4f}  PPL {row['ppl']:.3f}  ({row['seconds']} s)")
            rows.append(row)
            if on_row is not None:
                on_row(rows)
        ref_past = past_by_method.get(reference)
        for row in rows:  # paired differences to the reference, on the same resampled blocks
            if row["model"] != model_name or row["method"] == reference or ref_past is None:
                continue
            past = past_by_method.get(row["method"])
            if past is None or any(a.numel() != b.numel() for a, b in zip(past, ref_past)):
                continue
            d_mean, d_lo, d_hi = mean_ci([a.double() - b.double() for a, b in zip(past, ref_past)])
            row.update(diff_ref=reference, diff_past=d_mean, diff_past_lo=d_lo, diff_past_hi=d_hi)
        if on_row is not None:
            on_row(rows)
        del model
    return rows


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


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


def write_tables(rows: list[dict[str, Any]], out: Path, command: str, note: str) -> None:
    """`<out>.csv` and `<out>.md` (atomic writes)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    _atomic_write(out.with_suffix(".csv"), df.to_csv(index=False))
    lines = ["# Next-token KL to the BF16 cache and perplexity, decode-equivalent teacher forcing", "", note, "", f"Command: `{command}`", ""]
    for model, part in df.groupby("model", sort=False):
        ref = next((str(x) for x in part.get("diff_ref", pd.Series(dtype=object)).dropna()), "oscar")
        lines += [f"## {model}", "",
                  f"| method | bits | sink/recent | KL (all positions) [95% CI] | KL (past the windows) [95% CI] | "
                  f"KL past the windows minus {ref} [95% CI] | PPL |", "|---|---|---|---|---|---|---|"]
        for _, r in part.iterrows():
            if r.get("status") != "ok":
                lines.append(f"| {r['method']} | {r['bits']} | | {r.get('status')} | | | |")
                continue
            sink, recent = r.get("sink"), r.get("recent")
            known = sink is not None and recent is not None and not (isinstance(sink, float) and math.isnan(sink))
            win = f"{int(sink)}/{int(recent)}" if known else "-"
            lines.append(f"| {r['method']} | {r['bits']} | {win} | {_ci(r, 'kl', 'kl_lo', 'kl_hi')} | "
                         f"{_ci(r, 'kl_past_window', 'kl_past_lo', 'kl_past_hi')} | "
                         f"{_ci(r, 'diff_past', 'diff_past_lo', 'diff_past_hi', signed=True)} | {r['ppl']:.3f} |")
        lines.append("")
    _atomic_write(out.with_suffix(".md"), "\n".join(lines) + "\n")


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
    p.add_argument("--merge", nargs="+", default=None, metavar="CSV", help="only combine earlier runs' CSVs into --out")
    p.add_argument("--note", default="", help="extra sentence for the table header (e.g. what could not be measured)")
    p.add_argument("--reference", default="oscar", help="method the paired KL differences are taken against")
    args = p.parse_args(argv)
    if "bf16" in args.methods and args.methods[0] != "bf16":
        args.methods.remove("bf16")
        args.methods.insert(0, "bf16")
    torch.set_num_threads(args.threads)
    note = (
        f"Hardware: {hardware()}. Weights: GGUF Q4 packages dequantized to dense float32 (ASSETS.md); "
        "the reference is a BF16 KV cache over these same weights. Text: held-out Paul Graham essay windows "
        "(disjoint from calibration and held-back tokens). KL is mean next-token KL(BF16 || method) in nats; "
        "'past the windows' averages only positions t >= S0 + W, where the quantized history exists. "
        "KIVI-2 and TurboQuant are accuracy-only simulations (quantize-dequantize at the method's boundaries). "
        f"Intervals: 95% percentile bootstrap over blocks of {BLOCK} consecutive positions ({N_BOOT} resamples, "
        "seed 0, the same resamples for every method of a model, so the differences are paired)."
    )
    if args.note:
        note += " " + args.note
    command = "python -m oscar.studies.kl_table " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.merge:
        import pandas as pd

        command = f"python -m oscar.studies.kl_table --merge {' '.join(args.merge)} --out {args.out}"
        frames = [pd.read_csv(path) for path in args.merge]
        rows = pd.concat(frames, ignore_index=True).to_dict("records")
        write_tables(rows, Path(args.out), command, note)
        print(f"wrote {args.out}.csv and {args.out}.md")
        return 0
    rows = run(
        args.models, args.methods, num_tokens=args.tokens, seq_len=args.seq_len, sink=args.sink, recent=args.recent,
        results_dir=args.results_dir, on_row=lambda rows: write_tables(rows, Path(args.out), command, note),
        reference=args.reference,
    )
    write_tables(rows, Path(args.out), command, note)
    print(f"wrote {args.out}.csv and {args.out}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

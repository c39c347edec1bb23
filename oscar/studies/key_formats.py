"""Why a per-token key format can lose to KIVI's per-channel keys: key distortion of both on the same rows.

    python -m oscar.studies.key_formats --model qwen2.5-coder-0.5b --results-dir results \\
        --out reports/calibration/key_formats_qwen2.5-coder-0.5b

For every (layer, KV head) it compares, on the held-back calibration key rows (consecutive tokens, the
rows `auto` selects on) and with the same metric (`C_Q / n_Q`: the mean squared logit error
`oscar.core.clipfit.measured_distortion`):

- `auto`: the distortion of the candidate `auto` chose (its artifact's `choices`, per-token groups of
  `G` channels after its rotation, centering and fitted clip);
- `kivi<T>`: KIVI's keys (`oscar.core.baselines.kivi_fake_quantize`, per channel over blocks of T consecutive
  tokens, no clip, no rotation): T=32 as in KIVI-2 (3 key bits per element), T=64 (2.5, as many as
  per-token groups of 64 channels).

Per-channel groups absorb a channel's offset in their zero point, whatever it is; a per-token group has
one zero point for all its channels, so an offset that differs between channels of a token and moves from
token to token (a k_proj bias after RoPE rotates with the position) is quantization range it cannot
remove. The study says, per layer, which format distorts the keys less, at which key bits per element.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from oscar.core.baselines import kivi_fake_quantize
from oscar.core.clipfit import candidate_label, weighted_distortion
from oscar.core.files import atomic_write_text
from oscar.core.stats import CalibrationStats


def key_rows(stats: Any, auto_meta: dict[str, Any], *, kivi_groups: tuple[int, ...] = (32, 64), bits: int = 2) -> list[dict[str, Any]]:
    """One row per (layer, KV head): auto's chosen key distortion and KIVI per-channel key distortion for each
    token block size in `kivi_groups` (`kivi<G>`, and `kivi<G>_over_auto`)."""
    choices = {(int(c["layer"]), int(c["head"])): c for c in auto_meta.get("choices", [])}
    if not choices:
        raise ValueError("the artifact has no auto choices; pass the artifact of method=auto")
    rows = []
    for layer in range(stats.num_layers):
        keys = stats.samples[layer]["K_samples"]
        metric = stats.second_moment(layer, "Q")
        for head in range(stats.num_kv_heads):
            if (layer, head) not in choices:  # a layer auto did not select for (sliding window: never quantized)
                continue
            c = choices[(layer, head)]
            row: dict[str, Any] = {"layer": layer, "head": head, "auto_choice": candidate_label(c["key_target"], c["center_k"], int(c.get("key_block", 0))),
                                   "auto": float(c["key_distortion"])}
            for g in kivi_groups:
                n = (keys.shape[1] // g) * g
                if n == 0:
                    raise ValueError(f"layer {layer}: {keys.shape[1]} held-back rows, fewer than one KIVI block of {g}")
                x = keys[head, :n].to(torch.float32)
                k_hat, _ = kivi_fake_quantize(x, x, bits=bits, group_size=g, residual=0)
                row[f"kivi{g}"] = weighted_distortion(k_hat.double() - x.double(), metric[head])
                row[f"kivi{g}_over_auto"] = row[f"kivi{g}"] / row["auto"]
            rows.append(row)
    return rows


def _geo(values: list[float]) -> float:
    vals = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def write_report(rows: list[dict[str, Any]], out: Path, *, model: str, group_size: int, command: str) -> None:
    """`<out>.csv` and `<out>.md` (atomic)."""
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out.parent / (out.name + ".csv"), buf.getvalue())
    groups = sorted(int(k[4:]) for k in rows[0] if k.startswith("kivi") and k[4:].isdigit())
    lines = [
        f"# Key distortion: `auto`'s per-token keys vs KIVI's per-channel keys ({model})",
        "",
        "Mean squared logit error (metric C_Q / n_Q) of the 2-bit key quantizer on the held-back calibration key rows "
        f"(consecutive tokens), per layer and KV head. `auto`: its chosen candidate (per-token groups of {group_size} "
        f"channels, bf16 scale and zero: {2 + 32 / group_size:.2f} key bits per element; `/ch<T>`: its per-channel "
        "candidate over blocks of T tokens, 2 + 32/T bits, with rotation, centering and fitted clip). `kivi<T>`: per-channel groups "
        "over blocks of T tokens, no rotation or clip ("
        + ", ".join(f"T={g}: {2 + 32 / g:.2f}" for g in groups)
        + " key bits per element, before the BF16 residual window; KIVI-2 uses T=32). Ratio below 1: per-channel keys "
        "distort the logits less.",
        "",
        f"Command: `{command}`",
        "",
    ]
    for g in groups:
        wins = sum(r[f"kivi{g}"] < r["auto"] for r in rows)
        lines.append(f"- T={g}: per-channel keys distort less on {wins} of {len(rows)} heads; geometric mean of kivi{g} / auto "
                     f"{_geo([r[f'kivi{g}_over_auto'] for r in rows]):.3f}.")
    lines += ["", "| layer | auto choice (per KV head) | auto | " + " | ".join(f"kivi{g} | kivi{g} / auto" for g in groups) + " |",
              "|---|---|---|" + "---|---|" * len(groups)]
    for layer in sorted({r["layer"] for r in rows}):
        lr = [r for r in rows if r["layer"] == layer]
        cells = [", ".join(r["auto_choice"] for r in lr), ", ".join(format(r["auto"], ".3g") for r in lr)]
        for g in groups:
            cells += [", ".join(format(r[f"kivi{g}"], ".3g") for r in lr), format(_geo([r[f"kivi{g}_over_auto"] for r in lr]), ".3f")]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    atomic_write_text(out.parent / (out.name + ".md"), "\n".join(lines) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    """Command line entry point."""
    p = argparse.ArgumentParser(prog="python -m oscar.studies.key_formats", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--results-dir", default="results")
    p.add_argument("--calibration", default="default")
    p.add_argument("--out", required=True, help="output path without suffix (.csv and .md)")
    args = p.parse_args(argv)
    root = Path(args.results_dir)
    stats = CalibrationStats.load(root / "stats" / args.model / args.calibration)
    meta = json.loads((root / "calibration" / args.model / "auto" / "meta.json").read_text())
    with torch.no_grad():
        rows = key_rows(stats, meta)
    command = "python -m oscar.studies.key_formats " + " ".join(sys.argv[1:] if argv is None else argv)
    write_report(rows, Path(args.out), model=args.model, group_size=int(meta["group_size"]), command=command)
    print(f"wrote {args.out}.csv and {args.out}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

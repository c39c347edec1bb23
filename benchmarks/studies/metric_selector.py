"""Held-out next-token KL of `auto`'s key-format selections (distortion vs `method.select_by=kl`): writes
reports/accuracy/metric/selector.json, the table of reports/accuracy/metric/selector.md.

    python benchmarks/studies/metric_selector.py --token results/s2/art/tok --channel results/s2/art/cb32-ch \\
        --selection results/s2/art/cb32-kl --distortion results/s2/art/cb32-dist --prices 0 0.002 0.005 \\
        --tokens 4096 --out reports/accuracy/metric/selector

Paths given as arguments are read from the working directory; the default `--out` is the report's, under the
repository root.

Every row runs the same model on the calibration corpus's evaluation windows (disjoint from the statistics and from
the held-back windows the KL selection scored), decode-equivalent, through `oscar.models.select.kl_and_bits`'s cache.
A row's layers take their rotations from the all-per-token artifact (`--token`: `auto` with channel_block=0 chooses
the same per-token candidates) or the all-per-channel one (`--channel`), as its key formats say: a layer's selection
does not depend on the other layers' formats. `kl@price` rows apply the selection rule to the per-layer gains that
`--selection`'s artifact recorded (`meta["selection"]`) at other prices, without recalibrating.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from oscar.config import compose
from oscar.core.artifact import load_artifact
from oscar.core.files import atomic_write_text
from oscar.data.corpora import eval_sequences
from oscar.eval.fidelity import block_bootstrap_ci
from oscar.models import load_model
from oscar.models.engine import cache_spec, layer_rotations, new_cache, next_token_kl
from oscar.models.generate import cache_kwarg
from oscar.models.select import bf16_logits

BLOCK = 128
ROOT = Path(__file__).resolve().parents[2]  # the repository root (this file is benchmarks/studies/<name>.py)


def formats_of(meta: dict) -> list[bool]:
    """Per layer: True where the artifact's keys are per-channel."""
    return [bool(b) for b in (meta.get("key_block") or [0] * int(meta["model"]["num_layers"]))]


def at_price(selection: dict, price: float) -> list[bool]:
    """The per-layer rule of `oscar.models.select` applied at `price` to recorded gains (no guard)."""
    return [bool(m["measured"] and m["kl_gain"] > price * m["extra_bits"]) for m in selection["layers"]]


@torch.no_grad()
def per_position_kl(model, method, rotations, windows, refs, start) -> tuple[list[torch.Tensor], float]:
    kls, bits = [], 0.0
    for ids, ref in zip(windows, refs):
        cache = new_cache(model, cache_spec(method, model, rotations, mode="decode_equivalent"))
        logits = model(input_ids=ids[None], use_cache=True, **{cache_kwarg(model): cache}).logits
        kls.append(next_token_kl(ref[0, start:-1], logits[0, start:-1]))
        bits += float(cache.bits_per_element()) / len(windows)
    return kls, bits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--token", required=True, help="auto artifact with per-token keys everywhere (channel_block=0)")
    p.add_argument("--channel", required=True, help="auto artifact with per-channel keys everywhere")
    p.add_argument("--selection", required=True, help="artifact made with method.select_by=kl (its meta.selection)")
    p.add_argument("--distortion", default=None, help="artifact made with channel_block>0, select_by=distortion")
    p.add_argument("--prices", nargs="*", type=float, default=[])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--kivi", action="store_true", help="add KIVI-2 (its own windows) as a reference row")
    p.add_argument("--out", default=str(ROOT / "reports" / "accuracy" / "metric" / "selector"),
                   help="output stem: writes <out>.json")
    args = p.parse_args(argv)

    cfg = compose([f"model={args.model}", "method=auto"])
    model, tok = load_model(cfg.model, device="cpu")
    windows = eval_sequences(tok, cfg.calibration, args.tokens, seq_len=args.seq_len)
    arts = {k: load_artifact(Path(v)) for k, v in (("token", args.token), ("channel", args.channel), ("kl", args.selection))}
    tok_rot, ch_rot = layer_rotations(arts["token"]), layer_rotations(arts["channel"])
    method = dict(arts["channel"].meta["method"])
    start = int(method["sink"]) + int(method["recent"])
    selection = arts["kl"].meta["selection"]
    rows: list[tuple[str, list[bool]]] = [("distortion, channel_block=0 (auto today)", [False] * len(tok_rot))]
    if args.distortion:
        rows.append(("distortion, channel_block=32", formats_of(load_artifact(Path(args.distortion)).meta)))
    rows.append(("all per-channel, channel_block=32", [bool(r.k_block) for r in ch_rot]))
    rows.append((f"kl, price {selection['price']:g} (kept: {selection['kept']})", formats_of(arts["kl"].meta)))
    for price in args.prices:
        rows.append((f"kl rule at price {price:g} (no guard)", at_price(selection, price)))
    t0 = time.perf_counter()
    refs = bf16_logits(model, windows)
    out, kl_ref = [], None
    for label, formats in rows:
        rots = [ch_rot[i] if f else tok_rot[i] for i, f in enumerate(formats)]
        kls, bits = per_position_kl(model, method, rots, windows, refs, start)
        mean = float(torch.cat(kls).mean())
        lo, hi = block_bootstrap_ci(kls, block=BLOCK, n_boot=2000, seed=0)
        row = {"row": label, "channel_layers": [i for i, f in enumerate(formats) if f], "n_channel": sum(formats),
               "bits_per_element": bits, "kl": mean, "kl_lo": lo, "kl_hi": hi}
        if kl_ref is None:
            kl_ref = kls
        else:
            d = [a - b for a, b in zip(kls, kl_ref)]
            row.update(diff=float(torch.cat(d).mean()), diff_lo=block_bootstrap_ci(d, block=BLOCK, seed=0)[0],
                       diff_hi=block_bootstrap_ci(d, block=BLOCK, seed=0)[1])
        out.append(row)
        print(f"{label}: KL {mean:.4f} [{lo:.4f}, {hi:.4f}] at {bits:.3f} b, channel layers {row['channel_layers']}",
              flush=True)
    if args.kivi:
        kivi = compose([f"model={args.model}", "method=kivi2"]).method
        kls, bits = per_position_kl(model, kivi, None, windows, refs, start)
        lo, hi = block_bootstrap_ci(kls, block=BLOCK, n_boot=2000, seed=0)
        out.append({"row": f"KIVI-2 (S0/W {kivi.sink}/{kivi.recent})", "channel_layers": "all", "n_channel": len(tok_rot),
                    "bits_per_element": bits, "kl": float(torch.cat(kls).mean()), "kl_lo": lo, "kl_hi": hi})
        print(out[-1], flush=True)
    cmd = "python benchmarks/studies/metric_selector.py " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {"command": cmd,
              "hardware": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
              "windows": [int(w.numel()) for w in windows], "positions_from": start, "seconds": time.perf_counter() - t0,
              "selection": selection, "rows": out}
    atomic_write_text(Path(args.out + ".json"), json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

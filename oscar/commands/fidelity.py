"""`python -m oscar fidelity [flags] [hydra overrides]`: KL / perplexity / attention diagnostics vs BF16.

Writes `output=DIR/{result.json,per_layer.csv,per_position.csv}` (the workflow gives
`results/fidelity/<model>/<method>/<corpus>`; without `output=`, ad-hoc runs go to
`results/adhoc/fidelity/<model>/<method>/<corpus>`, which no workflow table reads). Verb flags: `corpus=` (default: the calibration corpus, held-out windows only),
`windows=` (number of token windows), `seq_len=`, `prefill=` (serving mode: tokens prefilled before
token-by-token decoding; default 3/4 of seq_len), `modes=serving,decode_equivalent`,
`attention=true|false`, `force=true`, `progress=false`, `threads=N`.
"""

from __future__ import annotations

import csv
import io
import json
import sys
import time
from pathlib import Path

from oscar.commands._stage import pop_flags, read_json
from oscar.config import ConfigError, compose, config_hash
from oscar.core.files import atomic_write_text
from oscar.data.corpora import eval_sequences
from oscar.eval.cells import git_commit, hardware
from oscar.eval.fidelity import MODES, attention_fidelity, model_fidelity
from oscar.models import load_model
from oscar.models.methods import needs_statistics

FLAGS = {"corpus": "", "windows": 2, "seq_len": 1024, "prefill": 0, "modes": "serving,decode_equivalent",
         "attention": True, "force": False, "progress": True, "threads": 0}


def _csv(rows: list[dict]) -> str:
    if not rows:
        return ""
    fields = list(rows[0])
    for row in rows[1:]:
        fields += [k for k in row if k not in fields]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def main(argv: list[str]) -> int:
    """Run the fidelity diagnostics of one (model, method, corpus); 0 on success, 2 on bad input."""
    from omegaconf import OmegaConf

    try:
        flags, overrides = pop_flags(argv, FLAGS)
        cfg = compose(overrides)
        ref_cfg = compose([o for o in overrides if not o.startswith("method=")] + ["method=bf16"])
    except (ConfigError, ValueError) as exc:
        print(f"oscar fidelity: {exc}", file=sys.stderr)
        return 2
    if cfg.engine.name != "embedded":
        print(f"oscar fidelity: engine={cfg.engine.name} is not supported (the diagnostics read the embedded engine's "
              "logits and attention); use engine=embedded", file=sys.stderr)
        return 2
    modes = [m for m in str(flags["modes"]).split(",") if m]

    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        print(f"oscar fidelity: modes={flags['modes']!r}; valid: {', '.join(MODES)}", file=sys.stderr)
        return 2
    seq_len = int(flags["seq_len"])
    prefill = int(flags["prefill"]) or (3 * seq_len) // 4
    corpus = str(flags["corpus"] or cfg.calibration.corpus)
    out = Path(cfg.output) if cfg.output else Path(cfg.results_dir) / "adhoc" / "fidelity" / cfg.model.name / cfg.method.name / corpus
    settings = {"corpus": corpus, "windows": int(flags["windows"]), "seq_len": seq_len, "prefill": prefill,
                "modes": modes, "attention": bool(flags["attention"])}

    chash = config_hash({"model": OmegaConf.to_container(cfg.model), "method": OmegaConf.to_container(cfg.method),
                         "calibration": OmegaConf.to_container(cfg.calibration), "settings": settings})
    previous = read_json(out / "result.json")
    if previous and previous.get("config_hash") == chash and not flags["force"]:
        print(f"oscar fidelity: {out} is up to date (force=true reruns it)", file=sys.stderr)
        print(json.dumps(previous["metrics"], sort_keys=True))
        return 0

    import torch

    # local: keeps transformers out of import time
    from oscar.models.engine import (Engine, artifact_dir, effective_group_size, method_format, rotations_from_artifact,
                                     rotations_in_code)

    if flags["threads"]:
        torch.set_num_threads(int(flags["threads"]))
    start = time.monotonic()
    device = None if str(cfg.device) == "auto" else str(cfg.device)
    model, tokenizer = load_model(cfg.model, device=device)
    model.eval()
    cal = OmegaConf.merge(OmegaConf.to_container(cfg.calibration), {"corpus": corpus})
    try:
        windows = eval_sequences(tokenizer, cal, num_tokens=settings["windows"] * seq_len, seq_len=seq_len)
    except (ValueError, FileNotFoundError) as exc:
        print(f"oscar fidelity: {exc}", file=sys.stderr)
        return 2
    windows = [w for w in windows if int(w.numel()) == seq_len][: settings["windows"]]
    reference = Engine(model, tokenizer, ref_cfg.method)
    method = cfg.method
    metrics: dict[str, float] = {}
    per_layer: list[dict] = []
    per_position: list[dict] = []
    if not method_format(method, model).quantized:  # the reference itself
        ref_metrics, _ = model_fidelity(reference, reference, windows, modes, prefill, bool(flags["progress"]))
        metrics.update({k: v for k, v in ref_metrics.items() if k.startswith(("ppl.", "tokens."))})
        for mode in modes:  # the reference itself: zero by definition, so tables can show its row
            for suffix in ("", ".ci_lo", ".ci_hi"):
                metrics[f"kl.next_token.{mode}{suffix}"] = 0.0
    else:
        try:
            rotations = (rotations_from_artifact(artifact_dir(cfg), method, model) if needs_statistics(method)
                         else rotations_in_code(method, model))
        except FileNotFoundError as exc:
            print(f"oscar fidelity: {exc}", file=sys.stderr)
            return 2
        engine = Engine(model, tokenizer, method, rotations, fold_values=False)
        m, curves = model_fidelity(engine, reference, windows, modes, prefill, bool(flags["progress"]))
        metrics.update(m)
        for mode, curve in curves.items():
            first = prefill if mode == "serving" else 0
            per_position += [{"mode": mode, "position": first + i, "kl": float(v)} for i, v in enumerate(curve)]
        if settings["attention"]:
            d = int(cfg.model.head_dim)
            per_layer = attention_fidelity(model, windows, rotations, int(method.bits), effective_group_size(method, d),
                                           progress="attention" if flags["progress"] else None)
            for key in ("k_mse", "v_mse", "qk_mse", "sv_mse", "attn_kl"):
                metrics[f"{'kl.attn' if key == 'attn_kl' else 'mse.' + key[:-4]}"] = \
                    sum(r[key] for r in per_layer) / len(per_layer)
    result = {"model": cfg.model.name, "method": cfg.method.name, "corpus": corpus, "settings": settings,
              "scoring_modes": {"serving": "prefill in full precision, then token-by-token decode reading the cache",
                                "decode_equivalent": "teacher forcing; every position attends to the quantized history"},
              "windows": {"sink": int(method.sink), "recent": int(method.recent)},
              "metrics": metrics, "config_hash": chash, "git_commit": git_commit(), "hardware": hardware(str(reference.device)),
              "wall_s": round(time.monotonic() - start, 3)}
    atomic_write_text(out / "per_layer.csv", _csv(per_layer))
    atomic_write_text(out / "per_position.csv", _csv(per_position))
    atomic_write_text(out / "result.json", json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"oscar fidelity: {cfg.model.name} / {cfg.method.name} / {corpus} in {result['wall_s']:.1f}s -> {out}",
          file=sys.stderr)
    print(json.dumps(metrics, sort_keys=True))
    return 0

"""`python -m oscar dump [overrides] [force=true]`: run calibration text, write statistics.

Writes `<results_dir>/stats/<model>/<calibration>/` (or `output=`): `stats.safetensors` +
`stats.json` (`oscar.core.stats.CalibrationStats`): float64 sums C_Q/C_S/C_K/C_V per (layer, KV head)
over the calibration windows, plus up to `calibration.holdout_tokens` raw key/value rows per
(layer, head) from held-back windows (never part of the sums) for clip fitting and `auto`.
With `calibration.sample_rows > 0`, also `samples.safetensors`: the first `sample_rows` tokens of
raw post-RoPE Q, K, V and per-head outputs S per layer (`layers.{l}.Q` `[H, n, d]`, `.K`/`.V`
`[Hkv, n, d]`, `.S` `[H, n, d]`, float32) for diagnostics.
Skipped when the output exists with the same configuration hash, unless `force=true`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from oscar.commands._stage import run_stage_verb, StageResult, dump_hash, recorded_hash, stats_dir
from oscar.core.artifact import model_config_fields, model_config_hash
from oscar.core.files import atomic_write
from oscar.core.stats import CalibrationStats
from oscar.data.corpora import calibration_splits
from oscar.models import load_model, model_dims
from oscar.models.adapters import key_rope, layer_windows
from oscar.models.capture import run_captured


class RowSampler:
    """Keeps the first `limit` token rows of q/k/v/S per layer (float32) for diagnostics."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.rows: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
        """Append the batch's first rows (batch 0) until `limit` tokens are kept for `layer`."""
        store = self.rows.setdefault(layer, {})
        have = store["K"].shape[1] if "K" in store else 0
        room = self.limit - have
        if room <= 0:
            return
        for name, x in (("Q", q), ("K", k), ("V", v), ("S", s)):
            piece = x[0, :, :room].to(torch.float32).cpu()
            store[name] = torch.cat([store[name], piece], dim=1) if name in store else piece

    def save(self, path: Path) -> None:
        """Write `layers.{l}.{Q,K,V,S}` to a safetensors file atomically."""
        from safetensors.torch import save_file

        tensors = {f"layers.{l}.{n}": t.contiguous() for l, d in sorted(self.rows.items()) for n, t in d.items()}
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))


def collect_statistics(
    model: Any, tokenizer: Any, cal_cfg: Any, *, progress: bool = True, sampler: RowSampler | None = None
) -> Any:
    """Capture the model on the calibration windows (sums) and held-back windows (sample rows)."""
    dims = model_dims(model)
    splits = calibration_splits(tokenizer, cal_cfg)
    fields = model_config_fields(model)
    stats = CalibrationStats(
        dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim, max_samples=int(cal_cfg.holdout_tokens)
    )

    ropes = [key_rope(model, layer, positions=int(cal_cfg.seq_len)) for layer in range(dims.num_layers)]

    def accumulate(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
        spec = ropes[layer][0]
        # windows start at position 0 and carry no padding (run_captured), so token t sits at position t
        k_pre = None if spec is None else spec.apply(k.to(torch.float64), torch.arange(k.shape[2], device=k.device), inverse=True)
        stats.update(layer, q=q, k=k, v=v, attn_out=s, k_pre=k_pre)
        if sampler is not None:
            sampler(layer, q, k, v, s)

    def keep_rows(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> None:
        stats.add_samples(layer, k, v)

    t0 = time.perf_counter()
    seen = run_captured(model, splits.calibration, accumulate, progress="dump: calibration" if progress else None)
    held = run_captured(model, splits.holdout, keep_rows, progress="dump: held-back" if progress else None) if splits.holdout else 0
    stats.meta.update({
        "model": {"fields": fields, "config_hash": model_config_hash(**fields), "model_type": model.config.model_type},
        "calibration": {
            "data_id": splits.data_id,
            "tokens": seen,
            "holdout_tokens": held,
            "token_hash": splits.hash(),
            "seed": int(cal_cfg.seed),
            "seq_len": int(cal_cfg.seq_len),
            "num_windows": len(splits.calibration),
        },
        "capture_seconds": time.perf_counter() - t0,
        "rope": [spec.to_json() if spec is not None else {"unavailable": why} for spec, why in ropes],
        # sliding-window layers keep a BF16 window in the cache: nothing of theirs is quantized
        "window_layers": [i for i, w in enumerate(layer_windows(model)) if w is not None],
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
    })
    return stats


def run_dump(cfg: Any, *, model: Any = None, tokenizer: Any = None, force: bool = False, out: Path | None = None) -> StageResult:
    """Stage `dump` for a composed configuration (loads the model unless one is given)."""
    t0 = time.perf_counter()
    target = Path(out) if out is not None else (Path(str(cfg.output)) if cfg.get("output") else stats_dir(cfg))
    h = dump_hash(cfg)
    if not force and recorded_hash(target / "stats.json", "meta", "stage_hash") == h and (target / "stats.safetensors").is_file():
        return StageResult("dump", target, True, time.perf_counter() - t0, h)
    if model is None:
        torch.manual_seed(int(cfg.seed))
        model, tokenizer = load_model(cfg.model, device=cfg.device)
    sample_rows = int(cfg.calibration.get("sample_rows", 0) or 0)
    sampler = RowSampler(sample_rows) if sample_rows > 0 else None
    stats = collect_statistics(model, tokenizer, cfg.calibration, sampler=sampler)
    stats.meta.update({"stage_hash": h, "model_name": str(cfg.model.name), "calibration_name": str(cfg.calibration.name)})
    if sampler is not None:
        sampler.save(target / "samples.safetensors")
        stats.meta["diagnostic_samples"] = {"file": "samples.safetensors", "rows": sample_rows}
    stats.save(target)
    return StageResult("dump", target, False, time.perf_counter() - t0, h)


# verb flags and defaults, listed by `--help`
HELP_FLAGS = {"force": False}


def main(argv: list[str]) -> int:
    """Compose the configuration, run `dump`, print where the statistics are."""
    return run_stage_verb("dump", argv, run_dump, takes_out=False)

"""Statistics over seeds and items: mean ± std over seeds, paired bootstrap CI of the difference vs BF16."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Hashable, Mapping

import numpy as np


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0.0 for a single value)."""
    if not values:
        raise ValueError("mean_std of an empty list")
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if arr.size > 1 else 0.0


def paired_bootstrap(method: Mapping[tuple[Hashable, int], float], baseline: Mapping[tuple[Hashable, int], float],
                     n_boot: int = 2000, alpha: float = 0.05, seed: int = 0) -> dict:
    """Bootstrap CI of mean(method - baseline) over the (item, seed) pairs both runs scored.

    Items are the resampling unit (a cluster bootstrap: all seeds of a drawn item come along), so
    the CI reflects item sampling, the dominant source of variance, and stays paired.
    Returns {diff, lo, hi, n_items, n_pairs, p_nonpositive, p_nonnegative}.
    """
    common = sorted(set(method) & set(baseline), key=repr)
    if not common:
        raise ValueError("paired_bootstrap: the two runs share no (item, seed) pairs")
    per_item: dict[Hashable, list[float]] = defaultdict(list)
    for key in common:
        per_item[key[0]].append(float(method[key]) - float(baseline[key]))
    items = list(per_item)
    sums = np.array([sum(per_item[i]) for i in items])
    counts = np.array([len(per_item[i]) for i in items], dtype=np.float64)
    diff = float(sums.sum() / counts.sum())
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(items), size=(n_boot, len(items)))
    boot = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    return {"diff": diff, "lo": float(lo), "hi": float(hi), "n_items": len(items), "n_pairs": len(common),
            "p_nonpositive": float((boot <= 0).mean()), "p_nonnegative": float((boot >= 0).mean())}


def bootstrap_mean_ci(values: list[float], n_boot: int = 2000, alpha: float = 0.05, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap CI of a mean."""
    if not values:
        raise ValueError("bootstrap_mean_ci of an empty list")
    arr = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    boot = arr[rng.integers(0, arr.size, size=(n_boot, arr.size))].mean(axis=1)
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def format_pm(mean: float, std: float, scale: float = 100.0, digits: int = 1) -> str:
    """"mean ± std" in percent (scale=100) with fixed digits."""
    if math.isnan(mean):
        return "n/a"
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"

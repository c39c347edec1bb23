"""Synthetic rotation study: INT2 logit distortion of OSCAR U.H.P versus the other rotations; writes
reports/synthetic_rotations.csv and prints the table of reports/synthetic_rotations.md.

Usage: python benchmarks/studies/synthetic_rotations.py [--seeds 3] [--rows 4000] [--out reports/synthetic_rotations.csv]
Prints a markdown table (mean relative logit distortion over seeds, lower is better) and writes
one CSV row per (scenario, group size, clip mode, seed, rotation). The default `--out` is under the repository root.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from oscar.core.files import atomic_write_csv
from oscar.core.synthetic import STUDY_ROTATIONS, attention_like_sample, rotation_study

ROOT = Path(__file__).resolve().parents[2]  # the repository root (this file is benchmarks/studies/<name>.py)

SCENARIOS = {
    "aligned": {"shared": 4, "key_mean": 3.0},
    "aligned, no key mean": {"shared": 4, "key_mean": 0.0},
    "unrelated bases": {"shared": 0, "key_mean": 3.0},
    "aligned, outlier channels": {"shared": 4, "key_mean": 3.0, "outlier_channels": 2},
}
CLIP = {"none": (1.0,), "fit": (0.90, 0.92, 0.94, 0.96, 0.98, 1.0)}


def main() -> None:
    """Run the study and write the CSV."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "synthetic_rotations.csv")
    args = parser.parse_args()
    torch.set_num_threads(2)
    records = []
    for scenario, kw in SCENARIOS.items():
        for group in (128, 32):
            for clip, grid in CLIP.items():
                for seed in range(args.seeds):
                    q, k = attention_like_sample(128, args.rows, seed=seed, **kw)
                    for row in rotation_study(q, k, bits=2, group_size=group, clip_grid=grid):
                        records.append({"scenario": scenario, "group_size": group, "clip": clip, "seed": seed, **row})
    atomic_write_csv(args.out, records)
    labels = [r[0] for r in STUDY_ROTATIONS]
    print("| scenario | G | clip | " + " | ".join(labels) + " |")
    print("|---|---|---|" + "---|" * len(labels))
    for scenario in SCENARIOS:
        for group in (128, 32):
            for clip in CLIP:
                cells = []
                for label in labels:
                    vals = [r["relative"] for r in records if (r["scenario"], r["group_size"], r["clip"], r["rotation"]) == (scenario, group, clip, label)]
                    cells.append(f"{statistics.mean(vals):.4f}")
                print(f"| {scenario} | {group} | {clip} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""A timing artifact for serving a model with dummy weights: seeded random orthogonal rotations (or identity).

    python -m oscar.bench.timing_artifact CONFIG_DIR OUT_DIR [--rotation random|identity] [--bits 2] [--mu]

(``python -m oscar gpu serving`` and ``gpu prefix`` write one with ``write_timing_artifact``.)

With random weights there is nothing to calibrate; a dense seeded orthogonal ``[Hkv, d, d]`` rotation per
(layer, KV head) costs the kernels exactly what a calibrated ``U.H.P`` costs (as ``oscar.bench.throughput``'s
timing rotations), and ``--mu`` adds key/value means (the centering terms the kernels also pay for).
``identity`` makes the quantization-free path exact (the correctness check while the windows cover the
sequence). One group per row (``group_size = head_dim``: the mma layout). Plain torch + safetensors: runs
on the GPU machine without the project's Hydra dependencies.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from oscar.cache.formats import record_format
from oscar.core.artifact import CalibrationArtifact, build_meta, config_hash_of, model_config_fields, save_artifact
from oscar.core.rotation import random_orthogonal


def write_timing_artifact(config: str | Path, out: str | Path, rotation: str = "random", bits: int = 2,
                          mu: bool = False, sink: int = 64, recent: int = 256, page_size: int = 16) -> str:
    """Write the artifact for the model whose ``config.json`` is in ``config`` (its ``cache_format``: the rotated
    format, one group per row, ``sink``/``recent`` windows); returns a one-line description."""
    from transformers import AutoConfig


    if rotation not in ("random", "identity"):
        raise ValueError(f"rotation={rotation!r}; valid: random, identity")
    hf = AutoConfig.from_pretrained(str(config))
    f = model_config_fields(hf)
    L, hkv, d = int(f["num_layers"]), int(f["num_kv_heads"]), int(f["head_dim"])

    def rot(layer: int, h: int, extra: int) -> torch.Tensor:
        if rotation == "identity":
            return torch.eye(d)
        return random_orthogonal(d, seed=1000 * layer + h + extra, dtype=torch.float32)

    gen = torch.Generator().manual_seed(0)
    mean = (lambda: 0.05 * torch.randn(hkv, d, generator=gen)) if mu else (lambda: torch.zeros(hkv, d))
    method = {"name": f"timing-{rotation}", "kind": "rotated", "bits": bits, "group_size": d, "sink": sink,
              "recent": recent, "page_size": page_size}
    art = CalibrationArtifact(
        R_K=[torch.stack([rot(layer, h, 0) for h in range(hkv)]) for layer in range(L)],
        R_V=[torch.stack([rot(layer, h, 500) for h in range(hkv)]) for layer in range(L)],
        mu_K=[mean() for _ in range(L)], mu_V=[mean() for _ in range(L)],
        rho_K=[torch.ones(hkv) for _ in range(L)], rho_V=[torch.ones(hkv) for _ in range(L)],
        meta=build_meta(method=method,
                        model_id=str(config), config_hash=config_hash_of(hf), num_layers=L, num_kv_heads=hkv,
                        head_dim=d, group_size=d, bits=bits))
    record_format(art, method)
    save_artifact(art, str(out))
    return f"artifact {out}: {L} layers, {hkv} KV heads, d={d}, {rotation} rotations, INT{bits}, group {d}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--rotation", choices=("random", "identity"), default="random")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--mu", action="store_true")
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--recent", type=int, default=256)
    a = ap.parse_args(argv)
    print(write_timing_artifact(a.config, a.out, a.rotation, a.bits, a.mu, a.sink, a.recent))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

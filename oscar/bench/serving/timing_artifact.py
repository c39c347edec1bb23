"""A timing artifact for serving a model with dummy weights: seeded random orthogonal rotations (or identity).

    python -m oscar.bench.serving.timing_artifact CONFIG_DIR OUT_DIR [--rotation random|identity] [--bits 2] [--mu]
        [--format token|channel|mixed|rope]

(``python -m oscar gpu serving`` and ``gpu prefix`` write one with ``write_timing_artifact``.)

With random weights there is nothing to calibrate; a dense seeded orthogonal ``[Hkv, d, d]`` rotation per
(layer, KV head) costs the kernels exactly what a calibrated ``U.H.P`` costs (as ``oscar.bench.throughput.decode``'s
timing rotations), and ``--mu`` adds key/value means (the centering terms the kernels also pay for).
``identity`` makes the quantization-free path exact (the correctness check while the windows cover the
sequence). One group per row (``group_size = head_dim``: the mma layout). Plain torch + safetensors: runs
on the GPU machine without the project's Hydra dependencies.

``format`` (``oscar.bench.serving.formats.FORMATS``) chooses the served format the artifact records, as a calibrated
``auto`` artifact would:
``token`` per-token keys everywhere (the ``rotated`` kind); ``channel`` per-channel keys over blocks of
``CHANNEL_BLOCK`` tokens in every layer (``rotated_channel``: the default ``auto``'s key candidates, the
worst case of its per-layer choice); ``mixed`` per-channel keys in 3 layers of 4 (``auto`` on Qwen2.5-Coder-0.5B
chose 17 of 24); ``rope`` per-token keys with rope-centered means in every head (``rotated``, pre-RoPE key means:
``auto``'s ``+rope`` candidates).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from oscar.cache.formats import record_format
from oscar.core.artifact import CalibrationArtifact, build_meta, config_hash_of, model_config_fields, save_artifact
from oscar.core.rope import RopeSpec
from oscar.core.rotation import random_orthogonal

from oscar.bench.serving.formats import CHANNEL_BLOCK, FORMATS, format_page_size


def write_timing_artifact(config: str | Path, out: str | Path, rotation: str = "random", bits: int = 2,
                          mu: bool = False, sink: int = 64, recent: int = 256, page_size: int = 16,
                          fmt: str = "token") -> str:
    """Write the artifact for the model whose ``config.json`` is in ``config`` (its ``cache_format``: the rotated
    format of ``fmt``, one group per row, ``sink``/``recent`` windows); returns a one-line description."""
    from transformers import AutoConfig

    if rotation not in ("random", "identity"):
        raise ValueError(f"rotation={rotation!r}; valid: random, identity")
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}; valid: {', '.join(FORMATS)}")
    hf = AutoConfig.from_pretrained(str(config))
    f = model_config_fields(hf)
    L, hkv, d = int(f["num_layers"]), int(f["num_kv_heads"]), int(f["head_dim"])

    def rot(layer: int, h: int, extra: int) -> torch.Tensor:
        if rotation == "identity":
            return torch.eye(d)
        return random_orthogonal(d, seed=1000 * layer + h + extra, dtype=torch.float32)

    gen = torch.Generator().manual_seed(0)
    mean = (lambda: 0.05 * torch.randn(hkv, d, generator=gen)) if mu else (lambda: torch.zeros(hkv, d))
    method = {"name": f"timing-{rotation}-{fmt}", "kind": "rotated", "bits": bits, "group_size": d, "sink": sink,
              "recent": recent, "page_size": format_page_size(fmt, page_size)}
    ropemu = [0.5 * torch.randn(hkv, d, generator=gen) for _ in range(L)] if fmt == "rope" else []
    art = CalibrationArtifact(
        R_K=[torch.stack([rot(layer, h, 0) for h in range(hkv)]) for layer in range(L)],
        R_V=[torch.stack([rot(layer, h, 500) for h in range(hkv)]) for layer in range(L)],
        mu_K=[mean() for _ in range(L)], mu_V=[mean() for _ in range(L)],
        rho_K=[torch.ones(hkv) for _ in range(L)], rho_V=[torch.ones(hkv) for _ in range(L)], ropemu_K=ropemu,
        meta=build_meta(method=method,
                        model_id=str(config), config_hash=config_hash_of(hf), num_layers=L, num_kv_heads=hkv,
                        head_dim=d, group_size=d, bits=bits))
    if fmt == "rope":
        theta = float((getattr(hf, "rope_parameters", None) or {}).get("rope_theta") or getattr(hf, "rope_theta", None)
                      or 1e6)
        spec = RopeSpec(1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d), 1.0, head_dim=d)
        art.meta["rope"] = [spec.to_json() for _ in range(L)]
    if fmt in ("channel", "mixed"):
        art.meta["key_block"] = [0 if fmt == "mixed" and layer % 4 == 3 else CHANNEL_BLOCK for layer in range(L)]
    kind = record_format(art, method).kind
    save_artifact(art, str(out))
    return (f"artifact {out}: {L} layers, {hkv} KV heads, d={d}, {rotation} rotations, INT{bits}, group {d}, "
            f"format {fmt} ({kind}; per-channel key layers: {sum(1 for b in art.meta.get('key_block', []) if b)})")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--rotation", choices=("random", "identity"), default="random")
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--mu", action="store_true")
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--recent", type=int, default=256)
    ap.add_argument("--format", choices=FORMATS, default="token")
    a = ap.parse_args(argv)
    print(write_timing_artifact(a.config, a.out, a.rotation, a.bits, a.mu, a.sink, a.recent, fmt=a.format))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Tensor-parallel serving: which heads a rank holds, and the rank's slice of the OSCAR state and value fold.

SGLang (0.5.17 and 0.5.23) splits attention over the attention-TP group (`QKVParallelLinear`,
`RowParallelLinear`, `ModelConfig.get_num_kv_heads`, the models' attention modules):

- rank ``r`` of ``tp`` holds query heads ``[r H/tp, (r + 1) H/tp)`` (``H % tp == 0``);
- ``tp <= Hkv`` (``Hkv % tp == 0``): it holds KV heads ``[r Hkv/tp, (r + 1) Hkv/tp)``;
- ``tp > Hkv`` (``tp % Hkv == 0``): it holds one KV head, ``r // (tp / Hkv)``, replicated on ``tp / Hkv`` ranks;
- ``o_proj`` is row-parallel: rank ``r`` holds the input columns of its query heads, every rank the whole bias,
  which only rank 0 adds before the all-reduce of the partial outputs.

The artifact's state is per KV head (rotations, means, clip ratios, rope-centered means, and through them the
``auto`` choices), so a rank's slice is its KV heads' rows (`shard_rotations`): its pool quantizes and its
backend attends exactly as the unsharded pool would for those heads. The value fold is per query head
(``W_h <- W_h R_V[kv(h)]``), so each rank folds its own ``o_proj`` columns with its KV heads' ``R_V``
(`fold_o_proj_shard`); the mean's bias term ``sum_h W_h mu_V[kv(h)]`` sums over the heads of every rank, so
its per-rank parts are summed once at load (one all-reduce of ``[layers, hidden]``, not per step) and the sum
goes into the bias that rank 0 adds. No collective is added to the step.

Plain torch; no sglang import (tested in the default environment, `tests/test_sharding.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from oscar.cache.torch_cache import LayerRotations
from oscar.models.surgery import folded_weight


def tp_problems(tp_size: int, num_heads: int, num_kv_heads: int) -> list[str]:
    """Why a model's heads do not split over ``tp_size`` ranks as SGLang splits them (empty when they do)."""
    out = []
    if tp_size < 1:
        out.append(f"tp_size {tp_size} must be at least 1")
        return out
    if num_heads % num_kv_heads:
        out.append(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    if num_heads % tp_size:
        out.append(f"--tp-size {tp_size} does not divide the {num_heads} query heads (SGLang splits them evenly): "
                   f"use a divisor of {num_heads}")
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        out.append(f"--tp-size {tp_size} does not divide the {num_kv_heads} KV heads: use a divisor or a multiple "
                   f"of {num_kv_heads}")
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        out.append(f"--tp-size {tp_size} is above the {num_kv_heads} KV heads but not a multiple of them "
                   "(SGLang replicates each KV head on tp_size / Hkv ranks)")
    return out


@dataclass(frozen=True)
class HeadShard:
    """The attention heads of TP rank ``tp_rank`` of ``tp_size`` for a model of ``num_heads`` query and
    ``num_kv_heads`` KV heads (SGLang's split; see the module docstring)."""

    tp_rank: int
    tp_size: int
    num_heads: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        problems = tp_problems(self.tp_size, self.num_heads, self.num_kv_heads)
        if not 0 <= self.tp_rank < max(self.tp_size, 1):
            problems.append(f"tp_rank {self.tp_rank} is not in [0, {self.tp_size})")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def local_heads(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        """KV heads on this rank (SGLang's ``get_num_kv_heads``: at least one)."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head (``tp / Hkv`` when ``tp > Hkv``, else 1)."""
        return self.tp_size // self.num_kv_heads if self.tp_size > self.num_kv_heads else 1

    @property
    def kv_start(self) -> int:
        """First (global) KV head of this rank (`QKVParallelLinear`'s ``tp_rank // num_kv_head_replicas``)."""
        return self.tp_rank // self.kv_replicas * self.local_kv_heads

    @property
    def q_start(self) -> int:
        """First (global) query head of this rank."""
        return self.tp_rank * self.local_heads

    @property
    def kv_slice(self) -> slice:
        return slice(self.kv_start, self.kv_start + self.local_kv_heads)

    @property
    def q_slice(self) -> slice:
        return slice(self.q_start, self.q_start + self.local_heads)

    @property
    def whole(self) -> bool:
        """True when this rank holds every head (no tensor parallelism)."""
        return self.tp_size == 1

    def describe(self) -> str:
        """One line for the logs: the rank and its heads."""
        rep = f", each replicated on {self.kv_replicas} ranks" if self.kv_replicas > 1 else ""
        return (f"TP rank {self.tp_rank} of {self.tp_size}: query heads {self.q_start}..{self.q_start + self.local_heads - 1}"
                f" of {self.num_heads}, KV heads {self.kv_start}..{self.kv_start + self.local_kv_heads - 1} of "
                f"{self.num_kv_heads}{rep}")


def head_shard(tp_rank: int, tp_size: int, num_heads: int, num_kv_heads: int) -> HeadShard:
    """The heads of TP rank ``tp_rank`` (refuses a split SGLang would refuse, naming the sizes)."""
    return HeadShard(int(tp_rank), int(tp_size), int(num_heads), int(num_kv_heads))


def shard_rotations(rot: LayerRotations, shard: HeadShard) -> LayerRotations:
    """One layer's per-KV-head state restricted to the rank's KV heads (views; the layer's RoPE is shared)."""
    if shard.whole:
        return rot
    hkv = int(rot.r_k.shape[0])
    if hkv != shard.num_kv_heads:
        raise ValueError(f"layer rotations for {hkv} KV heads, but the model has {shard.num_kv_heads}")
    s = shard.kv_slice

    def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t[s]

    return replace(rot, r_k=rot.r_k[s], r_v=rot.r_v[s], mu_k=cut(rot.mu_k), mu_v=cut(rot.mu_v), rho_k=cut(rot.rho_k),
                   rho_v=cut(rot.rho_v), rope_k=cut(rot.rope_k))


def shard_layers(rotations: Sequence[LayerRotations], shard: HeadShard) -> list[LayerRotations]:
    """`shard_rotations` of every layer."""
    return [shard_rotations(rot, shard) for rot in rotations]


def fold_o_proj_shard(weight: torch.Tensor, rot: LayerRotations, shard: HeadShard
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The rank's folded ``o_proj`` columns and its part of the mean's bias term.

    ``weight`` ``[hidden, H/tp * d]`` is the rank's row-parallel shard and ``rot`` the rank's slice
    (`shard_rotations`). Returns ``W_h R_V[kv(h)]`` for the rank's heads (``weight.dtype``) and
    ``sum_h W_h mu_V[kv(h)]`` over them (float64 ``[hidden]``, None without ``mu_V``): the bias term of the
    whole layer is the sum of the ranks' parts."""
    d = int(rot.r_v.shape[-1])
    if weight.shape[1] != shard.local_heads * d:
        raise ValueError(f"o_proj shard of input width {weight.shape[1]}, expected {shard.local_heads} heads x "
                         f"head_dim {d} ({shard.describe()})")
    if rot.r_v.shape[0] != shard.local_kv_heads:
        raise ValueError(f"rotations of {rot.r_v.shape[0]} KV heads for a rank holding {shard.local_kv_heads}: "
                         "slice them with shard_rotations first")
    folded = folded_weight(weight, rot.r_v, shard.local_heads)
    if rot.mu_v is None:
        return folded, None
    hidden, per = weight.shape[0], shard.local_heads // shard.local_kv_heads
    w = weight.reshape(hidden, shard.local_kv_heads, per, d).to(torch.float64)
    term = torch.einsum("okpd,kd->o", w, rot.mu_v.to(device=weight.device, dtype=torch.float64))
    return folded, term


__all__ = ["HeadShard", "fold_o_proj_shard", "head_shard", "shard_layers", "shard_rotations", "tp_problems"]

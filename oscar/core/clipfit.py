"""Attention-weighted distortion, clip-ratio fitting, and the rotation candidates of `auto`.

Distortion of one (layer, KV head). Let `X` be `n` held-back key rows (or value rows), `R` the
rotation, `mu` the mean subtracted before rotating (zero when not centering), and
`Y = X_hat_rot - (X - mu) R` the error of the *real* quantizer (`oscar.core.quant.rotate_clip_quantize`
then `dequantize`, float32 rotation as in the cache) in the rotated frame. With the metric
`C` (a second moment, normalized by its count):

    D = tr(Y (R^T C R) Y^T) / n = mean over rows of  e C e^T,  e = Y R^T  (original-frame error)

Keys use `C = C_Q / n_Q` (uncentered query second moment): for a query `q`, the logit error is
`q . e`, and `E_q[(q . e)^2] = e C_Q e^T`, so `D` is the mean squared logit error (before the
softmax scale). The mean `mu` is added back exactly in the attention (`q . mu_K`), so centering
changes which errors occur, not the metric. Values use the `C_S` analogue
(`C = C_S / n_S`, the second moment of the per-head attention outputs `S V`): value-error
directions are weighted by the energy the head actually writes in them.

Candidate rotation targets (each `U.H.P` of the target's eigenbasis, plus plain `H.P`):

- `query` (keys) / `output` (values): the metric itself, `C_Q` / `C_S` (OSCAR).
- `raw`: the second moment of the cached rows themselves, `C_K` / `C_V` (centered covariance
  `C / n - mu mu^T` when centering).
- `geomean`: the matrix geometric mean `M # D` of the metric `M` (`C_Q` or `C_S`) and the data
  moment `D` (`C_K` or `C_V`). Why: a key component along a unit direction `u` costs quantization
  error proportional to its spread `u^T D u` and hurts logits in proportion to `u^T M u`; the
  cost of direction `u` is the product. When `M` and `D` commute, `M # D` has their common
  eigenvectors with eigenvalues `sqrt(lambda_M lambda_D)`, so its eigenbasis orders directions by
  exactly that product, and `U.H.P` makes the most expensive ones group-constant (free under the
  per-group zero point). In general `#` is the unique symmetric mean with
  `(A^T M A) # (A^T D A) = A^T (M # D) A` for every invertible `A`, so the choice does not depend
  on the basis the statistics were collected in, and it is invariant to rescaling `M` or `D`.
- `hadamard`: `H.P` without any eigenbasis.

Per-channel keys (`block > 0`, the "channel" key format, KIVI-style: `oscar.core.quant.quantize_channels`):
each channel is quantized over blocks of `T` consecutive tokens, so a channel's offset and scale live in
its own zero point and scale; what a per-token group cannot absorb (channels of very different spread, an
offset per channel) costs it nothing. Its candidates (`CHANNEL_TARGETS`) rotate by the identity (the
channels as the model writes them, KIVI) or by the eigenbasis `U` of the `raw` target (no Hadamard: a
Hadamard would spread every channel's spread over all of them, the opposite of what per-channel groups
want), each plain or rope-centered. The held-back rows are consecutive tokens, scored in whole blocks.
The key format is one per layer (`select_layer`: the format whose per-head best candidates distort less in
total), since a layer's key pages have one layout.

Each target comes with and without centering (`center`: `False`, `True` = subtract the constant mean).
Keys have a third mode where the model's RoPE is known (`oscar.core.rope`, statistics with pre-RoPE sums):
`center="rope"` subtracts `RoPE_p(m)`, the pre-RoPE key mean `m` turned to each row's position `p`
(exact for a `k_proj` bias, which a constant post-RoPE mean cannot remove), and its `raw` target is
`mean_p RoPE_p Cov_pre RoPE_p^T` over the calibration positions; `geomean` uses that as its data moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from oscar.core.quant import ClipRatio, dequantize, dequantize_channels, quantize_channels, rotate_clip_quantize
from oscar.core.rope import RopeSpec
from oscar.core.rotation import bit_reversal, build_rotation, eigenbasis, hadamard
from oscar.core.stats import CalibrationStats

KEY_TARGETS = ("query", "raw", "geomean", "hadamard")
CHANNEL_TARGETS = ("identity", "raw")  # per-channel key candidates (module doc)
VALUE_TARGETS = ("output", "raw", "geomean", "hadamard")
_METRIC = {"key": "Q", "value": "S"}
_DATA = {"key": "K", "value": "V"}
Center = bool | str  # False | True | "rope"


def center_suffix(center: Center) -> str:
    """Label suffix of a centering mode: `""`, `"+center"` or `"+rope"`."""
    return {False: "", True: "+center", "rope": "+rope"}[center]


def candidate_label(target: str, center: Center, block: int = 0) -> str:
    """`target+center`, with `/ch<block>` for a per-channel key candidate."""
    return target + center_suffix(center) + (f"/ch{int(block)}" if block else "")


def stats_rope(stats: CalibrationStats, layer: int) -> RopeSpec | None:
    """The layer's key RoPE recorded by `dump` when its pre-RoPE key sums exist, else None."""
    specs = stats.meta.get("rope") or []
    if layer >= len(specs) or not isinstance(specs[layer], dict) or "inv_freq" not in specs[layer]:
        return None
    return RopeSpec.from_json(specs[layer]) if stats.has_pre_rope(layer) else None


def key_centers(stats: CalibrationStats, layer: int) -> tuple[Center, ...]:
    """Centering modes `auto` tries for the keys of `layer`: `rope` joins where the statistics allow it."""
    return (False, True, "rope") if stats_rope(stats, layer) is not None else (False, True)


def _rope_data_moment(stats: CalibrationStats, layer: int, head: int) -> torch.Tensor:
    spec = stats_rope(stats, layer)
    if spec is None:
        raise ValueError(
            f"layer {layer}: rope-centered keys need pre-RoPE key sums and the layer's RoPE in the statistics; "
            "re-run python -m oscar dump (force=true) with this version"
        )
    seq_len = int((stats.meta.get("calibration") or {}).get("seq_len", 2048))
    cov = stats.second_moment(layer, "Kpre", centered=True)[head]
    return spec.averaged_second_moment(cov, torch.arange(seq_len))


def geometric_mean(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-9) -> torch.Tensor:
    """Matrix geometric mean `A # B = A^1/2 (A^-1/2 B A^-1/2)^1/2 A^1/2` of PSD matrices (float64).

    Both are regularized by `eps * tr/d * I` so that rank-deficient statistics stay well defined.
    """
    a = _regularize(a.to(torch.float64), eps)
    b = _regularize(b.to(torch.float64), eps)
    a_half, a_ihalf = _sqrt_and_inv_sqrt(a)
    inner = a_ihalf @ b @ a_ihalf
    inner_half, _ = _sqrt_and_inv_sqrt((inner + inner.T) / 2)
    g = a_half @ inner_half @ a_half
    return (g + g.T) / 2


def _regularize(c: torch.Tensor, eps: float) -> torch.Tensor:
    d = c.shape[-1]
    c = (c + c.T) / 2
    scale = max(float(torch.trace(c)) / d, 1e-300)
    return c + eps * scale * torch.eye(d, dtype=c.dtype)


def _sqrt_and_inv_sqrt(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lam, vec = torch.linalg.eigh(c)
    top = float(lam.max())
    lam = lam.clamp_min(top * 1e-15 if top > 0 else 1e-300)
    return (vec * lam.sqrt()) @ vec.T, (vec * lam.rsqrt()) @ vec.T


def quantization_error(
    rows: torch.Tensor,
    R: torch.Tensor,
    mu: torch.Tensor | None,
    rho: ClipRatio,
    bits: int,
    group_size: int,
    block: int = 0,
) -> torch.Tensor:
    """Original-frame error `e = (X_hat_rot - (X - mu) R) R^T` (float64 `[n, d]`) of the real quantizer.

    The rotation is applied in float32 like the cache does (`rotate_clip_quantize`), the codes
    are packed and unpacked, and the error is measured in float64 against the exact rotation.
    `block > 0`: per-channel quantization over blocks of `block` consecutive rows (the channel key
    format); only whole blocks are scored (`n` is cut to a multiple of `block`).
    """
    r32 = R.to(torch.float32)
    if block:
        n = (rows.shape[0] // block) * block
        if n == 0:
            raise ValueError(f"{rows.shape[0]} held-back rows are fewer than one channel block of {block} tokens")
        rows = rows[:n]
        if mu is not None and mu.ndim == 2:
            mu = mu[:n]
        xr = rows.to(torch.float32) - (0 if mu is None else mu.to(torch.float32))
        deq = dequantize_channels(quantize_channels(xr @ r32, bits, block, group_size, rho))
    else:
        deq = dequantize(rotate_clip_quantize(rows, r32, mu, rho, bits=bits, group_size=group_size))
    x = rows.to(torch.float64)
    if mu is not None:
        x = x - mu.to(torch.float64)
    r64 = r32.to(torch.float64)
    return (deq.to(torch.float64) - x @ r64) @ r64.T


def weighted_distortion(err: torch.Tensor, metric: torch.Tensor) -> float:
    """`tr(E C E^T) / n` for error rows `E` `[n, d]` and a metric `C` `[d, d]` (float64)."""
    e = err.to(torch.float64)
    return float(((e @ metric.to(torch.float64)) * e).sum() / max(e.shape[0], 1))


def measured_distortion(
    rows: torch.Tensor,
    R: torch.Tensor,
    metric: torch.Tensor,
    *,
    mu: torch.Tensor | None = None,
    rho: ClipRatio = 1.0,
    bits: int = 2,
    group_size: int = 128,
    block: int = 0,
) -> float:
    """Attention-weighted distortion `tr(Y R^T C R Y^T) / n` after real quantization (module doc);
    `block > 0` scores the per-channel key format over blocks of `block` rows."""
    if rows.ndim != 2:
        raise ValueError(f"rows must be [n, d] samples of one (layer, head), got shape {tuple(rows.shape)}")
    if rows.shape[0] == 0:
        raise ValueError("no held-back rows to measure distortion on")
    return weighted_distortion(quantization_error(rows, R, mu, rho, bits, group_size, block), metric)


@dataclass
class ClipFit:
    """Result of a clip-ratio grid search: the best ratio and the distortion at each grid point."""

    rho: float
    distortion: float
    grid: list[float] = field(default_factory=list)
    distortions: list[float] = field(default_factory=list)


def fit_clip_ratio(
    rows: torch.Tensor,
    R: torch.Tensor,
    metric: torch.Tensor,
    grid: Sequence[float],
    *,
    mu: torch.Tensor | None = None,
    bits: int = 2,
    group_size: int = 128,
    block: int = 0,
) -> ClipFit:
    """The grid ratio with the smallest measured distortion (first one on ties)."""
    grid = [float(g) for g in grid]
    if not grid:
        raise ValueError("clip grid is empty; give at least one ratio in (0, 1]")
    values = [measured_distortion(rows, R, metric, mu=mu, rho=g, bits=bits, group_size=group_size, block=block) for g in grid]
    best = min(range(len(grid)), key=lambda i: (values[i], i))
    return ClipFit(rho=grid[best], distortion=values[best], grid=grid, distortions=values)


def _metric(stats: CalibrationStats, layer: int, side: str) -> torch.Tensor:
    if side not in _METRIC:
        raise ValueError(f"side={side!r}; valid are 'key' and 'value'")
    return stats.second_moment(layer, _METRIC[side])


def target_matrix(stats: CalibrationStats, layer: int, head: int, side: str, target: str, center: Center) -> torch.Tensor | None:
    """Matrix whose eigenbasis a candidate uses (float64 `[d, d]`), or None for `hadamard` (module doc)."""
    valid = KEY_TARGETS if side == "key" else VALUE_TARGETS
    if target not in valid:
        raise ValueError(f"unknown {side} target {target!r}; valid are {valid}")
    if center not in (False, True, "rope") or (center == "rope" and side != "key"):
        raise ValueError(f"{side} center={center!r}; valid are False, True" + (" and 'rope'" if side == "key" else ""))
    if target == "hadamard":
        return None
    metric = _metric(stats, layer, side)[head]
    if target in ("query", "output"):
        return metric
    if center == "rope":
        data = _rope_data_moment(stats, layer, head)
    else:
        data = stats.second_moment(layer, _DATA[side], centered=bool(center))[head]
    if target == "raw":
        return data
    return geometric_mean(metric, data)


@dataclass
class Candidate:
    """One candidate rotation for a (layer, KV head, side): target, centering, `R`, `mu`, eigenvalues.

    A rope-centered key candidate (`center == "rope"`) has `mu` zero, `rope_mean` the pre-RoPE mean
    and `row_offsets` `RoPE_p(rope_mean)` at the held-back rows' positions (what scoring subtracts).
    `block > 0`: a per-channel key candidate over blocks of `block` tokens (the channel key format).
    """

    target: str
    center: Center
    R: torch.Tensor
    mu: torch.Tensor
    eig: torch.Tensor | None
    rope_mean: torch.Tensor | None = None
    row_offsets: torch.Tensor | None = None
    block: int = 0

    @property
    def name(self) -> str:
        """Readable label, e.g. `query+center`, `raw+rope`, `identity+rope/ch64` (per-channel keys)."""
        return candidate_label(self.target, self.center, self.block)

    @property
    def scoring_mean(self) -> torch.Tensor:
        """What the quantizer subtracts from the held-back rows: `mu`, or the per-row RoPE offsets."""
        return self.row_offsets if self.row_offsets is not None else self.mu


def _centering(
    stats: CalibrationStats, layer: int, head: int, side: str, center: Center
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`(mu, rope_mean, row_offsets)` of a centering mode (`Candidate`)."""
    d = stats.head_dim
    mu = stats.mean(layer, _DATA[side])[head] if center is True else torch.zeros(d, dtype=torch.float64)
    if center != "rope":
        return mu, None, None
    spec = stats_rope(stats, layer)
    if spec is None:
        raise ValueError(f"layer {layer}: rope-centered keys need pre-RoPE key sums and the layer's RoPE in the statistics")
    rope_mean = stats.mean(layer, "Kpre")[head]
    pos = stats.sample_pos[layer]
    if pos.numel() != stats.samples[layer]["K_samples"].shape[1]:
        raise ValueError(f"layer {layer}: {pos.numel()} sample positions for {stats.samples[layer]['K_samples'].shape[1]} held-back rows")
    return mu, rope_mean, spec.offsets(rope_mean[None], pos[None], dtype=torch.float64)[0, 0]


def make_candidate(
    stats: CalibrationStats, layer: int, head: int, side: str, target: str, center: Center, block: int = 0
) -> Candidate:
    """Build the `U.H.P` (or `H.P` for `hadamard`) candidate of a target, with or without centering;
    `block > 0`: the per-channel key candidate of a `CHANNEL_TARGETS` target (`I` or the raw eigenbasis `U`)."""
    d = stats.head_dim
    if block and (side != "key" or target not in CHANNEL_TARGETS):
        raise ValueError(f"per-channel candidates are keys with targets {CHANNEL_TARGETS}, got {side} {target!r}")
    mat = None if block and target == "identity" else target_matrix(stats, layer, head, side, target, center)
    mu, rope_mean, offsets = _centering(stats, layer, head, side, center)
    if block:
        if mat is None:
            return Candidate(target, center, torch.eye(d, dtype=torch.float64), mu, None, rope_mean, offsets, block)
        u, eig = eigenbasis(mat)
        return Candidate(target, center, _compose(u, "u"), mu, eig, rope_mean, offsets, block)
    if mat is None:
        return Candidate(target, center, build_rotation("hp", d), mu, None, rope_mean, offsets)
    u, eig = eigenbasis(mat)
    return Candidate(target, center, _compose(u, "uhp"), mu, eig, rope_mean, offsets)


def _compose(u: torch.Tensor, kind: str) -> torch.Tensor:
    """`U`, `U.H`, `U.P` or `U.H.P` from an eigenbasis (same products as `build_rotation`)."""
    d = u.shape[0]
    if kind == "u":
        return u
    if kind == "uh":
        return u @ hadamard(d)
    if kind == "up":
        return u @ bit_reversal(d)
    return u @ hadamard(d) @ bit_reversal(d)


def candidates(
    stats: CalibrationStats,
    layer: int,
    head: int,
    side: str,
    targets: Sequence[str] | None = None,
    centers: Sequence[Center] | None = None,
    channel_block: int = 0,
) -> list[Candidate]:
    """All candidates of `auto` for one (layer, head, side): every target with every centering mode
    (default: without and with the mean; keys also rope-centered where `key_centers` allows), and with
    `channel_block > 0` the per-channel key candidates (`CHANNEL_TARGETS`, plain and, where allowed, rope-centered)."""
    if centers is None:
        centers = key_centers(stats, layer) if side == "key" else (False, True)
    targets = list(targets) if targets is not None else list(KEY_TARGETS if side == "key" else VALUE_TARGETS)
    out = [make_candidate(stats, layer, head, side, t, c) for t in targets for c in centers]
    if channel_block and side == "key":
        ch_centers = [c for c in centers if c is not True]  # a constant mean is the per-channel zero point's job
        out += [make_candidate(stats, layer, head, side, t, c, channel_block) for t in CHANNEL_TARGETS for c in ch_centers]
    return out


def _samples(stats: CalibrationStats, layer: int, side: str) -> torch.Tensor:
    rows = stats.samples[layer]["K_samples" if side == "key" else "V_samples"]
    if rows.shape[1] == 0:
        raise ValueError(
            f"layer {layer} has no held-back {side} rows; collect them with CalibrationStats(max_samples>0)"
            ".add_samples(...) (calibration.holdout_tokens)"
        )
    return rows


@dataclass
class Selection:
    """The chosen candidate of one (layer, head, side), its clip fit, and every candidate's score."""

    candidate: Candidate
    clip: ClipFit
    table: list[dict] = field(default_factory=list)
    score: float = float("nan")  # what the selection minimized: the distortion, or the `select_by` score


# Selection hook: `score(candidate, rho) -> float` (lower is better) replaces the measured distortion as what
# `auto` minimizes among its candidates (each still at its distortion-fitted clip ratio); e.g. a task metric
# measured with only this (layer, KV head, side) quantized by the candidate (oscar.studies.metric_select).
CandidateScore = Callable[[Candidate, float], float]
# `select_by(layer, head, side) -> CandidateScore | None` for every (layer, KV head, side) of a calibration.
SelectBy = Callable[[int, int, str], "CandidateScore | None"]


def select_candidate(
    rows: torch.Tensor,
    metric: torch.Tensor,
    cands: Sequence[Candidate],
    grid: Sequence[float],
    *,
    bits: int = 2,
    group_size: int = 128,
    score: CandidateScore | None = None,
) -> Selection:
    """Fit the clip ratio of each candidate on `rows`, keep the lowest measured distortion (or, with `score`,
    the lowest score of the candidate at its fitted ratio; the table then lists both)."""
    if not cands:
        raise ValueError("no candidates to select from")
    best: Selection | None = None
    best_value = float("inf")
    table = []
    for cand in cands:
        fit = fit_clip_ratio(rows, cand.R, metric, grid, mu=cand.scoring_mean, bits=bits, group_size=group_size, block=cand.block)
        value = fit.distortion if score is None else float(score(cand, fit.rho))
        entry = {"target": cand.target, "center": cand.center, "rho": fit.rho, "distortion": fit.distortion}
        if score is not None:
            entry["score"] = value
        table.append(entry if not cand.block else {**entry, "block": cand.block})
        if best is None or value < best_value:
            best, best_value = Selection(cand, fit), value
    assert best is not None
    best.table = table
    best.score = best_value
    return best


def rotation_seed(seed: int, layer: int, head: int, side: str) -> int:
    """Deterministic seed of the random rotation of one (layer, KV head, side)."""
    return (int(seed) * 1_000_003 + layer * 1009 + head * 17 + (0 if side == "key" else 7)) % (2**63 - 1)


def layer_rotations(
    side: str,
    kind: str,
    *,
    head_dim: int,
    num_kv_heads: int,
    stats: CalibrationStats | None = None,
    layer: int = 0,
    target: str | None = None,
    center: bool = False,
    group_size: int | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor | None]:
    """Rotations of one layer and side for a named kind: `R` `[Hkv, d, d]`, `mu` `[Hkv, d]`, `eig` or None.

    `kind` is an `oscar.core.rotation` kind (`raw_uhp` forces the `raw` target). Kinds with an
    eigenbasis, and centering, need `stats`. `target` defaults to `query` (keys) / `output`
    (values); `geomean` is accepted too.
    """
    if side not in _METRIC:
        raise ValueError(f"side={side!r}; valid are 'key' and 'value'")
    d, hkv = head_dim, num_kv_heads
    if target is None:
        target = "query" if side == "key" else "output"
    if kind == "raw_uhp":
        target, kind = "raw", "uhp"
    needs_u = kind in ("u", "uh", "up", "uhp")
    if (needs_u or center) and stats is None:
        raise ValueError(f"{side} rotation {kind!r} (center={center}) needs calibration statistics")
    rs, mus, eigs = [], [], []
    for h in range(hkv):
        if needs_u:
            mat = target_matrix(stats, layer, h, side, target, center)  # type: ignore[arg-type]
            if mat is None:
                raise ValueError(f"{side} rotation {kind!r} needs an eigenbasis target, got target={target!r}")
            u, eig = eigenbasis(mat)
            rs.append(_compose(u, kind))
            eigs.append(eig)
        else:
            rs.append(build_rotation(kind, d, group_size=group_size, seed=rotation_seed(seed, layer, h, side)))
        mus.append(stats.mean(layer, _DATA[side])[h] if center else torch.zeros(d, dtype=torch.float64))  # type: ignore[union-attr]
    return {"R": torch.stack(rs), "mu": torch.stack(mus), "eig": torch.stack(eigs) if eigs else None}


def fit_layer_clip(
    stats: CalibrationStats,
    layer: int,
    side: str,
    R: torch.Tensor,
    mu: torch.Tensor,
    grid: Sequence[float],
    *,
    bits: int,
    group_size: int,
) -> list[ClipFit]:
    """Per-KV-head clip fits of one layer and side on the held-back rows (`R` `[Hkv, d, d]`)."""
    rows = _samples(stats, layer, side)
    metric = _metric(stats, layer, side)
    return [
        fit_clip_ratio(rows[h], R[h], metric[h], grid, mu=mu[h], bits=bits, group_size=group_size)
        for h in range(stats.num_kv_heads)
    ]


def select_layer(
    stats: CalibrationStats,
    layer: int,
    side: str,
    grid: Sequence[float],
    *,
    bits: int,
    group_size: int,
    targets: Sequence[str] | None = None,
    centers: Sequence[Center] | None = None,
    channel_block: int = 0,
    select_by: SelectBy | None = None,
    key_format: bool | None = None,
    memo: dict | None = None,
) -> list[Selection]:
    """`auto` for one layer and side: the best candidate of every KV head on held-back rows. With
    `channel_block > 0` (keys) the layer's key format is the one (per-token or per-channel) whose per-head
    best candidates distort less in total, and each head takes its best candidate of that format; every
    head's table still lists all candidates. `select_by` (the selection hook, opt-in): each head's candidates
    and the layer's key format are chosen by its score instead of the measured distortion. `key_format`
    (keys with `channel_block > 0`): True / False imposes per-channel / per-token keys on the layer (a format
    chosen elsewhere, e.g. by the model's next-token KL: `oscar.models.select`); None lets the score choose.
    `memo` (a dict shared by calls with the same statistics and arguments but `key_format`): each (layer, side)'s
    per-head selections are computed once, so imposing other key formats costs no second selection."""
    if key_format is not None and not (channel_block and side == "key"):
        raise ValueError(f"layer {layer}: key_format={key_format} imposes a key format; it needs side='key' and "
                         f"channel_block > 0, got side={side!r}, channel_block={channel_block}")
    if memo is not None and (layer, side) in memo:
        return _pick_format(memo[(layer, side)], key_format)
    rows = _samples(stats, layer, side)
    metric = _metric(stats, layer, side)
    if rows.shape[1] < channel_block:  # fewer held-back rows than one block: nothing to score them on
        channel_block = 0
    cands = [candidates(stats, layer, h, side, targets, centers, channel_block) for h in range(stats.num_kv_heads)]
    scores = [None if select_by is None else select_by(layer, h, side) for h in range(len(cands))]
    if not (channel_block and side == "key"):
        by_format = {False: [select_candidate(rows[h], metric[h], cands[h], grid, bits=bits, group_size=group_size,
                                              score=scores[h]) for h in range(len(cands))]}
    else:
        by_format = {
            fmt: [select_candidate(rows[h], metric[h], [c for c in cands[h] if bool(c.block) == fmt], grid, bits=bits,
                                   group_size=group_size, score=scores[h]) for h in range(len(cands))]
            for fmt in (False, True)
        }
    if memo is not None:
        memo[(layer, side)] = by_format
    return _pick_format(by_format, key_format)


def _pick_format(by_format: dict[bool, list[Selection]], key_format: bool | None) -> list[Selection]:
    """The layer's selections of one key format (imposed, or the lower total score), each head's table listing
    the candidates of both formats; copies, so that the per-format selections stay as computed."""
    if len(by_format) == 1:
        return [replace(s) for s in by_format[False]]
    total = {fmt: sum(s.score for s in sel) for fmt, sel in by_format.items()}
    fmt = total[True] < total[False] if key_format is None else bool(key_format)
    return [replace(s, table=by_format[False][h].table + by_format[True][h].table) for h, s in enumerate(by_format[fmt])]


__all__ = [
    "CHANNEL_TARGETS",
    "Candidate",
    "CandidateScore",
    "ClipFit",
    "KEY_TARGETS",
    "SelectBy",
    "Selection",
    "VALUE_TARGETS",
    "candidate_label",
    "candidates",
    "center_suffix",
    "fit_clip_ratio",
    "fit_layer_clip",
    "geometric_mean",
    "key_centers",
    "layer_rotations",
    "make_candidate",
    "measured_distortion",
    "quantization_error",
    "rotation_seed",
    "select_candidate",
    "select_layer",
    "stats_rope",
    "target_matrix",
    "weighted_distortion",
]

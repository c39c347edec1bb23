"""Tensor-parallel serving state (oscar.serve.sharding, the plugin's fold): rank by rank against the unsharded twin.

Every rank quantizes and attends over its slice of the KV heads with its slice of the artifact's per-KV-head
state (rotations, means, clip ratios, rope-centered key means) through the pool's own path (the paged
writer and decode attention, torch twins); the ranks' outputs, concatenated over query heads, are the
unsharded computation's. The ranks' folded ``o_proj`` shards, summed as SGLang's row-parallel all-reduce
sums them (bias added once), give the unsharded folded ``o_proj``, which gives the unfolded one.
"""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace

import pytest
import torch

from oscar.cache import paged
from oscar.cache.torch_cache import LayerRotations
from oscar.core.rope import RopeSpec
from oscar.core.rotation import random_orthogonal
from oscar.models.surgery import folded_bias, folded_weight
from oscar.serve.plugin import fold_model, shard_state
from oscar.serve.sharding import fold_o_proj_shard, head_shard, shard_rotations, tp_problems

D, PAGE, SINK, RECENT, HIDDEN = 64, 16, 4, 6, 40
INT_LENS = (37, 21)  # quantized tokens of the two sequences (pages of 16: a partial last page each)
SIZES = (1, 2, 4, 8)
GRID = [(hkv, ratio, tp) for hkv, ratio, tp in itertools.product(SIZES, SIZES, SIZES)
        if not tp_problems(tp, hkv * ratio, hkv)]


def _rotations(hkv: int, seed: int) -> LayerRotations:
    g = torch.Generator().manual_seed(seed)
    orth = lambda s: torch.stack([random_orthogonal(D, seed=s * 100 + h) for h in range(hkv)]).float()  # noqa: E731
    rope_k = torch.randn(hkv, D, generator=g)
    rope_k[::2] = 0  # rope-centered keys on the odd heads only (zero rows elsewhere)
    spec = RopeSpec(1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), 1.0, D)
    return LayerRotations(orth(seed), orth(seed + 1), torch.randn(hkv, D, generator=g) * 0.3,
                          torch.randn(hkv, D, generator=g) * 0.3, 0.8 + 0.2 * torch.rand(hkv, generator=g),
                          0.8 + 0.2 * torch.rand(hkv, generator=g), rope_k, spec)


def _state(hkv: int, heads: int, seed: int) -> dict[str, torch.Tensor]:
    """A decode step of two sequences: queries, the quantized rows (with positions) and the BF16 windows."""
    g = torch.Generator().manual_seed(seed)
    B, n = len(INT_LENS), sum(INT_LENS)
    bf = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    pos = torch.cat([SINK + torch.arange(t) for t in INT_LENS])
    return dict(q=torch.randn(B, heads, D, generator=g), k=bf(n, hkv, D).float(), v=bf(n, hkv, D).float(), pos=pos,
                sink_k=bf(B, hkv, SINK, D), sink_v=bf(B, hkv, SINK, D), recent_k=bf(B, hkv, RECENT, D),
                recent_v=bf(B, hkv, RECENT, D))


def _attend(st: dict[str, torch.Tensor], rot: LayerRotations, frame: str = "rotated") -> tuple[torch.Tensor, ...]:
    """The pool's path for one layer: rows written through the paged writer into shuffled pages, then decode
    attention over sink + pages + recent. Returns the output ``[B, H, d]`` and the K and V codes."""
    hkv = st["k"].shape[1]
    per_seq = [(t + PAGE - 1) // PAGE for t in INT_LENS]
    ids = torch.randperm(sum(per_seq), generator=torch.Generator().manual_seed(7)).to(torch.int32)
    table = torch.zeros(len(INT_LENS), max(per_seq), dtype=torch.int32)
    table[0, : per_seq[0]], table[1, : per_seq[1]] = ids[: per_seq[0]], ids[per_seq[0]:]
    seq = torch.cat([torch.full((t,), b) for b, t in enumerate(INT_LENS)])
    slots = paged.slots_for(table, seq, st["pos"] - SINK, PAGE)
    kp = paged.QuantPages.empty(sum(per_seq), hkv, PAGE, D, 2, D)
    vp = paged.QuantPages.empty(sum(per_seq), hkv, PAGE, D, 2, D)
    kt, vt = rot.paged_transforms("test")
    paged.rotate_quantize_pack_kv(st["k"], st["v"], slots, kp, vp, kt, vt, positions=st["pos"])
    B = len(INT_LENS)
    seg = paged.Segments(table, torch.tensor(INT_LENS, dtype=torch.int32), sink_k=st["sink_k"], sink_v=st["sink_v"],
                         sink_len=torch.full((B,), SINK, dtype=torch.int32), recent_k=st["recent_k"],
                         recent_v=st["recent_v"], recent_len=torch.full((B,), RECENT, dtype=torch.int32), int_pos0=SINK)
    out = paged.decode_attention(st["q"], kp, vp, seg, kt, vt, output_frame=frame, backend="torch")
    return out, kp.codes, vp.codes


def _rank_state(st: dict[str, torch.Tensor], shard) -> dict[str, torch.Tensor]:
    return {name: (x[:, shard.q_slice] if name == "q" else x[:, shard.kv_slice]) if x.dim() > 1 else x
            for name, x in st.items()}


@pytest.mark.parametrize("hkv,ratio,tp", GRID, ids=[f"hkv{a}-gqa{b}-tp{c}" for a, b, c in GRID])
def test_ranks_attend_and_fold_as_the_unsharded_twin(hkv: int, ratio: int, tp: int) -> None:
    heads = hkv * ratio
    rot, st = _rotations(hkv, seed=hkv * 7 + ratio), _state(hkv, heads, seed=tp)
    full, k_codes, v_codes = _attend(st, rot)
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(HIDDEN, heads * D, generator=g) * 0.05, torch.randn(HIDDEN, generator=g)
    y_full = full.reshape(2, -1) @ folded_weight(w, rot.r_v, heads).T + folded_bias(w, b, rot.mu_v, heads)

    outs, partial, terms = [], torch.zeros(2, HIDDEN, dtype=torch.float64), []
    for r in range(tp):
        shard = head_shard(r, tp, heads, hkv)
        rrot = shard_rotations(rot, shard)
        out, kc, vc = _attend(_rank_state(st, shard), rrot)
        # the same rows through the same quantizer: the rank's codes are the unsharded pool's for its heads
        assert torch.equal(kc, k_codes[:, shard.kv_slice]) and torch.equal(vc, v_codes[:, shard.kv_slice])
        outs.append(out)
        w_shard = w[:, shard.q_start * D: (shard.q_start + shard.local_heads) * D]
        folded, term = fold_o_proj_shard(w_shard, rrot, shard)
        partial += (out.reshape(2, -1) @ folded.T).double()  # the row-parallel all-reduce
        terms.append(term)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-5, atol=1e-5)
    y_tp = partial + (b.double() + torch.stack(terms).sum(0))  # rank 0 adds the bias with every rank's term
    torch.testing.assert_close(y_tp.float(), y_full, rtol=1e-4, atol=1e-4)
    if tp == 1:  # and the fold is the unfolded o_proj over the original frame (float32 reduction orders)
        orig, _, _ = _attend(st, rot, frame="original")
        torch.testing.assert_close(y_full, orig.reshape(2, -1) @ w.T + b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hkv,ratio,tp", GRID, ids=[f"hkv{a}-gqa{b}-tp{c}" for a, b, c in GRID])
def test_heads_split_as_sglang_splits_them(hkv: int, ratio: int, tp: int) -> None:
    heads = hkv * ratio
    shards = [head_shard(r, tp, heads, hkv) for r in range(tp)]
    # query heads: consecutive, disjoint, all of them (QKVParallelLinear's q shard tp_rank * H/tp)
    assert [h for s in shards for h in range(heads)[s.q_slice]] == list(range(heads))
    held = [0] * hkv
    for s in shards:
        assert s.local_kv_heads == max(1, hkv // tp)  # ModelConfig.get_num_kv_heads
        for h in range(hkv)[s.kv_slice]:
            held[h] += 1
        # each local query head j reads local KV head j // (H_local / Hkv_local): the global KV head of its query head
        per = s.local_heads // s.local_kv_heads
        assert all(s.kv_start + j // per == (s.q_start + j) // ratio for j in range(s.local_heads))
    assert held == [max(1, tp // hkv)] * hkv  # replicated on tp / Hkv ranks when tp > Hkv


def test_splits_sglang_refuses_are_refused_by_name() -> None:
    assert any("does not divide the 4 query heads" in p for p in tp_problems(8, 4, 4))
    assert any("does not divide the 4 KV heads" in p for p in tp_problems(3, 12, 4))  # tp below Hkv, no divisor
    assert any("not a multiple" in p for p in tp_problems(6, 24, 4))  # tp above Hkv, not a multiple
    with pytest.raises(ValueError, match="tp_rank 2 is not in"):
        head_shard(2, 2, 8, 2)
    assert head_shard(5, 8, 16, 2).kv_start == 1 and head_shard(3, 8, 16, 2).kv_start == 0


def test_rank_slices_are_the_rows_of_the_artifact() -> None:
    rot = _rotations(4, seed=1)
    s = head_shard(1, 2, 16, 4)
    cut = shard_rotations(rot, s)
    for name in ("r_k", "r_v", "mu_k", "mu_v", "rho_k", "rho_v", "rope_k"):
        assert torch.equal(getattr(cut, name), getattr(rot, name)[2:4]), name
    assert cut.rope is rot.rope and cut.k_block == rot.k_block
    with pytest.raises(ValueError, match="layer rotations for 4 KV heads, but the model has 8"):
        shard_rotations(rot, head_shard(0, 2, 16, 8))


# -- the plugin's fold and rank state on SGLang-shaped modules (one thread per rank) ------------------------


class _RowParallel(torch.nn.Module):
    """What the fold reads of SGLang's row-parallel ``o_proj``: the weight shard, the whole bias, the rank."""

    def __init__(self, weight: torch.Tensor, bias, tp_rank: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.clone(), requires_grad=False)
        self.tp_rank = tp_rank

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight.T
        return out + self.bias if self.tp_rank == 0 and self.bias is not None else out  # bias on rank 0 only


def _rank_model(ws: list[torch.Tensor], bias, shard) -> SimpleNamespace:
    cols = slice(shard.q_start * D, (shard.q_start + shard.local_heads) * D)
    layers = [SimpleNamespace(self_attn=SimpleNamespace(num_heads=shard.local_heads, num_kv_heads=shard.local_kv_heads,
                                                        o_proj=_RowParallel(w[:, cols], bias, shard.tp_rank)))
              for w in ws]
    return SimpleNamespace(model=SimpleNamespace(layers=layers))


class _ThreadSum:
    """An all-reduce over ranks run as threads (what the plugin's gloo all-reduce does across processes)."""

    def __init__(self, n: int) -> None:
        self.barrier, self.parts, self.calls = threading.Barrier(n), [None] * n, 0

    def for_rank(self, r: int):
        def reduce_sum(x: torch.Tensor) -> torch.Tensor:
            self.parts[r] = x.clone()
            self.barrier.wait()
            total = torch.stack(self.parts).sum(0)
            self.barrier.wait()
            self.calls += 1
            return total
        return reduce_sum


@pytest.mark.parametrize("hkv,heads,tp,bias", [(2, 8, 2, False), (2, 8, 4, True), (4, 8, 8, False), (1, 4, 2, True)])
def test_plugin_fold_per_rank_sums_to_the_unsharded_fold(hkv: int, heads: int, tp: int, bias: bool) -> None:
    layers = 3
    rots = [_rotations(hkv, seed=i) for i in range(layers)]
    rots[1].mu_v = None  # a layer without value centering: no bias term, on every rank
    g = torch.Generator().manual_seed(5)
    ws = [torch.randn(HIDDEN, heads * D, generator=g) * 0.05 for _ in range(layers)]
    b = torch.randn(HIDDEN, generator=g) if bias else None
    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=hkv, hidden_size=heads * D,
                          num_hidden_layers=layers, head_dim=D)
    summer, models, states, errors = _ThreadSum(tp), [], [], []
    for r in range(tp):
        st = shard_state({"rotations": rots}, cfg, r, tp)
        assert st["full_rotations"] is rots and st["shard"].tp_rank == r
        states.append(st)
        models.append(_rank_model(ws, b, st["shard"]))

    def run(r: int) -> None:
        try:
            fold_model(models[r], states[r]["rotations"], states[r]["shard"], summer.for_rank(r))
        except Exception as err:  # noqa: BLE001  (reported below, from the main thread)
            errors.append(err)
            summer.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert summer.calls == tp  # one all-reduce per rank for all layers together, at load
    x = torch.randn(3, heads * D, generator=g)
    for i, rot in enumerate(rots):
        ref_b = folded_bias(ws[i], b, rot.mu_v, heads) if rot.mu_v is not None else b
        ref = x @ folded_weight(ws[i], rot.r_v, heads).T + (0 if ref_b is None else ref_b)
        got = sum(models[r].model.layers[i].self_attn.o_proj.partial(x[:, states[r]["shard"].q_start * D:
                                                                        (states[r]["shard"].q_start + heads // tp) * D])
                  for r in range(tp))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="cut for TP rank 0 of 2"):
        shard_state(states[0], cfg, 1, 2) if tp == 2 else shard_state(shard_state({"rotations": rots}, cfg, 0, 2), cfg, 1, 2)


def test_plugin_fold_refuses_a_module_of_other_heads() -> None:
    rots = [_rotations(2, seed=0)]
    shard = head_shard(1, 2, 8, 2)
    model = _rank_model([torch.randn(HIDDEN, 8 * D)], None, head_shard(0, 2, 8, 2))
    with pytest.raises(RuntimeError, match=r"o_proj TP rank\) \(4, 1, 0\).*expected \(4, 1, 1\)"):
        fold_model(model, [shard_rotations(r, shard) for r in rots], shard, lambda x: x)
    with pytest.raises(ValueError, match="need a sum over the TP ranks"):
        fold_model(model, [shard_rotations(r, shard) for r in rots], shard)

"""Rope-centered keys in the plugin's pool and backend (CPU, torch twins, SGLang pages of 16 tokens, no engine).

Keys carry a large pre-RoPE bias that RoPE turns with the position (a ``k_proj`` bias, as in Qwen2): the pool
stores ``k - RoPE_p(m)`` at each row's position ``p`` (``write`` at prefill, ``write_decode`` with the
decode metadata's ``pos``), ``cached_rows`` adds the offsets back, and decode adds ``q . RoPE_p(m)`` at
``int_pos0 = S0``.

- Write-through: the dequantized keys equal those of the twin writer given each row's own position (prefill and
  decode rows alike; float32 reassociation only), and their INT2 error is 6x below that of the same pool
  without the rope centering (which quantizes the bias too).
- A decode step through ``OscarAttnBackend.forward_decode`` equals attention over the rows the cache holds
  (the same dequantized values in float32; tolerance 2e-2 relative: the bf16 output).
- The extend path's prefix (``cached_rows``, a chunked prefill) carries the offsets: the second chunk equals
  attention over the first chunk's cached rows.
- Refusals, naming the value: rope-centered keys on a kernel that takes no positions (the row-layout
  Triton kernels), per-channel keys (``method.channel_block > 0``).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oscar.cache.formats import RotatedFormat

from oscar.cache.torch_cache import LayerRotations
from oscar.core.rope import RopeSpec
from oscar.serve.settings import OscarServeError, ServeSettings
from test_pool_paged import _Mode, _backend, write_history  # the engine-less helpers of the paged pool tests

HKV, H, D, PAGE, S0, W = 2, 4, 64, 16, 16, 16
SPEC = RopeSpec(1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), 1.0, head_dim=D)
BIAS = 6.0 * torch.randn(HKV, D, generator=torch.Generator().manual_seed(7))


def _pool(rope: bool, kernels: str = "torch", layout: str = "mma"):
    from oscar.serve.pool import OscarTokenToKVPool

    gen = torch.Generator().manual_seed(0)
    orth = lambda: torch.linalg.qr(torch.randn(HKV, D, D, generator=gen))[0]  # noqa: E731
    rot = LayerRotations(orth(), orth(), None, 0.1 * torch.randn(HKV, D, generator=gen),
                         rope_k=BIAS.clone() if rope else None, rope=SPEC if rope else None)
    state = dict(settings=ServeSettings(artifact=Path("art"), sink=S0, recent=W, kernels=kernels), rotations=[rot],
                 format=RotatedFormat(name="auto", bits=2, group_size=D, sink=S0, recent=W), fold=False)
    pool = OscarTokenToKVPool(512, PAGE, torch.bfloat16, HKV, D, 1, "cpu", False, oscar_state=state, oscar_layout=layout)
    pool.bind_requests(4)
    return pool


def _r2t(r: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    r2t = torch.zeros(4, 256, dtype=torch.int32)
    pages = (torch.randperm(512 // PAGE - 1, generator=gen) + 1).tolist()
    for j in range(math.ceil(n / PAGE)):
        page = pages.pop()
        r2t[r, j * PAGE : (j + 1) * PAGE] = torch.arange(page * PAGE, (page + 1) * PAGE, dtype=torch.int32)
    return r2t


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE keys with the rotating bias ``RoPE_p(BIAS)``, and values, ``[n, Hkv, d]`` bf16."""
    gen = torch.Generator().manual_seed(seed)
    pre = BIAS[:, None, :].double() + torch.randn(HKV, n, D, generator=gen, dtype=torch.float64)
    k = SPEC.apply(pre[None], torch.arange(n))[0].transpose(0, 1)
    return k.to(torch.bfloat16), torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16)


def _twin_rows(pool, k: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Keys ``[Hkv, last - first, d]`` at positions ``first..last-1`` through the twin writer and reader on their own
    (offsets subtracted at those positions, quantized, dequantized, unrotated, offsets added back)."""
    from oscar.cache import paged

    kt = pool.transforms[0][0]
    n = last - first
    pages = paged.QuantPages.empty(math.ceil(n / PAGE), HKV, PAGE, D, 2, D, "cpu", "rows")
    pos = torch.arange(first, last)
    paged.rotate_quantize_pack_torch(k[first:last], torch.arange(n), pages, kt, positions=pos)
    x = paged.gather_dequantize(pages, torch.arange(pages.codes.shape[0], dtype=torch.int32)[None], 0, n)
    return torch.einsum("hte,hde->htd", x, kt.R) + paged.rope_offsets(kt, pos).transpose(0, 1)


# Rows (token, KV head) allowed to differ from the twin beyond float32 reassociation: the pool and the twin subtract
# the offsets and rotate in different orders, so an element lying on an INT2 rounding boundary may take the other code,
# and one flipped code moves its whole dequantized row (the inverse rotation spreads it over the d channels). Measured:
# 0 of 176 rows on an AMD EPYC, 1 on an Intel Xeon before MKL's path was pinned (off by 0.0445 at most).
MAX_FLIPPED_ROWS = 3


def assert_rows_match_up_to_flips(got: torch.Tensor, want: torch.Tensor) -> None:
    """``[Hkv, T, d]`` dequantized rows equal to 1e-4, except at most MAX_FLIPPED_ROWS rows, each off by less than a
    quarter of its norm (a flipped code moves a row by one INT2 step of one rotated channel; a wrong offset or a
    wrong position moves it by about its norm)."""
    err = (got - want).abs().amax(dim=-1)  # [Hkv, T]
    flipped = err > 1e-4
    assert int(flipped.sum()) <= MAX_FLIPPED_ROWS, f"{int(flipped.sum())} of {err.numel()} rows differ: {err[flipped]}"
    bound = 0.25 * want.norm(dim=-1)
    assert bool((err[flipped] <= bound[flipped]).all()), (err[flipped], bound[flipped])


@pytest.mark.parametrize("layout", ["mma", "rows"])
def test_write_through_subtracts_the_offsets_at_each_rows_position(layout):
    n, prompt = 120, 70
    k, v = _rows(n, seed=2)
    errs = {}
    for rope in (True, False):
        pool = _pool(rope, layout=layout)
        r2t = _r2t(1, n)
        write_history(pool, r2t, 1, prompt, n - prompt, k, v)
        ck, _ = pool.cached_rows(0, r2t, 1, n)
        assert torch.equal(ck[:, :S0], k[:S0].transpose(0, 1).float())
        assert torch.equal(ck[:, n - W :], k[n - W :].transpose(0, 1).float())
        errs[rope] = float((ck[:, S0 : n - W] - k[S0 : n - W].transpose(0, 1).float()).norm(dim=-1).mean())
        if rope:  # prefill rows and decode rows alike: the codes of each row at its own position
            assert_rows_match_up_to_flips(ck[:, S0 : n - W], _twin_rows(pool, k, S0, n - W))
    # INT2 of the centered rows (unit spread) against INT2 of rows carrying the bias (|m| ~ 6 sqrt(d)): measured
    # 3.5 against 21 (6x)
    assert errs[True] * 4 < errs[False], errs


LAYER = SimpleNamespace(layer_id=0, tp_q_head_num=H, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D, scaling=D**-0.5,
                        sliding_window_size=-1, logit_cap=0)


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask=None) -> torch.Tensor:
    """float32 attention of ``q`` ``[n, H*d]`` over ``[Hkv, T, d]`` keys/values (GQA), ``[n, H*d]``."""
    qs = q.float().reshape(q.shape[0], HKV, H // HKV, D)
    s = torch.einsum("nhrd,htd->nhrt", qs, keys) * D**-0.5
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.einsum("nhrt,htd->nhrd", torch.softmax(s, dim=-1), vals).reshape(q.shape[0], H * D)


def test_decode_through_the_backend_equals_attention_over_the_cached_rows():
    n = 100
    k, v = _rows(n, seed=3)
    pool = _pool(True)
    r2t = _r2t(2, n)
    write_history(pool, r2t, 2, n - 4, 3, k, v)  # the 100th row comes with the decode step below
    be = _backend(pool, r2t)
    fb = SimpleNamespace(forward_mode=_Mode(True), req_pool_indices=torch.tensor([2]), seq_lens=torch.tensor([n]),
                         seq_lens_cpu=torch.tensor([n]), out_cache_loc=r2t[2, n - 1 : n].long())
    be.init_forward_metadata(fb)
    assert be.meta.int_len.tolist() == [n - S0 - W] and be.meta.pos.tolist() == [n - 1]
    q = torch.randn(1, H * D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = be.forward_decode(q, k[n - 1 :].reshape(1, -1), v[n - 1 :].reshape(1, -1), LAYER, fb).float()
    ck, cv = pool.cached_rows(0, r2t, 2, n)
    ref = _attend(q, ck, cv)
    rel = float((out - ref).reshape(H, D).norm(dim=-1).div(ref.reshape(H, D).norm(dim=-1)).max())
    assert rel < 2e-2, rel  # the output is rounded to bf16


def test_chunked_prefill_reads_the_prefix_with_its_offsets():
    n, first = 80, 48
    k, v = _rows(n, seed=5)
    q = torch.randn(n, H * D, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    pool = _pool(True)
    r2t = _r2t(1, n)
    be = _backend(pool, r2t)

    def extend(start: int, c: int) -> torch.Tensor:
        fb = SimpleNamespace(forward_mode=_Mode(False), req_pool_indices=torch.tensor([1]),
                             seq_lens=torch.tensor([start + c]), seq_lens_cpu=torch.tensor([start + c]),
                             extend_seq_lens_cpu=[c], extend_prefix_lens_cpu=[start],
                             out_cache_loc=r2t[1, start : start + c].long())
        be.init_forward_metadata(fb)
        sl = slice(start, start + c)
        return be.forward_extend(q[sl], k[sl].reshape(c, -1), v[sl].reshape(c, -1), LAYER, fb).float()

    extend(0, first)
    ck, cv = pool.cached_rows(0, r2t, 1, first)
    # the prefix as the cache holds it is the rows within the INT2 error (the offsets are back on)
    err = float((ck[:, S0 : first - W] - k[S0 : first - W].transpose(0, 1).float()).norm(dim=-1).mean())
    assert err < 0.25 * float(k[S0 : first - W].float().norm(dim=-1).mean()), err
    out = extend(first, n - first)
    keys = torch.cat([ck, k[first:].transpose(0, 1).float()], dim=1)
    vals = torch.cat([cv, v[first:].transpose(0, 1).float()], dim=1)
    ref = _attend(q[first:], keys, vals, torch.ones(n - first, n, dtype=torch.bool).tril(first))
    rel = float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max())
    assert rel < 2e-2, rel


def test_rope_centered_keys_are_refused_where_the_kernel_takes_no_positions():
    with pytest.raises(OscarServeError, match=r"rope-centered keys in layers \[0\].*OSCAR_KERNELS=triton.*rows layout"):
        _pool(True, kernels="triton", layout="rows")
    _pool(False, kernels="triton", layout="rows")  # without rope centering the row kernels serve it


def test_two_per_channel_key_blocks_are_refused(monkeypatch):
    """Per-channel keys are served (tests/serve/test_pool_channel.py), one block size per artifact."""
    from oscar.serve import settings

    art = SimpleNamespace(num_layers=3, key_block=lambda layer: (0, 64, 32)[layer])
    monkeypatch.setattr(settings, "load_artifact", lambda *a, **k: art)
    with pytest.raises(OscarServeError, match=r"per-channel keys over blocks of \[32, 64\] tokens.*one block size"):
        settings.load_rotations(ServeSettings(artifact=Path(__file__).parent), SimpleNamespace())

"""Every registered cache format through the SGLang pool (CPU, torch twins), the third consumer of
oscar.cache.formats (tests/test_formats.py runs the torch cache and the device cache).

A format the pool serves: the same K/V rows written through the pool (prefill ``write``, then decode
``write_decode`` at the decode metadata's positions, as the backend does) and through the embedded engine's
torch cache layer of the same format give the same decode attention, within bf16 rounding of the output (the two
quantize the same bf16 rows with the same quantizer and reduce in different orders). A format it does not serve
is refused by the pool with the consumers that do serve it.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from oscar.cache.formats import KINDS, FormatNotServed, format_for
from oscar.cache.attention import take_pending
from oscar.cache.torch_cache import OscarCache
from oscar.kernels.segments import Segments
from test_pool_paged import D, H, HKV, PAGE, _backend, _req_to_token, _state, write_history

S0, W, PROMPT, STEPS = 16, 32, 90, 5


def _format(kind: str):
    fields = {"bf16": dict(), "rotated": dict(bits=2, group_size=D, sink=S0, recent=W, page_size=PAGE),
              "kivi": dict(bits=2, group_size=32, recent=W), "turboquant": dict(bits=2, group_size=D, sink=S0, recent=W),
              "rotated_channel": dict(bits=2, group_size=D, sink=S0, recent=W, page_size=PAGE, key_block=PAGE)}
    return format_for(kind, name=kind, **fields[kind])


def _pool(fmt):
    from oscar.serve.pool import OscarTokenToKVPool

    state = {**_state(S0, W), "format": fmt}
    if fmt.kind == "rotated_channel":  # the artifact's rotations carry the layers' key blocks
        state["rotations"] = [dataclasses.replace(r, k_block=fmt.layer_key_block(i)) for i, r in enumerate(state["rotations"])]
    pool = OscarTokenToKVPool(512, PAGE, torch.bfloat16, HKV, D, 1, "cpu", False, oscar_state=state, oscar_layout="rows")
    pool.bind_requests(4)
    return pool, state["rotations"][0]


def _torch_cache_output(fmt, rot, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Decode attention ``[H, D]`` of query ``q`` at the last row through the torch cache of ``fmt``: every row but
    the last stored, then the last written by the step itself."""
    cache = OscarCache(fmt.cache_spec([rot]), 1)
    layer = cache.layers[0]
    rows = lambda t: t.transpose(0, 1)[None]  # noqa: E731  [n, Hkv, d] -> [1, Hkv, n, d]
    layer.write_rows(rows(k[:-1]), rows(v[:-1]))
    module = SimpleNamespace(num_key_value_groups=H // HKV, training=False, is_causal=True)
    key, value = rows(k[-1:]), rows(v[-1:])
    layer.update(key, value)  # what the model's attention call does: update, then take the pending record
    assert take_pending(key) is layer
    out = layer.attend_and_write(module, q[None, :, None, :], key, value, None, D**-0.5)
    return out[0, :, 0].float()


@pytest.mark.parametrize("kind", KINDS)
def test_every_format_through_the_pool(kind):
    fmt = _format(kind)
    if "pool" not in fmt.served_by:
        with pytest.raises(FormatNotServed, match=f"the {kind} cache format .* not served by the SGLang KV pool"):
            _pool(fmt)
        return
    gen = torch.Generator().manual_seed(5)
    pool, rot = _pool(fmt)
    assert pool.format == fmt.replace(page_size=PAGE) and pool.layout == "rows"
    r2t = _req_to_token({1: PROMPT + STEPS})
    L = PROMPT + STEPS
    k = torch.randn(L, HKV, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(L, HKV, D, generator=gen).to(torch.bfloat16)
    meta = write_history(pool, r2t, 1, PROMPT, STEPS, k, v)
    q = torch.randn(1, H, D, generator=gen).to(torch.bfloat16)
    int_len = pool.lengths(0, meta.int_len, meta.recent_len, meta.blocks)[0]  # per-channel keys: whole blocks
    segments = Segments(meta.page_table, int_len, **_backend(pool, r2t)._window_segments(meta, 0))
    out = pool.format.attend(q, (pool.k_pages[0], pool.v_pages[0]), segments, pool.transforms[0],
                             sm_scale=D**-0.5, output_frame="original", backend="torch")[0].float()
    ref = _torch_cache_output(fmt, rot, k, v, q[0])
    rel = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert rel < 2e-2, rel  # both outputs are rounded to bf16 (2^-8 relative per element)

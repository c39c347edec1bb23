"""The synthetic-state decode timing of ``python -m oscar.bench.serving.one_batch`` and its profile parsing (CPU).

- ``fill_pool`` leaves every slot of the OSCAR pool valid (codes over all byte values, scales in range,
  ``zero = -1.5 * scale`` exactly as bf16 rounds it, finite BF16 windows), so a dequantized row is bounded
  by ``1.5 * scale``; SGLang's BF16 buffers get finite ``randn``.
- ``fits`` is ``bench_one_batch``'s batch rule (the capacity rows of the table; exact integer arithmetic).
- ``attribute_kernels`` gives a kernel the innermost label range around its CPU launch (correlation id),
  else its category by name; ``summarize`` averages per step.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from test_pool_paged import _pool

from oscar.cache import paged
from oscar.bench.serving import synthetic as sy
from oscar.bench.serving import trace


def test_fill_pool_gives_valid_oscar_pages_and_windows():
    pool = _pool(16, 32)
    assert sy.fill_pool(pool, seed=1) == "oscar"
    lo, hi = sy.SCALE_RANGE
    for pages in (*pool.k_pages, *pool.v_pages):
        assert int(pages.codes.min()) == 0 and int(pages.codes.max()) == 255
        assert float(pages.scale.min()) >= lo and float(pages.scale.max()) <= hi
        assert torch.equal(pages.zero, (pages.scale.float() * -1.5).to(pages.zero.dtype))
    for w in (*pool.win_k, *pool.win_v):
        assert torch.isfinite(w).all() and 0.8 < float(w.float().std()) < 1.2
    table = torch.arange(1, 9, dtype=torch.int32)[None]  # 8 pages of 16 rows
    for pages in (pool.k_pages[0], pool.v_pages[0]):
        x = paged.gather_dequantize(pages, table, 0, 8 * 16)
        assert torch.isfinite(x).all() and float(x.abs().max()) <= 1.5 * hi + 1e-3


def test_fill_pool_bf16_buffers_and_refusal():
    bufs = [torch.zeros(64, 2, 8, dtype=torch.bfloat16) for _ in range(4)]
    pool = SimpleNamespace(device="cpu", k_buffer=bufs[:2], v_buffer=bufs[2:])
    assert sy.fill_pool(pool) == "bf16"
    assert all(torch.isfinite(b).all() and float(b.float().abs().sum()) > 0 for b in bufs)
    with pytest.raises(TypeError, match="neither OSCAR pages nor SGLang's k_buffer"):
        sy.fill_pool(SimpleNamespace(device="cpu"))


def test_fits_is_bench_one_batch_rule():
    assert sy.fits(749474, 7, 100000, 16) and not sy.fits(749474, 8, 100000, 16)
    assert sy.fits(5175008, 51, 100000, 16) and not sy.fits(5175008, 52, 100000, 16)


def test_attribute_kernels_by_launch_range_then_name():
    def x(name, cat, ts, dur, pid=1, tid=7, **args):
        return dict(ph="X", name=name, cat=cat, ts=ts, dur=dur, pid=pid, tid=tid, args=args)

    events = [x("oscar.attention", "user_annotation", 100, 50), x("oscar.write", "user_annotation", 10, 20),
              x("oscar.attention", "gpu_user_annotation", 0, 1000, pid=0, tid=3),  # GPU-side copy: not a range
              x("cudaLaunchKernel", "cuda_runtime", 120, 2, correlation=1),
              x("cudaLaunchKernel", "cuda_runtime", 15, 2, correlation=2),
              x("cudaLaunchKernel", "cuda_runtime", 300, 2, correlation=3),
              x("elementwise_kernel<copy>", "kernel", 400, 30, pid=0, tid=3, correlation=1),
              x("elementwise_kernel<copy>", "kernel", 440, 10, pid=0, tid=3, correlation=2),
              x("nvjet_tst_128x64", "kernel", 460, 40, pid=0, tid=3, correlation=3),
              x("Memset (Device)", "gpu_memset", 500, 4, pid=0, tid=3)]
    got = trace.attribute_kernels({"traceEvents": events})
    assert [(k["name"], k["part"]) for k in got] == [("elementwise_kernel<copy>", "oscar.attention"),
                                                     ("elementwise_kernel<copy>", "oscar.write"),
                                                     ("nvjet_tst_128x64", "gemm"), ("Memset (Device)", "copy_index")]
    parts = trace.summarize(got, steps=2)
    assert parts["oscar.attention"] == {"ms": 0.015, "kernels": 0.5} and parts["gemm"]["ms"] == 0.02
    assert trace.top_kernels(got, 2)[0] == dict(name="nvjet_tst_128x64", part="gemm", ms=0.02, calls=0.5)
    assert trace.kernel_category("flashinfer::norm::FusedAddRMSNormKernel") == "norm"
    assert trace.kernel_category("zzz") == "other"
    assert trace.kernel_category("flashinfer::BatchPrefillWithPagedKVCacheKernel") == "attention"


def test_label_ranges_wraps_the_plugin_calls_and_restores_them():
    from torch.profiler import ProfilerActivity, profile

    from oscar.cache.formats import RotatedFormat

    calls = []
    pool = SimpleNamespace(write_decode=lambda *a: calls.append("write"), format=RotatedFormat(bits=2, group_size=64, recent=1))
    backend = SimpleNamespace(pool=pool, init_forward_metadata=lambda fb: calls.append("meta"),
                              _window_segments=lambda m, i: calls.append("windows") or {}, _to_folded=lambda o, i: o)
    before = (pool.write_decode, backend._window_segments, type(pool.format).attend)
    with profile(activities=[ProfilerActivity.CPU]) as prof, sy.label_ranges(backend):
        backend.init_forward_metadata(None)
        backend._window_segments(None, 0)
        pool.write_decode()
    assert calls == ["meta", "windows", "write"]
    assert (pool.write_decode, backend._window_segments, type(pool.format).attend) == before
    names = {e.name for e in prof.events()}
    assert {"oscar.metadata", "oscar.windows", "oscar.write"} <= names


def test_bench_shapes_parse_and_refuse_bad_ones():
    from oscar.bench.serving.one_batch import _shapes

    assert _shapes("1x30000, 51x100000,") == [(1, 30000), (51, 100000)] and _shapes("") == []
    for bad in ("1x", "0x100", "8*100", "ax1"):
        with pytest.raises(SystemExit, match=re.escape(f"shape '{bad}' is not valid; write BATCHxINPUT")):
            _shapes(bad)

"""Where a prefix hit's time goes: the extend's per-layer host work, the plugin's profiler labels, the sweep's profile mode.

- An extend's write plan (``pool.write_plan``, once per forward) gives the pool exactly the state of the per-layer
  masks it replaces (same rows through the same quantizer: ``torch.equal``), and a layer's write with it asks the
  device nothing (no ``nonzero``, ``bool``, ``item`` or ``tolist`` of a tensor: on a GPU, no host sync per layer).
- With the labels installed (``OSCAR_PROFILE_LABELS``), a hit's extend under ``torch.profiler`` on CPU shows each
  phase once per layer, and the summary (``oscar.bench.prefix.profile``) finds the extend window.
- ``python -m oscar.bench.prefix.sweep --profile`` through SGLang's CPU engine (tiny random Llama, INT2 quarot,
  S0 = W = 16): a cold request and two hits profiled in the scheduler process; the hits reuse the cached prefix and
  the summary of each trace holds the extend's phases (one ``oscar.extend`` range per layer).
- Through the backend, a hit with ``extend_route="dequant"`` (pages dequantized once, then SDPA) gives the outputs of
  the in-place route, and a chunk longer than ``extend_in_place_max`` (which that route also takes) the old route's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oscar.bench.prefix import profile as prefix_profile
from oscar.serve.labels import LABELS, install_labels, labels_requested
from serve_helpers import save_in_code_artifact
from test_pool_paged import D, H, HKV, _backend, _extend, _history, _pool, _req_to_token
from test_prefix_extend import _layer, _prefix_pool


def _rows(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [t.to(torch.bfloat16) for t in _history(n, gen)]


def _state(pool):
    pages = [t.clone() for p in (*pool.k_pages, *pool.v_pages) for t in (p.codes, p.scale, p.zero)]
    return pages + [t.clone() for t in (*pool.win_k, *pool.win_v)]


def test_write_plan_equals_the_masks_without_a_host_sync(monkeypatch):
    S0, W = 16, 16
    r2t = _req_to_token({1: 70, 2: 40})
    k, v = _rows(110, 1)
    # two requests in one extend: a first chunk of 70 (sink, pages, ring) and a later chunk at 24..40
    req = torch.tensor([1] * 70 + [2] * 16)
    pos = torch.cat([torch.arange(70), torch.arange(24, 40)])
    seq_len = torch.tensor([70] * 70 + [40] * 16)
    loc = torch.cat([r2t[1, :70], r2t[2, 24:40]]).long()
    plain, planned = _pool(S0, W), _pool(S0, W)
    plain.kernels = planned.kernels = "triton"  # the GPU's writer (interpreted here); the twin checks finiteness
    plain.write(0, k[:86], v[:86], loc, req, pos, seq_len)
    plan = planned.write_plan(loc, req, pos, seq_len)
    assert plan.quant.tolist() == [i for i in range(86) if pos[i] >= S0]
    assert plan.keep.tolist() == [i for i in range(86) if pos[i] < S0 or pos[i] >= seq_len[i] - W]

    def refuse(self, *a, **kw):
        raise AssertionError("a host sync in a layer's write")

    for name in ("__bool__", "item", "tolist", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(torch, "nonzero", lambda *a, **kw: refuse(None))
    with pytest.raises(AssertionError, match="host sync"):  # what the plan saves each layer
        planned.write(0, k[:86], v[:86], loc, req, pos, seq_len)
    planned.write(0, k[:86], v[:86], loc, req, pos, seq_len, plan=plan)
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(_state(plain), _state(planned)))


def test_labels_show_the_phases_of_a_hit(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    assert not labels_requested({}) and labels_requested({"OSCAR_PROFILE_LABELS": "1"})
    S0, W, shared, n_donor, n_new = 32, 16, 96, 112, 21
    pool = _prefix_pool(S0, W, "torch")
    r2t = _req_to_token({1: n_donor, 2: shared + n_new})
    r2t[2, :shared] = r2t[1, :shared]
    be = _backend(pool, r2t)
    be.req_to_token_pool.req_generation = torch.tensor([0, 1, 1, 0])
    installed = install_labels(be)
    assert set(installed) <= set(LABELS) and "oscar.extend.pages" in installed
    assert install_labels(be) == []  # idempotent
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(n_donor + n_new, H * D, generator=gen).to(torch.bfloat16)
    k, v = (t.reshape(-1, HKV * D) for t in _history(n_donor + n_new, gen))
    _extend(be, _layer(), q[:n_donor], k[:n_donor], v[:n_donor], 1, 0, n_donor, r2t)
    pool.store_sink(r2t, 1, n_donor)
    pool.slot_generation[2] = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _extend(be, _layer(), q[n_donor:], k[n_donor:], v[n_donor:], 2, shared, n_new, r2t)
    path = Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"oscar_labels_{os.getpid()}.json"
    prof.export_chrome_trace(str(path))
    try:
        s = prefix_profile.summarize(prefix_profile.read_trace(path))
    finally:
        path.unlink()
    calls = {p["label"]: p["calls"] for p in s["phases"]}
    assert calls == {"oscar.metadata": 1, "oscar.extend": 1, "oscar.extend.sink": 1, "oscar.extend.pages": 1,
                     "oscar.extend.write": 1}, calls
    assert s["extend"]["layers"] == 1 and s["extend"]["wall_ms"] > 0
    pages = next(p for p in s["phases"] if p["label"] == "oscar.extend.pages")
    assert 0 < pages["self_ms"] < pages["host_ms"]  # its torch ops are its children


def test_sweep_profile_mode_through_the_cpu_engine(tiny_llama, tmp_path):
    quarot = save_in_code_artifact(tiny_llama, "quarot", tmp_path / "quarot")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OSCAR_ARTIFACT": str(quarot), "OSCAR_SINK": "16",
           "OSCAR_RECENT": "16", "OSCAR_PROFILE_LABELS": "1", "OSCAR_PREFIX_REUSE": "quantized",  # the profile's reuse
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "oscar.bench.prefix.sweep", "--model-path", str(tiny_llama), "--attention-backend",
           "oscar", "--out", str(out / "rows.jsonl"), "--input-len", "200", "--output-len", "4", "--ratios", "",
           "--vocab", "300", "--profile", str(out), "--engine", "device=cpu", "disable_cuda_graph=true", "page_size=16",
           "dtype=float32", "max_running_requests=4", "max_total_tokens=4096", "mem_fraction_static=0.5",
           "chunked_prefill_size=-1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads((out / "prefix_profile.json").read_text())
    runs = {r["name"]: r for r in data["results"]}
    assert list(runs) == ["cold", "hit", "hit2_stack"]
    # 200 tokens, W = 16: a match capped at 184 -> 176 (whole pages of 16)
    assert runs["cold"]["cached"] == 0 and runs["hit"]["cached"] == runs["hit2_stack"]["cached"] == 176
    for name, r in runs.items():
        calls = {p["label"]: p["calls"] for p in r["summary"]["phases"]}
        assert r["summary"]["extend"]["layers"] == calls["oscar.extend"] == 2, (name, calls)  # two layers
        assert calls["oscar.extend.write"] == 2 and r["ttft_s"] > 0 and (out / r["trace"]).is_file()
        assert calls.get("oscar.extend.pages", 0) == (0 if name == "cold" else 2)  # a hit reads its pages in place
        assert calls.get("oscar.extend.sink", 0) == (0 if name == "cold" else 2)  # its sink from the sink store
    assert runs["hit2_stack"]["summary"]["top_python"]  # Python stacks on
    md = (out / "prefix_profile.md").read_text()
    assert "| request | TTFT s (profiled)" in md and "## hit2_stack" in md
    assert not (out / "rows.jsonl").exists()  # no sweep


def test_dequant_route_through_the_backend():
    """A hit through the backend with ``extend_route="dequant"`` gives the outputs of the in-place route (the same
    rows in float32 on CPU; bf16 outputs)."""
    S0, W, shared, n_donor, n_new = 32, 16, 96, 112, 21
    pool = _prefix_pool(S0, W, "triton")
    r2t = _req_to_token({1: n_donor, 2: shared + n_new})
    r2t[2, :shared] = r2t[1, :shared]
    be = _backend(pool, r2t)
    be.req_to_token_pool.req_generation = torch.tensor([0, 1, 1, 0])
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(n_donor + n_new, H * D, generator=gen).to(torch.bfloat16)
    k, v = (t.reshape(-1, HKV * D) for t in _history(n_donor + n_new, gen))
    _extend(be, _layer(), q[:n_donor], k[:n_donor], v[:n_donor], 1, 0, n_donor, r2t)
    pool.store_sink(r2t, 1, n_donor)
    outs = {}
    for route in ("pages", "dequant"):
        pool.slot_generation[2] = 0  # the slot changed hands: a hit each time (its rows rewritten alike)
        be.extend_route = route
        outs[route] = _extend(be, _layer(), q[n_donor:], k[n_donor:], v[n_donor:], 2, shared, n_new, r2t).float()
        assert be.meta.hit == [True]
    rel = ((outs["dequant"] - outs["pages"]).norm(dim=-1) / outs["pages"].norm(dim=-1)).max().item()
    assert rel < 1e-2, rel  # bf16 outputs of float32 attention (2^-8 relative per element)


def test_dequant_route_takes_long_extends_too():
    """With ``extend_route="dequant"`` (the default) on the Triton kernels, an extend longer than ``extend_in_place_max`` reads the
    pages too (one dequantizing pass, then flash SDPA) instead of ``cached_rows``; the in-place route keeps the bound."""
    S0, W = 32, 16
    pool = _prefix_pool(S0, W, "triton")
    be = _backend(pool, _req_to_token({1: 64}))
    assert be.extend_route == "dequant"  # the default: the H200 profile's 4.5x faster route for a hit
    be.extend_route = "pages"
    assert not be._pages_in_place(0, 100, 4097, hit=True)
    be.extend_route = "dequant"
    assert be._pages_in_place(0, 100, 4097, hit=True) and be._pages_in_place(0, 100, 21, hit=False)
    assert not be._pages_in_place(0, S0 + W, 8, hit=False)  # a prefix all sink and ring: nothing quantized to read
    pool.kernels = "torch"  # the twin: the bound again
    assert not be._pages_in_place(0, 100, 4097, hit=True)


def test_long_extend_by_the_dequant_route_equals_the_old_route():
    """A later chunk longer than ``extend_in_place_max``: the dequant route's output equals the old route's
    (``cached_rows`` + SDPA in the original frame; float32 on CPU, bf16 outputs)."""
    S0, W, n_first, n = 32, 16, 112, 8
    pool = _prefix_pool(S0, W, "triton")
    r2t = _req_to_token({1: n_first + n})
    be = _backend(pool, r2t)
    be.req_to_token_pool.req_generation = torch.tensor([0, 0, 0, 0])
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(n_first + n, H * D, generator=gen).to(torch.bfloat16)
    k, v = (t.reshape(-1, HKV * D) for t in _history(n_first + n, gen))
    _extend(be, _layer(), q[:n_first], k[:n_first], v[:n_first], 1, 0, n_first, r2t)
    windows = pool.win_k[0].clone(), pool.win_v[0].clone()
    be.extend_in_place_max = 4
    outs = {}
    for route in ("pages", "dequant"):  # "pages" with the bound: the old route (cached_rows)
        pool.win_k[0].copy_(windows[0])
        pool.win_v[0].copy_(windows[1])
        be.extend_route = route
        outs[route] = _extend(be, _layer(), q[n_first:], k[n_first:], v[n_first:], 1, n_first, n, r2t).float()
        assert be.meta.hit == [False]
    rel = ((outs["dequant"] - outs["pages"]).norm(dim=-1) / outs["pages"].norm(dim=-1)).max().item()
    assert rel < 1e-2, rel

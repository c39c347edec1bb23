"""`--attention-backend oscar` at SGLang's defaults: the plugin fills in what the defaults leave unserved
(`oscar.serve.plugin.serving_defaults`), keeps what the user gave, and the start-up check still refuses a given value
it cannot serve; the prefill-at-defaults table (`python -m oscar gpu prefix defaults=true`) and the FP8 pool fill of
the serving table."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from oscar.serve.plugin import (DEFAULT_MAX_RUNNING, MIN_CUDA_PAGE_SIZE, _flag_problems, _format_problems,
                                serving_defaults)


def _args(**kw):
    base = dict(page_size=None, device="cuda", disable_cuda_graph=False, disable_prefill_cuda_graph=False,
                cuda_graph_backend_prefill=None, max_running_requests=None)
    return SimpleNamespace(**{**base, **kw})


def _flags(args):
    """The start-up check's view of ``args`` (the fields it reads, SGLang's resolved defaults for the rest)."""
    full = dict(tp_size=1, pp_size=1, dp_size=1, dcp_size=1, enable_dp_attention=False, speculative_algorithm=None,
                disable_radix_cache=False, radix_cache_backend=None, chunked_prefill_size=8192,
                enable_mixed_chunk=False, prefill_attention_backend=None, decode_attention_backend=None,
                kv_cache_dtype="auto", enable_hierarchical_cache=False, disaggregation_mode="null")
    return SimpleNamespace(**{**full, **vars(args), "page_size": args.page_size or 1})


@pytest.mark.parametrize("device,block,page", [("cuda", 0, MIN_CUDA_PAGE_SIZE), ("cuda", 32, 32), ("cuda", 128, 128),
                                               ("cpu", 32, 32), ("cpu", 0, None)])
def test_defaults_are_filled_and_then_served(device, block, page):
    args = _args(device=device)
    said = serving_defaults(args, block)
    assert args.page_size == page
    assert args.max_running_requests == DEFAULT_MAX_RUNNING
    assert args.disable_prefill_cuda_graph is (device == "cuda")
    assert len(said) == (page is not None) + (device == "cuda") + 1  # one line per value set, each naming its flag
    assert all(line.startswith("--") for line in said)
    if page:
        assert said[0].startswith(f"--page-size {page} (") and (str(block) in said[0] if block > 16 else True)
    assert _flag_problems(_flags(args)) == []  # what SGLang's defaults plus the plugin's give is served


def test_given_values_are_kept_and_refused_by_name():
    args = _args(page_size=1, max_running_requests=8, disable_prefill_cuda_graph=False, cuda_graph_backend_prefill="full")
    assert serving_defaults(args, 32) == []  # nothing the user gave is changed
    assert (args.page_size, args.max_running_requests, args.disable_prefill_cuda_graph) == (1, 8, False)
    problems = _flag_problems(_flags(args))
    assert any("--page-size 1 is too small" in p for p in problems)
    assert any("--disable-prefill-cuda-graph" in p for p in problems)
    # graphs off altogether: no prefill switch needed, none set
    off = _args(disable_cuda_graph=True)
    assert not any("prefill" in line for line in serving_defaults(off, 0)) and off.disable_prefill_cuda_graph is False


def test_a_page_must_hold_whole_key_blocks():
    """A per-channel artifact served at a page the user gave that splits its key blocks is refused at start-up, by
    name, before any server process (the pool would refuse it later, in the scheduler)."""
    from oscar.cache.formats import ChannelKeyFormat

    fmt = ChannelKeyFormat(name="auto", bits=2, group_size=64, sink=64, recent=64, page_size=32, key_block=32,
                           layer_blocks=(0, 32, 32))
    problems = _format_problems(fmt, SimpleNamespace(page_size=16), 3)
    assert problems == ["--page-size 16: the artifact's per-channel key blocks of 32 tokens live in one page; use "
                        "--page-size 32 or a multiple (or leave it unset: the plugin then sets it)"]
    assert _format_problems(fmt, SimpleNamespace(page_size=32), 3) == []
    assert _format_problems(fmt, SimpleNamespace(page_size=64), 3) == []
    args = _args()
    serving_defaults(args, 32)  # what the plugin sets when the page is left unset is served
    assert _format_problems(fmt, args, 3) == []


def test_hook_leaves_other_backends_alone(monkeypatch):
    from oscar.serve import plugin

    monkeypatch.setattr(plugin, "_artifact_key_block", lambda args: pytest.fail("read the artifact of another backend"))
    args = _args(attention_backend="flashinfer", model_path="m")
    assert plugin.serving_defaults_before(args) is None
    assert args.page_size is None and args.max_running_requests is None
    monkeypatch.setattr(plugin, "_artifact_key_block", lambda args: 32)
    ours = _args(attention_backend="oscar", model_path="m")
    plugin.serving_defaults_before(ours)
    assert (ours.page_size, ours.max_running_requests) == (32, DEFAULT_MAX_RUNNING)


def test_prefill_defaults_plan_and_report(tmp_path):
    from oscar.bench.prefix import report, spec

    opts = dict(spec.DEFAULTS, defaults=True)
    runs = spec._default_runs(opts)
    assert [(r["name"], r["backend"], r["format"], r["engine"]) for r in runs] == [
        ("oscar_channel", "oscar", "channel", []), ("oscar_token", "oscar", "token", []),
        ("flashinfer", "flashinfer", None, []), ("flashinfer_fp8", "flashinfer", None, ["kv_cache_dtype=fp8_e4m3"])]
    assert spec.stem(opts) == "prefill_defaults"
    with pytest.raises(ValueError, match="oscar_nope.*valid: oscar_token, oscar_channel"):
        spec._default_runs(dict(opts, backends="oscar_nope"))
    with pytest.raises(ValueError, match="backends= is empty"):
        spec._default_runs(dict(opts, backends=" , "))
    row = dict(kind="check", tag="oscar_channel", backend="oscar", cache="oscar", input_len=128000, cold_tokens=[1, 2, 3],
               hit_tokens=[1, 2, 4], cold_cached=0, hit_cached=127744, cold_ttft_s=25.1, hit_ttft_s=0.9,
               max_total_num_tokens=2045504, mem_fraction_static=0.835, chunked_prefill_size=8192, page_size=32,
               gpu_memory_used_mib="79344/81559", cuda_graph=True, radix=True, device="H100", sglang="0.5.17")
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    env = {"runs": [{"name": "oscar_channel", "rc": 0}, {"name": "flashinfer", "rc": "timeout"}], "command": "c"}
    report.write_defaults(tmp_path / "rows.jsonl", tmp_path, env=env)
    md = (tmp_path / "prefill_defaults.md").read_text()
    assert "| oscar_channel | oscar | 128000 | ok | 25.1 | 0.9 | 127744 | 2/3 | 2045504 | 0.835 | 8192 | 32 |" in md
    assert "| flashinfer |  |  | no row (exit timeout; logs/prefill_flashinfer.log) |" in md  # a failed engine is a row
    csv = (tmp_path / "prefill_defaults.csv").read_text().splitlines()
    assert len(csv) == 3 and csv[0].startswith("tag,backend,input_len,status,cold_ttft_s")


def test_fp8_pool_fill_is_finite():
    from oscar.bench.serving.synthetic import fill_pool

    k, v = [torch.zeros(70000, 2, 8, dtype=torch.uint8)], [torch.zeros(70000, 2, 8, dtype=torch.uint8)]
    pool = SimpleNamespace(device="cpu", k_buffer=k, v_buffer=v, dtype=torch.float8_e4m3fn)
    assert fill_pool(pool) == "bf16"
    vals = torch.cat([k[0], v[0]]).view(torch.float8_e4m3fn).float()
    assert torch.isfinite(vals).all() and 0.8 < vals.std().item() < 1.2  # normal values, no NaN byte patterns
    bf = [torch.zeros(10, 2, 8, dtype=torch.bfloat16)]
    fill_pool(SimpleNamespace(device="cpu", k_buffer=bf, v_buffer=[torch.zeros_like(bf[0])]))
    assert bf[0].std().item() > 0.5


def test_capacity_reads_what_the_engine_reports(monkeypatch):
    from oscar.bench import host
    from oscar.bench.prefix import sweep

    monkeypatch.setattr(host, "gpu_memory", lambda: {"total_gib": 79.6474609375, "used_gib": 77.484375, "free_gib": 2.0})
    info = {"mem_fraction_static": 0.835, "chunked_prefill_size": 8192, "page_size": 32, "max_running_requests": 64,
            "internal_states": [{"max_total_num_tokens": 2045504, "context_len": 131072}]}
    got = sweep._capacity(SimpleNamespace(get_server_info=lambda: info))
    assert got == {"max_total_num_tokens": 2045504, "mem_fraction_static": 0.835, "chunked_prefill_size": 8192,
                   "context_len": 131072, "page_size": 32, "max_running_requests": 64,
                   "gpu_memory_used_mib": "79344/81559"}

    def broken():
        raise RuntimeError("no server info")

    assert sweep._capacity(SimpleNamespace(get_server_info=broken)) == {"capacity_error": "RuntimeError: no server info"}

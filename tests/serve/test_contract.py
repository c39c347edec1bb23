"""Every SGLang symbol the plugin registers with or hooks exists with the signature it relies on, for each
supported version: the installed one (0.5.23 in CI) by import, and 0.5.17 (the GPU host's) from its sources
(parsed, not imported: it needs torch 2.11 and CUDA wheels), when the bundle is on this machine; and the
plugin is found through SGLang's entry-point group."""

from __future__ import annotations

import os
import tarfile
from importlib.metadata import entry_points
from pathlib import Path

import pytest

_REPO = Path(__file__).parents[2]
_CANDIDATES = [Path(os.environ["OSCAR_SGLANG_GPU_BUNDLE"])] if os.environ.get("OSCAR_SGLANG_GPU_BUNDLE") else [
    _REPO / ".dev" / "sglang-gpu", _REPO.parent / "shared" / "sglang-gpu", _REPO.parent.parent / "shared" / "sglang-gpu"]
TARBALL = next((c / "sglang-0.5.17-h200-site.tar.xz" for c in _CANDIDATES
                if (c / "sglang-0.5.17-h200-site.tar.xz").is_file()), _CANDIDATES[0] / "sglang-0.5.17-h200-site.tar.xz")


def test_sglang_symbols_match_the_contract():
    from oscar.serve.contract import check_contract

    assert check_contract() == []


@pytest.fixture(scope="module")
def sglang_0517_sources(tmp_path_factory) -> Path:
    """sglang 0.5.17's pure-Python sources, extracted from the GPU bundle (``sglang/`` only)."""
    if not TARBALL.is_file():
        pytest.skip(f"the sglang 0.5.17 bundle is not on this machine ({TARBALL}; set OSCAR_SGLANG_GPU_BUNDLE)")
    out = tmp_path_factory.mktemp("sg0517")
    with tarfile.open(TARBALL) as tar:
        members = [m for m in tar
                   if m.name.removeprefix("./").startswith("sglang/") and (m.isdir() or m.name.endswith(".py"))]
        tar.extractall(out, members=members, filter="data")
    return out


@pytest.mark.slow
def test_sglang_0517_sources_match_the_contract(sglang_0517_sources):
    from oscar.serve.contract import check_contract_source

    assert check_contract_source(sglang_0517_sources, "0.5.17") == []
    # and the check is not vacuous: the 0.5.23 seams are absent there
    problems = check_contract_source(sglang_0517_sources, "0.5.23")
    assert any("_resolve_kv_pool_class" in p for p in problems) and any("arg_groups.choices" in p for p in problems)


def test_unsupported_version_is_refused_by_name():
    from oscar.serve.contract import seams

    with pytest.raises(RuntimeError, match="supports 0.5.17, 0.5.23"):
        seams("0.5.9")


def test_plugin_is_an_sglang_entry_point():
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP

    eps = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert eps.get("oscar") == "oscar.serve.plugin:register"


def test_register_adds_backend_choice_and_hooks():
    import importlib

    import sglang
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins.hook_registry import HookRegistry

    from oscar.serve import plugin
    from oscar.serve.contract import seams

    choices = importlib.import_module(seams(sglang.__version__).choices_module).ATTENTION_BACKEND_CHOICES
    plugin.register()
    plugin.register()  # idempotent
    assert ATTENTION_BACKENDS["oscar"] is plugin.create_backend
    assert choices.count("oscar") == 1
    hooked = {t for t, entries in HookRegistry._hooks.items() for _, h, _ in entries if h.__module__ == plugin.__name__}
    assert hooked == {
        "sglang.srt.server_args.ServerArgs.resolve_once",  # the serving defaults, before SGLang resolves its own
        "sglang.srt.server_args.ServerArgs.check_server_args",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_kv_pool_class",
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes",
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
        # the radix cache: the tree takes a request's pages; the allocator frees and clears them; the match cap
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint",
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids",
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.clear",
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free",
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.clear",
        "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len",
    }
    # under 0.5.17 the pool hook is the builder (one seam differs; the others are shared)
    targets = {t for t, _, _ in plugin.hooks("0.5.17")}
    assert "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool" in targets
    # and its tree takes pages in cache_finished_req / cache_unfinished_req (0.5.23: checkpoint)
    radix = "sglang.srt.mem_cache.radix_cache.RadixCache"
    assert {f"{radix}.cache_finished_req", f"{radix}.cache_unfinished_req"} <= targets
    assert "sglang.srt.server_args.ServerArgs.__post_init__" in targets  # 0.5.17 resolves its arguments there
    assert len(targets) == len(hooked) + 1
    for target, entries in HookRegistry._hooks.items():
        assert sum(h.__module__ == plugin.__name__ for _, h, _ in entries) <= 1, target


def test_refusals_name_the_flag():
    from types import SimpleNamespace

    from oscar.serve.plugin import _flag_problems, _format_problems

    ok = SimpleNamespace(tp_size=1, pp_size=1, dp_size=1, dcp_size=1, enable_dp_attention=False,
                         speculative_algorithm=None, disable_radix_cache=True, chunked_prefill_size=8192,
                         enable_mixed_chunk=False, device="cpu", disable_cuda_graph=False,
                         prefill_attention_backend=None, decode_attention_backend=None, max_running_requests=8,
                         kv_cache_dtype="auto", enable_hierarchical_cache=False, disaggregation_mode="null",
                         page_size=1, disable_prefill_cuda_graph=False)
    assert _flag_problems(ok) == []  # chunked prefill and (decode) CUDA graphs are served
    assert _flag_problems(SimpleNamespace(**{**vars(ok), "disable_radix_cache": False})) == []  # radix cache served
    assert _flag_problems(SimpleNamespace(**{**vars(ok), "tp_size": 2, "dp_size": 2})) == []  # TP and DP are served
    cases = {"pp_size": (2, "--pp-size 2: pipeline parallelism"),
             "dcp_size": (2, "--dcp-size 2: decode context parallelism"),
             "attn_cp_size": (2, "--attn-cp-size 2: context parallelism"),
             "enable_dp_attention": (True, "--enable-dp-attention: DP attention"),
             "enable_mixed_chunk": (True, "--enable-mixed-chunk"),
             "speculative_algorithm": ("EAGLE", "--speculative-algorithm"),
             "max_running_requests": (None, "--max-running-requests"),
             "decode_attention_backend": ("triton", "--decode-attention-backend"),
             "kv_cache_dtype": ("fp8_e4m3", "--kv-cache-dtype"), "page_size": (24, "--page-size")}
    for field, (value, flag) in cases.items():
        problems = _flag_problems(SimpleNamespace(**{**vars(ok), field: value}))
        assert len(problems) == 1 and flag in problems[0], (field, problems)
    # another tree implementation would bypass the sink store's hooks
    problems = _flag_problems(SimpleNamespace(**{**vars(ok), "disable_radix_cache": False, "radix_cache_backend": "x"}))
    assert len(problems) == 1 and "--radix-cache-backend x" in problems[0], problems
    gpu = SimpleNamespace(**{**vars(ok), "device": "cuda", "page_size": 16, "disable_prefill_cuda_graph": True})
    assert _flag_problems(gpu) == []
    for field, value, flag in (("page_size", 1, "--page-size 16"),
                               ("disable_prefill_cuda_graph", False, "--disable-prefill-cuda-graph")):
        problems = _flag_problems(SimpleNamespace(**{**vars(gpu), field: value}))
        assert len(problems) == 1 and flag in problems[0], (field, problems)
    fmt = SimpleNamespace(sink=24)
    assert any("sink of 24 tokens" in p and "--page-size 16" in p for p in _format_problems(fmt, gpu))
    assert _format_problems(SimpleNamespace(sink=64), gpu) == []


def test_serving_defaults_fill_what_sglang_leaves(tiny_llama, tmp_path, monkeypatch):
    """``--attention-backend oscar`` and nothing else: the installed SGLang's own argument resolution, with the
    plugin loaded, ends in values the start-up check serves (0.5.23 resolves in ``resolve_once``, 0.5.17 in
    ``__post_init__``: the hook sits on whichever the version's seams name)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from serve_helpers import save_in_code_artifact
    from oscar.serve import plugin

    monkeypatch.setenv("OSCAR_ARTIFACT", str(save_in_code_artifact(tiny_llama, "int2", tmp_path / "int2")))
    load_plugins()
    args = ServerArgs(model_path=str(tiny_llama), attention_backend="oscar", device="cpu")
    if hasattr(args, "resolve_once"):
        args.resolve_once()
    assert args.max_running_requests == plugin.DEFAULT_MAX_RUNNING
    assert plugin._flag_problems(args) == []
    given = ServerArgs(model_path=str(tiny_llama), attention_backend="oscar", device="cpu", max_running_requests=5)
    if hasattr(given, "resolve_once"):
        given.resolve_once()
    assert given.max_running_requests == 5  # a value the user gave is kept

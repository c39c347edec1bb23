"""Every SGLang symbol the plugin registers with or hooks exists with the signature it relies on (pinned
sglang 0.5.23), and the plugin is found through SGLang's entry-point group."""

from __future__ import annotations

from importlib.metadata import entry_points


def test_sglang_symbols_match_the_contract():
    from oscar.serve.contract import check_contract

    assert check_contract() == []


def test_plugin_is_an_sglang_entry_point():
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP

    eps = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert eps.get("oscar") == "oscar.serve.plugin:register"


def test_register_adds_backend_choice_and_hooks():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins.hook_registry import HookRegistry

    from oscar.serve import plugin

    plugin.register()
    plugin.register()  # idempotent
    assert ATTENTION_BACKENDS["oscar"] is plugin.create_backend
    assert ATTENTION_BACKEND_CHOICES.count("oscar") == 1
    hooked = {t for t, entries in HookRegistry._hooks.items() for _, h, _ in entries if h.__module__ == plugin.__name__}
    assert hooked == {
        "sglang.srt.server_args.ServerArgs.check_server_args",
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_kv_pool_class",
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes",
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
    }
    for target, entries in HookRegistry._hooks.items():
        assert sum(h.__module__ == plugin.__name__ for _, h, _ in entries) <= 1, target


def test_refusals_name_the_flag():
    from types import SimpleNamespace

    from oscar.serve.plugin import _flag_problems

    ok = SimpleNamespace(tp_size=1, pp_size=1, dp_size=1, dcp_size=1, enable_dp_attention=False,
                         speculative_algorithm=None, disable_radix_cache=True, chunked_prefill_size=-1,
                         enable_mixed_chunk=False, device="cpu", disable_cuda_graph=False,
                         prefill_attention_backend=None, decode_attention_backend=None, max_running_requests=8,
                         kv_cache_dtype="auto", enable_hierarchical_cache=False, disaggregation_mode="null")
    assert _flag_problems(ok) == []
    cases = {"tp_size": (2, "--tp-size 1"), "disable_radix_cache": (False, "--disable-radix-cache"),
             "chunked_prefill_size": (8192, "--chunked-prefill-size -1"),
             "speculative_algorithm": ("EAGLE", "--speculative-algorithm"),
             "max_running_requests": (None, "--max-running-requests"),
             "decode_attention_backend": ("triton", "--decode-attention-backend"),
             "kv_cache_dtype": ("fp8_e4m3", "--kv-cache-dtype")}
    for field, (value, flag) in cases.items():
        problems = _flag_problems(SimpleNamespace(**{**vars(ok), field: value}))
        assert len(problems) == 1 and flag in problems[0], (field, problems)
    cuda = SimpleNamespace(**{**vars(ok), "device": "cuda"})
    assert any("--disable-cuda-graph" in p for p in _flag_problems(cuda))

"""Every SGLang symbol the plugin registers with, hooks or subclasses, with the signature it relies on.

Checked by ``tests/serve/test_contract.py`` and logged by the plugin at load, so that an SGLang upgrade
that moves or reshapes one of these fails loudly instead of serving wrong. Pinned: ``SGLANG_VERSION``.
"""

from __future__ import annotations

import inspect
import pkgutil
from typing import Any

SGLANG_VERSION = "0.5.23"

# dotted path -> parameter names the plugin calls or receives, in order (None: existence only)
SIGNATURES: dict[str, Any] = {
    "sglang.srt.plugins.GENERAL_PLUGINS_GROUP": None,
    "sglang.srt.plugins.hook_registry.HookRegistry.register": ["target", "hook", "hook_type", "source"],
    "sglang.srt.plugins.hook_registry.HookType": None,
    "sglang.srt.layers.attention.attention_registry.register_attention_backend": ["name"],
    "sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS": None,
    "sglang.srt.arg_groups.choices.add_attention_backend_choices": None,
    "sglang.srt.arg_groups.choices.ATTENTION_BACKEND_CHOICES": None,
    "sglang.srt.server_args.ServerArgs.check_server_args": ["self"],
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._resolve_kv_pool_class": ["self", "kind", "default"],
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size": ["self", "kvc", "num_layers"],
    "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes": [
        "self", "available_bytes", "page_size"],
    "sglang.srt.model_executor.model_runner.ModelRunner.load_model": ["self"],
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.__init__": [
        "self", "size", "page_size", "dtype", "head_num", "head_dim", "layer_num", "device", "enable_memory_saver"],
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers": ["self"],
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.get_kv_size_bytes": ["self"],
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer": ["self", "layer", "loc_info", "cache_k", "cache_v"],
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.init_forward_metadata": ["self", "forward_batch"],
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward_extend": [
        "self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"],
    "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward_decode": [
        "self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"],
}

# ForwardBatch fields the backend reads
FORWARD_BATCH_FIELDS = ("forward_mode", "req_pool_indices", "seq_lens", "seq_lens_cpu", "extend_prefix_lens_cpu",
                        "extend_seq_lens_cpu", "out_cache_loc")
# ServerArgs fields the start-up check reads
SERVER_ARGS_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend", "model_path",
                      "trust_remote_code", "device", "tp_size", "pp_size", "dp_size", "dcp_size", "enable_dp_attention",
                      "speculative_algorithm", "disable_radix_cache", "chunked_prefill_size", "enable_mixed_chunk",
                      "disable_cuda_graph", "max_running_requests", "kv_cache_dtype", "enable_hierarchical_cache",
                      "disaggregation_mode")


def _params(obj: Any) -> list[str]:
    sig = inspect.signature(obj)
    return [p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def check_contract() -> list[str]:
    """Problems with the installed SGLang (empty when every symbol exists with the expected signature)."""
    import sglang

    problems = []
    if sglang.__version__ != SGLANG_VERSION:
        problems.append(f"sglang {sglang.__version__} is installed; the oscar plugin supports {SGLANG_VERSION}")
    for path, expected in SIGNATURES.items():
        try:
            obj = pkgutil.resolve_name(path)
        except (ImportError, AttributeError) as err:
            problems.append(f"{path}: missing ({err})")
            continue
        if expected is None:
            continue
        got = _params(obj)
        if got[: len(expected)] != expected:
            problems.append(f"{path}: parameters {got}, expected to start with {expected}")
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.server_args import ServerArgs

    # ForwardBatch is a dataclass, ServerArgs a msgspec struct: both list their fields in the constructor
    for cls, fields in ((ForwardBatch, FORWARD_BATCH_FIELDS), (ServerArgs, SERVER_ARGS_FIELDS)):
        names = set(inspect.signature(cls).parameters)
        problems += [f"{cls.__name__}.{f}: missing field" for f in fields if f not in names]
    return problems


__all__ = ["FORWARD_BATCH_FIELDS", "SERVER_ARGS_FIELDS", "SGLANG_VERSION", "SIGNATURES", "check_contract"]

"""The SGLang plugin: entry point ``oscar`` in group ``sglang.srt.plugins`` (see pyproject.toml).

``register()`` runs in every SGLang process (``sglang.srt.plugins.load_plugins``) and only registers;
everything it hooks is inert unless the server runs with ``--attention-backend oscar``. One plugin for the
SGLang versions of ``oscar.serve.contract.SUPPORTED_VERSIONS``; the state lives in ``oscar.serve.state``:

- attention backend ``oscar`` (``attention_registry.register_attention_backend``) and its CLI choice;
- ``ServerArgs.check_server_args`` (after): refuses unsupported flags and models and validates the OSCAR
  settings (``oscar.serve.settings``) against the model, in the launching process, before any server
  process starts; marks the backend active for the scheduler processes (``OSCAR_SERVE_ACTIVE``);
- the MHA pool becomes ``OscarTokenToKVPool``: ``KVCacheConfigurator._resolve_kv_pool_class`` (0.5.23) or
  ``KVCacheConfigurator._build_mha_kv_pool`` (0.5.17), around (``oscar.serve.contract.SEAMS``);
- ``DefaultPoolConfigurator._compute_cell_size`` / ``calculate_pool_sizes`` (around): pool sizing from the
  real bytes per token, with the BF16 windows of ``--max-running-requests`` request slots reserved first;
- ``ModelRunner.load_model`` (after): the value rotation folded into each layer's ``o_proj``;
- the radix (prefix) cache (``oscar.serve.contract.Seams.tree_hooks``): before the tree takes a request's
  pages (0.5.17: ``RadixCache.cache_finished_req`` / ``cache_unfinished_req``; 0.5.23:
  ``UnifiedRadixCache.checkpoint``) the request's BF16 sink rows go to the pool's sink store; the paged
  allocator's ``_release_page_ids`` (and ``TokenToKVPoolAllocator.free`` for pages of one token) releases
  them, ``clear`` empties the store; ``Req._compute_max_prefix_len`` (after) caps a match at
  ``input_len - OSCAR_RECENT`` so that every request computes its own recent window.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from oscar.serve.state import BACKEND, active, ensure_state, set_active

logger = logging.getLogger(__name__)

MIN_CUDA_PAGE_SIZE = 16  # the fragment-order pages of the v9 kernel hold blocks of 16 tokens


# -- start-up check (launching process) -----------------------------------------------------------


def _flag_problems(args: Any) -> list[str]:
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    out = []
    for name, flag in (("tp_size", "--tp-size"), ("pp_size", "--pp-size"), ("dp_size", "--dp-size"),
                       ("dcp_size", "--dcp-size")):
        if (get(name) or 1) > 1:
            out.append(f"tensor/pipeline/data parallelism is not supported yet: set {flag} 1 (got {get(name)})")
    if get("enable_dp_attention"):
        out.append("DP attention is not supported: drop --enable-dp-attention")
    if get("speculative_algorithm"):
        out.append(f"speculative decoding is not supported: drop --speculative-algorithm {get('speculative_algorithm')}")
    if not get("disable_radix_cache") and get("radix_cache_backend"):
        out.append(f"--radix-cache-backend {get('radix_cache_backend')} bypasses the tree hooks that keep the BF16 "
                   "sink rows of cached prefixes: drop it (SGLang's default radix cache is served)")
    if get("enable_mixed_chunk"):
        out.append("mixed prefill/decode batches are not supported: drop --enable-mixed-chunk")
    if str(get("device") or "cuda") != "cpu" and get("disable_prefill_cuda_graph") is False \
            and not get("disable_cuda_graph"):
        out.append("prefill CUDA graphs are not supported (the extend attention loops over requests on the host): "
                   "add --disable-prefill-cuda-graph (decode CUDA graphs are supported)")
    page = int(get("page_size") or 1)
    if page & (page - 1):
        out.append(f"--page-size {page} is not supported: use a power of two")
    if str(get("device") or "cuda") != "cpu" and page < MIN_CUDA_PAGE_SIZE:
        out.append(f"--page-size {page} is too small on a GPU: use --page-size {MIN_CUDA_PAGE_SIZE} or more (pages "
                   "of the fragment-order layout read by the v9 decode kernel)")
    for name in ("prefill_attention_backend", "decode_attention_backend"):
        if get(name) not in (None, BACKEND):
            out.append(f"--{name.replace('_', '-')} {get(name)} would bypass the OSCAR pool: drop it or set it to oscar")
    if not get("max_running_requests"):
        out.append("set --max-running-requests N: the BF16 sink and recent windows are reserved per running request")
    if str(get("kv_cache_dtype") or "auto") not in ("auto", "bfloat16", "bf16"):
        out.append(f"--kv-cache-dtype {get('kv_cache_dtype')} is not supported with oscar: keep auto (the pool is "
                   "INT2/INT4; its settings come from OSCAR_* variables)")
    if get("enable_hierarchical_cache"):
        out.append("hierarchical cache is not supported: drop --enable-hierarchical-cache")
    if str(get("disaggregation_mode") or "null") != "null":
        out.append(f"PD disaggregation is not supported: drop --disaggregation-mode {get('disaggregation_mode')}")
    return out


def _settings_problems(settings: Any, args: Any) -> list[str]:
    """Settings that do not fit the server's flags (the sink must fill whole pages)."""
    page = int(getattr(args, "page_size", None) or 1)
    if settings.sink % page:
        return [f"OSCAR_SINK={settings.sink} must be a multiple of --page-size {page} (quantized rows start on a page)"]
    return []


def check_server_args_after(result: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
    """AFTER hook of ``ServerArgs.check_server_args``: refuse what the plugin cannot serve correctly."""
    if getattr(args, "attention_backend", None) != BACKEND:
        set_active(False)
        return result
    from oscar.serve.settings import OscarServeError, ServeSettings, validate

    settings = ServeSettings.from_env()
    problems = _flag_problems(args) + _settings_problems(settings, args)
    if problems:
        raise OscarServeError("--attention-backend oscar refuses these settings:\n  - " + "\n  - ".join(problems))
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(args.model_path, trust_remote_code=bool(args.trust_remote_code))
    validate(settings, hf_config)
    set_active(True)
    return result


# -- scheduler process hooks ----------------------------------------------------------------------


def resolve_kv_pool_class_around(original: Any, kvc: Any, *args: Any, **kwargs: Any) -> Any:
    """``KVCacheConfigurator._resolve_kv_pool_class`` (0.5.23): the OSCAR pool for MHA when the backend is oscar."""
    if active() and kwargs.get("kind", args[0] if args else None) == "mha":
        from oscar.serve.pool import OscarTokenToKVPool

        ensure_state(kvc.model_config.hf_config)
        return OscarTokenToKVPool
    return original(kvc, *args, **kwargs)


def build_mha_kv_pool_around(original: Any, kvc: Any, *args: Any, **kwargs: Any) -> Any:
    """``KVCacheConfigurator._build_mha_kv_pool`` (0.5.17): built with the OSCAR pool class when the backend is
    oscar (its arguments are keyword-only: ``max_total_num_tokens``, ``mha_pool_class``, ``quant_method``)."""
    if active():
        from oscar.serve.pool import OscarTokenToKVPool

        ensure_state(kvc.model_config.hf_config)
        if kwargs.get("quant_method") is not None:
            from oscar.serve.settings import OscarServeError

            raise OscarServeError("--attention-backend oscar got a KV-cache quantization method from SGLang "
                                  "(--kv-cache-dtype); keep --kv-cache-dtype auto")
        kwargs["mha_pool_class"] = OscarTokenToKVPool
    return original(kvc, *args, **kwargs)


def compute_cell_size_around(original: Any, conf: Any, kvc: Any, num_layers: int, *args: Any, **kwargs: Any) -> Any:
    """``DefaultPoolConfigurator._compute_cell_size``: OSCAR bytes per token; remembers the window bytes."""
    if not active():
        return original(conf, kvc, num_layers, *args, **kwargs)
    from sglang.srt.runtime_context import get_parallel

    from oscar.serve.settings import bytes_per_token, window_bytes_per_request

    st = ensure_state(kvc.model_config.hf_config)
    mc = kvc.model_config
    par = get_parallel()
    try:  # 0.5.23: (attn_tp_size, attn_dcp_size); 0.5.17: (tensor_parallel_size); DCP > 1 is refused
        hkv = mc.get_num_kv_heads(par.attn_tp_size, par.attn_dcp_size)
    except TypeError:
        hkv = mc.get_num_kv_heads(par.attn_tp_size)
    cell = bytes_per_token(int(num_layers), int(hkv), int(mc.head_dim), st["bits"], st["group_size"])
    bf16 = int(hkv) * (int(mc.head_dim) + int(mc.v_head_dim)) * int(num_layers) * 2
    reqs = int(kvc.server_args.max_running_requests) + 1
    sink = st["settings"].sink
    st["prefix_cache"] = not bool(getattr(kvc.server_args, "disable_radix_cache", True))
    conf._oscar_window_bytes = reqs * window_bytes_per_request(
        int(num_layers), int(hkv), int(mc.head_dim), sink, st["settings"].recent)
    if st["prefix_cache"]:  # the sink store: BF16 sink pages of twice as many prefixes as request slots
        from oscar.serve.pool import sink_store_pages

        page = int(getattr(kvc.server_args, "page_size", None) or 1)
        conf._oscar_window_bytes += sink_store_pages(reqs, sink, page) * page * int(hkv) * int(mc.head_dim) * 2 * 2 \
            * int(num_layers)
    logger.info("OSCAR pool sizing: %d bytes/token (BF16 would be %d: %.2fx the tokens per byte); BF16 windows "
                "of %d request slots%s reserved first: %.3f GB", cell, bf16, bf16 / cell, reqs,
                " and the prefix cache's sink store" if st["prefix_cache"] else "", conf._oscar_window_bytes / 2**30)
    return cell


def calculate_pool_sizes_around(original: Any, conf: Any, available_bytes: int, *args: Any, **kwargs: Any) -> Any:
    """``DefaultPoolConfigurator.calculate_pool_sizes``: tokens from what is left after the windows."""
    reserve = int(getattr(conf, "_oscar_window_bytes", 0)) if active() else 0
    if reserve:
        if reserve >= available_bytes:
            from oscar.serve.settings import OscarServeError

            raise OscarServeError(
                f"the BF16 windows of --max-running-requests need {reserve / 2**30:.2f} GB, more than the "
                f"{available_bytes / 2**30:.2f} GB left for the KV cache; lower --max-running-requests, OSCAR_SINK "
                "or OSCAR_RECENT, or raise --mem-fraction-static")
        available_bytes -= reserve
    return original(conf, available_bytes, *args, **kwargs)


def fold_after_load(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """``ModelRunner.load_model`` (after): fold ``R_V`` (and ``mu_V``) into every layer's ``o_proj``."""
    if not active():
        return result
    st = ensure_state(runner.model_config.hf_config)
    if st["fold"]:
        n = fold_model(runner.model, st["rotations"])
        logger.info("OSCAR: value rotation folded into o_proj of %d layers", n)
    return result


# -- the radix (prefix) cache ----------------------------------------------------------------------


def _oscar_pool(allocator: Any) -> Any:
    """The OSCAR pool behind a token allocator (None for another pool, or before it is bound)."""
    try:
        pool = allocator.get_kvcache()
    except AttributeError:  # the allocator's own __init__ clears before it holds its pool
        return None
    return pool if hasattr(pool, "release_sink_pages") else None


def _req_slot(req: Any) -> int:
    kv = getattr(req, "kv", None)  # 0.5.23 keeps the row in req.kv; 0.5.17 on the request
    return int(kv.req_pool_idx if kv is not None and hasattr(kv, "req_pool_idx") else req.req_pool_idx)


def _store_sink(cache: Any, req: Any, length: int) -> None:
    pool = _oscar_pool(cache.token_to_kv_pool_allocator)
    if pool is not None and not getattr(cache, "disable", False):
        pool.store_sink(cache.req_to_token_pool.req_to_token, _req_slot(req), int(length))


def finished_before(cache: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """``RadixCache.cache_finished_req`` (0.5.17, before): the request's sink pages into the sink store."""
    _store_sink(cache, req, kwargs["kv_len_to_handle"])


def unfinished_before(cache: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """``RadixCache.cache_unfinished_req`` (0.5.17, before): a chunked request's sink pages into the store."""
    _store_sink(cache, req, len(req.get_fill_ids()))


def checkpoint_before(cache: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """``UnifiedRadixCache.checkpoint`` (0.5.23, before): the sink pages of ``[0, up_to)`` into the store."""
    _store_sink(cache, req, kwargs["up_to"])


def release_pages_before(allocator: Any, *page_ids: Any, **kwargs: Any) -> None:
    """``PagedTokenToKVPoolAllocator._release_page_ids`` (before): these pages' sink-store rows are free."""
    pool = _oscar_pool(allocator)
    if pool is not None:
        for ids in page_ids:
            pool.release_sink_pages(ids)


def free_tokens_before(allocator: Any, free_index: Any, *args: Any, **kwargs: Any) -> None:
    """``TokenToKVPoolAllocator.free`` (before; pages of one token: token slots are pages). Called again for a
    deferred free group; releasing is idempotent."""
    release_pages_before(allocator, free_index)


def clear_after(result: Any, allocator: Any, *args: Any, **kwargs: Any) -> Any:
    """The allocator's ``clear`` (after): every page is free, so is the sink store."""
    pool = _oscar_pool(allocator)
    if pool is not None:
        pool.clear_sink_store()
    return result


def cap_prefix_after(result: Any, req: Any, input_len: int, *args: Any, **kwargs: Any) -> Any:
    """``Req._compute_max_prefix_len`` (after): a match leaves at least ``OSCAR_RECENT`` tokens to compute, so
    the request's recent window holds its own exact BF16 rows (a cached prefix has no BF16 ring rows)."""
    if not active():
        return result
    from oscar.serve.state import current_state

    try:
        recent = int(current_state()["settings"].recent)
    except RuntimeError:  # no pool in this process
        return result
    return max(0, min(int(result), int(input_len) - recent))


def _attention_modules(model: Any) -> list[Any]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise NotImplementedError(f"{type(model).__name__} has no .model.layers; the oscar plugin cannot find o_proj")
    out = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not hasattr(attn, "o_proj"):
            raise NotImplementedError(f"{type(layer).__name__} has no self_attn.o_proj; the oscar plugin cannot fold")
        out.append(attn)
    return out


def fold_model(model: Any, rotations: list[Any]) -> int:
    """Fold each layer's ``R_V`` / ``mu_V`` into its ``o_proj`` in place (tensor-parallel rank 0 of 1)."""
    import torch

    from oscar.models.surgery import folded_bias, folded_weight

    attns = _attention_modules(model)
    if len(attns) != len(rotations):
        raise ValueError(f"{len(rotations)} layer rotations for a model with {len(attns)} attention layers")
    for attn, rot in zip(attns, rotations):
        o = attn.o_proj
        heads = int(getattr(attn, "num_heads"))
        w = o.weight
        with torch.no_grad():
            if rot.mu_v is not None:
                new_bias = folded_bias(w.detach(), None if o.bias is None else o.bias.detach(), rot.mu_v, heads)
                if o.bias is None:
                    o.bias = torch.nn.Parameter(new_bias, requires_grad=False)
                else:
                    o.bias.copy_(new_bias)
            w.copy_(folded_weight(w.detach(), rot.r_v, heads))
    return len(attns)


def create_backend(runner: Any) -> Any:
    """Factory registered as attention backend ``oscar``."""
    from oscar.serve.backend import OscarAttnBackend

    return OscarAttnBackend(runner)


def hooks(version: str) -> list[tuple[str, Any, Any]]:
    """(target, hook, kind name) of every hook the plugin registers under SGLang ``version``."""
    from oscar.serve.contract import seams

    s = seams(version)
    pool_hook = build_mha_kv_pool_around if s.pool_hook_kind == "build" else resolve_kv_pool_class_around
    conf = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
    alloc = "sglang.srt.mem_cache.allocator"
    tree = {"finished": finished_before, "unfinished": unfinished_before, "checkpoint": checkpoint_before}
    return [
        ("sglang.srt.server_args.ServerArgs.check_server_args", check_server_args_after, "AFTER"),
        (s.pool_hook, pool_hook, "AROUND"),
        (f"{conf}._compute_cell_size", compute_cell_size_around, "AROUND"),
        (f"{conf}.calculate_pool_sizes", calculate_pool_sizes_around, "AROUND"),
        ("sglang.srt.model_executor.model_runner.ModelRunner.load_model", fold_after_load, "AFTER"),
        *((target, tree[kind], "BEFORE") for target, kind in s.tree_hooks),
        (f"{alloc}.paged.PagedTokenToKVPoolAllocator._release_page_ids", release_pages_before, "BEFORE"),
        (f"{alloc}.token.TokenToKVPoolAllocator.free", free_tokens_before, "BEFORE"),
        (f"{alloc}.paged.PagedTokenToKVPoolAllocator.clear", clear_after, "AFTER"),
        (f"{alloc}.token.TokenToKVPoolAllocator.clear", clear_after, "AFTER"),
        ("sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len", cap_prefix_after, "AFTER"),
    ]


def register() -> None:
    """Entry point: register the backend, its CLI choice and the hooks of the installed SGLang (idempotent)."""
    import importlib

    import sglang
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from oscar.serve.contract import seams

    version = str(sglang.__version__)
    choices = importlib.import_module(seams(version).choices_module)
    if BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND)(create_backend)
    if BACKEND not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([BACKEND])
    registered = {(t, h) for t, entries in HookRegistry._hooks.items() for _, h, _ in entries}
    for target, hook, kind in hooks(version):
        if (target, hook) not in registered:
            HookRegistry.register(target, hook, getattr(HookType, kind))


def plugin_loaded() -> Optional[bool]:
    """True when ``register`` ran in this process (the backend is in SGLang's registry)."""
    try:
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    except ImportError:
        return None
    return BACKEND in ATTENTION_BACKENDS


__all__ = ["BACKEND", "MIN_CUDA_PAGE_SIZE", "fold_model", "hooks", "register"]

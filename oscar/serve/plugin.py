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
- tensor parallelism (``--tp-size``; ``--dp-size`` replicas need nothing more): each scheduler process cuts the
  state to its attention-TP rank's KV heads once (``rank_state``, ``oscar.serve.sharding``), so its pool, backend
  and fold see only those heads; the fold of a rank's ``o_proj`` shard sums the means' bias terms over the ranks
  once at load (``_attn_tp_sum``). Pipeline/context parallelism and DP attention are refused by name
  (``REFUSED_PARALLELISM``);
- the radix (prefix) cache (``oscar.serve.contract.Seams.tree_hooks``): before the tree takes a request's
  pages (0.5.17: ``RadixCache.cache_finished_req`` / ``cache_unfinished_req``; 0.5.23:
  ``UnifiedRadixCache.checkpoint``) the request's BF16 sink rows go to the pool's sink store; the paged
  allocator's ``_release_page_ids`` (and ``TokenToKVPoolAllocator.free`` for pages of one token) releases
  them, ``clear`` empties the store; ``Req._compute_max_prefix_len`` (after) caps a match at
  ``input_len - OSCAR_RECENT`` so that every request computes its own recent window, and under
  ``OSCAR_PREFIX_REUSE=exact`` (the default) at the sink, so that a hit reads what a cold prefill reads.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from oscar.serve.contract import seams
from oscar.serve.reuse import PREFIX_REUSE
from oscar.serve.state import BACKEND, active, current_state, ensure_state, set_active

logger = logging.getLogger(__name__)

MIN_CUDA_PAGE_SIZE = 16  # the fragment-order pages of the v9 kernel hold blocks of 16 tokens

# Parallelism the plugin refuses (ServerArgs field -> (flag, why)); --tp-size and --dp-size are served
# (oscar.serve.sharding; docs/DESIGN.md "Serving with SGLang").
REFUSED_PARALLELISM = {
    "pp_size": ("--pp-size", "pipeline parallelism is not supported: its stages hold a subset of the layers "
                "(PPMissingLayer in the fold, the pool's start_layer) and its micro-batches run several batches "
                "through one pool at once, none of which the plugin has been checked on; use --tp-size (and "
                "--dp-size for replicas)"),
    "dcp_size": ("--dcp-size", "decode context parallelism is not supported: it interleaves a request's tokens "
                 "over ranks, while the OSCAR pool keeps every token of a request on its rank (BF16 sink and "
                 "recent windows, the page table from position S0 on); use --tp-size"),
    "attn_cp_size": ("--attn-cp-size", "context parallelism is not supported: it splits a request's tokens over "
                     "ranks, while the OSCAR pool keeps every token of a request on its rank (BF16 sink and recent "
                     "windows, the page table from position S0 on); use --tp-size"),
    "enable_prefill_cp": ("--enable-prefill-cp", "prefill context parallelism is not supported: it splits a "
                          "request's tokens over ranks, while the OSCAR pool writes every token of a request on "
                          "its rank; drop it"),
    "enable_dp_attention": ("--enable-dp-attention", "DP attention is not supported: it exists for MLA and MoE "
                            "models (MLA is refused), runs attention over batches gathered and scattered across "
                            "DP ranks that the plugin has not been checked on; for the dense GQA models it serves, "
                            "--dp-size without it gives replicas each with its own pool"),
    "attn_dp_size": ("--attn-dp-size", "DP attention is not supported (see --enable-dp-attention); use --dp-size "
                     "for replicas"),
}


# -- serving defaults (launching process, before SGLang resolves its own) --------------------------

DEFAULT_MAX_RUNNING = 64  # request slots whose BF16 sink and recent windows the pool reserves when none is given


def serving_defaults(args: Any, key_block: int = 0) -> list[str]:
    """Fill in what ``--attention-backend oscar`` needs where the user left SGLang's default, and say what was set.

    A user who starts SGLang with ``--attention-backend oscar`` and nothing else gets a served configuration, not
    a refusal: pages of ``MIN_CUDA_PAGE_SIZE`` tokens on a GPU (or of the artifact's per-channel key block where
    that is larger), prefill CUDA graphs off (SGLang's default captures them; the extend attention loops over
    requests on the host; decode CUDA graphs stay on), ``DEFAULT_MAX_RUNNING`` request slots. A value the user
    gave is kept, and the start-up check (`check_server_args_after`) refuses it by name if it cannot be served.
    Mutates ``args``; returns one line per value set."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    gpu = str(get("device") or _default_device()) != "cpu"
    out = []
    if get("page_size") is None:
        floor = MIN_CUDA_PAGE_SIZE if gpu else 1
        page = 1 << (max(floor, int(key_block or 1)) - 1).bit_length()  # a power of two holding whole key blocks
        if page > 1:
            args.page_size = page
            why = (f"per-channel key blocks of {key_block} tokens live in one page" if key_block > floor
                   else f"the GPU decode kernel reads pages of {floor} tokens")
            out.append(f"--page-size {page} ({why})")
    if gpu and not get("disable_cuda_graph") and not get("disable_prefill_cuda_graph") \
            and get("cuda_graph_backend_prefill") is None:
        args.disable_prefill_cuda_graph = True
        out.append("--disable-prefill-cuda-graph (the extend attention loops over requests on the host; decode CUDA "
                   "graphs stay on)")
    if not get("max_running_requests"):
        args.max_running_requests = DEFAULT_MAX_RUNNING
        out.append(f"--max-running-requests {DEFAULT_MAX_RUNNING} (the pool reserves BF16 sink and recent windows "
                   "per request slot; give your own to change it)")
    return out


def _default_device() -> str:
    """SGLang's device when ``--device`` is not given: CUDA where torch sees a GPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _artifact_key_block(args: Any) -> int:
    """The served format's per-channel key block (0: per-token keys); 0 where the artifact or the model cannot be
    read here (the start-up check then names the problem)."""
    # local: keeps torch and transformers out of the entry point's import time (SGLang loads it in every process)
    from oscar.serve.settings import OscarServeError, ServeSettings, validate

    try:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(args.model_path, trust_remote_code=bool(getattr(args, "trust_remote_code",
                                                                                               False)))
        _, fmt = validate(ServeSettings.from_env(), hf_config)
        cfg = getattr(hf_config, "text_config", None) or hf_config
        return max((fmt.layer_key_block(i) for i in range(int(cfg.num_hidden_layers))), default=0)
    except (OscarServeError, OSError, ValueError, KeyError, RuntimeError, TypeError):
        return 0  # the start-up check reads the same artifact and model, and names what is wrong


def serving_defaults_before(args: Any, *rest: Any, **kwargs: Any) -> None:
    """BEFORE hook of the ``ServerArgs`` method that resolves SGLang's defaults (``Seams.args_hook``: 0.5.17's
    ``__post_init__``, 0.5.23's ``resolve_once``; SGLang loads plugins before either runs): `serving_defaults` for
    ``--attention-backend oscar``, logged once."""
    if getattr(args, "attention_backend", None) != BACKEND or getattr(args, "_resolution_finished", False) \
            or str(getattr(args, "model_path", "")).lower() in ("none", "dummy"):
        return None  # not ours, already resolved (0.5.23 calls resolve_once again in child processes), or no model
    chosen = serving_defaults(args, _artifact_key_block(args))
    if chosen:
        logger.warning("OSCAR sets what SGLang's defaults leave unserved: %s", "; ".join(chosen))
    return None


# -- start-up check (launching process) -----------------------------------------------------------


def _flag_problems(args: Any) -> list[str]:
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    out = []
    for name, (flag, why) in REFUSED_PARALLELISM.items():  # --tp-size and --dp-size are served
        value = get(name)
        if value is True or (isinstance(value, int) and not isinstance(value, bool) and value > 1):
            out.append(f"{flag if value is True else f'{flag} {value}'}: {why}")
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


def _format_problems(fmt: Any, args: Any, num_layers: int = 0) -> list[str]:
    """What of the served cache format does not fit the server's flags: the sink must fill whole pages, and a page
    must hold whole per-channel key blocks (of the ``num_layers`` layers')."""
    page = int(getattr(args, "page_size", None) or 1)
    out = []
    if fmt.sink % page:
        out.append(f"the sink of {fmt.sink} tokens (OSCAR_SINK, else the artifact's format) must be a multiple of "
                   f"--page-size {page} (quantized rows start on a page)")
    blocks = sorted({fmt.layer_key_block(i) for i in range(num_layers)} - {0})
    if blocks and page % blocks[-1]:
        out.append(f"--page-size {page}: the artifact's per-channel key blocks of {blocks[-1]} tokens live in one page; "
                   f"use --page-size {max(blocks[-1], MIN_CUDA_PAGE_SIZE)} or a multiple (or leave it unset: the "
                   "plugin then sets it)")
    return out


def _tp_problems(args: Any, hf_config: Any) -> list[str]:
    """A ``--tp-size`` whose split of the model's heads SGLang would refuse (named here, before any process)."""
    # local: keeps torch and transformers (oscar.serve.sharding) out of the entry point's import time
    from oscar.core.artifact import model_config_fields
    from oscar.serve.sharding import tp_problems

    f = model_config_fields(getattr(hf_config, "text_config", None) or hf_config)
    return tp_problems(int(getattr(args, "tp_size", None) or 1), f["num_heads"], f["num_kv_heads"])


def check_server_args_after(result: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
    """AFTER hook of ``ServerArgs.check_server_args``: refuse what the plugin cannot serve correctly."""
    if getattr(args, "attention_backend", None) != BACKEND:
        set_active(False)
        return result
    # local: keeps torch out of import time (SGLang loads this entry point in every process, served or not)
    from oscar.serve.settings import OscarServeError, ServeSettings, validate

    settings = ServeSettings.from_env()
    problems = _flag_problems(args)
    if problems:
        raise OscarServeError("--attention-backend oscar refuses these settings:\n  - " + "\n  - ".join(problems))
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(args.model_path, trust_remote_code=bool(args.trust_remote_code))
    _, fmt = validate(settings, hf_config)
    cfg = getattr(hf_config, "text_config", None) or hf_config
    problems = _format_problems(fmt, args, int(getattr(cfg, "num_hidden_layers", 0) or 0))
    if problems:
        raise OscarServeError("--attention-backend oscar refuses these settings:\n  - " + "\n  - ".join(problems))
    problems = _tp_problems(args, hf_config)
    if problems:
        raise OscarServeError("--attention-backend oscar refuses these settings:\n  - " + "\n  - ".join(problems))
    set_active(True)
    return result


# -- scheduler process hooks ----------------------------------------------------------------------


def shard_state(st: dict[str, Any], hf_config: Any, tp_rank: int, tp_size: int) -> dict[str, Any]:
    """Cut the state's rotations to attention-TP rank ``tp_rank`` of ``tp_size`` (once; the pool, the backend and
    the fold then read the rank's KV heads only). Keeps the whole artifact's as ``full_rotations``."""
    if "shard" in st:
        have = st["shard"]
        if (have.tp_rank, have.tp_size) != (int(tp_rank), int(tp_size)):
            raise RuntimeError(f"the oscar state of this process is cut for TP rank {have.tp_rank} of {have.tp_size}, "
                               f"not {tp_rank} of {tp_size}")
        return st
    # local: keeps torch and transformers (oscar.serve.sharding) out of the entry point's import time
    from oscar.core.artifact import model_config_fields
    from oscar.serve.sharding import head_shard, shard_layers

    f = model_config_fields(getattr(hf_config, "text_config", None) or hf_config)
    shard = head_shard(tp_rank, tp_size, f["num_heads"], f["num_kv_heads"])
    st["full_rotations"] = st["rotations"]
    st["rotations"] = shard_layers(st["rotations"], shard)
    st["shard"] = shard
    if not shard.whole:
        logger.info("OSCAR: %s; the artifact's per-KV-head state is cut to these heads", shard.describe())
    return st


def rank_state(hf_config: Any) -> dict[str, Any]:
    """``ensure_state`` of this scheduler process, its rotations cut to the process's attention-TP rank."""
    from sglang.srt.runtime_context import get_parallel

    st = ensure_state(hf_config)
    par = get_parallel()
    return shard_state(st, hf_config, int(par.attn_tp_rank), int(par.attn_tp_size))


def resolve_kv_pool_class_around(original: Any, kvc: Any, *args: Any, **kwargs: Any) -> Any:
    """``KVCacheConfigurator._resolve_kv_pool_class`` (0.5.23): the OSCAR pool for MHA when the backend is oscar."""
    if active() and kwargs.get("kind", args[0] if args else None) == "mha":
        from oscar.serve.pool import OscarTokenToKVPool  # local: keeps sglang out of import time

        rank_state(kvc.model_config.hf_config)
        return OscarTokenToKVPool
    return original(kvc, *args, **kwargs)


def build_mha_kv_pool_around(original: Any, kvc: Any, *args: Any, **kwargs: Any) -> Any:
    """``KVCacheConfigurator._build_mha_kv_pool`` (0.5.17): built with the OSCAR pool class when the backend is
    oscar (its arguments are keyword-only: ``max_total_num_tokens``, ``mha_pool_class``, ``quant_method``)."""
    if active():
        from oscar.serve.pool import OscarTokenToKVPool  # local: keeps sglang out of import time

        rank_state(kvc.model_config.hf_config)
        if kwargs.get("quant_method") is not None:
            from oscar.serve.settings import OscarServeError  # local: keeps torch out of import time

            raise OscarServeError("--attention-backend oscar got a KV-cache quantization method from SGLang "
                                  "(--kv-cache-dtype); keep --kv-cache-dtype auto")
        kwargs["mha_pool_class"] = OscarTokenToKVPool
    return original(kvc, *args, **kwargs)


def compute_cell_size_around(original: Any, conf: Any, kvc: Any, num_layers: int, *args: Any, **kwargs: Any) -> Any:
    """``DefaultPoolConfigurator._compute_cell_size``: OSCAR bytes per token; remembers the window bytes."""
    if not active():
        return original(conf, kvc, num_layers, *args, **kwargs)
    from sglang.srt.runtime_context import get_parallel

    st = ensure_state(kvc.model_config.hf_config)
    mc = kvc.model_config
    par = get_parallel()
    try:  # 0.5.23: (attn_tp_size, attn_dcp_size); 0.5.17: (tensor_parallel_size); DCP > 1 is refused
        hkv = mc.get_num_kv_heads(par.attn_tp_size, par.attn_dcp_size)
    except TypeError:
        hkv = mc.get_num_kv_heads(par.attn_tp_size)
    fmt = st["format"]
    cell = fmt.bytes_per_token(int(num_layers), int(hkv), int(mc.head_dim))
    bf16 = int(hkv) * (int(mc.head_dim) + int(mc.v_head_dim)) * int(num_layers) * 2
    reqs = int(kvc.server_args.max_running_requests) + 1
    sink = fmt.sink
    st["prefix_cache"] = not bool(getattr(kvc.server_args, "disable_radix_cache", True))
    conf._oscar_window_bytes = reqs * fmt.window_bytes(int(num_layers), int(hkv), int(mc.head_dim))
    if st["prefix_cache"]:  # the sink store: BF16 sink pages of twice as many prefixes as request slots
        from oscar.serve.pool import sink_store_pages  # local: keeps sglang out of import time

        page = int(getattr(kvc.server_args, "page_size", None) or 1)
        conf._oscar_window_bytes += sink_store_pages(reqs, sink, page) * page * int(hkv) * int(mc.head_dim) * 2 * 2 \
            * int(num_layers)
    tp, dp = int(getattr(par, "attn_tp_size", 1) or 1), int(getattr(kvc.server_args, "dp_size", 1) or 1)
    conf._oscar_topology = (tp, dp, int(hkv), getattr(kvc.server_args, "max_total_tokens", None))
    logger.info("OSCAR pool sizing: %d bytes/token on this rank's %d KV heads (BF16 would be %d: %.2fx the tokens "
                "per byte); BF16 windows of %d request slots%s reserved first: %.3f GB", cell, int(hkv), bf16,
                bf16 / cell, reqs, " and the prefix cache's sink store" if st["prefix_cache"] else "",
                conf._oscar_window_bytes / 2**30)
    return cell


def calculate_pool_sizes_around(original: Any, conf: Any, available_bytes: int, *args: Any, **kwargs: Any) -> Any:
    """``DefaultPoolConfigurator.calculate_pool_sizes``: tokens from what is left after the windows."""
    reserve = int(getattr(conf, "_oscar_window_bytes", 0)) if active() else 0
    if reserve:
        if reserve >= available_bytes:
            from oscar.serve.settings import OscarServeError  # local: keeps torch out of import time

            raise OscarServeError(
                f"the BF16 windows of --max-running-requests need {reserve / 2**30:.2f} GB, more than the "
                f"{available_bytes / 2**30:.2f} GB left for the KV cache; lower --max-running-requests, OSCAR_SINK "
                "or OSCAR_RECENT, or raise --mem-fraction-static")
        available_bytes -= reserve
    result = original(conf, available_bytes, *args, **kwargs)
    topology = getattr(conf, "_oscar_topology", None) if active() else None
    if topology is not None:
        tp, dp, hkv, cap = topology
        tokens = int(getattr(result, "max_total_num_tokens", -1))
        logger.info("OSCAR pool sizing: %d tokens per replica%s (each of its %d TP rank(s) holds them for its %d KV "
                    "heads; --dp-size %d: %d replica(s), each with its own pool)", min(tokens, int(cap or tokens)),
                    f" (--max-total-tokens {cap}; the memory left holds {tokens})" if cap and cap < tokens else "",
                    tp, hkv, dp, dp)
    return result


def fold_after_load(result: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """``ModelRunner.load_model`` (after): fold ``R_V`` (and ``mu_V``) into every layer's ``o_proj`` (under tensor
    parallelism, each rank its own ``o_proj`` shard with its KV heads' slice)."""
    if not active():
        return result
    st = rank_state(runner.model_config.hf_config)
    if st["fold"]:
        shard = st["shard"]
        n = fold_model(runner.model, st["rotations"], shard, None if shard.whole else _attn_tp_sum)
        logger.info("OSCAR: value rotation folded into o_proj of %d layers (%s)", n, shard.describe())
    return result


def _attn_tp_sum(x: Any) -> Any:
    """Sum ``x`` over the attention-TP group (the ranks of one ``o_proj``), once at load: an all-reduce on the
    group's CPU (gloo) group, so it needs no device collective and runs the same on GPUs and CPUs."""
    import torch
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    out = x.detach().to("cpu", torch.float64).contiguous()
    dist.all_reduce(out, group=get_parallel().attn_tp_group.cpu_group)
    return out.to(x.device)


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
    """``Req._compute_max_prefix_len`` (after): a match leaves at least the served format's recent window of tokens
    to compute, so the request's recent window holds its own exact BF16 rows (a cached prefix has no BF16 ring rows);
    under ``OSCAR_PREFIX_REUSE=exact`` (the default) it also ends at the sink, whose BF16 rows the sink store keeps:
    the hit's extend then reads what a cold prefill reads (the quantized pages of a cached prefix are not reused)."""
    if not active():
        return result
    try:
        st = current_state()
        fmt = st["format"]
    except RuntimeError:  # no pool in this process
        return result
    cap = int(input_len) - int(fmt.recent)
    settings = st.get("settings")
    if getattr(settings, "prefix_reuse", PREFIX_REUSE[0]) == "exact":
        cap = min(cap, int(fmt.sink))
    return max(0, min(int(result), cap))


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


def _check_rank_heads(attn: Any, shard: Any, layer: int) -> None:
    """The attention module holds the heads the shard says (SGLang's split, oscar.serve.sharding)."""
    got = (int(getattr(attn, "num_heads")), int(getattr(attn, "num_kv_heads", shard.local_kv_heads)),
           int(getattr(attn.o_proj, "tp_rank", shard.tp_rank)))
    want = (shard.local_heads, shard.local_kv_heads, shard.tp_rank)
    if got != want:
        raise RuntimeError(f"layer {layer}: the attention module holds (query heads, KV heads, o_proj TP rank) {got}, "
                           f"the oscar plugin expected {want} for {shard.describe()}")


def fold_model(model: Any, rotations: list[Any], shard: Optional[Any] = None,
               reduce_sum: Optional[Callable[[Any], Any]] = None) -> int:
    """Fold each layer's ``R_V`` / ``mu_V`` into its ``o_proj`` in place.

    Under tensor parallelism ``model`` is one rank's, ``rotations`` and ``shard`` the rank's slice
    (`shard_state`): the rank folds its ``o_proj`` columns with its KV heads' ``R_V``
    (`oscar.serve.sharding.fold_o_proj_shard`), and the mean's bias terms of every layer (``[layers, hidden]``)
    are summed over the ranks by ``reduce_sum`` (an all-reduce at load, not per step) into the bias every rank
    holds and rank 0 adds. ``shard=None``: one rank holding every head."""
    import torch

    from oscar.serve.sharding import fold_o_proj_shard, head_shard  # local: keeps transformers out of import time

    attns = _attention_modules(model)
    if len(attns) != len(rotations):
        raise ValueError(f"{len(rotations)} layer rotations for a model with {len(attns)} attention layers")
    if shard is not None and not shard.whole and reduce_sum is None:
        raise ValueError(f"{shard.describe()}: the bias terms of the value means need a sum over the TP ranks "
                         "(reduce_sum)")
    centered, terms = [], []
    for layer, (attn, rot) in enumerate(zip(attns, rotations)):
        sh = shard if shard is not None else head_shard(0, 1, int(getattr(attn, "num_heads")), int(rot.r_v.shape[0]))
        _check_rank_heads(attn, sh, layer)
        o = attn.o_proj
        with torch.no_grad():
            folded, term = fold_o_proj_shard(o.weight.detach(), rot, sh)
            o.weight.copy_(folded)
        if term is not None:
            centered.append(o)
            terms.append(term)
    if terms:  # the same layers on every rank: each rank's slice of mu_V exists where the artifact's does
        total = torch.stack(terms)
        if reduce_sum is not None and shard is not None and not shard.whole:
            total = reduce_sum(total).to(total.device)
        for o, term in zip(centered, total):
            with torch.no_grad():
                base = torch.zeros_like(term) if o.bias is None else o.bias.detach().to(term.device, torch.float64)
                new_bias = (base + term).to(o.weight.dtype)
                if o.bias is None:
                    o.bias = torch.nn.Parameter(new_bias.to(o.weight.device), requires_grad=False)
                else:
                    o.bias.copy_(new_bias)
    return len(attns)


def create_backend(runner: Any) -> Any:
    """Factory registered as attention backend ``oscar``."""
    from oscar.serve.backend import OscarAttnBackend  # local: keeps sglang out of import time

    return OscarAttnBackend(runner)


def hooks(version: str) -> list[tuple[str, Any, Any]]:
    """(target, hook, kind name) of every hook the plugin registers under SGLang ``version``."""
    s = seams(version)
    pool_hook = build_mha_kv_pool_around if s.pool_hook_kind == "build" else resolve_kv_pool_class_around
    conf = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
    alloc = "sglang.srt.mem_cache.allocator"
    tree = {"finished": finished_before, "unfinished": unfinished_before, "checkpoint": checkpoint_before}
    return [
        (s.args_hook, serving_defaults_before, "BEFORE"),
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


__all__ = ["BACKEND", "MIN_CUDA_PAGE_SIZE", "REFUSED_PARALLELISM", "fold_model", "hooks", "rank_state", "register",
           "shard_state"]

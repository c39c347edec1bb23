"""Every SGLang symbol the plugin registers with, hooks or subclasses, with the signature it relies on, per version.

Two SGLang versions are supported by one plugin: 0.5.17 (the newest release pinned to torch 2.11, what the
H200 host runs) and 0.5.23 (the CPU CI). They differ in two seams, named by ``Seams``:

- the attention-backend CLI choices live in ``sglang.srt.server_args`` (0.5.17) or
  ``sglang.srt.arg_groups.choices`` (0.5.23);
- the MHA pool class is picked in ``KVCacheConfigurator._build_mha_kv_pool`` (0.5.17: the plugin swaps its
  ``mha_pool_class`` argument) or ``KVCacheConfigurator._resolve_kv_pool_class`` (0.5.23: the plugin
  returns its class for ``kind="mha"``).

Both versions drive the backend's metadata through ``init_forward_metadata_out_graph`` /
``init_forward_metadata_in_graph`` and ``init_cuda_graph_state`` (the decode CUDA-graph runner records
``in_graph`` inside the capture and replays it).

``check_contract()`` checks the installed SGLang by import (``tests/serve/test_contract.py``, and the GPU
script under 0.5.17); ``check_contract_source(root, version)`` checks an unpacked source tree without
importing it (parses the files), so that CI covers 0.5.17 on a CPU that cannot import it.
"""

from __future__ import annotations

import ast
import inspect
import pkgutil
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

SUPPORTED_VERSIONS = ("0.5.17", "0.5.23")
SGLANG_VERSION = "0.5.23"  # the CPU CI's pin (envs/serve-constraints.txt); the GPU host runs 0.5.17


@dataclass(frozen=True)
class Seams:
    """Where one SGLang version keeps the symbols that differ between versions."""

    choices_module: str  # holds ATTENTION_BACKEND_CHOICES and add_attention_backend_choices
    pool_hook: str  # the KVCacheConfigurator method the plugin hooks (AROUND) to put its pool in
    pool_hook_kind: str  # "build" (swap mha_pool_class) or "resolve" (return the class for kind="mha")
    tree_hooks: tuple[tuple[str, str], ...]  # (tree method, kind): where the radix tree takes a request's pages
    args_hook: str  # the ServerArgs method that runs before SGLang resolves its defaults (the serving defaults' seam)


_KVC = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_RADIX = "sglang.srt.mem_cache.radix_cache.RadixCache"
SEAMS = {
    # 0.5.17 resolves its arguments in ServerArgs.__post_init__; 0.5.23 leaves __post_init__ empty and resolves in
    # ServerArgs.resolve_once (called by the launchers)
    "0.5.17": Seams("sglang.srt.server_args", f"{_KVC}._build_mha_kv_pool", "build",
                    ((f"{_RADIX}.cache_finished_req", "finished"), (f"{_RADIX}.cache_unfinished_req", "unfinished")),
                    "sglang.srt.server_args.ServerArgs.__post_init__"),
    "0.5.23": Seams("sglang.srt.arg_groups.choices", f"{_KVC}._resolve_kv_pool_class", "resolve",
                    (("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint", "checkpoint"),),
                    "sglang.srt.server_args.ServerArgs.resolve_once"),
}
_POOL_HOOK_PARAMS = {"build": ["self", "max_total_num_tokens", "mha_pool_class"], "resolve": ["self", "kind", "default"]}
# the tree hooks read the request and how many of its positions the tree takes (a keyword argument)
_TREE_HOOK_PARAMS = {"finished": ["self", "req", "is_insert", "kv_len_to_handle"], "unfinished": ["self", "req"],
                     "checkpoint": ["self", "req", "up_to"]}

_BASE = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"
_MHA = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
_POOLCONF = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator"
# dotted path -> parameter names the plugin calls or receives, in order (None: existence only); both versions
COMMON: dict[str, Any] = {
    "sglang.srt.plugins.GENERAL_PLUGINS_GROUP": None,
    "sglang.srt.plugins.hook_registry.HookRegistry.register": ["target", "hook", "hook_type", "source"],
    "sglang.srt.plugins.hook_registry.HookRegistry.apply_hooks": None,
    "sglang.srt.plugins.hook_registry.HookType": None,
    "sglang.srt.layers.attention.attention_registry.register_attention_backend": ["name"],
    "sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS": None,
    "sglang.srt.server_args.ServerArgs.check_server_args": ["self"],
    f"{_POOLCONF}._compute_cell_size": ["self", "kvc", "num_layers"],
    f"{_POOLCONF}.calculate_pool_sizes": ["self", "available_bytes", "page_size"],
    "sglang.srt.model_executor.model_runner.ModelRunner.load_model": ["self"],
    "sglang.srt.runtime_context.get_parallel": None,
    # tensor parallelism: the rank's heads (oscar.serve.sharding) and the fold's one all-reduce at load
    "sglang.srt.runtime_context.ParallelContext.attn_tp_rank": None,
    "sglang.srt.runtime_context.ParallelContext.attn_tp_size": None,
    "sglang.srt.runtime_context.ParallelContext.attn_tp_group": None,
    "sglang.srt.runtime_context.get_schedule": None,
    f"{_MHA}.__init__": ["self", "size", "page_size", "dtype", "head_num", "head_dim", "layer_num", "device",
                         "enable_memory_saver"],
    f"{_MHA}._create_buffers": ["self"],
    f"{_MHA}.get_kv_size_bytes": ["self"],
    f"{_MHA}.set_kv_buffer": ["self", "layer", "loc_info", "cache_k", "cache_v"],
    f"{_BASE}.init_forward_metadata": ["self", "forward_batch"],
    f"{_BASE}.init_forward_metadata_out_graph": ["self", "forward_batch", "in_capture"],
    f"{_BASE}.init_forward_metadata_in_graph": ["self", "forward_batch"],
    f"{_BASE}.init_cuda_graph_state": ["self", "max_bs", "max_num_tokens"],
    f"{_BASE}.get_cuda_graph_seq_len_fill_value": ["self"],
    f"{_BASE}.forward_extend": ["self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"],
    f"{_BASE}.forward_decode": ["self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"],
    # the radix cache: the sink store's release and clear, the match cap
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids": ["self"],
    "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.clear": ["self"],
    "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free": ["self", "free_index"],
    "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.clear": ["self"],
    "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.get_kvcache": ["self"],
    "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len": ["self", "input_len"],
}
# attributes set in __init__ that the plugin reads (checked in the constructor's source)
INIT_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.__init__": ("req_to_token", "req_generation"),
    "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.__init__": ("_kvcache",),
    "sglang.srt.distributed.parallel_state.GroupCoordinator.__init__": ("cpu_group",),
}

# ForwardBatch fields the backend reads
FORWARD_BATCH_FIELDS = ("forward_mode", "batch_size", "req_pool_indices", "seq_lens", "seq_lens_cpu",
                        "extend_prefix_lens_cpu", "extend_seq_lens_cpu", "out_cache_loc")
# ServerArgs fields the start-up check reads
SERVER_ARGS_FIELDS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend", "model_path",
                      "trust_remote_code", "device", "tp_size", "pp_size", "dp_size", "dcp_size", "attn_cp_size",
                      "enable_prefill_cp", "enable_dp_attention",
                      "speculative_algorithm", "disable_radix_cache", "chunked_prefill_size", "enable_mixed_chunk",
                      "disable_cuda_graph", "max_running_requests", "kv_cache_dtype", "enable_hierarchical_cache",
                      "disaggregation_mode", "page_size")
_CLASSES = {"sglang.srt.model_executor.forward_batch_info.ForwardBatch": FORWARD_BATCH_FIELDS,
            "sglang.srt.server_args.ServerArgs": SERVER_ARGS_FIELDS}


def seams(version: str) -> Seams:
    """The seams of SGLang ``version``; refuses an unsupported version, naming the supported ones."""
    if version not in SEAMS:
        raise RuntimeError(f"sglang {version} is installed; the oscar plugin supports {', '.join(SUPPORTED_VERSIONS)}")
    return SEAMS[version]


def signatures(version: str) -> dict[str, Any]:
    """Dotted path -> expected leading parameter names (None: existence only) for ``version``."""
    s = seams(version)
    return {**COMMON, f"{s.choices_module}.ATTENTION_BACKEND_CHOICES": None,
            f"{s.choices_module}.add_attention_backend_choices": None,
            s.pool_hook: _POOL_HOOK_PARAMS[s.pool_hook_kind], s.args_hook: ["self"],
            **{target: _TREE_HOOK_PARAMS[kind] for target, kind in s.tree_hooks}}


def _assigned_attributes(fn: ast.AST) -> set[str]:
    """Names ``x`` of every ``self.x = ...`` / ``self.x: T = ...`` in a function's body."""
    out = set()
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        out |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    return out


def _missing_attributes(path: str, fn: Optional[ast.AST], names: tuple[str, ...]) -> list[str]:
    if fn is None:
        return [f"{path}: missing"]
    have = _assigned_attributes(fn)
    return [f"{path}: does not set self.{n}" for n in names if n not in have]


def _compare(path: str, got: list[str], expected: list[str]) -> list[str]:
    return [] if got[: len(expected)] == expected else [f"{path}: parameters {got}, expected to start with {expected}"]


def _params(obj: Any) -> list[str]:
    sig = inspect.signature(obj)
    return [p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def check_contract(version: Optional[str] = None) -> list[str]:
    """Problems with the installed SGLang (empty when every symbol exists with the expected signature)."""
    import sglang

    installed = str(sglang.__version__)
    version = version or installed
    if installed != version or version not in SEAMS:
        return [f"sglang {installed} is installed; the oscar plugin supports {', '.join(SUPPORTED_VERSIONS)}"
                + (f" (asked to check {version})" if version != installed else "")]
    problems = []
    for path, expected in signatures(version).items():
        try:
            obj = pkgutil.resolve_name(path)
        except (ImportError, AttributeError) as err:
            problems.append(f"{path}: missing ({err})")
            continue
        if expected is not None:
            problems += _compare(path, _params(obj), expected)
    for path, names in INIT_ATTRIBUTES.items():
        try:
            fn: Optional[ast.AST] = ast.parse(textwrap.dedent(inspect.getsource(pkgutil.resolve_name(path))))
        except (ImportError, AttributeError, OSError, TypeError):
            fn = None
        problems += _missing_attributes(path, fn, names)
    # ForwardBatch is a dataclass, ServerArgs a msgspec struct: both list their fields in the constructor
    for cls_path, fields in _CLASSES.items():
        cls = pkgutil.resolve_name(cls_path)
        names = set(inspect.signature(cls).parameters) | set(getattr(cls, "__annotations__", {}))
        problems += [f"{cls.__name__}.{f}: missing field" for f in fields if f not in names]
    return problems


# -- the same check on an unpacked source tree (no import) --------------------------------------------


def _find_module(root: Path, parts: list[str]) -> tuple[Optional[Path], list[str]]:
    for n in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:n])
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.is_file():
                return cand, parts[n:]
    return None, parts


def _lookup(body: list[ast.stmt], name: str) -> Optional[ast.AST]:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return node
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return node
    return None


def _ast_params(fn: ast.AST) -> list[str]:
    a = fn.args  # type: ignore[attr-defined]
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    bound = any(isinstance(d, ast.Name) and d.id == "classmethod" for d in fn.decorator_list)  # type: ignore[attr-defined]
    return names[1:] if bound else names  # as inspect.signature shows a classmethod


def _resolve_source(root: Path, path: str) -> tuple[Optional[ast.AST], str]:
    file, rest = _find_module(root, path.split("."))
    if file is None:
        return None, "no such module"
    if not rest:
        return ast.parse(file.read_text()), ""
    node: Optional[ast.AST] = ast.parse(file.read_text())
    for name in rest:
        node = _lookup(getattr(node, "body", []), name)
        if node is None:
            return None, f"{name} not found in {file.relative_to(root)}"
    return node, ""


def check_contract_source(root: str | Path, version: str) -> list[str]:
    """``check_contract`` on an unpacked SGLang ``version`` under ``root`` (the folder holding ``sglang/``),
    from the source files alone: symbols and their parameters, and the fields of ForwardBatch and ServerArgs."""
    root = Path(root)
    ver_file = root / "sglang" / "_version.py"
    problems = []
    if ver_file.is_file():
        text = ver_file.read_text()
        if f'"{version}"' not in text and f"'{version}'" not in text:
            problems.append(f"{ver_file}: not sglang {version}")
    for path, expected in signatures(version).items():
        node, why = _resolve_source(root, path)
        if node is None:
            problems.append(f"{path}: missing ({why})")
            continue
        if expected is not None:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                problems.append(f"{path}: not a function in the sources")
                continue
            problems += _compare(path, _ast_params(node), expected)
    for path, names in INIT_ATTRIBUTES.items():
        node, _ = _resolve_source(root, path)
        problems += _missing_attributes(path, node, names)
    for cls_path, fields in _CLASSES.items():
        node, why = _resolve_source(root, cls_path)
        if not isinstance(node, ast.ClassDef):
            problems.append(f"{cls_path}: missing ({why})")
            continue
        names = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        problems += [f"{node.name}.{f}: missing field" for f in fields if f not in names]
    return problems


__all__ = ["COMMON", "FORWARD_BATCH_FIELDS", "INIT_ATTRIBUTES", "SEAMS", "SERVER_ARGS_FIELDS", "SGLANG_VERSION", "SUPPORTED_VERSIONS",
           "Seams", "check_contract", "check_contract_source", "seams", "signatures"]

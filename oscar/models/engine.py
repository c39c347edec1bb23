"""Engine facade (docs/DESIGN.md, "Engine API"): a model + a KV-cache method, ready to generate and score.

`Engine.from_config(cfg)` loads the model, builds the method's per-(layer, KV head) rotations, means
and clip ratios (in code for the methods without calibration, from the calibration artifact for
the others), switches the model to the "oscar" attention, and, when it owns the model, folds the
value rotations into `o_proj`. Every call makes a fresh cache.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from oscar.cache import attention
from oscar.cache.formats import CacheFormat, FormatNotServed
from oscar.core.artifact import artifact_dir, load_artifact
from oscar.cache.rotations import LayerRotations
from oscar.cache.torch_cache import CacheSpec, OscarCache
from oscar.cache.torch_cache import cache_spec as format_cache_spec
from oscar.models.adapters import check_supported, layer_windows
from oscar.models import methods
from oscar.models.generate import SamplingParams, cache_kwarg, generate_continuous, generate_tokens, positions_from_mask, truncate_at_stop
from oscar.models.loading import load_model
from oscar.models.methods import clip_mode, in_code_artifact, needs_statistics
from oscar.models.surgery import fold_value_rotations

class MethodNotSupported(NotImplementedError):
    """A method whose cache the embedded engine cannot build."""


def _geometry(model: Any) -> tuple[int, int, int, int]:
    cfg = model.config
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return layers, heads, hkv, d


def effective_group_size(method_cfg: Any, head_dim: int) -> int:
    """`min(method.group_size, head_dim)` (docs/DESIGN.md, "Effective group size")."""
    return int(methods.effective_group_size(method_cfg, head_dim))


def layer_rotations(artifact: Any) -> list[LayerRotations]:
    """Per-layer cache state from a `CalibrationArtifact` (all-zero means become "no centering")."""
    out = []
    for layer in range(artifact.num_layers):
        t = artifact.layer(layer)
        mu_k, mu_v = t["mu_K"], t["mu_V"]
        rope = artifact.key_rope(layer)  # (RopeSpec, pre-RoPE means) of rope-centered key heads, or None
        out.append(
            LayerRotations(
                t["R_K"].float(),
                t["R_V"].float(),
                None if mu_k is None or not bool(mu_k.any()) else mu_k.float(),
                None if mu_v is None or not bool(mu_v.any()) else mu_v.float(),
                t["rho_K"].float(),
                t["rho_V"].float(),
                None if rope is None else rope[1].float(),
                None if rope is None else rope[0],
                artifact.key_block(layer),
            )
        )
    return out


def rotations_in_code(method_cfg: Any, model: Any) -> list[LayerRotations]:
    """Per-layer rotations of a method that needs no calibration (identity, H, block H, random ...)."""
    layers, _, hkv, d = _geometry(model)
    return layer_rotations(in_code_artifact(method_cfg, num_layers=layers, num_kv_heads=hkv, head_dim=d))


def rotations_from_artifact(path: Path, method_cfg: Any, model: Any) -> list[LayerRotations]:
    """Per-layer rotations, means and clip ratios from a calibration artifact directory (checked
    against the model's geometry, group size, bits and the method settings it was made with)."""
    _, _, _, d = _geometry(model)
    if not (path / "rotations.safetensors").exists():
        raise FileNotFoundError(
            f"calibration artifact {path} is missing; create it with: "
            f"python -m oscar calibrate model=<model> method={method_cfg.name}"
        )
    art = load_artifact(path, model=model, group_size=effective_group_size(method_cfg, d), bits=int(method_cfg.bits),
                        method=method_cfg)
    return layer_rotations(art)


def new_cache(model: Any, spec: CacheSpec) -> OscarCache:
    """An empty torch cache of ``spec`` for ``model`` (whose attention implementation must be "oscar"), with the
    model's sliding-window layers (`oscar.models.adapters.layer_windows`)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "oscar":
        raise ValueError(
            f"the model's attention implementation is {impl!r}; the OSCAR cache needs 'oscar' "
            "(call oscar.cache.attention.enable(model) first)"
        )
    check_supported(model)
    return OscarCache(spec, int(model.config.num_hidden_layers), layer_windows(model))


def method_format(method_cfg: Any, model: Any) -> CacheFormat:
    """The cache format (`oscar.cache.formats`) of a method on ``model`` (its head_dim fixes the group)."""
    return CacheFormat.from_method(method_cfg, _geometry(model)[3])


def cache_spec(
    method_cfg: Any,
    model: Any,
    rotations: Optional[list[LayerRotations]] = None,
    *,
    mode: str = "serving",
    fold_values: bool = False,
    backend: str = "torch",
) -> CacheSpec:
    """The cache configuration of a method on a model: its `oscar.cache.formats.CacheFormat` (the one
    translation of a method into a storage format) with this engine's rotations and run-time choices."""
    fmt = method_format(method_cfg, model)
    try:
        fmt.check_served("torch")
    except FormatNotServed as err:
        raise MethodNotSupported(f"method {method_cfg.name!r}: {err}") from None
    if fmt.rotated and rotations is None:
        rotations = rotations_in_code(method_cfg, model)
    return format_cache_spec(fmt, rotations, fold_values=fold_values, mode=mode, backend=backend)


class Engine:
    """A causal LM with a KV-cache method: generation, scoring and log-likelihoods."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        method_cfg: Any,
        rotations: Optional[list[LayerRotations]] = None,
        *,
        fold_values: bool = False,
        backend: str = "torch",
    ):
        self.model = model
        self.backend = backend
        self.tokenizer = tokenizer
        self.method = method_cfg
        attention.enable(model)
        self.format = method_format(method_cfg, model)
        if self.format.rotated and rotations is None:
            if needs_statistics(method_cfg):
                raise ValueError(
                    f"method {method_cfg.name!r} (clip policy {clip_mode(method_cfg)!r}) needs calibration: pass rotations, "
                    "use Engine.from_config, or choose method.clip=none|fixed|paper"
                )
            rotations = rotations_in_code(method_cfg, model)
        self.rotations = rotations
        self.fold_handle = None
        self.fold_values = bool(fold_values and self.format.rotated)
        if self.fold_values:
            self.fold_handle = fold_value_rotations(model, rotations)  # type: ignore[arg-type]
        self.device = next(model.parameters()).device
        self.reset_perf()

    @classmethod
    def from_config(cls, cfg: Any, *, fold_values: bool = True) -> "Engine":
        """Load `cfg.model` on `cfg.device` and set up `cfg.method` (artifact from `cfg.artifacts_dir`)."""
        model, tokenizer = load_model(cfg.model, device=str(cfg.device) if str(cfg.device) != "auto" else None)
        method = cfg.method
        rotations = None
        if method_format(method, model).rotated:
            if needs_statistics(method):
                rotations = rotations_from_artifact(artifact_dir(cfg), method, model)
            else:
                rotations = rotations_in_code(method, model)
        return cls(model, tokenizer, method, rotations, fold_values=fold_values, backend=str(cfg.backend))

    def new_cache(self, mode: str = "serving") -> OscarCache:
        """A fresh cache of this engine's method."""
        spec = cache_spec(self.method, self.model, self.rotations, mode=mode, fold_values=self.fold_values, backend=self.backend)
        return new_cache(self.model, spec)

    # -- scoring ------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, mode: str = "serving", attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits `[B, T, V]` of one teacher-forced pass through a fresh cache.

        `serving`: a normal prefill (full precision inside the pass); `decode_equivalent`: every
        position sees the quantized history exactly as it would while decoding token by token.
        """
        ids = input_ids.to(self.device)
        if ids.dim() == 1:
            ids = ids[None]
        mask = None if attention_mask is None else attention_mask.to(self.device)
        pos = positions_from_mask(mask) if mask is not None else None
        cache = self.new_cache(mode)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kwarg(self.model): cache})
        return out.logits

    @torch.no_grad()
    def loglikelihood(self, contexts: Sequence[str], continuations: Sequence[str], mode: str = "serving",
                      batch_size: int = 1) -> list[tuple[float, bool]]:
        """Sum of log-probabilities of each continuation given its context, and whether greedy decoding
        would produce it. With `batch_size > 1` requests of similar length are scored together, left-padded
        (each row sees only its own tokens: the padding mask travels with the pass): faster, but a padded
        row's float32 sums run in another order, which the cache's BF16/INT rounding can amplify (SmolLM2:
        up to ~1% of a log-probability), so a score then depends slightly on its batch-mates. The default,
        one request at a time, is batch-invariant."""
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        requests = [self._request(ctx, cont) for ctx, cont in zip(contexts, continuations)]
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        pad = self.tokenizer.pad_token_id
        pad = int(pad if pad is not None else (self.tokenizer.eos_token_id or 0))
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(requests[i][0]) for i in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                full = requests[i][0]
                ids[r, width - len(full):] = torch.tensor(full)
                mask[r, width - len(full):] = 1
            logits = self.score(ids, mode=mode, attention_mask=None if bool(mask.all()) else mask).float()
            for r, i in enumerate(rows):
                full, n_ctx = requests[i]
                off = width - len(full)
                logp = torch.log_softmax(logits[r, off + n_ctx - 1 : off + len(full) - 1], dim=-1)
                target = torch.tensor(full[n_ctx:], device=logp.device)
                results[i] = (float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(dim=-1) == target).all()))
        return results

    def _request(self, ctx: str, cont: str) -> tuple[list[int], int]:
        """Token ids of context + continuation and the number of context tokens (a BOS in front when the
        context is empty), refusing a continuation that adds no token."""
        ctx_ids = self.tokenizer(ctx, add_special_tokens=False)["input_ids"] if ctx else []
        full = self.tokenizer(ctx + cont, add_special_tokens=False)["input_ids"]
        n_ctx = _common_prefix(ctx_ids, full)
        if n_ctx == len(full):
            raise ValueError(f"continuation {cont!r} adds no token to its context")
        if n_ctx == 0:
            bos = self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id
            full, n_ctx = [int(bos)] + full, 1
        return list(full), n_ctx

    # -- generation ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: Optional[Sequence[str]] = None,
    ) -> list[str]:
        """Complete each prompt (batched, left-padded); text after a stop string is cut."""
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop or ()))
        encoded, eos_ids, pad, decode = self._encode(prompts)
        stats: dict = {}
        outs = generate_tokens(self.model, encoded, params, self.new_cache, eos_ids, pad, decode, stats=stats)
        self._account(stats)
        if "kv_bits_per_element" in stats:
            self.perf["kv_bits"].append(stats["kv_bits_per_element"])
        texts = [decode(o) for o in outs]
        return [truncate_at_stop(t, params.stop) for t in texts]

    def generate_stream(
        self,
        prompts: Sequence[str],
        on_done: Callable[[int, str, dict], None],
        max_batch: int = 8,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        stop: Optional[Sequence[str]] = None,
    ) -> list[str]:
        """Complete each prompt with continuous batching (`oscar.models.generate.generate_continuous`: up to
        `max_batch` requests per decode step, finished ones replaced by waiting ones); `on_done(i, text,
        info)` is called as prompt `i` finishes (`info["kv_bits_per_element"]`: its cache rows, measured)."""
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, tuple(stop or ()))
        encoded, eos_ids, pad, decode = self._encode(prompts)
        texts: list[str] = [""] * len(prompts)

        def finished(i: int, ids: list[int], info: dict) -> None:
            texts[i] = truncate_at_stop(decode(ids), params.stop)
            if "kv_bits_per_element" in info:
                self.perf["kv_bits"].append(info["kv_bits_per_element"])
            on_done(i, texts[i], info)

        stats: dict = {}
        generate_continuous(self.model, encoded, params, self.new_cache, eos_ids, pad, decode, max_batch=max_batch,
                            on_done=finished, stats=stats)
        self._account(stats)
        return texts

    def _encode(self, prompts: Sequence[str]) -> tuple[list[list[int]], list[int], int, Callable[[list[int]], str]]:
        """Token ids of the prompts, the EOS ids (tokenizer and generation config), the pad id and a decoder."""
        tok = self.tokenizer
        encoded = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
        eos_ids = eos_token_ids(tok, self.model)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
        return encoded, eos_ids, int(pad), lambda ids: tok.decode(ids, skip_special_tokens=True)

    def _account(self, stats: dict) -> None:
        for key in ("prefill_s", "prefill_tokens", "decode_s", "decode_steps", "row_steps"):
            self.perf[key] += stats.get(key, 0)

    def reset_perf(self) -> None:
        """Start new timing and cache-size accounting for `perf_metrics` (generation calls only)."""
        self.perf: dict[str, Any] = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_steps": 0,
                                     "row_steps": 0, "kv_bits": []}

    def perf_metrics(self) -> dict[str, float]:
        """Generation measured since `reset_perf`: `perf.decode_ms` (wall ms per batched decode step),
        `perf.prefill_ms_per_token`, `mem.kv_bits_per_element` (cache bits per stored K/V element at the
        end of each call, averaged over calls). Empty before any generation."""
        p = self.perf
        out: dict[str, float] = {}
        if p["decode_steps"]:
            out["perf.decode_ms"] = 1e3 * p["decode_s"] / p["decode_steps"]
            if p["row_steps"]:  # continuous batching: mean requests per decode step
                out["perf.batch_occupancy"] = p["row_steps"] / p["decode_steps"]
        if p["prefill_tokens"]:
            out["perf.prefill_ms_per_token"] = 1e3 * p["prefill_s"] / p["prefill_tokens"]
        if p["kv_bits"]:
            out["mem.kv_bits_per_element"] = sum(p["kv_bits"]) / len(p["kv_bits"])
        return out

    def close(self) -> None:
        """Undo the o_proj surgery (the model is usable with other caches again)."""
        if self.fold_handle is not None:
            self.fold_handle.undo()
            self.fold_handle = None


def eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokens that end a generation: the tokenizer's EOS and the model's generation-config EOS ids."""
    eos = tokenizer.eos_token_id
    ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
    return ids


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def next_token_kl(logits_ref: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(ref || method) of next-token distributions, float64 `[..., T]`."""
    lp_ref = torch.log_softmax(logits_ref.double(), dim=-1)
    lp = torch.log_softmax(logits.double(), dim=-1)
    return (lp_ref.exp() * (lp_ref - lp)).sum(dim=-1)


def perplexity(logits: torch.Tensor, input_ids: torch.Tensor) -> float:
    """exp of the mean next-token cross-entropy of `input_ids` under `logits` `[B, T, V]`."""
    lp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    nll = -lp.gather(-1, input_ids[:, 1:, None].to(lp.device)).squeeze(-1)
    return math.exp(float(nll.mean()))


__all__ = [
    "Engine",
    "MethodNotSupported",
    "method_format",
    "new_cache",
    "artifact_dir",
    "cache_spec",
    "effective_group_size",
    "eos_token_ids",
    "next_token_kl",
    "perplexity",
    "rotations_from_artifact",
    "rotations_in_code",
]


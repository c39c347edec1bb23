"""``engine=sglang`` for the evaluation runner: the cell's model and method served by an SGLang server.

``SGLangEngine`` has the runner's engine interface (``tokenizer``, ``device``, ``generate``,
``loglikelihood``, ``close``) and sends each batch as one OpenAI-compatible request (``/v1/completions``
with a list of prompts; scoring through SGLang's native ``/generate`` with input log-probabilities).
The method maps to the server: the BF16 format -> ``--attention-backend flashinfer`` on a GPU (SGLang's default GPU
backend; ``torch_native`` on the CPU); a format the SGLang
pool serves (`oscar.cache.formats.served_kinds("pool")`) -> ``--attention-backend oscar`` with the artifact
the embedded engine would use (``artifact_dir``, or, for methods without calibration, the same rotations built
in code and written to a temporary folder). The server takes its cache format from the artifact's
``meta.json``; only windows that differ from the artifact's are passed (``OSCAR_SINK``/``OSCAR_RECENT``).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

from oscar.cache.formats import CacheFormat, served_kinds, with_key_blocks
from oscar.core.artifact import artifact_dir, config_hash_of, model_config_fields, read_meta, save_artifact
from oscar.models.loading import dense_dir, load_model
from oscar.models.methods import in_code_artifact, needs_statistics
from oscar.serve.server import SGLangServer, ServerError
from oscar.serve.reuse import ENV_PREFILL_STAGE, ENV_PREFIX_REUSE, PREFILL_STAGE_MIB, PREFIX_REUSE


def model_path(model_cfg: Any) -> str:
    """What SGLang loads: the dense copy of an offline (GGUF) model, made on first use, or the ``hf_id``."""
    if bool(model_cfg.offline):
        path = dense_dir(model_cfg)
        if not (path / "config.json").exists():
            load_model(model_cfg, device="cpu")  # dequantizes the GGUF once and writes the dense copy
        return str(path)
    if not model_cfg.hf_id:
        raise ValueError(f"model {model_cfg.name!r} has neither an offline package nor an hf_id to serve")
    return str(model_cfg.hf_id)


def _in_code_artifact(cfg: Any, path: str, out: Path) -> Path:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path)
    f = model_config_fields(hf)
    art = in_code_artifact(cfg.method, num_layers=f["num_layers"], num_kv_heads=f["num_kv_heads"],
                           head_dim=f["head_dim"], model_id=str(cfg.model.name), config_hash=config_hash_of(hf))
    save_artifact(art, out)
    return out


def pool_format(fmt: Any, head_dim: int) -> Any:
    """The format the SGLang pool serves for a method's format: the format itself, or the paged twin of a simulated
    format that has one (KIVI-2 -> per-channel key pages, `KiviFormat.served`)."""
    if fmt.quantized and "pool" not in fmt.served_by and hasattr(fmt, "served"):
        return fmt.served(head_dim)
    return fmt


def served_windows(fmt: Any, artifact: Path) -> dict[str, str]:
    """``OSCAR_SINK``/``OSCAR_RECENT`` for the windows of ``fmt`` (the pool's format of the method, `pool_format`)
    that differ from the artifact's recorded format as the pool serves it (the server reads the rest from the
    artifact); refuses an artifact of another kind, bits or group. An `auto` artifact whose layers chose
    per-channel keys (``key_block``) serves the per-channel format of the method's candidates."""
    meta = read_meta(artifact)
    recorded = CacheFormat.of_artifact(meta)
    head_dim = int(meta["model"]["head_dim"])
    served = pool_format(recorded, head_dim)
    fmt = with_key_blocks(fmt, meta)
    if (served.kind, served.bits, served.group_size) != (fmt.kind, fmt.bits, fmt.group_size):
        raise ValueError(f"artifact {artifact} was calibrated for the {served.kind} format INT{served.bits} group "
                         f"{served.group_size}, but method {fmt.name!r} asks for {fmt.kind} INT{fmt.bits} group "
                         f"{fmt.group_size}; recalibrate (python -m oscar calibrate ... force=true)")
    return {name: str(mine) for name, mine, theirs in (("OSCAR_SINK", fmt.sink, served.sink),
                                                       ("OSCAR_RECENT", fmt.recent, served.recent)) if mine != theirs}


def _device(cfg: Any) -> str:
    dev = str(cfg.engine.device if cfg.engine.device != "auto" else cfg.device)
    if dev == "auto":
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
    return dev.split(":")[0]


def served_config(e: Any, device: str) -> dict[str, Any]:
    """What the server runs with: ``cuda_graph`` (decode CUDA graphs), ``radix`` (the prefix cache),
    ``chunked_prefill_size`` (None: SGLang's default), ``prefix_reuse`` (``OSCAR_PREFIX_REUSE`` of the oscar
    backend: ``exact``, the default, or ``quantized``) and ``prefill_stage_mib`` (``OSCAR_PREFILL_STAGE_MIB``: MiB of
    BF16 rows a chunked prefill keeps of its earlier chunks; ``auto``: the plugin's default). ``auto`` (the default of each) is the production configuration
    on a GPU (graphs on, radix on, SGLang's chunked prefill) and, on the CPU, graphs off (SGLang has none there), the
    radix cache off and one prefill chunk (the CPU engine's comparisons with the embedded engine); ``false`` /
    ``true`` / a size override either (``engine.cuda_graph=false`` is the debug switch)."""
    def value(name: str, default: Any = "auto") -> Any:
        return e.get(name, default) if hasattr(e, "get") else getattr(e, name, default)

    def flag(name: str, on_gpu: bool, on_cpu: bool) -> bool:
        v = value(name)
        if str(v) == "auto":
            return on_gpu if device == "cuda" else on_cpu
        if not isinstance(v, bool):
            raise ValueError(f"engine.{name}={v!r} is not valid; choose auto, true or false")
        return v

    chunk = value("chunked_prefill_size")
    if str(chunk) == "auto":
        chunk = None if device == "cuda" else -1
    elif not isinstance(chunk, int):
        raise ValueError(f"engine.chunked_prefill_size={chunk!r} is not valid; choose auto or a number of tokens "
                         "(-1: one chunk)")
    reuse = str(value("prefix_reuse", PREFIX_REUSE[0]))
    if reuse not in PREFIX_REUSE:
        raise ValueError(f"engine.prefix_reuse={reuse!r} is not valid; choose one of {', '.join(PREFIX_REUSE)}")
    stage = value("prefill_stage_mib")
    if str(stage) == "auto":
        stage = PREFILL_STAGE_MIB
    elif not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
        raise ValueError(f"engine.prefill_stage_mib={stage!r} is not valid; choose auto or MiB >= 0 (0: off)")
    return {"cuda_graph": flag("cuda_graph", True, False) and device == "cuda", "radix": flag("radix", True, False),
            "chunked_prefill_size": chunk, "prefix_reuse": reuse, "prefill_stage_mib": int(stage)}


class SGLangEngine:
    """The runner's engine, backed by an SGLang server that lives as long as this object (``close``)."""

    def __init__(self, cfg: Any, log_path: Optional[Path] = None) -> None:
        from transformers import AutoTokenizer


        e = cfg.engine
        fmt = pool_format(CacheFormat.from_method(cfg.method, int(cfg.model.head_dim)), int(cfg.model.head_dim))
        if fmt.quantized and "pool" not in fmt.served_by:
            raise NotImplementedError(f"engine=sglang serves the bf16 format and the formats of the SGLang pool "
                                      f"({', '.join(served_kinds('pool'))}); method {cfg.method.name!r} has the "
                                      f"{fmt.kind} format (use engine=embedded)")
        self.cfg = cfg
        self.device = _device(cfg)
        self.last_info: list[dict[str, Any]] = []  # per prompt of the last `generate`: bits per element, steps
        if self.device == "cuda" and str(cfg.model.dtype) == "float32":
            raise ValueError("engine=sglang on a GPU serves BF16/FP16 models: SGLang's CUDA RMSNorm has no float32 kernel "
                             f"(got model.dtype={cfg.model.dtype}); set model.dtype=bfloat16 (float32 serves on device=cpu)")
        self.path = model_path(cfg.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self._tmp: Optional[str] = None
        env: dict[str, str] = {}
        self.served = served_config(e, self.device)
        args = ["--device", self.device, "--dtype", str(cfg.model.dtype), "--max-running-requests",
                str(int(e.max_running_requests)), "--random-seed", str(int(cfg.seed)),
                "--context-length", str(int(cfg.model.max_context))]
        if str(e.mem_fraction_static) != "default":
            args += ["--mem-fraction-static", str(float(e.mem_fraction_static))]
        if not self.served["radix"]:
            args += ["--disable-radix-cache"]
        if self.served["chunked_prefill_size"] is not None:
            args += ["--chunked-prefill-size", str(self.served["chunked_prefill_size"])]
        if e.max_total_tokens:
            args += ["--max-total-tokens", str(int(e.max_total_tokens))]
        if self.device == "cuda" and not self.served["cuda_graph"]:
            args += ["--disable-cuda-graph"]
        if not fmt.quantized:
            args += ["--attention-backend", "flashinfer" if self.device == "cuda" else "torch_native"]
        else:
            if self.device == "cuda" and self.served["cuda_graph"]:
                args += ["--disable-prefill-cuda-graph"]  # the plugin captures decode only (oscar.serve.plugin)
            if needs_statistics(cfg.method):  # the clip policy decides too (clip=fit needs statistics)
                art = artifact_dir(cfg)
                if not (art / "rotations.safetensors").exists():
                    raise FileNotFoundError(f"calibration artifact {art} is missing; create it with: "
                                            f"python -m oscar calibrate model={cfg.model.name} method={cfg.method.name}")
            else:
                self._tmp = tempfile.mkdtemp(prefix="oscar-sglang-")
                art = _in_code_artifact(cfg, self.path, Path(self._tmp) / "artifact")
            env = {"OSCAR_ARTIFACT": str(art), "OSCAR_KERNELS": str(cfg.backend), **served_windows(fmt, art),
                   ENV_PREFIX_REUSE: self.served["prefix_reuse"],
                   ENV_PREFILL_STAGE: str(self.served["prefill_stage_mib"])}
            fmt = with_key_blocks(fmt, read_meta(art))  # per-channel key layers of an `auto` artifact
            args += ["--attention-backend", "oscar"]
        self.format = fmt  # the format the pool serves (windows as served), for `request_info`
        args += [str(a) for a in e.extra_args]
        self.server = SGLangServer(self.path, args, env=env, python=str(e.python), host=str(e.host), port=int(e.port),
                                   startup_timeout_s=float(e.startup_timeout_s), log_path=log_path)
        self.timeout_s = float(e.request_timeout_s)
        try:
            self.server.start()
        except BaseException:
            self._cleanup()
            raise

    # -- the runner's interface ---------------------------------------------------------------------

    def generate(self, prompts: Sequence[str], max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop: Optional[Sequence[str]] = None) -> list[str]:
        """One batched ``/v1/completions`` request for all prompts (same sampling settings and seed)."""
        payload: dict[str, Any] = {"model": self.path, "prompt": list(prompts), "max_tokens": int(max_new_tokens),
                                   "temperature": float(temperature), "top_p": float(top_p),
                                   "top_k": int(top_k) if top_k else -1, "seed": int(seed)}
        if stop:
            payload["stop"] = list(stop)
        out = self.server.post("/v1/completions", payload, timeout_s=self.timeout_s)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise ServerError(f"/v1/completions returned {len(choices)} choices for {len(prompts)} prompts")
        texts = [c["text"] for c in choices]
        self.last_info = [self.request_info(p, t) for p, t in zip(prompts, texts)]
        return texts

    def request_info(self, prompt: str, text: str) -> dict[str, Any]:
        """``kv_bits_per_element`` of a finished request: the served format's accounting
        (`CacheFormat.expected_bits`) at the request's length, prompt tokens plus the completion's tokens as the
        tokenizer counts them (the server tokenizes the same prompt; a completion's retokenization can differ from
        the sampled ids by a token at a merge); ``steps``: those completion tokens."""
        n_prompt = len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        steps = len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0
        bits = self.format.expected_bits(n_prompt + steps, int(self.cfg.model.head_dim))
        return {"kv_bits_per_element": float(bits), "steps": steps, "cuda_graph": self.served["cuda_graph"],
                "radix": self.served["radix"],
                # what a radix hit reuses (OSCAR_PREFIX_REUSE); "-" for SGLang's own BF16 cache (hits read BF16)
                "prefix_reuse": self.served["prefix_reuse"] if self.format.quantized else "-",
                # MiB of its own earlier chunks a chunked prefill reads as BF16 (OSCAR_PREFILL_STAGE_MIB); "-" for BF16
                "prefill_stage_mib": self.served["prefill_stage_mib"] if self.format.quantized else "-"}

    def loglikelihood(self, contexts: Sequence[str], continuations: Sequence[str], mode: str = "serving",
                      batch_size: int = 1) -> list[tuple[float, bool]]:
        """Sum of log-probabilities of each continuation after its context, and whether it is greedy; one
        batched ``/generate`` request (prefill only) with input-token log-probabilities."""
        from oscar.models.engine import Engine  # local: keeps transformers out of import time

        if mode != "serving":
            raise ValueError(f"engine=sglang scores with the serving semantics only (score_mode=serving); got {mode!r}. "
                             "Use engine=embedded for decode_equivalent scoring")
        if len(contexts) != len(continuations):
            raise ValueError(f"{len(contexts)} contexts but {len(continuations)} continuations")
        # the embedded engine's tokenization of (context, continuation), so both engines score the same ids
        reqs = [Engine._request(self, c, k) for c, k in zip(contexts, continuations)]  # type: ignore[arg-type]
        payload = {"input_ids": [full for full, _ in reqs], "return_logprob": True, "top_logprobs_num": 1,
                   # SGLang returns None for the token at logprob_start_len (no context before it in that window)
                   "logprob_start_len": [n_ctx - 1 for _, n_ctx in reqs],
                   "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}
        outs = self.server.post("/generate", payload, timeout_s=self.timeout_s)
        results = []
        for (full, n_ctx), out in zip(reqs, outs):
            meta = out["meta_info"]
            lps = meta["input_token_logprobs"][1:]
            tops = meta["input_top_logprobs"][1:]
            want = full[n_ctx:]
            if [int(t[1]) for t in lps] != want:
                raise ServerError(f"/generate returned log-probabilities for tokens {[t[1] for t in lps]}, "
                                  f"expected the continuation {want}")
            greedy = all(int(top[0][1]) == tok for top, tok in zip(tops, want))
            results.append((float(sum(t[0] for t in lps)), greedy))
        return results

    def close(self) -> None:
        """Stop the server (its whole process group) and remove the temporary artifact."""
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["SGLangEngine", "model_path", "served_windows"]

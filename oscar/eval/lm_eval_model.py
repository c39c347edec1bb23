"""lm-eval model `oscar`: Hugging Face causal LM whose every forward pass goes through an OSCAR KV cache.

Any lm-eval task runs with any KV-cache method:
`lm_eval --model oscar --model_args model=smollm2-135m,method=quarot,score_mode=decode_equivalent --tasks ...`
(after `import oscar.eval.lm_eval_model`, or with the `lm_eval.models` entry point declared in
pyproject). Importing this module registers the class with lm-eval's model registry, which is
the module's purpose. Log-likelihood requests are scored with `Engine.score` in the chosen mode;
generation uses the engine's sampler with a fresh cache per batch.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from oscar.config import compose
from oscar.eval.fidelity import MODES
from oscar.models.engine import Engine
from oscar.models.generate import SamplingParams, generate_tokens


@register_model("oscar")
class OscarLM(HFLM):
    """HFLM over an `oscar.models.engine.Engine` (model + KV-cache method)."""

    def __init__(self, model: str = "smollm2-135m", method: str = "oscar", score_mode: str = "serving",
                 overrides: str = "", engine: Any = None, **kwargs: Any) -> None:
        """Compose `model=`, `method=` and extra Hydra `overrides` (space separated), or take a ready `engine`."""
        if score_mode not in MODES:
            raise ValueError(f"score_mode={score_mode!r}; valid: {', '.join(MODES)}")
        if engine is None:
            cfg = compose([f"model={model}", f"method={method}", *overrides.split()])
            engine = Engine.from_config(cfg)
        self.engine = engine
        self.score_mode = score_mode
        kwargs.setdefault("device", str(engine.device))
        super().__init__(pretrained=engine.model, tokenizer=engine.tokenizer, **kwargs)

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[B, T, V]` of right-padded requests through a fresh OSCAR cache."""
        if attn_mask is not None or labels is not None:
            raise ValueError("OscarLM supports decoder-only (causal) models only")
        return self.engine.score(inps, mode=self.score_mode)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> torch.Tensor:
        """Continue left-padded `context` rows; returns `[B, ctx + new]` token ids like HFLM."""
        mask = generation_kwargs.pop("attention_mask", None)
        rows = []
        for b in range(context.shape[0]):
            row = context[b]
            if mask is not None:
                row = row[mask[b].bool()]
            rows.append(row.tolist())
        temperature = float(generation_kwargs.get("temperature", 0.0) or 0.0)
        if generation_kwargs.get("do_sample") is False:
            temperature = 0.0
        params = SamplingParams(max_new_tokens=max(0, int(max_length) - int(context.shape[1])),
                                temperature=temperature, top_p=float(generation_kwargs.get("top_p", 1.0) or 1.0),
                                top_k=int(generation_kwargs.get("top_k", 0) or 0),
                                seed=int(generation_kwargs.get("seed", 0) or 0), stop=tuple(stop or ()))
        tok = self.tokenizer
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else 0)
        outs = generate_tokens(self.engine.model, rows, params, self.engine.new_cache, eos, pad,
                               lambda ids: tok.decode(ids, skip_special_tokens=True))
        width = max((len(o) for o in outs), default=0)
        new = torch.full((len(outs), width), pad, dtype=torch.long)
        for b, o in enumerate(outs):
            new[b, :len(o)] = torch.tensor(o, dtype=torch.long)
        return torch.cat([context.cpu(), new], dim=1)

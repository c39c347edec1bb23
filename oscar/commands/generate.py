"""`python -m oscar generate [overrides] prompt="..." [prompt_file=...] [max_new_tokens=64] [temperature=0]
[top_p=1] [top_k=0] [gen_seed=0] [stop=...] [chat=true]`: text generation with a KV-cache method.

The model and method come from the Hydra configuration (`model=... method=...`); calibrated methods
read their artifact from `<artifacts_dir>/<model>/<method>/` (`python -m oscar calibrate`). Each
line of `prompt_file` is one prompt of the batch. With `output=<path>`, the completions are also
written as JSON lines (atomically).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from oscar.commands._stage import pop_flags
from oscar.config import compose
from oscar.core.files import atomic_write_text

FLAGS: dict[str, Any] = {
    "prompt": "",
    "prompt_file": "",
    "max_new_tokens": 64,
    "temperature": "0",
    "top_p": "1.0",
    "top_k": 0,
    "gen_seed": 0,
    "stop": "",
    "chat": False,
}


def _prompts(flags: dict[str, Any]) -> list[str]:
    if flags["prompt_file"]:
        lines = Path(flags["prompt_file"]).read_text().splitlines()
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = [flags["prompt"]] if flags["prompt"] else []
    if not prompts:
        raise ValueError('no prompt given: pass prompt="..." or prompt_file=<path with one prompt per line>')
    return prompts


def _apply_chat(tokenizer: Any, prompts: list[str]) -> list[str]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat=true but the tokenizer has no chat template; use chat=false")
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


def main(argv: list[str]) -> int:
    """Compose the configuration, build the engine, generate, print (and optionally write) completions."""
    # local: keeps transformers out of import time
    from oscar.models.engine import Engine

    try:
        flags, overrides = pop_flags(argv, FLAGS)
        cfg = compose(overrides)
        prompts = _prompts(flags)
        temperature, top_p = float(flags["temperature"]), float(flags["top_p"])
    except (ValueError, OSError) as exc:
        print(f"oscar generate: {exc}", file=sys.stderr)
        return 2
    if cfg.engine.name != "embedded":
        print(f"oscar generate: engine={cfg.engine.name} is not supported here; serve with sglang.launch_server "
              "(README, Serving with SGLang) or evaluate with `oscar eval engine=sglang`", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        engine = Engine.from_config(cfg)
        texts = _apply_chat(engine.tokenizer, prompts) if flags["chat"] else prompts
        outs = engine.generate(
            texts,
            max_new_tokens=int(flags["max_new_tokens"]),
            temperature=temperature,
            top_p=top_p,
            top_k=int(flags["top_k"]),
            seed=int(flags["gen_seed"]),
            stop=[flags["stop"]] if flags["stop"] else None,
        )
    except (FileNotFoundError, ValueError, NotImplementedError) as exc:
        print(f"oscar generate: {exc}", file=sys.stderr)
        return 1
    for prompt, out in zip(prompts, outs):
        print(f"### {prompt}\n{out}\n")
    perf = engine.perf_metrics()
    measured = ", ".join(f"{k} {v:.3g}" for k, v in perf.items())
    print(f"generate: {cfg.model.name} / {cfg.method.name}, {len(prompts)} prompt(s) in {time.perf_counter() - t0:.1f} s"
          + (f" ({measured})" if measured else ""), file=sys.stderr)
    if cfg.output:
        atomic_write_text(Path(str(cfg.output)), "".join(
            json.dumps({"model": str(cfg.model.name), "method": str(cfg.method.name), "prompt": prompt,
                        "completion": out, **perf}) + "\n" for prompt, out in zip(prompts, outs)))
    return 0

"""Helpers of the serving tests: the SGLang driver, in-code artifacts, the embedded engine's greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

DRIVER = Path(__file__).with_name("sgl_driver.py")
SMOLLM2_DENSE = Path(os.environ.get("OSCAR_CACHE_DIR", Path.home() / ".cache" / "oscar")) / "models" / "smollm2-135m" / "dense"


def run_driver(runs: list[dict[str, Any]], tmp: Path, timeout: float = 900) -> tuple[dict[str, Any], str]:
    """Run `sgl_driver.py` on `runs` in a fresh process; returns (results by run name, its log)."""
    spec, out = tmp / "spec.json", tmp / "out.json"
    spec.write_text(json.dumps({"runs": runs}))
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    proc = subprocess.run([sys.executable, str(DRIVER), str(spec), str(out)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"sgl_driver failed (exit {proc.returncode}):\n{log[-6000:]}")
    return json.loads(out.read_text()), log


def save_in_code_artifact(model_dir: Path, method: str, out: Path) -> Path:
    """The artifact of a method that needs no calibration (int2: identity, quarot: Hadamard) for a local model.

    `method.clip=paper` selects the published, unclipped baseline: under the default fair clip policy
    (`fit`) these methods fit their clip on calibration statistics like every other row."""
    from transformers import AutoConfig

    from oscar.artifact import config_hash_of, model_config_fields, save_artifact
    from oscar.config import compose
    from oscar.methods import in_code_artifact

    hf = AutoConfig.from_pretrained(str(model_dir))
    f = model_config_fields(hf)
    cfg = compose([f"method={method}", "method.clip=paper"])
    art = in_code_artifact(cfg.method, num_layers=f["num_layers"], num_kv_heads=f["num_kv_heads"],
                           head_dim=f["head_dim"], model_id=str(model_dir), config_hash=config_hash_of(hf))
    save_artifact(art, out)
    return out


def embedded_greedy(model: Any, method: str, artifact: Path, sink: int, recent: int, prompts: list[list[int]],
                    max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the embedded engine (oscar.engine, value rotation folded) for each prompt alone."""
    from oscar.config import compose
    from oscar.engine import Engine, rotations_from_artifact
    from oscar.generate import SamplingParams, generate_tokens

    cfg = compose([f"method={method}", "method.clip=paper", f"method.sink={sink}", f"method.recent={recent}"])
    rotations = rotations_from_artifact(artifact, cfg.method, model)
    engine = Engine(model, None, cfg.method, rotations, fold_values=True)
    try:
        params = SamplingParams(max_new_tokens, 0.0, 1.0, 0, 0, ())
        out = []
        for ids in prompts:
            toks = generate_tokens(model, [ids], params, engine.new_cache, [], 0)
            out.append([int(t) for t in toks[0]])
        return out
    finally:
        engine.close()



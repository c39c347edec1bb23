"""Helpers of the serving tests: the SGLang driver, in-code artifacts, the embedded engine's greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# the tolerances of an INT2 comparison across engines and the teacher-forced check: oscar.bench.correctness.compare (shared
# with the GPU correctness table; it says where the bounds come from)
from oscar.bench.correctness.compare import (INT2_LOGPROB_TOL, INT2_MEDIAN_TOL, check_teacher_forced,  # noqa: F401
                                       save_in_code_artifact)

DRIVER = Path(__file__).with_name("sgl_driver.py")
SMOLLM2_DENSE = Path(os.environ.get("OSCAR_CACHE_DIR", Path.home() / ".cache" / "oscar")) / "models" / "smollm2-135m" / "dense"


def run_driver(runs: list[dict[str, Any]], tmp: Path, timeout: float | None = None) -> tuple[dict[str, Any], str]:
    """Run `sgl_driver.py` on `runs` in a fresh process; returns (results by run name, its log). `timeout`
    defaults to $OSCAR_SERVE_DRIVER_TIMEOUT or 900 s (a loaded shared CPU starts SGLang engines slowly)."""
    timeout = float(timeout or os.environ.get("OSCAR_SERVE_DRIVER_TIMEOUT", 900))
    spec, out = tmp / "spec.json", tmp / "out.json"
    spec.write_text(json.dumps({"runs": runs}))
    # the driver imports the plugin of this checkout (not whichever `oscar` the environment has installed)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(DRIVER), str(spec), str(out)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"sgl_driver failed (exit {proc.returncode}):\n{log[-6000:]}")
    return json.loads(out.read_text()), log


def embedded_greedy(model: Any, method: str, artifact: Path, sink: int, recent: int, prompts: list[list[int]],
                    max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the embedded engine (oscar.models.engine, value rotation folded) for each prompt alone."""
    from oscar.config import compose
    from oscar.models.engine import Engine, rotations_from_artifact
    from oscar.models.generate import SamplingParams, generate_tokens

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


def embedded_forced_logprobs(model: Any, method: str, artifact: Path, sink: int, recent: int,
                             prompts: list[list[int]], forced: list[list[int]],
                             overrides: tuple[str, ...] = ("method.clip=paper",)) -> list[Any]:
    """Teacher-forced next-token log-probabilities of the embedded engine (value rotation folded) along
    `forced` (`oscar.models.generate.forced_logprobs`: the decode path, through the quantized cache); `overrides`:
    method settings the artifact was made with (default: the unclipped in-code artifacts)."""
    from oscar.config import compose
    from oscar.models.engine import Engine, rotations_from_artifact
    from oscar.models.generate import forced_logprobs

    cfg = compose([f"method={method}", *overrides, f"method.sink={sink}", f"method.recent={recent}"])
    engine = Engine(model, None, cfg.method, rotations_from_artifact(artifact, cfg.method, model), fold_values=True)
    try:
        return [forced_logprobs(model, ids, toks, engine.new_cache) for ids, toks in zip(prompts, forced)]
    finally:
        engine.close()

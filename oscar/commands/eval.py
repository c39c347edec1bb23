"""`python -m oscar eval [flags] [hydra overrides]`: one (model, method, benchmark, seed) cell.

Writes `output=DIR/{result.json,items.jsonl}` (the workflow gives its cell folder); without
`output=`, ad-hoc runs go to `results/adhoc/eval/<model>/<method>/<benchmark>/seed<k>/`, which no
workflow table reads.
Verb flags (not Hydra keys): `force=true` reruns a finished cell; `progress=false` hides the bar;
`threads=N` sets torch's CPU threads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from oscar.commands._stage import pop_flags, read_json
from oscar.commands.eval_shared import main as shared
from oscar.config import ConfigError, compose
from oscar.eval.cells import KEPT_FILE, RESULT_FILE, cell_config_hash, cell_dir, engine_name
from oscar.eval.items import DataNotAvailable
from oscar.eval.runner import run_cell
from oscar.serve.client import SGLangEngine
from oscar.serve.server import ServerError

FLAGS = {"force": False, "progress": True, "threads": 0}


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def build_engine(cfg: Any, log_path: Path | None = None) -> Any:
    """The cell's engine: `oscar.models.engine.Engine` in this process, or (`engine=sglang`) an SGLang server with
    the oscar plugin (`oscar.serve.client.SGLangEngine`; stop it with `close()`)."""
    if engine_name(cfg) == "sglang":
        return SGLangEngine(cfg, log_path=log_path)
    # local: keeps transformers out of import time
    from oscar.models.engine import Engine

    return Engine.from_config(cfg)


def main(argv: list[str]) -> int:
    """Run one evaluation cell; 0 on success, 2 on a configuration or data error, 3 when the SGLang server
    (engine=sglang) fails to start or refuses a request."""
    try:
        flags, overrides = pop_flags(argv, FLAGS)
        cfg = compose(overrides)
    except (ConfigError, ValueError) as exc:
        print(f"oscar eval: {exc}", file=sys.stderr)
        return 2
    out = cell_dir(cfg)
    previous = read_json(out / RESULT_FILE)
    if previous and previous.get("config_hash") == cell_config_hash(cfg) and not flags["force"]:
        print(f"oscar eval: {out} is up to date (force=true reruns it)", file=sys.stderr)
        print(json.dumps(previous["metrics"], sort_keys=True))
        return 0
    if flags["force"]:  # recompute every item, not only what a finished run did not keep
        (out / KEPT_FILE).unlink(missing_ok=True)
    import signal

    import torch

    if flags["threads"]:
        torch.set_num_threads(int(flags["threads"]))
    if engine_name(cfg) != "embedded":  # a kill of this job must still stop the server (via close below)
        signal.signal(signal.SIGTERM, _raise_exit)
    if cfg.benchmark.extra.get("shared_prefill", False):  # the procedure of `oscar eval-shared`, for one method

        return shared(argv)
    engine = None
    try:
        engine = build_engine(cfg, log_path=out / "server.log" if engine_name(cfg) != "embedded" else None)
        result = run_cell(cfg, engine, out, progress=bool(flags["progress"]))
    except (DataNotAvailable, FileNotFoundError) as exc:
        print(f"oscar eval: {exc}", file=sys.stderr)
        return 2
    except ServerError as exc:
        print(f"oscar eval: {exc}", file=sys.stderr)
        return 3
    finally:
        if engine is not None and callable(getattr(engine, "close", None)) and engine_name(cfg) != "embedded":
            engine.close()
    label = f" (stand-in for {result['stand_in_for']})" if result["stand_in_for"] else ""
    print(f"oscar eval: {cfg.model.name} / {cfg.method.name} / {cfg.benchmark.name}{label} seed {cfg.seed}: "
          f"n={result['n']} {json.dumps(result['metrics'], sort_keys=True)} in {result['wall_s']:.1f}s -> {out}",
          file=sys.stderr)
    print(json.dumps(result["metrics"], sort_keys=True))
    return 0

"""`python -m oscar eval-shared [flags] CELL -- CELL ...`: needle cells of several methods, one BF16 prefill per haystack.

Each CELL is the Hydra overrides of one eval cell (with its `output=DIR`), cells separated by `--`; they must
share the model, the benchmark (a `niah`-family one) and the seed, and differ in the method. Every haystack
runs through the model once; each method's cache is filled from its rows, then the question and the answer
are decoded token by token through that cache (`oscar.eval.shared_prefill`). Each cell folder gets its own
`result.json` / `items.jsonl`, and `items.partial.jsonl` while running (an interrupted run resumes per item).
Verb flags: `force=true` reruns finished cells; `progress=false` hides the per-item lines; `threads=N` sets
torch's CPU threads.

    python -m oscar eval-shared threads=1 model=qwen2.5-coder-0.5b method=bf16 benchmark=niah output=/tmp/a \\
        -- model=qwen2.5-coder-0.5b method=int2 benchmark=niah output=/tmp/b
"""

from __future__ import annotations

import json
import sys

from oscar.commands._stage import pop_flags, read_json
from oscar.config import ConfigError, compose
from oscar.eval.cells import RESULT_FILE, cell_config_hash, cell_dir
from oscar.eval.items import DataNotAvailable

FLAGS = {"force": False, "progress": True, "threads": 0}


def split_cells(argv: list[str]) -> list[list[str]]:
    """The argument groups between `--` separators (empty groups refused)."""
    cells: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--":
            cells.append([])
        else:
            cells[-1].append(arg)
    if any(not c for c in cells):
        raise ConfigError(f"eval-shared: an empty cell between '--' separators in {argv}; give each cell its overrides")
    return cells


def main(argv: list[str]) -> int:
    """Run the cells; 0 on success (or all up to date), 2 on a configuration or data error."""
    try:
        flags, rest = pop_flags(argv, FLAGS)
        cfgs = [compose(cell) for cell in split_cells(rest)]
        # local: keeps transformers out of import time
        from oscar.eval.shared_prefill import check_group

        check_group(cfgs)
    except (ConfigError, ValueError) as exc:
        print(f"oscar eval-shared: {exc}", file=sys.stderr)
        return 2
    outs = [cell_dir(cfg) for cfg in cfgs]
    stale = [i for i, (cfg, out) in enumerate(zip(cfgs, outs))
             if flags["force"] or (read_json(out / RESULT_FILE) or {}).get("config_hash") != cell_config_hash(cfg)]
    if not stale:
        print(f"oscar eval-shared: all {len(cfgs)} cells are up to date (force=true reruns them)", file=sys.stderr)
        return 0
    import torch

    # local: keeps transformers out of import time
    from oscar.eval.shared_prefill import run_cells

    if flags["threads"]:
        torch.set_num_threads(int(flags["threads"]))
    try:
        results = run_cells([cfgs[i] for i in stale], [outs[i] for i in stale], progress=bool(flags["progress"]),
                            log=lambda line: print(line, file=sys.stderr, flush=True), force=bool(flags["force"]))
    except (DataNotAvailable, FileNotFoundError) as exc:
        print(f"oscar eval-shared: {exc}", file=sys.stderr)
        return 2
    for i, result in zip(stale, results):
        print(f"oscar eval-shared: {cfgs[i].model.name} / {cfgs[i].method.name} / {cfgs[i].benchmark.name}: "
              f"n={result['n']} {json.dumps(result['metrics'], sort_keys=True)} -> {outs[i]}", file=sys.stderr)
    return 0

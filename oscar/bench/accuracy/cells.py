"""The accuracy table's cells: the ``python -m oscar eval-shared`` cells of each ``table=`` (embedded engine) and the
``python -m oscar eval engine=sglang`` command of each served variant, with the page size SGLang serves it at.

Light (no omegaconf: a method's settings are read from its YAML file as text), shared by the spec and the report.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from oscar.bench.host import ROOT

# engine=sglang: one SGLang server per cell (BF16 model: SGLang's CUDA RMSNorm has no float32), batches of 64 prompts
# The production configuration (oscar.serve.client.served_config: decode CUDA graphs, the radix cache, SGLang's chunked
# prefill and memory fraction); the offline bundle has no flashinfer sampling and no grammar backend, hence the two
# flags; the client adds --disable-prefill-cuda-graph for the oscar backend (it captures decode only)
SERVED_ARGS = ["model.dtype=bfloat16", "backend=triton", "engine.mem_fraction_static=default",
               "engine.max_total_tokens=null", "engine.max_running_requests=64",
               "engine.extra_args=[--page-size,16,--sampling-backend,pytorch,--grammar-backend,none]"]
CELLS = {
    "niah": (["benchmark=niah", "benchmark.context_lengths=[4096,8192]", "benchmark.extra.samples_per_length=32",
              "benchmark.max_new_tokens=12", "+benchmark.extra.shared_prefill=true", "seed=0"],
             "bf16=method=bf16;int2=method=int2;kivi2=method=kivi2;auto=method=auto"),
    # RULER's niah_multikey_1 on the essays haystack: 4 keyed needles (distractors), one queried, at long contexts
    "niah_multikey": (["benchmark=ruler_niah_multikey", "benchmark.context_lengths=[16384,32768]",
                       "benchmark.extra.samples_per_length=32", "benchmark.max_new_tokens=12",
                       "+benchmark.extra.shared_prefill=true", "seed=0"],
                      "bf16=method=bf16;kivi2=method=kivi2;auto=method=auto"),
    "humaneval": (["benchmark=humaneval", "benchmark.limit=164", "benchmark.max_new_tokens=384",
                   "benchmark.temperature=0.0", "benchmark.batch_size=64", "+benchmark.extra.continuous=true",
                   "+benchmark.extra.answer_start=function", "+benchmark.extra.stop=['```']",
                   "+benchmark.extra.shared_prefill=true", "seed=0"],
                  "bf16=method=bf16 method.sink=16 method.recent=64;kivi2=method=kivi2 method.sink=16 "
                  "method.recent=64;auto=method=auto method.sink=16 method.recent=64"),
}
# engine=sglang: KIVI-2's key groups and `auto`'s per-channel key blocks of 32 tokens live in pages of 32 whose sink
# is whole pages, so at the HumanEval windows they serve at sink 0 (`served_page`); the other cells as above
SERVED_CELLS = {t: v.replace("kivi2=method=kivi2 method.sink=16 ", "kivi2=method=kivi2 method.sink=0 ")
                .replace("auto=method=auto method.sink=16 ", "auto=method=auto method.sink=0 ")
                for t, (_, v) in CELLS.items()}
CONF_DIR = ROOT / "conf"  # oscar.config.CONF_DIR without importing omegaconf
NIAH_TABLES = ("niah", "niah_multikey")  # needle tables: rows per context length; `lengths=` / `samples=` apply


def base_args(opts: dict[str, Any]) -> list[str]:
    """The table's fixed overrides, with a needle table's ``lengths=`` (comma-separated context lengths in tokens)
    and ``samples=`` (needles per length) in place of its defaults."""
    table = str(opts["table"])
    base = list(CELLS[table][0])
    if table not in NIAH_TABLES:
        for key in ("lengths", "samples"):
            if opts.get(key):
                raise ValueError(f"{key}={opts[key]}: only the needle tables ({', '.join(NIAH_TABLES)}) take it")
        return base
    if opts.get("lengths"):
        try:
            lengths = [int(x) for x in str(opts["lengths"]).split(",") if x.strip()]
        except ValueError:
            lengths = []
        if not lengths or min(lengths) < 1024:
            raise ValueError(f"lengths={opts['lengths']!r}: comma-separated context lengths of at least 1024 tokens "
                             "(e.g. lengths=4096,8192,16384,32768)")
        base = [a if not a.startswith("benchmark.context_lengths=") else
                f"benchmark.context_lengths=[{','.join(map(str, lengths))}]" for a in base]
    if opts.get("samples"):
        if not str(opts["samples"]).isdigit() or int(opts["samples"]) < 1:
            raise ValueError(f"samples={opts['samples']!r}: a positive number of needles per context length")
        base = [a if not a.startswith("benchmark.extra.samples_per_length=") else
                f"benchmark.extra.samples_per_length={int(opts['samples'])}" for a in base]
    return base


def stem(opts: dict[str, Any]) -> str:
    return str(opts["table"]) + ("_served" if opts.get("engine") == "sglang" else "")


def variants(opts: dict[str, Any]) -> list[tuple[str, list[str]]]:
    if opts["table"] not in CELLS:
        raise ValueError(f"table={opts['table']!r}; valid: {', '.join(CELLS)}")
    spec = str(opts["variants"] or (SERVED_CELLS if opts.get("engine") == "sglang" else {}).get(opts["table"])
               or CELLS[opts["table"]][1])
    out = []
    for item in (x.strip() for x in spec.split(";") if x.strip()):
        name, sep, overrides = item.partition("=")
        if not sep or not overrides.strip():
            raise ValueError(f"variants: {item!r} is not NAME=OVERRIDES (e.g. auto=method=auto method.sink=16)")
        out.append((name.strip(), overrides.split()))
    return out


def methods(opts: dict[str, Any]) -> list[str]:
    found = []
    for _, over in variants(opts):
        found += [o.split("=", 1)[1] for o in over if o.startswith("method=")]
    return sorted(set(found))


def cell_args(opts: dict[str, Any]) -> list[str]:
    """The ``python -m oscar eval-shared`` arguments: one cell per variant, separated by ``--``."""
    args: list[str] = []
    base = base_args(opts)
    for i, (name, over) in enumerate(variants(opts)):
        output = f"{opts['results']}/eval/{opts['model']}/{name}/{opts['table']}/seed0"
        args += (["--"] if i else []) + [f"model={opts['model']}", *base, *over, "device=cuda",
                                         "tracking.enabled=false", f"results_dir={opts['results']}", f"output={output}"]
    return args


def served_output(opts: dict[str, Any], name: str) -> Path:
    """Where the served cell of a variant writes (the engine is part of its configuration hash)."""
    return Path(f"{opts['results']}/eval/{opts['model']}/{name}/{opts['table']}_sglang/seed0")


def served_page(over: list[str]) -> int:
    """SGLang's --page-size for a variant: its ``page=N``, else the smallest of 16, 32, 64, ... that holds one
    per-channel key block (``method.channel_block``, or KIVI-2's ``method.group_size``; from the method's
    ``conf/method/<name>.yaml`` unless the variant overrides them) with a sink (``method.sink``) of whole pages."""
    opts = dict(o.split("=", 1) for o in over if "=" in o)
    if "page" in opts:
        return int(opts["page"])
    conf = CONF_DIR / "method" / f"{opts.get('method', '')}.yaml"
    base = _yaml_scalars(conf) if conf.is_file() else {}
    get = lambda key, default: opts.get(f"method.{key}", base.get(key, default))  # noqa: E731
    block = int(get("group_size", 32)) if base.get("kind") == "kivi" else int(get("channel_block", 0))
    sink = int(get("sink", 64))  # MethodConfig's default where the method's file sets none
    page = 16
    while page < block:
        page *= 2
    if block and sink % page:
        raise ValueError(f"variant {' '.join(over)!r}: not servable: a page must hold a key block of {block} tokens "
                         f"(pages of {page}) and the sink must be whole pages, but method.sink={sink}; valid sinks: "
                         f"0, {page}, {2 * page}, ...")
    return page


UNCALIBRATED_METHODS = ("bf16", "kivi2", "int2")  # methods that read no calibration artifact
DEFAULT_WINDOWS = (64, 256)  # MethodConfig's sink / recent where neither the method's file nor the variant sets them


def variant_settings(over: list[str]) -> dict[str, str]:
    """What a served variant ran with, from its overrides and its method's ``conf/method/<name>.yaml``: ``windows``
    (``sink/recent`` BF16 tokens; ``-`` for bf16, where every row is BF16) and ``calibration`` (the calibration
    corpus, ``default`` where the variant names none; ``-`` for methods that read no artifact)."""
    opts = dict(o.split("=", 1) for o in over if "=" in o)
    method = opts.get("method", "")
    conf = CONF_DIR / "method" / f"{method}.yaml"
    base = _yaml_scalars(conf) if conf.is_file() else {}
    sink = opts.get("method.sink", base.get("sink", DEFAULT_WINDOWS[0]))
    recent = opts.get("method.recent", base.get("recent", DEFAULT_WINDOWS[1]))
    return {"windows": "-" if method == "bf16" else f"{sink}/{recent}",
            "calibration": "-" if method in UNCALIBRATED_METHODS else opts.get("calibration", "default")}


def _yaml_scalars(path: Path) -> dict[str, str]:
    """The top-level ``key: value`` scalars of a method's YAML file (no omegaconf: `gpu --help` stays light)."""
    out = {}
    for line in path.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#") and ":" in line:
            key, _, value = line.partition(":")
            value = value.split("#", 1)[0].strip()
            if value:
                out[key.strip()] = value
    return out


def served_commands(opts: dict[str, Any], python: str) -> list[list[str]]:
    """One ``python -m oscar eval engine=sglang`` per variant (run one after the other: one server at a time)."""
    base = [a for a in base_args(opts) if "shared_prefill" not in a]
    out = []
    for name, over in variants(opts):
        page = served_page(over)  # SGLang's --page-size for the cell: `page=N` or what its key block needs
        args = [a.replace("--page-size,16,", f"--page-size,{page},") for a in SERVED_ARGS]
        out.append([sys.executable, "-m", "oscar", "eval", "engine=sglang", f"engine.python={python}",
                    f"model={opts['model']}", *base, *[o for o in over if not o.startswith("page=")], "device=cuda",
                    *args, "tracking.enabled=false", "progress=false", f"results_dir={opts['results']}",
                    f"output={served_output(opts, name)}"])
    return out

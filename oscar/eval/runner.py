"""One evaluation cell (model, method, benchmark, seed) -> result.json + items.jsonl (DESIGN "Result files").

Items are processed in batches; each finished record is appended to `items.partial.jsonl`, so an
interrupted cell resumes where it stopped (records are reused only when their prompt and the cell's
configuration hash match). The final files are written atomically and the partial file removed.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from oscar.eval.items import EvalItem, prompt_hash, select
from oscar.eval.prompts import render
from oscar.eval.registry import load_items
from oscar.core.files import atomic_write_text

RESULT_FILE = "result.json"
ITEMS_FILE = "items.jsonl"
PARTIAL_FILE = "items.partial.jsonl"
# A finished cell's records with their configuration hash, outside the workflow's declared outputs: Snakemake
# deletes a job's outputs before it runs the job again (a shared-prefill job rerun for one missing cell deletes
# the finished cells' items.jsonl / result.json), and the cell then resumes from these instead of recomputing.
KEPT_FILE = "items.kept.jsonl"


def cell_dir(cfg: Any) -> Path:
    """`cfg.output` when given (the workflow always gives its cell folder), else the ad-hoc folder
    `results/adhoc/eval/<model>/<method>/<benchmark>/seed<k>/`, which no workflow table reads."""
    if cfg.get("output"):
        return Path(cfg.output)
    return Path(cfg.results_dir) / "adhoc" / "eval" / cfg.model.name / cfg.method.name / cfg.benchmark.name / f"seed{cfg.seed}"


def cell_config_hash(cfg: Any) -> str:
    """Hash of everything that changes a cell's outputs (model, method, benchmark, calibration, seed)."""
    from omegaconf import OmegaConf

    from oscar.config import config_hash

    bench = OmegaConf.to_container(cfg.benchmark, resolve=True)
    bench.pop("batch_size", None)  # batching does not change the outputs
    from oscar.eval.shared_prefill import shares_outputs

    if shares_outputs(cfg.benchmark):  # nor does one prefill per prompt shared by the methods of a stream
        (bench.get("extra") or {}).pop("shared_prefill", None)
    part = {"model": OmegaConf.to_container(cfg.model, resolve=True),
            "method": OmegaConf.to_container(cfg.method, resolve=True), "benchmark": bench,
            "calibration": OmegaConf.to_container(cfg.calibration, resolve=True), "seed": int(cfg.seed)}
    if engine_name(cfg) != "embedded":  # another engine is another cell (embedded hashes stay as they were)
        part["engine"] = engine_name(cfg)
    return config_hash(part)


def engine_name(cfg: Any) -> str:
    """`cfg.engine.name` (embedded when the configuration has no engine group)."""
    engine = cfg.get("engine") if hasattr(cfg, "get") else None
    return str(engine.name) if engine is not None else "embedded"


def build_engine(cfg: Any, log_path: Path | None = None) -> Any:
    """The cell's engine: `oscar.models.engine.Engine` in this process, or (`engine=sglang`) an SGLang server with
    the oscar plugin (`oscar.serve.client.SGLangEngine`; stop it with `close()`)."""
    if engine_name(cfg) == "sglang":
        from oscar.serve.client import SGLangEngine

        return SGLangEngine(cfg, log_path=log_path)
    from oscar.models.engine import Engine

    return Engine.from_config(cfg)


def git_commit() -> str | None:
    """HEAD commit of the source tree, or None outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def hardware(device: str) -> dict:
    """Short description of where the cell ran."""
    import torch

    info = {"device": str(device), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or None}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def _read_partial(path: Path, chash: str) -> dict[str, dict]:
    """The records of this configuration (`chash`) a cell already holds: those kept by a finished run of it
    (`KEPT_FILE`, beside `path`), then the partial file `path` of a run that was interrupted."""
    done: dict[str, dict] = {}
    for source in (path.parent / KEPT_FILE, path):
        if not source.is_file():
            continue
        for line in source.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut by an interruption
            if rec.get("_config_hash") == chash:
                done[rec["id"]] = rec
    return done


# ------------------------------------------------------------------------------------ per family

def _rendered(engine: Any, cfg: Any, item: EvalItem, prefix: str = "") -> str:
    return render(getattr(engine, "tokenizer", None), item.prompt, item.system,
                  use_chat=bool(cfg.model.chat_template), assistant_prefix=prefix)


def _sampling(cfg: Any) -> dict:
    b = cfg.benchmark
    return {"max_new_tokens": int(b.max_new_tokens), "temperature": float(b.temperature), "top_p": float(b.top_p),
            "top_k": int(b.top_k), "seed": int(cfg.seed)}


def _run_generate(engine: Any, cfg: Any, prompts: list[str], stop: list[str] | None = None) -> list[str]:
    outs = engine.generate(prompts, stop=stop, **_sampling(cfg))
    if len(outs) != len(prompts):
        raise RuntimeError(f"engine.generate returned {len(outs)} outputs for {len(prompts)} prompts")
    return list(outs)


def _choice_loglikelihoods(engine: Any, contexts: list[str], conts: list[str], mode: str) -> list[float]:
    """Log-likelihood of each continuation; one scoring pass per distinct context when every
    continuation is a single token appended to its context (else `engine.loglikelihood`)."""
    import torch

    tok = getattr(engine, "tokenizer", None)
    if tok is None or not hasattr(engine, "score"):
        return [lp for lp, _ in engine.loglikelihood(contexts, conts, mode=mode)]
    plan: dict[str, tuple[list[int], dict[str, int]]] = {}
    for ctx, cont in zip(contexts, conts):
        ctx_ids = tok(ctx, add_special_tokens=False)["input_ids"]
        full = tok(ctx + cont, add_special_tokens=False)["input_ids"]
        if not ctx_ids or len(full) != len(ctx_ids) + 1 or full[:-1] != ctx_ids:
            return [lp for lp, _ in engine.loglikelihood(contexts, conts, mode=mode)]
        plan.setdefault(ctx, (ctx_ids, {}))[1][cont] = full[-1]
    out: dict[tuple[str, str], float] = {}
    for ctx, (ids, targets) in plan.items():
        logits = engine.score(torch.tensor([ids]), mode=mode)[0, -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        for cont, token in targets.items():
            out[(ctx, cont)] = float(logp[token])
    return [out[(c, k)] for c, k in zip(contexts, conts)]


def process_batch(engine: Any, cfg: Any, items: list[EvalItem]) -> list[dict]:
    """Run and grade one batch of items; one record per item."""
    family = cfg.benchmark.family
    extra = cfg.benchmark.extra
    records: list[dict] = []
    if family == "multiple_choice" and extra.get("mode", "loglikelihood") == "loglikelihood":
        mode = extra.get("score_mode", "decode_equivalent")
        contexts, conts, owners = [], [], []
        for item in items:
            ctx = _rendered(engine, cfg, item, extra.get("answer_prefix", ""))
            for letter in "ABCD"[: item.meta.get("num_choices", 4)]:
                contexts.append(ctx)
                conts.append(extra.get("choice_prefix", "") + letter)
                owners.append(item.id)
        scores = _choice_loglikelihoods(engine, contexts, conts, mode)
        for item in items:
            ctx = _rendered(engine, cfg, item, extra.get("answer_prefix", ""))
            lls = [float(s) for s, o in zip(scores, owners) if o == item.id]
            pred = "ABCD"[max(range(len(lls)), key=lambda i: lls[i])]
            records.append({"id": item.id, "prompt_hash": prompt_hash(ctx), "prediction": pred,
                            "target": item.target, "correct": pred == item.target, "loglikelihoods": lls,
                            "score_mode": mode})
        return records
    prompts = [generation_prompt(engine, cfg, item) for item in items]
    outs = _run_generate(engine, cfg, prompts, stop=list(extra.get("stop", [])) or None)
    return [grade_generation(cfg, item, prompt, out) for item, prompt, out in zip(items, prompts, outs)]


ANSWER_STARTS = ("", "code_block", "function")


def answer_start(cfg: Any, item: EvalItem) -> str:
    """Opening words of the assistant's answer (`benchmark.extra.answer_start`): "" (none), `code_block`
    ("```python", EvalPlus's instruct prompting) or `function` (the code block opened with the item's
    signature and docstring, `meta["code_prompt"]`); they are part of the graded answer."""
    start = str(cfg.benchmark.extra.get("answer_start", "") or "")
    if start not in ANSWER_STARTS:
        raise ValueError(f"benchmark.extra.answer_start={start!r} is not valid; valid: {', '.join(map(repr, ANSWER_STARTS))}")
    if start == "code_block":
        return "```python"
    if start == "function":
        if "code_prompt" not in item.meta:
            raise ValueError(f"benchmark.extra.answer_start=function needs code items with a code prompt; {item.id} has none")
        return "```python\n" + item.meta["code_prompt"]
    return ""


def generation_prompt(engine: Any, cfg: Any, item: EvalItem) -> str:
    """Rendered prompt of a generated (not scored) item: the chat template, then the assistant's opening
    words (NIAH's answer prefix, or `answer_start`)."""
    if cfg.benchmark.family == "niah":
        return _rendered(engine, cfg, item, item.meta.get("answer_prefix", ""))
    start = answer_start(cfg, item)
    if start and cfg.benchmark.extra.get("answer_start") == "function":
        from oscar.eval.prompts import HUMANEVAL_CONTINUE_INSTRUCTION

        return render(getattr(engine, "tokenizer", None), HUMANEVAL_CONTINUE_INSTRUCTION, item.system,
                      use_chat=bool(cfg.model.chat_template), assistant_prefix=start)
    return _rendered(engine, cfg, item, start)


def grade_generation(cfg: Any, item: EvalItem, prompt: str, out: str) -> dict:
    """The graded record of one generated item (the response prefix, if any, is part of the answer)."""
    from oscar.eval import graders

    family = cfg.benchmark.family
    rec: dict[str, Any] = {"id": item.id, "prompt_hash": prompt_hash(prompt), "prediction": out, "target": item.target}
    answer = out if family == "niah" else answer_start(cfg, item) + out
    if family == "math":
        rec.update(graders.grade_math(answer, str(item.target)))
    elif family == "multiple_choice":
        letter = graders.extract_choice(answer, item.meta.get("num_choices", 4))
        rec.update({"extracted": letter, "correct": letter == item.target})
    elif family == "code":
        if cfg.benchmark.name == "humaneval":
            rec.update(graders.grade_humaneval(item.target, answer))
        else:
            rec.update(graders.grade_livecodebench(item.target["tests"], item.target["func_name"], answer))
            rec["target"] = {"num_tests": len(item.target["tests"])}
    elif family == "niah":
        rec.update(graders.grade_niah(out, list(item.target)))
        rec["length"] = item.meta.get("length")
    else:
        raise ValueError(f"benchmark family {family!r} has no grader; valid: math, multiple_choice, code, niah")
    return rec


def _continuous(cfg: Any, engine: Any) -> bool:
    """Whether the cell generates with continuous batching (`benchmark.extra.continuous=true`, a generated
    family and an engine that streams)."""
    scored = cfg.benchmark.family == "multiple_choice" and cfg.benchmark.extra.get("mode", "loglikelihood") == "loglikelihood"
    return bool(cfg.benchmark.extra.get("continuous", False)) and not scored and hasattr(engine, "generate_stream")


def _stream_items(engine: Any, cfg: Any, items: list[EvalItem], emit: Callable[[dict], None]) -> None:
    """Generate all `items` with continuous batching (`benchmark.batch_size` requests per decode step) and
    emit each graded record as its request finishes (with the measured bits per element of its cache rows)."""
    prompts = [generation_prompt(engine, cfg, item) for item in items]
    stop = list(cfg.benchmark.extra.get("stop", [])) or None

    def done(i: int, text: str, info: dict) -> None:
        rec = grade_generation(cfg, items[i], prompts[i], text)
        rec.update({k: v for k, v in info.items() if k in ("kv_bits_per_element", "steps")})
        emit(rec)

    engine.generate_stream(prompts, done, max_batch=max(1, int(cfg.benchmark.batch_size)), stop=stop, **_sampling(cfg))


def _with_ci(metrics: dict[str, float], name: str, values: list[float]) -> None:
    """`name` = mean of per-item values, with its 95% percentile-bootstrap interval over items
    (`name.ci_lo`, `name.ci_hi`; items are the resampling unit, seed 0, so the interval is reproducible)."""
    from oscar.eval.stats import bootstrap_mean_ci

    metrics[name] = sum(values) / len(values)
    metrics[f"{name}.ci_lo"], metrics[f"{name}.ci_hi"] = bootstrap_mean_ci(values)


def summarize(family: str, records: list[dict]) -> dict[str, float]:
    """Cell metrics with 95% bootstrap intervals over items: accuracy (pass@1 for code; for NIAH the
    share of needles retrieved, `score`, also per context length as `score@<length>` with `n@<length>`)."""
    if not records:
        return {}
    metrics: dict[str, float] = {}
    if family == "niah":
        _with_ci(metrics, "score", [float(r["score"]) for r in records])
        metrics["accuracy"] = sum(bool(r["correct"]) for r in records) / len(records)
        for length in sorted({r.get("length") for r in records if r.get("length")}):
            sub = [r for r in records if r.get("length") == length]
            _with_ci(metrics, f"score@{length}", [float(r["score"]) for r in sub])
            metrics[f"n@{length}"] = len(sub)
        return metrics
    _with_ci(metrics, "pass@1" if family == "code" else "accuracy", [float(bool(r["correct"])) for r in records])
    if family == "math":
        metrics["extracted_rate"] = sum(r.get("extraction") != "none" for r in records) / len(records)
    return metrics


# ------------------------------------------------------------------------------------------ cell

def prepare_items(cfg: Any, tokenizer: Any) -> tuple[list[EvalItem], list[str]]:
    """The cell's items (after `benchmark.limit`) and notes about anything dropped."""
    bcfg = cfg.benchmark
    items = load_items(bcfg, tokenizer)
    notes = []
    if bcfg.family == "niah":
        too_long = [it for it in items if (it.meta.get("length") or 0) > int(cfg.model.max_context)]
        if too_long:
            notes.append(f"dropped {len(too_long)} items longer than the model context {cfg.model.max_context}")
            items = [it for it in items if it not in too_long]
    return select(items, bcfg.limit), notes


def run_cell(cfg: Any, engine: Any, out_dir: Path | None = None, progress: bool = True,
             on_batch: Callable[[int, int], None] | None = None) -> dict:
    """Evaluate one cell with a ready engine and write result.json + items.jsonl; returns the result."""
    from tqdm.auto import tqdm

    out_dir = Path(out_dir) if out_dir else cell_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    chash = cell_config_hash(cfg)
    start = time.monotonic()
    items, notes = prepare_items(cfg, getattr(engine, "tokenizer", None))
    partial = out_dir / PARTIAL_FILE
    done = _read_partial(partial, chash)
    todo = [it for it in items if it.id not in done]
    if callable(getattr(engine, "reset_perf", None)):
        engine.reset_perf()
    batch_size = max(1, int(cfg.benchmark.batch_size))
    desc = f"{cfg.model.name}/{cfg.method.name}/{cfg.benchmark.name}/seed{cfg.seed}"
    bar = tqdm(total=len(items), initial=len(items) - len(todo), desc=desc, disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    with open(partial, "a", encoding="utf-8") as fh:
        def emit(rec: dict) -> None:
            rec["_config_hash"] = chash
            fh.write(json.dumps(rec, default=str) + "\n")
            fh.flush()
            done[rec["id"]] = rec
            bar.update(1)
            ok = [bool(r.get("correct")) for r in done.values()]
            bar.set_postfix(acc=f"{sum(ok) / max(1, len(ok)):.3f}")

        if _continuous(cfg, engine):  # one stream over every item left; records as requests end
            _stream_items(engine, cfg, todo, emit)
            if on_batch:
                on_batch(len(done), len(items))
        else:
            for i in range(0, len(todo), batch_size):
                for rec in process_batch(engine, cfg, todo[i:i + batch_size]):
                    emit(rec)
                if on_batch:
                    on_batch(len(done), len(items))
    bar.close()
    metrics = engine.perf_metrics() if callable(getattr(engine, "perf_metrics", None)) else {}
    return write_cell(cfg, out_dir, items, done, notes, chash, start, str(getattr(engine, "device", cfg.device)), metrics)


def write_cell(cfg: Any, out_dir: Path, items: list[EvalItem], done: dict[str, dict], notes: list[str], chash: str,
               start: float, device: str, perf: dict[str, float]) -> dict:
    """Write a finished cell: `items.jsonl` (records in item order), `result.json` (metrics with intervals, the
    generation's `perf` metrics, notes, provenance), both atomically, and `KEPT_FILE` (the records with their
    configuration hash, for a rerun whose outputs were deleted); the partial file is removed."""
    from oscar import __version__

    records = []
    for it in items:
        rec = dict(done[it.id])
        rec.pop("_config_hash", None)
        records.append(rec)
    atomic_write_text(out_dir / ITEMS_FILE, "".join(json.dumps(r, default=str) + "\n" for r in records))
    metrics = summarize(cfg.benchmark.family, records)
    unisolated = sum(r.get("isolation") == "hooks" for r in records)
    if unisolated:  # the user opted in (oscar.eval.sandbox.OPT_IN_ENV); the result must say so
        notes.append(f"UNISOLATED: {unisolated} of {len(records)} items ran generated code without isolation "
                     "(audit hooks only, OSCAR_UNISOLATED_CODE=1)")
    per_process = sum(r.get("memory_scope") == "process" for r in records)
    if per_process:  # no writable cgroup: memory was capped per process, not for the whole program
        notes.append(f"PER-PROCESS MEMORY CAP: {per_process} of {len(records)} items ran generated code without a "
                     "whole-program memory cap (no writable cgroup with memory and pids controllers; each item's "
                     "memory_scope says so)")
    metrics.update(perf)  # wall time of this run's generation (a resumed cell: the rest)
    result = {
        "model": cfg.model.name, "method": cfg.method.name, "benchmark": cfg.benchmark.name, "seed": int(cfg.seed),
        "stand_in_for": cfg.benchmark.stand_in_for, "n": len(records),
        "metrics": metrics, "config_hash": chash, "oscar_version": __version__,
        "git_commit": git_commit(), "hardware": hardware(device),
        "wall_s": round(time.monotonic() - start, 3),
        "sampling": _sampling(cfg), "source": cfg.benchmark.source, "notes": notes, "engine": engine_name(cfg),
    }
    atomic_write_text(out_dir / KEPT_FILE, "".join(json.dumps({**done[it.id], "_config_hash": chash}, default=str) + "\n"
                                                   for it in items))
    atomic_write_text(out_dir / RESULT_FILE, json.dumps(result, indent=2, sort_keys=True) + "\n")
    (out_dir / PARTIAL_FILE).unlink(missing_ok=True)
    return result


def load_cell(path: Path) -> tuple[dict, list[dict]]:
    """result.json and the item records of a finished cell directory."""
    path = Path(path)
    result = json.loads((path / RESULT_FILE).read_text())
    records = [json.loads(line) for line in (path / ITEMS_FILE).read_text().splitlines() if line.strip()]
    return result, records


def iter_cells(root: Path) -> Iterable[Path]:
    """Finished cell directories under a results root."""
    return sorted(p.parent for p in Path(root).rglob(RESULT_FILE))

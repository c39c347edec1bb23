"""One evaluation cell (model, method, benchmark, seed) -> result.json + items.jsonl (DESIGN "Result files").

Items are processed in batches; each finished record is appended to `items.partial.jsonl`, so an
interrupted cell resumes where it stopped (records are reused only when their prompt and the cell's
configuration hash match). The final files are written atomically and the partial file removed
(`oscar.eval.cells`: the files, the configuration hash, resuming and writing a cell).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from oscar.eval import graders
from oscar.eval.cells import PARTIAL_FILE, cell_config_hash, cell_dir, read_partial, sampling, write_cell
from oscar.eval.items import EvalItem, prompt_hash, select
from oscar.eval.prompts import HUMANEVAL_CONTINUE_INSTRUCTION, render
from oscar.eval.registry import load_items


# ------------------------------------------------------------------------------------ per family

# what a served engine says of each request (SGLangEngine.request_info): kept in the item records
REQUEST_INFO = ("kv_bits_per_element", "steps", "cuda_graph", "radix", "prefix_reuse", "prefill_stage_mib")


def _rendered(engine: Any, cfg: Any, item: EvalItem, prefix: str = "") -> str:
    return render(getattr(engine, "tokenizer", None), item.prompt, item.system,
                  use_chat=bool(cfg.model.chat_template), assistant_prefix=prefix)


def _run_generate(engine: Any, cfg: Any, prompts: list[str], stop: list[str] | None = None) -> list[str]:
    outs = engine.generate(prompts, stop=stop, **sampling(cfg))
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
    records = [grade_generation(cfg, item, prompt, out) for item, prompt, out in zip(items, prompts, outs)]
    infos = getattr(engine, "last_info", None)  # an engine that accounts per request (engine=sglang)
    if isinstance(infos, list) and len(infos) == len(records):
        for rec, info in zip(records, infos):
            rec.update({k: v for k, v in info.items() if k in REQUEST_INFO})
    return records


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
        return render(getattr(engine, "tokenizer", None), HUMANEVAL_CONTINUE_INSTRUCTION, item.system,
                      use_chat=bool(cfg.model.chat_template), assistant_prefix=start)
    return _rendered(engine, cfg, item, start)


def grade_generation(cfg: Any, item: EvalItem, prompt: str, out: str) -> dict:
    """The graded record of one generated item (the response prefix, if any, is part of the answer)."""
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
        rec.update({k: v for k, v in info.items() if k in REQUEST_INFO})
        emit(rec)

    engine.generate_stream(prompts, done, max_batch=max(1, int(cfg.benchmark.batch_size)), stop=stop, **sampling(cfg))


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
    done = read_partial(partial, chash)
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

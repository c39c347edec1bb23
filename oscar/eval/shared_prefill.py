"""Generation cells of several methods with one BF16 prefill per prompt (long-context needles and HumanEval, where
the prefill is most of a cell's work).

Serving semantics make a prompt's prefill method-independent: a prefill into an empty cache attends in BF16
(`OscarLayer.attend_and_write` takes its contiguous SDPA path, the simulated KIVI / TurboQuant layers see no
quantized row while `T = old = 0`), and a method's value fold only changes the frame of the attention output,
which the folded `o_proj` undoes (`oscar.models.surgery`). So every method's cache receives the same K/V rows, up to
float rounding (measured in tests/test_shared_prefill.py). Here the long part of each prompt (the haystack,
everything before `item.meta["question"]`) runs through the model once, into a BF16 cache that records the
rows each layer receives; each method's cache is then filled from those rows through its own write path
(`OscarCache.write_rows`: sink, INT pages, recent window, as its own prefill would), its value fold is applied,
and the question is fed one token at a time (decode steps), so the question and every answer token read the
method's quantized haystack, as a request's decode does. Answers are greedy or sampled as `generate` would.

Generated benchmarks with continuous batching (HumanEval, MATH: `benchmark.extra.continuous=true`) share the
whole prompt instead: each prompt is prefilled once (rows and last-position logits kept in memory), and each
method then runs its own continuous batch (`generate_continuous`) whose joining requests get caches filled from
those rows in place of a prefill pass. Those outputs are the cell's own up to float rounding (as a change of
batch is), so `benchmark.extra.shared_prefill` is not part of such a cell's configuration hash; with M methods
the prefill work (most of a HumanEval cell on CPU) is done once instead of M times.

Each method keeps its own cell folder (`result.json`, `items.jsonl`, resumable `items.partial.jsonl`); an
item whose records every method already holds is skipped, so an interrupted run resumes per item.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import torch

from oscar.cache import attention
from oscar.cache.torch_cache import OscarCache, spec_for_model
from oscar.eval.cells import KEPT_FILE, PARTIAL_FILE, RESULT_FILE, cell_config_hash, read_partial, write_cell
from oscar.eval.runner import generation_prompt, grade_generation, prepare_items
from oscar.models import load_model
from oscar.models.adapters import check_supported, layer_windows
from oscar.models.engine import (
    artifact_dir,
    cache_spec,
    eos_token_ids,
    method_format,
    new_cache,
    rotations_from_artifact,
    rotations_in_code,
)
from oscar.models.generate import (
    SamplingParams,
    cache_kwarg,
    generate_continuous,
    last_logits_only,
    next_tokens,
    truncate_at_stop,
)
from oscar.models.methods import needs_statistics
from oscar.models.surgery import fold_value_rotations


class RecordingCache(OscarCache):
    """A BF16 cache that also keeps every K/V chunk each layer receives (`rows[layer]`, BF16 as stored)."""

    def __init__(self, model: Any):
        check_supported(model)
        super().__init__(spec_for_model(model, "bf16"), int(model.config.num_hidden_layers), layer_windows(model))
        self.rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the chunk, then store it as the BF16 cache does."""
        dt = self.spec.store_dtype
        self.rows[layer_idx].append((key_states.to(dt), value_states.to(dt)))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def layer_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, all recorded keys and values `[B, Hkv, T, d]` in order."""
        return [(torch.cat([k for k, _ in chunks], dim=2), torch.cat([v for _, v in chunks], dim=2))
                for chunks in self.rows]


@dataclass
class MethodRun:
    """One method of a shared run: its composed cell configuration, rotations and value fold."""

    cfg: Any
    rotations: Optional[list] = None
    fold: bool = False
    backend: str = "torch"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Any, model: Any) -> "MethodRun":
        """Rotations of `cfg.method` from its artifact (or in code) and the fold `Engine.from_config` applies."""
        method = cfg.method
        rotations = None
        rotated = method_format(method, model).rotated
        if rotated:
            rotations = (rotations_from_artifact(artifact_dir(cfg), method, model) if needs_statistics(method)
                         else rotations_in_code(method, model))
        return cls(cfg, rotations, fold=rotated, backend=str(cfg.backend))

    def new_cache(self, model: Any) -> OscarCache:
        """A fresh serving-mode cache of this method (decode steps read it decode-equivalently)."""
        return new_cache(model, cache_spec(self.cfg.method, model, self.rotations, fold_values=self.fold,
                                           backend=self.backend))


def split_prompt(tokenizer: Any, text: str, question: str) -> tuple[list[int], int]:
    """Token ids of the rendered prompt and the index of its first question token: the first token that ends
    after the start of the last occurrence of `question` in `text` (a token across the boundary joins the question)."""
    at = text.rfind(question)
    if at < 0 or not question:
        raise ValueError(f"the question {question[:60]!r} does not occur in the rendered prompt")
    enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    split = next((i for i, (_, end) in enumerate(offsets) if end > at), len(ids))
    if split == 0:
        raise ValueError("the prompt has no token before its question: nothing to prefill")
    return ids, split


@torch.no_grad()
def prefill_rows(model: Any, ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Serving prefill of `ids` into a BF16 cache; per layer the K/V rows every method's cache would receive."""
    return prefill_prompt(model, ids)[0]


@torch.no_grad()
def prefill_prompt(model: Any, ids: Sequence[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """`prefill_rows` and the logits of the last prompt position `[1, vocab]` (what the first answer token is
    drawn from, the same for every method)."""
    attention.enable(model)
    device = next(model.parameters()).device
    cache = RecordingCache(model)
    x = torch.tensor([list(ids)], device=device)
    logits = model(input_ids=x, position_ids=torch.arange(x.shape[1], device=device)[None], use_cache=True,
                   **{cache_kwarg(model): cache}, **last_logits_only(model)).logits[:, -1, :]
    return cache.layer_rows(), logits


def filled_cache(model: Any, run: "MethodRun", rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> OscarCache:
    """A fresh cache of `run`'s method holding one request's prefill `rows`, written through its own write path
    (sink, INT pages, recent window, as its own prefill would)."""
    cache = run.new_cache(model)
    for layer, (k, v) in zip(cache.layers, rows):
        layer.write_rows(k, v)
    return cache


def filled_batch(model: Any, run: "MethodRun", prefills: Sequence[tuple[list, torch.Tensor]]) -> tuple[OscarCache, torch.Tensor]:
    """A joining group for `generate_continuous`'s `prefill` hook: one cache holding each `prefill_prompt` result
    of `prefills` as a row (in order, merged with `batch_extend`) and their last logits `[len(prefills), vocab]`."""
    caches = [filled_cache(model, run, rows) for rows, _ in prefills]
    for extra in caches[1:]:
        caches[0].batch_extend(extra)
    return caches[0], torch.cat([logits for _, logits in prefills])


@torch.no_grad()
def complete(model: Any, run: MethodRun, ids: Sequence[int], split: int, params: SamplingParams,
             eos_ids: Sequence[int] = (), decode: Optional[Callable[[list[int]], str]] = None,
             rows: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None, keep_logits: bool = False) -> dict:
    """Answer one prompt with `run`'s cache: `ids[:split]` prefilled (its own serving prefill, or `rows` from
    `prefill_rows` written through the cache's write path), `ids[split:]` fed one token per decode step, then up
    to `params.max_new_tokens` tokens. Returns `tokens`, `kv_bits_per_element` (the cache after the answer),
    `steps` and, with `keep_logits`, the float32 logits of every step from the last prompt token on."""
    device = next(model.parameters()).device
    kw = cache_kwarg(model)
    attention.enable(model)
    cache = run.new_cache(model)
    handle = None
    if run.fold:
        handle = fold_value_rotations(model, run.rotations)  # type: ignore[arg-type]
    generator = None
    if params.temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(params.seed))
    eos = {int(e) for e in eos_ids}
    out: list[int] = []
    kept: list[torch.Tensor] = []
    try:
        if rows is None:
            x = torch.tensor([list(ids[:split])], device=device)
            model(input_ids=x, position_ids=torch.arange(split, device=device)[None], use_cache=True,
                  **{kw: cache}, **last_logits_only(model))
        else:
            cache = filled_cache(model, run, rows)

        def step(token: int, pos: int) -> torch.Tensor:
            logits = model(input_ids=torch.tensor([[token]], device=device), position_ids=torch.tensor([[pos]], device=device),
                           use_cache=True, **{kw: cache}).logits[:, -1, :]
            if keep_logits:
                kept.append(logits[0].float().clone())
            return logits

        for pos in range(split, len(ids)):
            logits = step(int(ids[pos]), pos)
        pos = len(ids)
        for n in range(params.max_new_tokens):
            t = int(next_tokens(logits, params, generator)[0])
            if t in eos:
                break
            out.append(t)
            if params.stop and decode is not None and any(s in decode(out) for s in params.stop):
                break
            if n == params.max_new_tokens - 1:
                break
            logits = step(t, pos)
            pos += 1
        bits = float(cache.bits_per_element())
    finally:
        if handle is not None:
            handle.undo()
    result = {"tokens": out, "kv_bits_per_element": bits, "steps": len(out)}
    if keep_logits:
        result["logits"] = torch.stack(kept)
    return result


# ------------------------------------------------------------------------------------------ cells

def _sampling(cfg: Any) -> SamplingParams:
    b = cfg.benchmark
    return SamplingParams(int(b.max_new_tokens), float(b.temperature), float(b.top_p), int(b.top_k), int(cfg.seed),
                          tuple(b.extra.get("stop", []) or ()))


def check_group(cfgs: Sequence[Any]) -> None:
    """Refuse cells that cannot share prefills: another model, benchmark, seed or sampling, or one method twice."""
    if not cfgs:
        raise ValueError("eval-shared needs at least one cell")
    first = cfgs[0]
    for cfg in cfgs[1:]:
        for what, a, b in (("model", cfg.model.name, first.model.name), ("benchmark", cfg.benchmark.name, first.benchmark.name),
                           ("seed", cfg.seed, first.seed), ("sampling", _sampling(cfg), _sampling(first))):
            if a != b:
                raise ValueError(f"cells of one shared prefill must agree on the {what}: {a!r} vs {b!r}")
    from omegaconf import OmegaConf

    methods = [json.dumps(OmegaConf.to_container(c.method, resolve=True), sort_keys=True, default=str) for c in cfgs]
    if len(set(methods)) != len(methods):
        labels = cell_labels(cfgs)
        raise ValueError(f"cells {labels} repeat one method configuration; each method configuration is one cell "
                         "(the same method with other windows or options is another cell)")
    family = first.benchmark.family
    if family != "niah" and not (family in STREAM_FAMILIES and first.benchmark.extra.get("continuous", False)):
        raise ValueError(f"shared prefills serve needle benchmarks (family niah) and generated benchmarks with "
                         f"continuous batching (families {', '.join(STREAM_FAMILIES)} with benchmark.extra.continuous="
                         f"true), not {first.benchmark.name!r} (family {family!r}, continuous="
                         f"{bool(first.benchmark.extra.get('continuous', False))})")


def cell_labels(cfgs: Sequence[Any]) -> list[str]:
    """Each cell's method name, with its sink/recent windows where several cells share the name (`auto@16/96`)."""
    names = [str(c.method.name) for c in cfgs]
    return [f"{n}@{c.method.get('sink')}/{c.method.get('recent')}" if names.count(n) > 1 else n
            for n, c in zip(names, cfgs)]


STREAM_FAMILIES = ("code", "math")  # generated answers, graded per item


def run_cells(cfgs: Sequence[Any], out_dirs: Sequence[Path], progress: bool = True,
              log: Callable[[str], None] = print, force: bool = False) -> list[dict]:
    """Evaluate the cells `cfgs` (one per method, same model / benchmark / seed) with one shared BF16 prefill per
    item, streaming each method's records to its cell folder; returns each cell's result. A cell whose
    `result.json` has its configuration hash is left as it is (unless `force`)."""
    check_group(cfgs)
    results: list[Optional[dict]] = []
    for cfg, d in zip(cfgs, out_dirs):
        path = Path(d) / RESULT_FILE
        if force:  # recompute every item, not only what a finished run did not keep
            (Path(d) / KEPT_FILE).unlink(missing_ok=True)
        old = json.loads(path.read_text()) if path.is_file() and not force else None
        results.append(old if old and old.get("config_hash") == cell_config_hash(cfg) else None)
    todo = [i for i, r in enumerate(results) if r is None]
    if todo:
        runner = _run_cells if cfgs[0].benchmark.family == "niah" else _run_stream_cells
        fresh = iter(runner([cfgs[i] for i in todo], [Path(out_dirs[i]) for i in todo], progress, log))
        results = [r if r is not None else next(fresh) for r in results]
    return results  # type: ignore[return-value]


def _setup(cfgs: Sequence[Any], dirs: list[Path]) -> tuple:
    """What both kinds of shared run start from: the start time, the first cell, the model and tokenizer, each
    method's `MethodRun`, the items and notes, each cell's hash and the records it already holds, the sampling,
    a tokenizer view for `generation_prompt`, the EOS ids and a decoder."""
    start = time.monotonic()
    first = cfgs[0]
    model, tok = load_model(first.model, device=str(first.device) if str(first.device) != "auto" else None)
    runs = [MethodRun.from_config(cfg, model) for cfg in cfgs]
    items, notes = prepare_items(first, tok)
    hashes = [cell_config_hash(cfg) for cfg in cfgs]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    done = [read_partial(d / PARTIAL_FILE, h) for d, h in zip(dirs, hashes)]
    engine_view = SimpleNamespace(tokenizer=tok)  # generation_prompt reads the tokenizer only
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    return (start, first, model, tok, runs, items, notes, hashes, done, _sampling(first), engine_view,
            eos_token_ids(tok, model), decode)


def _run_cells(cfgs: Sequence[Any], dirs: list[Path], progress: bool, log: Callable[[str], None]) -> list[dict]:
    start, first, model, tok, runs, items, notes, hashes, done, params, engine_view, eos_ids, decode = _setup(cfgs, dirs)
    labels = cell_labels(cfgs)
    perf = [{"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_steps": 0} for _ in cfgs]
    files = [open(d / PARTIAL_FILE, "a", encoding="utf-8") for d in dirs]
    try:
        for n, item in enumerate(items):
            todo = [m for m in range(len(cfgs)) if item.id not in done[m]]
            if not todo:
                continue
            prompt = generation_prompt(engine_view, first, item)
            if "question" not in item.meta:
                raise ValueError(f"item {item.id} has no meta['question']: a shared prefill needs to know where the question starts")
            ids, split = split_prompt(tok, prompt, item.meta["question"])
            t0 = time.perf_counter()
            rows = prefill_rows(model, ids[:split])
            prefill_s = time.perf_counter() - t0
            for m in todo:
                t1 = time.perf_counter()
                res = complete(model, runs[m], ids, split, params, eos_ids, decode, rows=rows)
                text = truncate_at_stop(decode(res["tokens"]), params.stop)
                rec = grade_generation(cfgs[m], item, prompt, text)
                rec.update(kv_bits_per_element=res["kv_bits_per_element"], steps=res["steps"], prompt_tokens=len(ids),
                           question_tokens=len(ids) - split, _config_hash=hashes[m])
                files[m].write(json.dumps(rec, default=str) + "\n")
                files[m].flush()
                done[m][item.id] = rec
                p = perf[m]
                p["prefill_s"] += prefill_s / len(todo)  # the shared prefill, split over the methods that used it
                p["prefill_tokens"] += split
                p["decode_s"] += time.perf_counter() - t1
                p["decode_steps"] += len(ids) - split + res["steps"]
            if progress:
                scores = " ".join(f"{labels[m]}={done[m][item.id]['score']:.0f}" for m in todo)
                log(f"[{n + 1}/{len(items)}] {item.id}: {len(ids)} tokens, prefill {prefill_s:.1f}s; {scores}")
            del rows
    finally:
        for fh in files:
            fh.close()
    out = []
    for cfg, d, h, rec, p in zip(cfgs, dirs, hashes, done, perf):
        metrics = {}
        if p["decode_steps"]:
            metrics["perf.decode_ms"] = 1e3 * p["decode_s"] / p["decode_steps"]
        if p["prefill_tokens"]:
            metrics["perf.prefill_ms_per_token"] = 1e3 * p["prefill_s"] / p["prefill_tokens"]
        bits = [r["kv_bits_per_element"] for r in rec.values() if r.get("kv_bits_per_element") is not None]
        if bits:
            metrics["mem.kv_bits_per_element"] = sum(bits) / len(bits)
        cell_notes = notes + [f"shared prefill: one BF16 prefill per haystack for {len(cfgs)} methods "
                              f"({', '.join(labels)}); the question and the answer decoded "
                              "token by token through this method's cache"]
        out.append(write_cell(cfg, d, items, rec, cell_notes, h, start, str(next(model.parameters()).device), metrics))
    return out


def _run_stream_cells(cfgs: Sequence[Any], dirs: list[Path], progress: bool, log: Callable[[str], None]) -> list[dict]:
    """Generated cells (HumanEval, MATH) of several methods: every prompt still needed by some method is prefilled
    once into a BF16 cache (`prefill_prompt`, one request at a time, kept in memory: rows and last logits), then each
    method in turn generates all its remaining items with continuous batching (`generate_continuous`,
    `benchmark.batch_size` requests per decode step) whose joining requests get caches filled from those rows
    instead of a prefill pass. Records stream to each method's `items.partial.jsonl` as requests end, and each
    method's cell is written as soon as its stream ends."""
    start, first, model, tok, runs, items, notes, hashes, done, params, engine_view, eos_ids, decode = _setup(cfgs, dirs)
    labels = cell_labels(cfgs)
    prompts = [generation_prompt(engine_view, first, item) for item in items]
    encoded = [list(tok(p, add_special_tokens=True)["input_ids"]) for p in prompts]  # as Engine._encode
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else (eos_ids[0] if eos_ids else 0))
    need = [i for i, item in enumerate(items) if any(item.id not in d for d in done)]
    store: dict[int, tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]] = {}
    t0 = time.perf_counter()
    for n, i in enumerate(need):
        store[i] = prefill_prompt(model, encoded[i])
        if progress and ((n + 1) % 16 == 0 or n + 1 == len(need)):
            log(f"shared prefill: {n + 1}/{len(need)} prompts, {time.perf_counter() - t0:.0f}s")
    prefill_s = time.perf_counter() - t0
    users = {i: sum(items[i].id not in d for d in done) for i in need}  # methods sharing each prefill
    need_tokens = sum(len(encoded[i]) for i in need)
    device = str(next(model.parameters()).device)

    def finish(m: int, p: dict) -> dict:  # a method's cell is written as soon as its stream ends
        metrics = {}
        if p.get("decode_steps"):
            metrics["perf.decode_ms"] = 1e3 * p["decode_s"] / p["decode_steps"]
            metrics["perf.batch_occupancy"] = p["row_steps"] / p["decode_steps"]
        if p.get("prefill_tokens"):
            metrics["perf.prefill_ms_per_token"] = 1e3 * p["prefill_s"] / p["prefill_tokens"]
        bits = [r["kv_bits_per_element"] for r in done[m].values() if r.get("kv_bits_per_element") is not None]
        if bits:
            metrics["mem.kv_bits_per_element"] = sum(bits) / len(bits)
        cell_notes = notes + [f"shared prefill: one BF16 prefill per prompt for {len(cfgs)} methods "
                              f"({', '.join(labels)}); each method's requests then joined "
                              "its continuous batch with a cache filled from those rows"]
        return write_cell(cfgs[m], dirs[m], items, done[m], cell_notes, hashes[m], start, device, metrics)

    out = []
    for m, (cfg, run, d, h) in enumerate(zip(cfgs, runs, dirs, hashes)):
        todo = [i for i in need if items[i].id not in done[m]]
        if not todo:
            out.append(finish(m, {}))
            continue
        handle = None
        if run.fold:
            handle = fold_value_rotations(model, run.rotations)  # type: ignore[arg-type]

        def fill(group: list[int], run: MethodRun = run, todo: list[int] = todo) -> tuple[OscarCache, torch.Tensor]:
            return filled_batch(model, run, [store[todo[j]] for j in group])

        with open(d / PARTIAL_FILE, "a", encoding="utf-8") as fh:
            def finished(j: int, ids: list[int], info: dict, m: int = m, todo: list[int] = todo, fh: Any = fh) -> None:
                item = items[todo[j]]
                rec = grade_generation(cfgs[m], item, prompts[todo[j]], truncate_at_stop(decode(ids), params.stop))
                rec.update({k: v for k, v in info.items() if k in ("kv_bits_per_element", "steps")})
                rec["_config_hash"] = hashes[m]
                fh.write(json.dumps(rec, default=str) + "\n")
                fh.flush()
                done[m][item.id] = rec

            stats: dict = {}
            t1 = time.perf_counter()
            try:
                with torch.no_grad():
                    generate_continuous(model, [encoded[i] for i in todo], params, lambda: run.new_cache(model), eos_ids,
                                        pad, decode, max_batch=max(1, int(cfg.benchmark.batch_size)), on_done=finished,
                                        stats=stats, prefill=fill)
            finally:
                if handle is not None:
                    handle.undo()
        ok = [bool(r.get("correct")) for r in done[m].values()]
        if progress:
            log(f"{labels[m]}: {len(todo)} items in {time.perf_counter() - t1:.0f}s, "
                f"pass {sum(ok)}/{len(ok)}")
        share = sum(prefill_s * len(encoded[i]) / need_tokens / users[i] for i in todo)
        out.append(finish(m, {"prefill_s": share, "prefill_tokens": sum(len(encoded[i]) for i in todo), **stats}))
    return out


__all__ = ["MethodRun", "RecordingCache", "STREAM_FAMILIES", "cell_labels", "check_group", "complete", "filled_batch", "filled_cache", "prefill_prompt", "prefill_rows", "run_cells", "split_prompt"]

"""One BF16 prefill per haystack shared by every method (`oscar.eval.shared_prefill`) against each method's own
prefill, on SmolLM2-135M and a 512-token needle item (sink/recent 16/64, so ~90% of the haystack is INT2).

What is exact: the rows a serving prefill writes do not depend on the method's cache (its attention is BF16), so
with the same weights the shared rows, written through `OscarCache.write_rows`, leave every cache in the state
its own prefill leaves, bit for bit (BF16 segments, INT codes and scales, KIVI's history), and the question and
answer steps then give identical logits (same inputs, same arithmetic). What is not: a rotated method folds R_V
into `o_proj`, which changes the float rounding of its own prefill's hidden states; the rows then differ by
rounding (measured here: at most one code step in under 1% of the INT code bytes, 0.95% worst layer), and INT2
amplifies a code step into logit differences of several nats at single positions, so those are not compared.
"""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from oscar.core import quant
from oscar.config import compose
from oscar.eval.shared_prefill import MethodRun, complete, prefill_rows, split_prompt
from oscar.models.generate import SamplingParams, cache_kwarg

NIAH = ["model=smollm2-135m", "benchmark=niah", "benchmark.context_lengths=[512]", "benchmark.extra.samples_per_length=1",
        "benchmark.max_new_tokens=4"]
WINDOWS = ["method.clip=none", "method.sink=16", "method.recent=64"]


def _cfg(method: str, *extra: str):
    rotated = method in ("int2", "quarot")
    return compose(NIAH + [f"method={method}"] + (WINDOWS if rotated else []) + list(extra))


@pytest.fixture(scope="module")
def needle(smollm2, single_thread):
    from oscar.eval.runner import generation_prompt, prepare_items

    model, tok, _ = smollm2
    cfg = _cfg("bf16")
    item = prepare_items(cfg, tok)[0][0]
    prompt = generation_prompt(SimpleNamespace(tokenizer=tok), cfg, item)
    ids, split = split_prompt(tok, prompt, item.meta["question"])
    return ids, split, prefill_rows(model, ids[:split])


def _own_prefill(model, run: MethodRun, ids, split):
    from oscar.models.surgery import fold_value_rotations

    cache = run.new_cache(model)
    handle = fold_value_rotations(model, run.rotations) if run.fold else None
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids[:split]]), position_ids=torch.arange(split)[None], use_cache=True,
                  **{cache_kwarg(model): cache})
    finally:
        if handle is not None:
            handle.undo()
    return cache


def _shared(model, run: MethodRun, rows):
    cache = run.new_cache(model)
    for layer, (k, v) in zip(cache.layers, rows):
        layer.write_rows(k, v)
    return cache


def _state(layer) -> list[torch.Tensor]:
    if hasattr(layer, "hist_k"):  # KIVI / TurboQuant simulation: the BF16 history
        return [layer.hist_k[:, :, : max(layer.hist_len)], layer.hist_v[:, :, : max(layer.hist_len)]]
    out = [layer.sink_k, layer.sink_v, layer.recent_k, layer.recent_v]
    if layer.spec.kind == "rotated":
        out += [s.codes for s in (layer.k_store, layer.v_store)] + [s.scale for s in (layer.k_store, layer.v_store)]
    return out


def test_the_question_starts_after_the_haystack(smollm2, needle) -> None:
    _, tok, _ = smollm2
    ids, split, rows = needle
    assert tok.decode(ids[split:]).lstrip().startswith("What are all the special magic numbers")
    assert 350 < split < len(ids) - 20
    assert all(k.shape[2] == split and v.shape == k.shape for k, v in rows)


@pytest.mark.parametrize("method", ["bf16", "int2", "kivi2", "quarot-unfolded"])
def test_shared_rows_leave_the_cache_as_its_own_prefill_does_and_answer_alike(smollm2, needle, method) -> None:
    model, tok, _ = smollm2
    ids, split, rows = needle
    run = MethodRun.from_config(_cfg(method.split("-")[0]), model)
    if method.endswith("unfolded"):  # the value fold is the only float difference between the two prefills
        run = dataclasses.replace(run, fold=False)
    own, shared = _own_prefill(model, run, ids, split), _shared(model, run, rows)
    assert [layer.lengths() for layer in own.layers] == [layer.lengths() for layer in shared.layers]
    for a, b in zip(own.layers, shared.layers):
        assert all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))
    params = SamplingParams(max_new_tokens=2)
    alone = complete(model, run, ids, split, params, keep_logits=True)
    together = complete(model, run, ids, split, params, rows=rows, keep_logits=True)
    assert together["tokens"] == alone["tokens"]
    assert torch.equal(together["logits"], alone["logits"])
    assert together["kv_bits_per_element"] == alone["kv_bits_per_element"]
    if method != "bf16":
        assert together["kv_bits_per_element"] < 8  # the haystack is held quantized


def test_a_folded_rotation_changes_the_rows_by_rounding_only(smollm2, needle) -> None:
    model, _, _ = smollm2
    ids, split, rows = needle
    run = MethodRun.from_config(_cfg("quarot"), model)
    assert run.fold
    own, shared = _own_prefill(model, run, ids, split), _shared(model, run, rows)
    for a, b in zip(own.layers, shared.layers):
        for sa, sb in zip((a.k_store, a.v_store), (b.k_store, b.v_store)):
            assert sa.lengths == sb.lengths
            ca, cb = (quant.unpack_codes(s.codes, 2, s.group_size).int() for s in (sa, sb))
            assert int((ca - cb).abs().max()) <= 1  # measured: 1
            assert float((ca != cb).float().mean()) < 0.01  # measured worst layer: 0.4% of codes
        for x, y in zip((a.recent_k, a.recent_v), (b.recent_k, b.recent_v)):
            rel = float((x.float() - y.float()).norm() / y.float().norm())
            assert rel < 0.02  # measured worst layer: see the module docstring


def test_cells_share_the_prefill_stream_their_records_and_resume(smollm2, tmp_path, single_thread) -> None:
    from oscar.eval.cells import ITEMS_FILE, KEPT_FILE, PARTIAL_FILE, RESULT_FILE
    from oscar.eval.shared_prefill import run_cells

    short = ["benchmark.context_lengths=[256]", "benchmark.extra.samples_per_length=2", "benchmark.max_new_tokens=2"]
    cfgs = [_cfg(m, *short) for m in ("bf16", "int2")]
    dirs = [tmp_path / "bf16", tmp_path / "int2"]
    lines: list[str] = []
    run_cells(cfgs, dirs, log=lines.append)
    assert len(lines) == 2  # one shared prefill per item
    results = [json.loads((d / RESULT_FILE).read_text()) for d in dirs]
    assert [r["n"] for r in results] == [2, 2] and all(not (d / PARTIAL_FILE).exists() for d in dirs)
    assert any("shared prefill" in note for note in results[1]["notes"])
    records = [json.loads(x) for x in (dirs[1] / ITEMS_FILE).read_text().splitlines()]
    assert all(r["kv_bits_per_element"] < 16 and r["question_tokens"] > 10 for r in records)
    # an interrupted int2 cell keeps its first record; the finished bf16 cell is left as it is
    (dirs[1] / PARTIAL_FILE).write_text(json.dumps({**records[0], "_config_hash": results[1]["config_hash"]}) + "\n")
    (dirs[1] / RESULT_FILE).unlink()
    (dirs[1] / KEPT_FILE).unlink()  # an interrupted cell has not kept its records yet
    lines.clear()
    again = run_cells(cfgs, dirs, log=lines.append)
    assert len(lines) == 1 and "int2=" in lines[0] and "bf16=" not in lines[0]  # item 2, int2 only
    assert again[1]["n"] == 2


def test_cells_of_other_models_or_one_method_twice_are_refused() -> None:
    from oscar.eval.shared_prefill import check_group

    with pytest.raises(ValueError, match="seed"):
        check_group([_cfg("bf16"), _cfg("int2", "seed=1")])
    with pytest.raises(ValueError, match="repeat one method configuration"):
        check_group([_cfg("bf16"), _cfg("bf16")])
    # the same method with other windows is another cell, labelled by its windows
    from oscar.eval.shared_prefill import cell_labels

    pair = [_cfg("int2"), _cfg("int2", "method.recent=96")]
    check_group(pair)
    assert cell_labels(pair) == [f"int2@{pair[0].method.sink}/{pair[0].method.recent}", f"int2@{pair[1].method.sink}/96"]
    assert cell_labels([_cfg("bf16"), pair[0]]) == ["bf16", "int2"]
    with pytest.raises(ValueError, match="niah"):
        check_group([compose(["model=smollm2-135m", "method=bf16", "benchmark=humaneval"])])


# ------------------------------------------------------------------ generated cells: the continuous stream

HUMANEVAL = ["model=smollm2-135m", "benchmark=humaneval", "benchmark.limit=3", "benchmark.max_new_tokens=12",
             "benchmark.temperature=0.0", "+benchmark.extra.continuous=true", "+benchmark.extra.answer_start=function"]


def _he(method: str, *extra: str):
    rotated = method in ("int2", "quarot")
    return compose(HUMANEVAL + [f"method={method}"] + (WINDOWS if rotated else []) + list(extra))


def test_a_stream_fed_shared_rows_generates_what_its_own_prefill_does(smollm2, single_thread) -> None:
    """Each joining request alone (max_batch=1: the same [1, T] prefill shapes either way), so the two paths do the
    same arithmetic: the tokens are equal. The prompts (~150 tokens) are longer than the 16/64 windows, so
    every answer token reads INT2 rows."""
    from oscar.eval.runner import generation_prompt, prepare_items
    from oscar.eval.shared_prefill import filled_batch, prefill_prompt
    from oscar.models.generate import generate_continuous

    model, tok, _ = smollm2
    cfg = _he("int2")
    items = prepare_items(cfg, tok)[0]
    ids = [tok(generation_prompt(SimpleNamespace(tokenizer=tok), cfg, it), add_special_tokens=True)["input_ids"]
           for it in items]
    assert all(len(x) > 80 for x in ids)
    run = MethodRun.from_config(cfg, model)
    store = [prefill_prompt(model, x) for x in ids]
    params = SamplingParams(max_new_tokens=12)

    def fill(group):
        return filled_batch(model, run, [store[j] for j in group])

    from oscar.cache import attention

    attention.enable(model)
    seen: dict[str, list[float]] = {"own": [], "shared": []}
    with torch.no_grad():
        own = generate_continuous(model, ids, params, lambda: run.new_cache(model), max_batch=1,
                                  on_done=lambda i, t, info: seen["own"].append(info["kv_bits_per_element"]))
        shared = generate_continuous(model, ids, params, lambda: run.new_cache(model), max_batch=1, prefill=fill,
                                     on_done=lambda i, t, info: seen["shared"].append(info["kv_bits_per_element"]))
    assert shared == own and all(len(t) > 0 for t in own)
    assert seen["shared"] == seen["own"] and max(seen["own"]) < 12  # most of the history is held in INT2


def test_generated_cells_share_one_prefill_per_prompt_and_resume(tmp_path, single_thread) -> None:
    from oscar.eval.cells import ITEMS_FILE, KEPT_FILE, PARTIAL_FILE, RESULT_FILE, cell_config_hash
    from oscar.eval.shared_prefill import run_cells

    cfgs = [_he(m, "benchmark.batch_size=2", "+benchmark.extra.shared_prefill=true") for m in ("bf16", "int2")]
    # one prefill per prompt shared by a stream gives the cell's own outputs: the same cell (hash) as without it
    assert cell_config_hash(cfgs[1]) == cell_config_hash(_he("int2"))
    dirs = [tmp_path / "bf16", tmp_path / "int2"]
    lines: list[str] = []
    run_cells(cfgs, dirs, log=lines.append)
    assert sum(line.startswith("shared prefill: 3/3 prompts") for line in lines) == 1
    results = [json.loads((d / RESULT_FILE).read_text()) for d in dirs]
    assert [r["n"] for r in results] == [3, 3] and all(not (d / PARTIAL_FILE).exists() for d in dirs)
    assert any("shared prefill" in note for note in results[1]["notes"])
    assert results[1]["metrics"]["perf.batch_occupancy"] > 1
    records = [json.loads(x) for x in (dirs[1] / ITEMS_FILE).read_text().splitlines()]
    assert all(r["kv_bits_per_element"] < 16 and 0 < r["steps"] <= 12 and "status" in r for r in records)
    # an interrupted int2 cell keeps two records: one prompt is prefilled again, for int2 alone
    (dirs[1] / PARTIAL_FILE).write_text("".join(json.dumps({**r, "_config_hash": results[1]["config_hash"]}) + "\n"
                                                for r in records[:2]))
    (dirs[1] / RESULT_FILE).unlink()
    (dirs[1] / KEPT_FILE).unlink()  # an interrupted cell has not kept its records yet
    lines.clear()
    again = run_cells(cfgs, dirs, log=lines.append)
    assert lines[0].startswith("shared prefill: 1/1 prompts") and lines[1].startswith("int2: 1 items")
    assert again[1]["n"] == 3 and again[0] == results[0]
    # the workflow deletes a job's declared outputs before rerunning it: the finished cells come back from the
    # records they kept, with nothing recomputed
    before = [(d / ITEMS_FILE).read_text() for d in dirs]
    for d in dirs:
        (d / ITEMS_FILE).unlink()
        (d / RESULT_FILE).unlink()
    lines.clear()
    run_cells(cfgs, dirs, log=lines.append)
    assert lines == [] and [(d / ITEMS_FILE).read_text() for d in dirs] == before


def test_a_stream_without_continuous_batching_is_refused() -> None:
    from oscar.eval.shared_prefill import check_group

    with pytest.raises(ValueError, match="continuous=False"):
        check_group([compose(["model=smollm2-135m", "method=bf16", "benchmark=humaneval"])])

"""GPU correctness of the SGLang plugin on real weights (SmolLM2-135M), for reports/serving/gpu_correctness.{md,json}.

    python -m oscar.bench.serve_correctness --auto-artifact DIR --out DIR [--eval-sglang DIR --eval-embedded DIR]

(``python -m oscar gpu correctness`` runs it with the pool check and the eval cell, and checks what it needs). The model is the dense copy of the GGUF
(``oscar.serve.client.model_path``: ``$OSCAR_CACHE_DIR/models/smollm2-135m/dense``). SGLang engines run in
subprocesses of this script (``--engine SPEC OUT``) with ``$OSCAR_SGLANG_PYTHONPATH`` (the 0.5.17 bundle first)
and the oscar plugin's entry point, all with CUDA graphs for decode, pages of 16 tokens, in parallel:

- ``bf16_triton``: SGLang's own BF16 backend (``--attention-backend triton``), BF16 model; ``oscar_bf16eq``:
  the plugin with windows that cover every position (sink 64 + recent 512, identity artifact), BF16 model.
  Greedy tokens compared token for token (the same BF16 rows; two attention kernels, so where two tokens
  are within the kernels' rounding the report says at which step and with what BF16 top-2 margin).
- ``oscar_auto`` (with ``--auto-artifact``: rope-centered keys where auto chose them) and ``oscar_quarot``
  (Hadamard, built in code), BF16 model (SGLang's CUDA RMSNorm has no float32), both engines: INT2, sink 16,
  recent 16; greedy with the top-256 log-probabilities
  at each step. The embedded engine (``oscar.models.engine``, same artifact, value rotation folded, torch path on
  the GPU) is forced along SGLang's tokens (``oscar.models.generate.forced_logprobs``): ``check_teacher_forced``
  (``oscar.bench.serve_compare``: every reported log-probability within ``INT2_LOGPROB_TOL``, the median
  within ``INT2_MEDIAN_TOL``, SGLang's token the embedded argmax where the top-2 margin exceeds twice the
  tolerance), next-token agreement (SGLang's token = the embedded argmax; and each engine's INT2 argmax =
  the BF16 argmax along the same history, with Wilson 95% intervals), and the KL divergence between the two
  engines' INT2 distributions over SGLang's top 256 tokens plus the rest in one bucket (a lower bound of the
  full KL by data processing; the rest's mass is reported), beside the full KL of the embedded INT2 from
  the embedded BF16 cache (the size of the quantization's effect).
- ``--eval-sglang`` / ``--eval-embedded``: two ``python -m oscar eval`` output folders of the same cell
  (engine=sglang on the GPU, engine=embedded): item ids, prompt hashes, log-likelihoods within
  ``INT2_LOGPROB_TOL`` and predictions compared as tests/serve/test_eval_sglang.py does.

Writes ``gpu_correctness.json`` and ``gpu_correctness.md`` under ``--out`` (and the engines' logs); prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from oscar.bench.host import sglang_env
from oscar.bench.serve_compare import INT2_LOGPROB_TOL, INT2_MEDIAN_TOL, check_teacher_forced, save_in_code_artifact
from oscar.core.files import atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "The Roman aqueducts carried water from distant springs into the cities by gravity alone. Engineers surveyed "
    "a gentle, constant slope over tens of kilometres, and where a valley crossed the route they built",
    "class Stack:\n    \"\"\"A last-in, first-out container.\"\"\"\n\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
    "Question: A shop sells pencils at 3 for 45 cents. How much do 14 pencils cost, in dollars? Explain each "
    "step of the calculation before you give the answer.\nAnswer: One pencil costs",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light energy into "
    "chemical energy. In the chloroplasts, chlorophyll absorbs mostly blue and red light, and the energy",
    "Dear hiring manager,\n\nI am writing to apply for the position of data engineer advertised on your "
    "website. Over the last four years I have built and maintained pipelines that move",
    "The rules of chess are simple to state but hard to master. Each player starts with sixteen pieces: "
    "one king, one queen, two rooks, two bishops, two knights and eight pawns. The knight moves",
    "import numpy as np\n\n\ndef softmax(x, axis=-1):\n    \"\"\"Numerically stable softmax.\"\"\"\n"
    "    x = x - x.max(axis=axis, keepdims=True)\n    e = np.exp(x)\n    return",
    "In 1969 the Apollo 11 mission landed the first two people on the Moon. Neil Armstrong and Buzz Aldrin "
    "spent about two and a half hours outside the lunar module, while Michael Collins",
]
NEW_TOKENS = 32
TOP = 256  # SGLang top log-probabilities per step (the bucket KL below)
# SGLang's CUDA RMSNorm (sgl_kernel.rmsnorm) has no float32 kernel: on a GPU SGLang serves BF16/FP16 models only
# (measured: "rmsnorm ... failed to dispatch data type Float" at the decode graph capture, sglang 0.5.17, H200)
MODEL_DTYPE = "bfloat16"
S0_INT2, W_INT2 = 16, 16
S0_BF16EQ, W_BF16EQ = 64, 512
COMMON = dict(device="cuda", disable_radix_cache=True, chunked_prefill_size=-1, max_running_requests=8,
              max_total_tokens=16384, mem_fraction_static=0.9, log_level="info", random_seed=0, cuda_graph_max_bs_decode=8,
              sampling_backend="pytorch", grammar_backend="none")
OSCAR = dict(attention_backend="oscar", page_size=16, disable_prefill_cuda_graph=True)
# --cpu (a smoke test of this script where there is no GPU: sglang 0.5.23 CPU, torch twins, no CUDA graphs)
CPU = dict(device="cpu", disable_cuda_graph=True, max_total_tokens=4096, mem_fraction_static=0.5)
ENV_CPU = "OSCAR_GPU_CORRECTNESS_CPU"


def _common() -> dict:
    if os.environ.get(ENV_CPU) == "1":
        return {**{k: v for k, v in COMMON.items() if k != "cuda_graph_max_bs_decode"}, **CPU}
    return COMMON


# -- SGLang engines (subprocess) ------------------------------------------------------------------


def engine_main(spec_path: str, out_path: str) -> int:
    """Run SGLang's offline Engine for each run of the spec (one process: the plugin loads through its entry point)."""
    import sglang


    spec = json.loads(Path(spec_path).read_text())
    results = {}
    for run in spec["runs"]:
        os.environ.update({k: str(v) for k, v in run.get("env", {}).items()})
        t0 = time.perf_counter()
        try:
            engine = sglang.Engine(**{**_common(), **run["engine_args"]})
        except BaseException as err:  # report and go on with the next run
            results[run["name"]] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            atomic_write_json(out_path, results)
            continue
        started = time.perf_counter() - t0
        try:
            kwargs: dict[str, Any] = {"input_ids": run["input_ids"], "sampling_params": run["sampling"],
                                      **run.get("generate_args", {})}
            outs = engine.generate(**kwargs)
            res: dict[str, Any] = {"output_ids": [o["output_ids"] for o in outs], "start_s": started,
                                   "generate_s": time.perf_counter() - t0 - started}
            if kwargs.get("return_logprob"):
                res["logprobs"] = [{key: o["meta_info"].get(key) for key in ("output_token_logprobs",
                                                                            "output_top_logprobs")} for o in outs]
            results[run["name"]] = res
        except BaseException as err:
            results[run["name"]] = {"error": f"{type(err).__name__}: {err}"[:2000]}
        finally:
            engine.shutdown()
        atomic_write_json(out_path, results)  # after each run: a later run's timeout keeps this one
    atomic_write_json(out_path, results)
    return 0


def start_engines(name: str, runs: list[dict], out: Path) -> subprocess.Popen:

    spec = out / f"{name}_spec.json"
    atomic_write_json(spec, {"runs": runs})

    env = sglang_env()
    log = open(out / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "oscar.bench.serve_correctness", "--engine", str(spec),
                             str(out / f"{name}.json")],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))


# -- the comparisons ------------------------------------------------------------------------------


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson 95% interval of a proportion k/n."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (mid - half, mid + half)


def bucket_kl(p_logs: dict[int, float], q_row: Any) -> tuple[float, float]:
    """KL(P || Q) of P (log-probabilities of its reported tokens) and Q (a full log-probability row), both coarsened
    to those tokens plus the rest in one bucket; returns (KL, P's mass outside the reported tokens)."""
    import torch

    ids = torch.tensor(list(p_logs), dtype=torch.long)
    lp = torch.tensor(list(p_logs.values()), dtype=torch.float64)
    lq = q_row.double()[ids]
    p, q = lp.exp(), lq.exp()
    rest_p, rest_q = max(0.0, 1 - float(p.sum())), max(1e-30, 1 - float(q.sum()))
    kl = float((p * (lp - lq)).sum()) + (rest_p * math.log(rest_p / rest_q) if rest_p > 0 else 0.0)
    return kl, rest_p


def compare_int2(run: dict, emb_int2: list, emb_bf16: list) -> dict:
    """Teacher-forced comparison of one SGLang INT2 run with the embedded engine (INT2 and BF16 caches)."""
    import torch


    top2 = {"output_ids": run["output_ids"],  # the check's tolerances are for SGLang's token and its top 2
            "logprobs": [{"output_token_logprobs": lp["output_token_logprobs"],
                          "output_top_logprobs": [t[:2] for t in lp["output_top_logprobs"]]} for lp in run["logprobs"]]}
    try:
        _, _, decided = check_teacher_forced(top2, emb_int2)
        forced_ok, why = True, ""
    except AssertionError as err:
        decided, forced_ok, why = 0, False, str(err)[:500]
    med = lambda xs: float(torch.tensor(xs).median()) if xs else float("nan")  # noqa: E731
    agree = served_vs_bf16 = emb_vs_bf16 = n = 0
    kls, rests, kl_quant, per_step = [], [], [], []
    for toks, lp, li, lb in zip(run["output_ids"], run["logprobs"], emb_int2, emb_bf16):
        for i, tok in enumerate(toks):
            n += 1
            chosen = {int(e[1]): float(e[0]) for e in lp["output_top_logprobs"][i][:2]}
            chosen[tok] = float(lp["output_token_logprobs"][i][0])  # what check_teacher_forced compares
            per_step.append(max(abs(v - float(li[i, j])) for j, v in chosen.items()))
            agree += int(int(li[i].argmax()) == tok)
            served_vs_bf16 += int(int(lb[i].argmax()) == tok)
            emb_vs_bf16 += int(int(lb[i].argmax()) == int(li[i].argmax()))
            reported = {int(e[1]): float(e[0]) for e in lp["output_top_logprobs"][i]}
            kl, rest = bucket_kl(reported, li[i])
            kls.append(kl)
            rests.append(rest)
            kl_quant.append(float((lb[i].double().exp() * (lb[i].double() - li[i].double())).sum()))
    return {
        "steps": n, "teacher_forced_ok": forced_ok, "teacher_forced_error": why,
        "max_logprob_diff": max(per_step), "median_logprob_diff": med(per_step), "decided_steps_agreeing": decided,
        "tolerance": INT2_LOGPROB_TOL, "median_tolerance": INT2_MEDIAN_TOL,
        "agreement_with_embedded_int2": agree / max(n, 1), "agreement_with_embedded_int2_ci": wilson(agree, n),
        "served_int2_vs_bf16_argmax": served_vs_bf16 / max(n, 1),
        "served_int2_vs_bf16_argmax_ci": wilson(served_vs_bf16, n),
        "embedded_int2_vs_bf16_argmax": emb_vs_bf16 / max(n, 1),
        "embedded_int2_vs_bf16_argmax_ci": wilson(emb_vs_bf16, n),
        "kl_served_vs_embedded_top_mean": sum(kls) / max(len(kls), 1), "kl_served_vs_embedded_top_max": max(kls),
        "kl_served_vs_embedded_top_median": med(kls), "served_mass_outside_top_max": max(rests),
        "served_mass_outside_top_mean": sum(rests) / max(len(rests), 1),
        "kl_embedded_bf16_to_int2_mean": sum(kl_quant) / max(len(kl_quant), 1),
        "kl_embedded_bf16_to_int2_median": med(kl_quant),
    }


def compare_bf16(ref: list[list[int]], got: list[list[int]], bf16_logprobs: list) -> dict:
    """Token-for-token comparison of greedy runs; at a first difference, the BF16 top-2 margin there."""
    equal, first = [], []
    for p, (a, b) in enumerate(zip(ref, got)):
        equal.append(a == b)
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is not None:
            top = bf16_logprobs[p]["output_top_logprobs"][i]
            margin = float(top[0][0]) - float(top[1][0]) if len(top) > 1 else float("nan")
            first.append({"prompt": p, "step": i, "bf16_top2_margin": margin})
    return {"prompts": len(ref), "prompts_equal": sum(equal), "tokens_equal": all(equal), "first_differences": first}


def compare_eval(served_dir: Path, embedded_dir: Path) -> dict:

    def load(d: Path) -> tuple[dict, list]:
        return (json.loads((d / "result.json").read_text()),
                [json.loads(x) for x in (d / "items.jsonl").read_text().splitlines()])

    s, s_items = load(served_dir)
    e, e_items = load(embedded_dir)
    same_items = all((a["id"], a["prompt_hash"], a["target"]) == (b["id"], b["prompt_hash"], b["target"])
                     for a, b in zip(s_items, e_items)) and len(s_items) == len(e_items)
    diffs = [abs(x - y) for a, b in zip(s_items, e_items) for x, y in zip(a["loglikelihoods"], b["loglikelihoods"])]
    decided = [(a, b) for a, b in zip(s_items, e_items)
               if (lambda ll: ll[0] - ll[1])(sorted(b["loglikelihoods"], reverse=True)) > 2 * INT2_LOGPROB_TOL]
    log = (served_dir / "server.log").read_text() if (served_dir / "server.log").exists() else ""
    return {"engine_served": s.get("engine"), "engine_embedded": e.get("engine"), "n": s.get("n"),
            "same_items": same_items, "max_loglikelihood_diff": max(diffs) if diffs else float("nan"),
            "within_tolerance": bool(diffs) and max(diffs) <= INT2_LOGPROB_TOL,
            "decided_predictions_equal": all(a["prediction"] == b["prediction"] for a, b in decided),
            "decided": len(decided), "accuracy_served": s.get("metrics", {}).get("accuracy"),
            "accuracy_embedded": e.get("metrics", {}).get("accuracy"),
            "server_log_has_int2_pool": "OSCAR KV pool: INT2" in log}


# -- main -----------------------------------------------------------------------------------------


def embedded_forced(model: Any, method: str, artifact: Any, sink: int, recent: int, prompts: list, forced: list,
                    overrides: tuple = ()) -> list:
    # local: keeps omegaconf and transformers out of `gpu --help`
    from oscar.config import compose
    from oscar.models.engine import Engine, rotations_from_artifact
    from oscar.models.generate import forced_logprobs

    cfg = compose([f"method={method}", *overrides, f"method.sink={sink}", f"method.recent={recent}"])
    rots = None if artifact is None else rotations_from_artifact(artifact, cfg.method, model)
    engine = Engine(model, None, cfg.method, rots, fold_values=artifact is not None)
    try:
        return [forced_logprobs(model, ids, toks, engine.new_cache).cpu() for ids, toks in zip(prompts, forced)]
    finally:
        engine.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--auto-artifact", type=Path, default=None, help="an auto artifact of smollm2-135m (INT2 runs)")
    ap.add_argument("--method-override", action="append", default=[],
                    help="method settings the auto artifact was made with (default: auto's)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--eval-sglang", type=Path, default=None)
    ap.add_argument("--eval-embedded", type=Path, default=None)
    ap.add_argument("--engine-timeout", type=float, default=200.0, help="seconds for each group of engine runs")
    ap.add_argument("--reuse", action="store_true", help="take the engine results already under --out")
    ap.add_argument("--merge", action="store_true", help="add the eval cell's comparison to the report under --out")
    ap.add_argument("--cpu", action="store_true", help="smoke test without a GPU (SGLang CPU engine, torch twins)")
    a = ap.parse_args(argv)
    if a.cpu:
        os.environ[ENV_CPU] = os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    if a.engine:
        return engine_main(*a.engine)
    if a.merge:
        return merge_eval(a.out, a.eval_sglang, a.eval_embedded)
    import torch
    from transformers import AutoTokenizer

    # local: keeps omegaconf and transformers out of `gpu --help`
    from oscar.config import compose
    from oscar.models import load_model
    from oscar.serve.client import model_path

    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    mcfg = compose(["model=smollm2-135m"]).model
    path = model_path(mcfg)  # the dense copy (made from the GGUF at first use)
    tok = AutoTokenizer.from_pretrained(path)
    texts, new_tokens = (TEXTS[:2], 8) if a.cpu else (TEXTS, NEW_TOKENS)  # the smoke test: a small run
    prompts = [tok(t, add_special_tokens=True)["input_ids"] for t in texts]
    identity = save_in_code_artifact(Path(path), "int2", out / "art_identity")
    # the INT2 runs: quarot (Hadamard, built in code: the published baseline) and the auto artifact when given
    int2 = [("quarot", save_in_code_artifact(Path(path), "quarot", out / "art_quarot"), ("method.clip=paper",))]
    if a.auto_artifact is not None:
        int2.insert(0, ("auto", a.auto_artifact, tuple(a.method_override)))
    sampling = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    top = {"return_logprob": True, "top_logprobs_num": TOP}
    base = {"model_path": path, "input_ids": prompts, "sampling": sampling}
    groups = {
        "bf16_triton": [
            {**base, "name": "bf16_triton", "engine_args": {"model_path": path,
                                                            "attention_backend": "torch_native" if a.cpu else "triton",
                                                            "dtype": "bfloat16"}, "generate_args": top}],
        "oscar_bf16eq": [
            {**base, "name": "oscar_bf16eq", "engine_args": {"model_path": path, **OSCAR, "dtype": "bfloat16"},
             "env": {"OSCAR_ARTIFACT": str(identity), "OSCAR_SINK": S0_BF16EQ, "OSCAR_RECENT": W_BF16EQ}}],
        **{f"int2_{method}": [{**base, "name": f"oscar_{method}", "generate_args": top,
                               "engine_args": {"model_path": path, **OSCAR, "dtype": MODEL_DTYPE},
                               "env": {"OSCAR_ARTIFACT": str(art), "OSCAR_SINK": S0_INT2, "OSCAR_RECENT": W_INT2}}]
           for method, art, _ in int2},
    }
    procs = {name: None if a.reuse else start_engines(name, runs, out) for name, runs in groups.items()}
    served: dict[str, Any] = {}
    for name, proc in procs.items():
        rc = 0
        if proc is not None:
            try:
                rc = proc.wait(timeout=max(1.0, a.engine_timeout - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "timeout"
        res_path = out / f"{name}.json"
        served.update(json.loads(res_path.read_text()) if res_path.exists() else
                      {r["name"]: {"error": f"engine process exit {rc}; see {name}.log"} for r in groups[name]})
    engines_s = time.perf_counter() - t0

    report: dict[str, Any] = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized; BF16 = BF16 KV over these weights)",
                              "device": "cpu (smoke test)" if a.cpu else torch.cuda.get_device_name(0),
                              "torch": torch.__version__,
                              "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
                              "new_tokens": new_tokens, "engines_s": engines_s,
                              "runs": {k: {kk: vv for kk, vv in v.items() if kk not in ("logprobs", "output_ids")}
                                       for k, v in served.items()}}
    if "output_ids" in served.get("bf16_triton", {}) and "output_ids" in served.get("oscar_bf16eq", {}):
        report["greedy_bf16_windows_cover"] = compare_bf16(served["bf16_triton"]["output_ids"],
                                                          served["oscar_bf16eq"]["output_ids"],
                                                          served["bf16_triton"]["logprobs"])
    model, _ = load_model(mcfg, device="cpu" if a.cpu else "cuda", dtype=MODEL_DTYPE)
    for method, art, overrides in int2:
        run = served.get(f"oscar_{method}", {})
        if "output_ids" not in run:
            continue
        emb_int2 = embedded_forced(model.eval(), method, art, S0_INT2, W_INT2, prompts, run["output_ids"], overrides)
        emb_bf16 = embedded_forced(model, "bf16", None, S0_INT2, W_INT2, prompts, run["output_ids"])
        report[f"int2_{method}"] = {"method": method, "model_dtype": MODEL_DTYPE, **compare_int2(run, emb_int2, emb_bf16)}
    if a.auto_artifact is not None:
        choices = json.loads((a.auto_artifact / "meta.json").read_text()).get("choices", [])
        report["auto_artifact"] = {"center_k": sorted({str(c["center_k"]) for c in choices}),
                                   "rope_centered_heads": sum(c["center_k"] == "rope" for c in choices),
                                   "heads": len(choices)}
    if a.eval_sglang is not None and (a.eval_sglang / "result.json").exists() and a.eval_embedded is not None:
        report["eval_cell"] = compare_eval(a.eval_sglang, a.eval_embedded)
    report["total_s"] = time.perf_counter() - t0
    atomic_write_json(out / "gpu_correctness.json", report)
    md = render(report)
    atomic_write_text(out / "gpu_correctness.md", md)
    print(md)
    return 0


def merge_eval(out: Path, served: Path, embedded: Path) -> int:
    """The eval cell's comparison added to ``out/gpu_correctness.{json,md}`` (the cell runs beside the engines)."""

    report = json.loads((out / "gpu_correctness.json").read_text())
    if (served / "result.json").exists() and (embedded / "result.json").exists():
        report["eval_cell"] = compare_eval(served, embedded)
    else:
        report["eval_cell_missing"] = [str(d) for d in (served, embedded) if not (d / "result.json").exists()]
    atomic_write_json(out / "gpu_correctness.json", report)
    md = render(report)
    atomic_write_text(out / "gpu_correctness.md", md)
    print(md)
    return 0


def render(r: dict) -> str:
    lines = [f"# GPU correctness of the SGLang plugin on real weights ({r['device']})", "",
             f"Model: {r['model']}; {r['prompts']} prompts of {min(r['prompt_tokens'])}-{max(r['prompt_tokens'])} "
             f"tokens, {r['new_tokens']} greedy tokens each; torch {r['torch']}.", ""]
    g = r.get("greedy_bf16_windows_cover")
    if g:
        lines += ["## Greedy tokens, windows covering every position (sink 64 + recent 512, BF16 model)", "",
                  f"oscar (identity artifact, CUDA graphs, pages of 16) vs SGLang `triton` BF16: {g['prompts_equal']}/"
                  f"{g['prompts']} prompts token for token equal" +
                  ("" if g["tokens_equal"] else f"; first differences {g['first_differences']}"), ""]
    for name in [k for k in r if k.startswith("int2_")]:
        c = r[name]
        ci = lambda k: f"[{c[k][0]:.3f}, {c[k][1]:.3f}]"  # noqa: E731
        lines += [f"## INT2, {c['method']} artifact (sink {S0_INT2}, recent {W_INT2}), {c['model_dtype']} model: "
                  "SGLang vs embedded", "",
                  "| measure | value |", "|---|---|",
                  f"| teacher-forced check (tol {c['tolerance']}, median {c['median_tolerance']}) | "
                  f"{'pass' if c['teacher_forced_ok'] else 'FAIL ' + c['teacher_forced_error'][:120]} |",
                  f"| largest / median log-probability difference | {c['max_logprob_diff']:.4f} / {c['median_logprob_diff']:.4f} |",
                  f"| decided steps agreeing | {c['decided_steps_agreeing']} of {c['steps']} steps |",
                  f"| SGLang token = embedded INT2 argmax | {c['agreement_with_embedded_int2']:.3f} {ci('agreement_with_embedded_int2_ci')} |",
                  f"| INT2 argmax = BF16 argmax: SGLang | {c['served_int2_vs_bf16_argmax']:.3f} {ci('served_int2_vs_bf16_argmax_ci')} |",
                  f"| INT2 argmax = BF16 argmax: embedded | {c['embedded_int2_vs_bf16_argmax']:.3f} {ci('embedded_int2_vs_bf16_argmax_ci')} |",
                  f"| KL(SGLang INT2 \\|\\| embedded INT2), top-256 + rest: mean / median / max | "
                  f"{c['kl_served_vs_embedded_top_mean']:.2e} / {c['kl_served_vs_embedded_top_median']:.2e} / "
                  f"{c['kl_served_vs_embedded_top_max']:.2e} (mass outside the top 256: mean {c['served_mass_outside_top_mean']:.2e}, max {c['served_mass_outside_top_max']:.2e}) |",
                  f"| KL(embedded BF16 \\|\\| embedded INT2), full: mean / median | "
                  f"{c['kl_embedded_bf16_to_int2_mean']:.3f} / {c['kl_embedded_bf16_to_int2_median']:.3f} |", ""]
    e = r.get("eval_cell")
    if e:
        lines += ["## `oscar eval engine=sglang` on the GPU vs `engine=embedded` (one cell)", "",
                  f"n={e['n']}, same items {e['same_items']}, largest log-likelihood difference "
                  f"{e['max_loglikelihood_diff']:.2e} (within tolerance: {e['within_tolerance']}), predictions equal "
                  f"where decided ({e['decided']}): {e['decided_predictions_equal']}, accuracy {e['accuracy_served']} vs "
                  f"{e['accuracy_embedded']}, server log shows the INT2 pool: {e['server_log_has_int2_pool']}", ""]
    a = r.get("auto_artifact", {})
    if a.get("heads"):
        lines += [f"Auto artifact: key centering {a.get('center_k')}, {a.get('rope_centered_heads')} of {a.get('heads')} "
                  "(layer, KV head)s rope-centered.", ""]
    lines += ["Runs: " + ", ".join(
                  f"{k} ({'error: ' + v['error'][:200] if 'error' in v else 'start %.0f s' % v.get('start_s', 0)})"
                  for k, v in r["runs"].items()), "",
              "Reproduce: `python -m oscar gpu correctness auto=<auto artifact> mmlu=<mmlu.jsonl>` on a GPU host "
              "(benchmarks/README.md: the GGUF of smollm2-135m installed); the auto artifact: `python -m oscar calibrate "
              "model=smollm2-135m method=auto calibration.num_tokens=2048 calibration.seq_len=512 "
              "calibration.holdout_tokens=512`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""GPU correctness of the SGLang plugin on real weights (SmolLM2-135M), for reports/serving/gpu_correctness.{md,json}.

    python -m oscar.bench.correctness.real_weights --methods bf16,auto,quarot,int2 --artifact auto=DIR --out DIR
        [--prompts N --new-tokens N] [--cpu] [--eval-sglang DIR --eval-embedded DIR]

(``python -m oscar gpu correctness`` runs it with the pool check and the eval cell, and checks what it needs). The
model is the dense copy of the GGUF (``oscar.serve.client.model_path``: ``$OSCAR_CACHE_DIR/models/smollm2-135m/dense``).
SGLang engines run in subprocesses of this script (``--engine SPEC OUT``) with ``$OSCAR_SGLANG_PYTHONPATH`` (the
0.5.17 bundle first) and the oscar plugin's entry point, with CUDA graphs for decode and pages of 16 tokens, all in
parallel, one process per served method; meanwhile this process loads the model once, and compares each engine's
result as soon as that engine ends (the report is rewritten after every comparison, so a time limit keeps what was
compared):

- ``bf16``: ``bf16_triton``, SGLang's own BF16 backend (``--attention-backend triton``), and ``oscar_bf16eq``, the
  plugin with windows that cover every position (sink 64 + recent 512, identity artifact); greedy tokens compared
  token for token (where they part, the BF16 top-2 margin there), and each teacher forced like the INT2 runs.
- every other method (``auto`` and calibrated methods from ``--artifact``; ``quarot``, ``int2`` and other methods
  without calibration built in code, unclipped as published): the plugin with that artifact, BF16 model (SGLang's
  CUDA RMSNorm has no float32), sink 16, recent 16, greedy with the top-256 log-probabilities at each step.

Each served run is compared with the embedded engine (``oscar.models.engine``, same artifact, value rotation folded,
torch path) forced along SGLang's tokens, all prompts in one batch (``oscar.bench.correctness.compare.forced_logprobs_batch``):
next-token agreement (SGLang's token = the embedded argmax, Wilson 95%), the largest and median log-probability
difference over SGLang's token and its top 2, ``check_teacher_forced`` (``INT2_LOGPROB_TOL``, ``INT2_MEDIAN_TOL``),
the KL divergence between the two engines' distributions over SGLang's top 256 tokens plus the rest in one bucket
(a lower bound of the full KL by data processing), each engine's argmax against the embedded BF16 cache's, and the
full KL of the embedded method from the embedded BF16 cache (the size of the quantization's effect).
``--eval-sglang`` / ``--eval-embedded``: two ``python -m oscar eval`` output folders of the same cell (engine=sglang on
the GPU, engine=embedded): item ids, prompt hashes, log-likelihoods within ``INT2_LOGPROB_TOL`` and predictions.

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
from oscar.bench.host import ROOT, sglang_env
from oscar.bench.correctness.compare import (INT2_LOGPROB_TOL, INT2_MEDIAN_TOL, check_teacher_forced, forced_logprobs_batch,
                                       save_in_code_artifact)
from oscar.core.files import atomic_write_json, atomic_write_text

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
# formats with their own window rules: KIVI-2 served keeps no sink and a recent window of whole key blocks (32)
WINDOWS = {"kivi2": (0, 32)}


def windows(method: str) -> tuple[int, int]:
    """(sink, recent) of a served method in this table (S0_INT2/W_INT2 unless its format needs others)."""
    return WINDOWS.get(method, (S0_INT2, W_INT2))
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
    return subprocess.Popen([sys.executable, "-m", "oscar.bench.correctness.real_weights", "--engine", str(spec),
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


def compare_served(run: dict, emb_int2: list, emb_bf16: list) -> dict:
    """Teacher-forced comparison of one SGLang run with the embedded engine (its method's cache, and BF16's)."""
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

DEFAULT_METHODS = "bf16,auto,quarot,int2"
IN_CODE_OVERRIDES = ("method.clip=paper",)  # the in-code artifacts are the unclipped published baselines


def embedded_forced(model: Any, method: str, artifact: Any, sink: int, recent: int, prompts: list, forced: list,
                    overrides: tuple = ()) -> list:
    """The embedded engine (value rotation folded) teacher-forced along `forced`, all prompts in one batch
    (``oscar.bench.correctness.compare.forced_logprobs_batch``); `artifact` None: a method without rotations (bf16)."""
    # local: keeps omegaconf and transformers out of `gpu --help`
    from oscar.config import compose
    from oscar.models.engine import Engine, rotations_from_artifact

    cfg = compose([f"method={method}", *overrides, f"method.sink={sink}", f"method.recent={recent}"])
    rots = None if artifact is None else rotations_from_artifact(artifact, cfg.method, model)
    engine = Engine(model, None, cfg.method, rots, fold_values=artifact is not None)
    try:
        return forced_logprobs_batch(model, prompts, forced, engine.new_cache)
    finally:
        engine.close()


def served_groups(methods: list[str], artifacts: dict[str, tuple[Path, tuple]], path: str, prompts: list,
                  new_tokens: int, cpu: bool) -> dict[str, list[dict]]:
    """One SGLang engine process per group (they run in parallel): ``bf16_<backend>`` (SGLang's own BF16),
    ``oscar_bf16eq`` (the plugin, windows covering every position) and ``oscar_<method>`` per quantized method."""
    sampling = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    top = {"return_logprob": True, "top_logprobs_num": TOP}
    base = {"model_path": path, "input_ids": prompts, "sampling": sampling, "generate_args": top}
    groups: dict[str, list[dict]] = {}
    if "bf16" in methods:
        groups["bf16_triton"] = [{**base, "name": "bf16_triton", "engine_args": {
            "model_path": path, "attention_backend": "torch_native" if cpu else "triton", "dtype": "bfloat16"}}]
        groups["oscar_bf16eq"] = [{**base, "name": "oscar_bf16eq", "engine_args": {"model_path": path, **OSCAR,
                                                                                   "dtype": "bfloat16"},
                                   "env": {"OSCAR_ARTIFACT": str(artifacts["int2"][0]), "OSCAR_SINK": S0_BF16EQ,
                                           "OSCAR_RECENT": W_BF16EQ}}]
    for m in methods:
        if m != "bf16":
            groups[f"oscar_{m}"] = [{**base, "name": f"oscar_{m}", "engine_args": {"model_path": path, **OSCAR,
                                                                                  "dtype": MODEL_DTYPE},
                                     "env": {"OSCAR_ARTIFACT": str(artifacts[m][0]), "OSCAR_SINK": windows(m)[0],
                                             "OSCAR_RECENT": windows(m)[1]}}]
    return groups


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--methods", default=DEFAULT_METHODS,
                    help="served methods, comma-separated: bf16 (SGLang's BF16 and the plugin with covering windows), "
                         "methods without calibration (int2, quarot, ...: their artifact built in code) and methods "
                         "given by --artifact (default %(default)s)")
    ap.add_argument("--artifact", action="append", default=[], metavar="METHOD=DIR",
                    help="a calibration artifact of smollm2-135m for METHOD (e.g. auto=results/calibration/...)")
    ap.add_argument("--auto-artifact", type=Path, default=None, help="same as --artifact auto=DIR")
    ap.add_argument("--method-override", action="append", default=[],
                    help="method settings the calibrated artifacts were made with (default: the method's own)")
    ap.add_argument("--in-code-override", action="append", default=[],
                    help="settings of the methods whose artifact is built in code (e.g. method.bits=4: QuaRot-INT4, "
                         "a quantized row out of INT2's rounding-sensitive regime), after method.clip=paper")
    ap.add_argument("--prompts", type=int, default=0, help="first N prompts (default: 8; 2 with --cpu)")
    ap.add_argument("--new-tokens", type=int, default=0, help=f"greedy tokens per prompt (default {NEW_TOKENS}; 8 with --cpu)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--eval-sglang", type=Path, default=None)
    ap.add_argument("--eval-embedded", type=Path, default=None)
    ap.add_argument("--engine-timeout", type=float, default=300.0, help="seconds for the engine processes (all "
                                                                        "together; each result is compared when it ends)")
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
    return run(a)


def run(a: argparse.Namespace) -> int:
    """Start the engine processes, load the model meanwhile, compare each engine's result as it ends."""
    import torch
    from transformers import AutoTokenizer

    # local: keeps omegaconf and transformers out of `gpu --help`
    from oscar.config import compose
    from oscar.models import load_model
    from oscar.models.methods import needs_statistics
    from oscar.serve.client import model_path

    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    mcfg = compose(["model=smollm2-135m"]).model
    path = model_path(mcfg)  # the dense copy (made from the GGUF at first use)
    tok = AutoTokenizer.from_pretrained(path)
    n_prompts = a.prompts or (2 if a.cpu else len(TEXTS))
    new_tokens = a.new_tokens or (8 if a.cpu else NEW_TOKENS)
    prompts = [tok(t, add_special_tokens=True)["input_ids"] for t in TEXTS[:n_prompts]]
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    given = dict(x.split("=", 1) for x in a.artifact)
    if a.auto_artifact is not None:
        given.setdefault("auto", str(a.auto_artifact))
    in_code = (*IN_CODE_OVERRIDES, *a.in_code_override)
    artifacts: dict[str, tuple[Path, tuple]] = {"int2": (save_in_code_artifact(Path(path), "int2", out / "art_int2"),
                                                          IN_CODE_OVERRIDES)}
    for m in methods:
        if m in given:
            artifacts[m] = (Path(given[m]), tuple(a.method_override))
        elif m not in ("bf16", "int2"):
            if needs_statistics(compose([f"method={m}", *in_code]).method):
                raise SystemExit(f"--methods names {m!r}, which needs a calibration artifact: give --artifact {m}=DIR "
                                 f"(python -m oscar calibrate model=smollm2-135m method={m}) or leave it out")
            artifacts[m] = (save_in_code_artifact(Path(path), m, out / f"art_{m}", in_code), in_code)
    timings["setup_s"] = time.perf_counter() - t0
    groups = served_groups(methods, artifacts, path, prompts, new_tokens, a.cpu)
    procs = {name: None if a.reuse else start_engines(name, runs, out) for name, runs in groups.items()}
    t1 = time.perf_counter()
    model, _ = load_model(mcfg, device="cpu" if a.cpu else "cuda", dtype=MODEL_DTYPE)
    model.eval()
    timings["model_load_s"] = time.perf_counter() - t1  # overlaps the engines' start
    report: dict[str, Any] = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized; BF16 = BF16 KV over these weights)",
                              "device": "cpu (smoke test)" if a.cpu else torch.cuda.get_device_name(0),
                              "torch": torch.__version__, "prompts": len(prompts),
                              "prompt_tokens": [len(p) for p in prompts], "new_tokens": new_tokens,
                              "sink": S0_INT2, "recent": W_INT2, "methods": {}, "runs": {}, "timings": timings}
    served: dict[str, Any] = {}
    pending = dict(procs)
    while pending:
        done = []
        for name, proc in pending.items():
            rc: Any = 0 if proc is None else proc.poll()
            if rc is None and time.perf_counter() - t0 < a.engine_timeout:
                continue
            if rc is None:
                proc.kill()
                rc = "timeout"
            done.append(name)
            timings[f"engine_{name}_s"] = time.perf_counter() - t1
            res_path = out / f"{name}.json"
            served.update(json.loads(res_path.read_text()) if res_path.exists() else
                          {r["name"]: {"error": f"engine process exit {rc}; see {name}.log"} for r in groups[name]})
            for r in groups[name]:
                run_ = served.get(r["name"], {})
                report["runs"][r["name"]] = {k: v for k, v in run_.items() if k not in ("logprobs", "output_ids")}
                if "output_ids" in run_:
                    t2 = time.perf_counter()
                    compare_run(report, r["name"], run_, model, artifacts, prompts)
                    timings[f"compare_{r['name']}_s"] = time.perf_counter() - t2
            if {"bf16_triton", "oscar_bf16eq"} <= set(served) and "greedy_bf16_windows_cover" not in report and all(
                    "output_ids" in served[k] for k in ("bf16_triton", "oscar_bf16eq")):
                report["greedy_bf16_windows_cover"] = compare_bf16(served["bf16_triton"]["output_ids"],
                                                                  served["oscar_bf16eq"]["output_ids"],
                                                                  served["bf16_triton"]["logprobs"])
            write_report(out, report, t0)  # after every comparison: a later timeout keeps what was compared
        for name in done:
            pending.pop(name)
        if pending:
            time.sleep(0.5)
    if "auto" in artifacts:
        choices = json.loads((artifacts["auto"][0] / "meta.json").read_text()).get("choices", [])
        report["auto_artifact"] = {"center_k": sorted({str(c["center_k"]) for c in choices}),
                                   "rope_centered_heads": sum(c["center_k"] == "rope" for c in choices),
                                   "heads": len(choices)}
    if a.eval_sglang is not None and (a.eval_sglang / "result.json").exists() and a.eval_embedded is not None:
        report["eval_cell"] = compare_eval(a.eval_sglang, a.eval_embedded)
    md = write_report(out, report, t0)
    print(md)
    return 0


def compare_run(report: dict, name: str, run_: dict, model: Any, artifacts: dict, prompts: list) -> None:
    """The embedded engine forced along one served run's tokens (its method, and the BF16 cache), compared."""
    method = "bf16" if name in ("bf16_triton", "oscar_bf16eq") else name.removeprefix("oscar_")
    toks = run_["output_ids"]
    emb_bf16 = embedded_forced(model, "bf16", None, S0_INT2, W_INT2, prompts, toks)
    if method == "bf16":
        emb = emb_bf16
    else:
        art, overrides = artifacts[method]
        if json.loads((art / "meta.json").read_text()).get("cache_format", {}).get("kind", "rotated") != "rotated":
            art = None  # a format without rotations (KIVI's per-channel keys): the embedded engine builds it from the method
        emb = embedded_forced(model, method, art, *windows(method), prompts, toks, overrides)
    label = {"bf16_triton": "bf16 (SGLang's own)", "oscar_bf16eq": "bf16 (plugin, covering windows)"}.get(name, method)
    report["methods"][label] = {"method": method, "run": name, "model_dtype": MODEL_DTYPE, "windows": windows(method),
                                **compare_served(run_, emb, emb_bf16)}


def write_report(out: Path, report: dict, t0: float) -> str:
    report["total_s"] = time.perf_counter() - t0
    atomic_write_json(out / "gpu_correctness.json", report)
    md = render(report)
    atomic_write_text(out / "gpu_correctness.md", md)
    return md


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
    rows = r.get("methods", {})
    if rows:
        ci = lambda c, k: f"{c[k]:.3f} [{c[k + '_ci'][0]:.3f}, {c[k + '_ci'][1]:.3f}]"  # noqa: E731
        odd = "; ".join(f"{m}: sink {w[0]}, recent {w[1]}" for m, w in WINDOWS.items() if m in rows)
        lines += [f"## Served vs embedded, teacher forced (quantized methods: sink {r.get('sink', S0_INT2)}, recent "
                  f"{r.get('recent', W_INT2)}{'; ' + odd if odd else ''}; {MODEL_DTYPE} model)", "",
                  "Each served run's greedy tokens; the embedded engine (`oscar.models.engine`, same artifact, value "
                  "rotation folded) forced along them. Agreement: SGLang's token = the embedded argmax (Wilson 95%). "
                  "Differences: per step the largest |log-probability difference| over SGLang's token and its top 2. "
                  f"KL: SGLang's distribution against the embedded one over SGLang's top {TOP} + the rest (a lower "
                  "bound of the full KL). Check: `oscar.bench.correctness.compare.check_teacher_forced` (tolerance "
                  f"{INT2_LOGPROB_TOL}, median {INT2_MEDIAN_TOL}).", "",
                  "| served method | steps | next-token agreement | largest / median log-prob difference | mean KL "
                  "(served \\|\\| embedded) | check | INT2 argmax = BF16 argmax: served / embedded | KL(embedded BF16 "
                  "\\|\\| embedded method) |", "|---|---|---|---|---|---|---|---|"]
        for label, c in rows.items():
            check = "pass" if c["teacher_forced_ok"] else "FAIL"
            lines.append(f"| {label} | {c['steps']} | {ci(c, 'agreement_with_embedded_int2')} | "
                         f"{c['max_logprob_diff']:.3f} / {c['median_logprob_diff']:.4f} | "
                         f"{c['kl_served_vs_embedded_top_mean']:.2e} | {check} | {c['served_int2_vs_bf16_argmax']:.3f}"
                         f" / {c['embedded_int2_vs_bf16_argmax']:.3f} | {c['kl_embedded_bf16_to_int2_mean']:.3f} |")
        failed = [f"- {label}: {c['teacher_forced_error'][:300]}" for label, c in rows.items() if not c["teacher_forced_ok"]]
        lines += [""] + (["Failed checks (the first step outside the tolerance):", "", *failed, ""] if failed else [])
    g = r.get("greedy_bf16_windows_cover")
    if g:
        lines += ["## Greedy tokens, windows covering every position (sink 64 + recent 512, BF16 model)", "",
                  f"oscar (identity artifact, pages of 16) vs SGLang's own BF16 backend: {g['prompts_equal']}/"
                  f"{g['prompts']} prompts token for token equal" +
                  ("" if g["tokens_equal"] else f"; first differences {g['first_differences']}"), ""]
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
    t = r.get("timings", {})
    lines += ["Runs: " + ", ".join(
                  f"{k} ({'error: ' + v['error'][:200] if 'error' in v else 'start %.0f s, generate %.1f s' % (v.get('start_s', 0), v.get('generate_s', 0))})"
                  for k, v in r["runs"].items()), "",
              "Where the time went (s, from the script's start; engines run in parallel, each compared when it ends): "
              + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in t.items()) + f"; total {r.get('total_s', 0):.0f}.",
              "",
              "Reproduce: `python -m oscar gpu correctness auto=<auto artifact>` on a GPU host (benchmarks/README.md: "
              "the GGUF of smollm2-135m installed); the auto artifact: `python -m oscar calibrate model=smollm2-135m "
              "method=auto calibration.num_tokens=2048 calibration.seq_len=512 calibration.holdout_tokens=512`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

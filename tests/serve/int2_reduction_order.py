"""How far two float32 forwards of SmolLM2-135M under INT2 (quarot, S0=8, W=16) may disagree when they
differ only at the rounding level, the margin behind the cross-engine tolerances of tests/serve.

Teacher-forced (the same history at every step, the way greedy decoding runs: prefill, then one token
per step through the quantized cache): the embedded engine's next-token log-probabilities with the
weights as loaded, against the same forward with every weight moved by at most one float32 ulp
(random sign per element; the size of a reduction-order difference). A one-ulp change can move a
key/value element across a BF16 rounding or INT2 code boundary, which is where the differences
between engines grow beyond float32 rounding. With `--sglang` (serving environment), SGLang's own
greedy run with the plugin is compared the same way (the embedded engine forced along SGLang's
tokens). Writes reports/serve/int2_reduction_order.{csv,md}.

    OMP_NUM_THREADS=1 python tests/serve/int2_reduction_order.py [--seeds 6] [--sglang]

(It lives beside the serving tests: it measures their tolerances with their own driver and helpers.)
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from serve_helpers import SMOLLM2_DENSE, embedded_forced_logprobs, embedded_greedy, run_driver, save_in_code_artifact  # noqa: E402
from test_engine_smollm2 import NEW_TOKENS, RECENT, SINK, TEXTS  # noqa: E402

from oscar.core.files import atomic_write_csv, atomic_write_text  # noqa: E402


def _ulp_perturb(model, seed: int) -> None:
    """Move every float32 weight by -1, 0 or +1 ulp (uniformly at random), in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            step = torch.randint(-1, 2, p.shape, generator=gen)
            up, down = torch.nextafter(p, torch.full_like(p, float("inf"))), torch.nextafter(p, torch.full_like(p, -float("inf")))
            p.copy_(torch.where(step > 0, up, torch.where(step < 0, down, p)))


def _compare(ref: list[torch.Tensor], other: list[torch.Tensor], tokens: list[list[int]]) -> list[dict]:
    """Per step: |d logprob| of the forced token, max |d| over each side's top-2, and the top-2 margins."""
    rows = []
    for p, (a, b, toks) in enumerate(zip(ref, other, tokens)):
        for i, tok in enumerate(toks):
            ta, tb = a[i].topk(2), b[i].topk(2)
            ids = set(ta.indices.tolist()) | set(tb.indices.tolist()) | {tok}
            rows.append({"prompt": p, "step": i, "d_forced": abs(float(a[i, tok] - b[i, tok])),
                         "d_top2": max(abs(float(a[i, j] - b[i, j])) for j in ids),
                         "d_max": float((a[i] - b[i]).abs().max()),
                         "margin_ref": float(ta.values[0] - ta.values[1]),
                         "margin_other": float(tb.values[0] - tb.values[1]),
                         "argmax_equal": int(ta.indices[0] == tb.indices[0])})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--sglang", action="store_true", help="also compare SGLang's plugin run (serving environment)")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "serve" / "int2_reduction_order")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from oscar.config import compose
    from oscar.models import load_model

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(SMOLLM2_DENSE))
    prompts = [tok(t, add_special_tokens=True)["input_ids"] for t in TEXTS]
    tmp = Path(tempfile.mkdtemp(prefix="int2_ro_"))
    quarot = save_in_code_artifact(SMOLLM2_DENSE, "quarot", tmp / "quarot")
    load = lambda: load_model(compose(["model=smollm2-135m"]).model, device="cpu")[0].eval()  # noqa: E731
    model = load()
    greedy = embedded_greedy(model, "quarot", quarot, SINK, RECENT, prompts, NEW_TOKENS)
    ref = embedded_forced_logprobs(model, "quarot", quarot, SINK, RECENT, prompts, greedy)
    rows = []
    for seed in range(args.seeds):
        other = load()
        _ulp_perturb(other, seed)
        rows += [{"pair": f"embedded vs embedded+1ulp(seed {seed})", **r}
                 for r in _compare(ref, embedded_forced_logprobs(other, "quarot", quarot, SINK, RECENT, prompts, greedy),
                                   greedy)]
    _write(rows, args.out)
    if args.sglang:
        sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        run = {"name": "oscar_int2", "engine_args": {"model_path": str(SMOLLM2_DENSE), "attention_backend": "oscar",
                                                     "dtype": "float32"},
               "env": {"OSCAR_ARTIFACT": str(quarot), "OSCAR_SINK": SINK, "OSCAR_RECENT": RECENT},
               "input_ids": prompts, "sampling": sampling, "generate_args": {"return_logprob": True, "top_logprobs_num": 2}}
        served = run_driver([run], tmp)[0]["oscar_int2"]
        s_tokens = served["output_ids"]
        forced = embedded_forced_logprobs(model, "quarot", quarot, SINK, RECENT, prompts, s_tokens)
        for p, (toks, lp, lf) in enumerate(zip(s_tokens, served["logprobs"], forced)):
            for i, t in enumerate(toks):
                top = lp["output_top_logprobs"][i]
                sg = {int(e[1]): float(e[0]) for e in top}
                sg[int(lp["output_token_logprobs"][i][1])] = float(lp["output_token_logprobs"][i][0])
                rows.append({"pair": "sglang vs embedded (forced along sglang)", "prompt": p, "step": i,
                             "d_forced": abs(sg[t] - float(lf[i, t])),
                             "d_top2": max(abs(v - float(lf[i, j])) for j, v in sg.items()),
                             "d_max": float("nan"), "margin_ref": float(lf[i].topk(2).values.diff().abs()),
                             "margin_other": abs(top[0][0] - top[1][0]) if len(top) > 1 else float("nan"),
                             "argmax_equal": int(int(lf[i].argmax()) == t)})
    _write(rows, args.out)
    return 0


def _cpu() -> str:
    """CPU model and the vector ISA torch's kernels pick from (AVX2 / AVX-512 / AMX)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AMX", "amx_tile")) if flag in flags]
    return f"{model or platform.machine()}, {'/'.join(isa) or 'no AVX2'}"


def _write(rows: list[dict], out: Path) -> None:
    """The CSV of every step and the Markdown summary (one line per compared pair)."""
    atomic_write_csv(out.with_suffix(".csv"), rows)
    pairs = sorted({r["pair"] for r in rows}, key=lambda k: (k.startswith("sglang"), k))
    lines = [f"# INT2 teacher-forced log-probability differences ({_cpu()}, "
             f"torch {torch.__version__}, 1 thread)", "",
             "| pair | steps | max d(forced) | max d(top-2) | max d(any) | argmax differs | min top-2 margin where it differs |",
             "|---|---|---|---|---|---|---|"]
    for pair in pairs:
        sel = [r for r in rows if r["pair"] == pair]
        diff = [r for r in sel if not r["argmax_equal"]]
        lines.append(f"| {pair} | {len(sel)} | {max(r['d_forced'] for r in sel):.2e} | {max(r['d_top2'] for r in sel):.2e} | "
                     f"{max((r['d_max'] for r in sel if r['d_max'] == r['d_max']), default=float('nan')):.2e} | {len(diff)} | "
                     f"{min((r['margin_ref'] for r in diff), default=float('nan')):.2e} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())

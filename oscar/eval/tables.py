"""Small comparison tables from finished eval and fidelity cells: mean ± std over seeds, paired CI vs BF16.

`python -m oscar.eval.tables --results results --model smollm2-135m --out reports/eval/table.md`
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from oscar.core.files import atomic_write_text
from oscar.eval.stats import mean_std, paired_bootstrap

def _item_score(rec: dict) -> float:
    return float(rec["score"]) if "score" in rec else float(bool(rec.get("correct")))


def eval_rows(results: Path, model: str, baseline: str = "bf16") -> list[dict[str, Any]]:
    """One row per (benchmark, method): main metric mean ± std over seeds and the paired diff vs `baseline`."""
    cells: dict[tuple[str, str], list[tuple[dict, list[dict]]]] = defaultdict(list)
    for result_file in sorted((results / "eval" / model).glob("*/*/seed*/result.json")):
        cell = result_file.parent
        result = json.loads(result_file.read_text())
        records = [json.loads(x) for x in (cell / "items.jsonl").read_text().splitlines() if x.strip()]
        cells[(result["benchmark"], result["method"])].append((result, records))
    rows = []
    for (bench, method), runs in sorted(cells.items()):
        metric = next(iter(runs[0][0]["metrics"]))
        for name in ("score", "pass@1", "accuracy"):
            if name in runs[0][0]["metrics"]:
                metric = name
                break
        values = [r["metrics"][metric] for r, _ in runs]
        mean, std = mean_std(values)
        row = {"benchmark": bench, "stand_in_for": runs[0][0].get("stand_in_for"), "method": method, "metric": metric,
               "mean": mean, "std": std, "seeds": sorted(r["seed"] for r, _ in runs), "n": runs[0][0]["n"]}
        base = cells.get((bench, baseline))
        if base and method != baseline:
            mine = {(rec["id"], r["seed"]): _item_score(rec) for r, recs in runs for rec in recs}
            ref = {(rec["id"], r["seed"]): _item_score(rec) for r, recs in base for rec in recs}
            row["vs_baseline"] = paired_bootstrap(mine, ref)
            pred = {(rec["id"], r["seed"]): rec.get("prediction") for r, recs in runs for rec in recs}
            base_pred = {(rec["id"], r["seed"]): rec.get("prediction") for r, recs in base for rec in recs}
            common = set(pred) & set(base_pred)
            row["agreement"] = sum(pred[k] == base_pred[k] for k in common) / len(common)
            lls = {(rec["id"], r["seed"]): rec["loglikelihoods"] for r, recs in runs for rec in recs if "loglikelihoods" in rec}
            base_lls = {(rec["id"], r["seed"]): rec["loglikelihoods"] for r, recs in base for rec in recs
                        if "loglikelihoods" in rec}
            shared = sorted(set(lls) & set(base_lls), key=repr)
            if shared:
                row["choice_kl"] = sum(_choice_kl(base_lls[k], lls[k]) for k in shared) / len(shared)
        rows.append(row)
    return rows


def fidelity_rows(results: Path, model: str) -> list[dict[str, Any]]:
    """One row per fidelity cell (method, corpus or label)."""
    rows = []
    for result_file in sorted((results / "fidelity" / model).glob("*/*/result.json")):
        res = json.loads(result_file.read_text())
        rows.append({"method": res["method"], "cell": result_file.parent.name, "settings": res["settings"],
                     "windows": res.get("windows"), "metrics": res["metrics"]})
    return rows


def _pct_pm(mean: float, std: float) -> str:
    return f"{100 * mean:.1f} ± {100 * std:.1f}"


def _ci(d: dict | None) -> str:
    if not d:
        return "(baseline)"
    return f"{100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"


def _choice_kl(ref: list[float], got: list[float]) -> float:
    """KL(ref || got) between the answer-letter distributions (log-likelihoods renormalized over the choices)."""
    import math

    def norm(lls: list[float]) -> list[float]:
        top = max(lls)
        z = top + math.log(sum(math.exp(x - top) for x in lls))
        return [x - z for x in lls]

    lr, lg = norm(ref), norm(got)
    return sum(math.exp(a) * (a - b) for a, b in zip(lr, lg))


def _agreement(row: dict) -> str:
    text = "-" if "agreement" not in row else f"{100 * row['agreement']:.0f}%"
    if "choice_kl" in row:
        text += f" (letter KL {row['choice_kl']:.4f})"
    return text


def render_markdown(eval_rs: list[dict], fid_rs: list[dict]) -> str:
    """Markdown tables of the eval and fidelity rows."""
    lines = []
    if eval_rs:
        lines += ["| benchmark | method | metric | mean ± std over seeds (%) | seeds | n | diff vs BF16, 95% paired bootstrap CI (pts) | same prediction as BF16 |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in eval_rs:
            bench = r["benchmark"] + (f" (stand-in for {r['stand_in_for']})" if r["stand_in_for"] else "")
            spread = _pct_pm(r["mean"], r["std"]) if len(r["seeds"]) > 1 else f"{100 * r['mean']:.1f} (one seed)"
            lines.append(f"| {bench} | {r['method']} | {r['metric']} | {spread} | "
                         f"{','.join(map(str, r['seeds']))} | {r['n']} | {_ci(r.get('vs_baseline'))} | "
                         f"{_agreement(r)} |")
    if fid_rs:
        lines += ["", "| method | cell | mode | next-token KL vs BF16 [95% CI] | ppl method / BF16 | tokens |",
                  "|---|---|---|---|---|---|"]
        for r in fid_rs:
            m = r["metrics"]
            for mode in ("serving", "decode_equivalent"):
                key = f"kl.next_token.{mode}"
                if key in m:
                    lines.append(f"| {r['method']} | {r['cell']} | {mode} | {m[key]:.4f} [{m[key + '.ci_lo']:.4f}, "
                                 f"{m[key + '.ci_hi']:.4f}] | {m[f'ppl.{mode}']:.2f} / {m[f'ppl.{mode}.bf16']:.2f} | "
                                 f"{m[f'tokens.{mode}']} |")
        att = [r for r in fid_rs if "kl.attn" in r["metrics"]]
        if att:
            lines += ["", "| method | cell | attention KL (mean over layers) | QKᵀ MSE | S·V MSE | K MSE | V MSE |",
                      "|---|---|---|---|---|---|---|"]
            for r in att:
                m = r["metrics"]
                lines.append(f"| {r['method']} | {r['cell']} | {m['kl.attn']:.4g} | {m['mse.qk']:.4g} | {m['mse.sv']:.4g} | "
                             f"{m['mse.k']:.4g} | {m['mse.v']:.4g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print (or write) the comparison tables of one model's finished cells."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", default="results")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    text = render_markdown(eval_rows(Path(args.results), args.model), fidelity_rows(Path(args.results), args.model))
    if args.out:
        atomic_write_text(Path(args.out), text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

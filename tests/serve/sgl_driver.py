"""Test driver: run SGLang's offline ``sglang.Engine`` for a list of configurations, write JSON results.

Each configuration runs in this one process (SGLang's scheduler subprocesses inherit the ``OSCAR_*``
variables set for it) so the heavy import happens once. Usage: ``python sgl_driver.py SPEC.json OUT.json``
with ``SPEC = {"runs": [{"name", "engine_args", "env", "prompts" | "input_ids", "sampling", "generate_args"?}]}``.
``"rounds": [[ids, ...], ...]`` instead of ``input_ids`` generates each round after the previous one finished
(so a later round can hit the prefixes an earlier one left in the radix cache); the results concatenate them.
"""

from __future__ import annotations

import json
import os
import sys
import time

COMMON = dict(device="cpu", disable_radix_cache=True, chunked_prefill_size=-1, disable_cuda_graph=True,
              max_running_requests=8, max_total_tokens=4096, mem_fraction_static=0.5, log_level="info",
              random_seed=0)


def main(spec_path: str, out_path: str) -> int:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang

    spec = json.loads(open(spec_path).read())
    results = {}
    for run in spec["runs"]:
        saved = {k: os.environ.get(k) for k in run.get("env", {})}
        os.environ.update({k: str(v) for k, v in run.get("env", {}).items()})
        t0 = time.perf_counter()
        engine = sglang.Engine(**{**COMMON, **run["engine_args"]})
        started = time.perf_counter() - t0
        try:
            kwargs = {"sampling_params": run["sampling"]}
            kwargs.update(run.get("generate_args", {}))  # e.g. return_logprob, top_logprobs_num
            if "rounds" in run:
                outs = [o for ids in run["rounds"] for o in engine.generate(input_ids=ids, **kwargs)]
            else:
                if "input_ids" in run:
                    kwargs["input_ids"] = run["input_ids"]
                else:
                    kwargs["prompt"] = run["prompts"]
                outs = engine.generate(**kwargs)
            results[run["name"]] = {"output_ids": [o["output_ids"] for o in outs],
                                    "text": [o["text"] for o in outs], "start_s": started,
                                    "cached_tokens": [o["meta_info"].get("cached_tokens") for o in outs]}
            if kwargs.get("return_logprob"):  # [(logprob, token id, text)] per step; top-k lists per step
                results[run["name"]]["logprobs"] = [
                    {key: o["meta_info"].get(key) for key in ("output_token_logprobs", "output_top_logprobs")}
                    for o in outs]
        finally:
            engine.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    tmp = out_path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(results, fh)
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

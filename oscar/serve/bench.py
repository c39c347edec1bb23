"""SGLang's own one-batch benchmark (``sglang.benchmark.one_batch``) with the oscar plugin loaded.

    python -m oscar.serve.bench --model-path M --load-format dummy --attention-backend oscar --page-size 16 \
        --batch-size 1 8 --input-len 4096 30000 --output-len 16 ... --oscar-out rows.jsonl [--oscar-tag T]

SGLang's ``bench_one_batch`` neither loads plugins nor runs ``ServerArgs.check_server_args`` (only its
``Engine`` does), so this entry point registers the plugin and applies its hooks, runs the start-up check,
then drives SGLang's ``load_model`` and ``latency_test_run_once`` (the same prefill and decode timing as
``bench_one_batch``: one warm-up at the first shape, then each batch x input length). Each shape becomes one
JSON line in ``--oscar-out``: ``cache``, ``backend``, ``batch``, ``context``, ``decode_ms`` (median),
``prefill_s``, ``cuda_graph``, ``status`` (ok | capacity: over the pool's tokens | oom), the pool's token
capacity and the greedy tokens of the first request (the inputs are seeded, so two backends get the same
prompts: the GPU correctness check compares them).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _load_plugin() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from oscar.serve.plugin import register

    register()
    HookRegistry.apply_hooks()


def _record_tokens(runner: Any, store: list) -> None:
    """Keep the next-token tensors the bench runner returns (device clones: no sync inside the timing)."""
    extend, decode = runner.extend, runner.decode

    def ext(reqs: Any) -> Any:
        out = extend(reqs)
        store.append(out[0].clone())
        return out

    def dec(ids: Any, batch: Any) -> Any:
        out = decode(ids, batch)
        store.append(out[0].clone())
        return out

    runner.extend, runner.decode = ext, dec


def main(argv: list[str]) -> int:
    _load_plugin()
    import numpy as np
    import torch
    from sglang.benchmark import one_batch as ob
    from sglang.srt.server_args import PortArgs, ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ob.BenchArgs.add_cli_args(parser)
    parser.add_argument("--oscar-out", required=True, help="JSON-lines file the rows are appended to")
    parser.add_argument("--oscar-tag", default="", help="free text stored with each row")
    parser.add_argument("--oscar-seed", type=int, default=0, help="seed of the synthetic prompts")
    parser.add_argument("--oscar-shapes", default="", help="BATCHxINPUT,... to run instead of every --batch-size x "
                        "--input-len (the first one is also the warm-up)")
    args = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(args)
    bench_args = ob.BenchArgs.from_cli_args(args)
    server_args.check_server_args()  # the plugin's start-up check runs after SGLang's (a hook)
    if server_args.cuda_graph_config is not None:
        from sglang.srt.model_executor.cuda_graph_config import Phase

        server_args.cuda_graph_config[Phase.DECODE].max_bs = max(bench_args.batch_size)
    ob._set_envs_and_config(server_args)
    port_args = PortArgs.init_new(server_args)
    runner, _ = ob.load_model(server_args, port_args, 0, 0)
    capacity = int(runner.torch_runner.max_total_num_tokens)
    oscar = server_args.attention_backend == "oscar"
    base = dict(cache="oscar" if oscar else "bf16", backend=server_args.attention_backend,
                cuda_graph=not server_args.disable_cuda_graph, page_size=int(server_args.page_size or 1),
                max_total_num_tokens=capacity, tag=args.oscar_tag, device=torch.cuda.get_device_name())
    tokens: list = []
    _record_tokens(runner, tokens)

    def run(bs: int, il: int, ol: int) -> dict[str, Any]:
        np.random.seed(args.oscar_seed)
        reqs = ob.prepare_synthetic_inputs_for_latency_test(bs, il)
        tokens.clear()
        row = dict(base, batch=bs, context=il, output_len=ol)
        try:
            ret = ob.latency_test_run_once(bench_args.run_name, runner, print, reqs, bs, il, ol, 0, False, False,
                                           ("CPU", "GPU"), "", "all", 0)
        except torch.cuda.OutOfMemoryError as err:
            runner.clear()
            torch.cuda.empty_cache()
            return dict(row, status="oom", error=str(err).splitlines()[0][:200])
        if ret is None:
            return dict(row, status="capacity")
        first = [int(t[0]) for t in tokens] if tokens else []
        return dict(row, status="ok", decode_ms=1e3 * float(ret["median_decode_latency"]),
                    prefill_s=float(ret["prefill_latency"]), tokens=first)

    ol = bench_args.output_len[0]
    shapes = [(bs, il) for bs in bench_args.batch_size for il in bench_args.input_len]
    if args.oscar_shapes:
        shapes = [(int(b), int(n)) for b, n in (x.split("x") for x in args.oscar_shapes.split(","))]
    print("Warmup ...", flush=True)
    run(shapes[0][0], shapes[0][1], min(8, ol))
    for bs, il in shapes:
        row = run(bs, il, ol)
        print("OSCAR_ROW " + json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
        with open(args.oscar_out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

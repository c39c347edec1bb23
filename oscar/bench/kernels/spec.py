"""The kernel table (``python -m oscar gpu kernels``): paged decode attention against BF16 SDPA, one process.

Times, in one run on the same GPU: a large device-to-device copy (the bandwidth ceiling), torch SDPA BF16
decode attention with the cuDNN and flash backends (the baseline: the best of the two per shape), and the
paged quantized decode attention over its three segments (BF16 sink + quantized pages + BF16 recent) through
``oscar.cache.paged.decode_attention`` for each variant (``VARIANTS``: INT2 and INT4 in the fragment-order
pages read by the CUDA kernel, INT2 with rope-centered keys, INT4 in row pages read by the Triton kernel),
then the demotion of one token per sequence and the prefill quantization. Every column of a row is timed on
the same random codes (valid in both page layouts); each timing replays a CUDA graph that holds one call per
input set, the sets together several times the L2, and reports the median per call (``time_calls``). Before
timing, each variant is checked against the float32 dequantize-then-attend twin (relative error per head).

Files under ``out`` (``stem`` = ``name=``, default ``decode_attention``): ``<stem>_rows.csv`` (one row per shape
and variant, rewritten after every shape), ``<stem>_quantize.csv``, ``<stem>_env.json`` (hardware, command,
accuracy); ``report`` turns them into ``<stem>.csv`` (one row per shape), ``<stem>.md`` and ``<stem>.png``.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from oscar.bench import host
from oscar.core.files import atomic_write, atomic_write_csv, atomic_write_json, atomic_write_text
from oscar.kernels.launch import MmaLaunch, RowsLaunch

AREA = "kernels"
SUMMARY = "paged INT2/INT4 decode attention vs cuDNN/flash BF16 SDPA, demotion and prefill quantization"
DEFAULTS: dict[str, Any] = {
    "name": "decode_attention",
    "head_dims": "128,64",
    "batches": "1,8,32,128",
    "contexts": "4096,32768,131072",
    "variants": "int2,int2_rope,int4,int4_rows",
    "launch": "",  # more variants: NAME:{"bits": 2, "layout": "mma", <MmaLaunch or RowsLaunch fields>};NAME:{...}
    "parts": "attention,quantize",
    "check": True,
    "budget_s": 0,  # stop before the next shape once this many seconds have passed (0: no limit)
    "reps": 20,
    "q_heads": 32,
    "kv_heads": 8,
    "sink": 64,
    "recent": 256,
    "page_size": 64,
    "mem_gb": 120,
    "l2_factor": 4,
    "layer_weight_mb": 385.9,  # one Qwen3-8B layer's BF16 weights (the demotion's share of a layer step)
    "notes": "",  # Markdown appended to the report (the reading of the run)
}
# variant name -> (bits, page layout, rope-centered keys, launch options of the decode call)
VARIANTS: dict[str, dict[str, Any]] = {
    "int2": {"bits": 2, "layout": "mma"},
    "int2_rope": {"bits": 2, "layout": "mma", "rope": True},
    "int4": {"bits": 4, "layout": "mma"},
    "int4_rows": {"bits": 4, "layout": "rows"},
    "int2_rows": {"bits": 2, "layout": "rows"},
}
LABELS = {"int2": "INT2", "int2_rope": "INT2 + rope", "int4": "INT4", "int4_rows": "INT4 rows (v8)",
          "int2_rows": "INT2 rows (v8)"}


def stem(opts: dict[str, Any]) -> str:
    return str(opts["name"])


def _ints(s: Any) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


def variants(opts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The variants of this run: the named ``VARIANTS`` of ``variants=`` and the ``launch=`` ones."""
    out = {}
    for name in (x.strip() for x in str(opts["variants"]).split(",") if x.strip()):
        if name not in VARIANTS:
            raise ValueError(f"variants: unknown variant {name!r}; valid: {', '.join(VARIANTS)} (or launch=NAME:JSON)")
        out[name] = dict(VARIANTS[name])
    for item in (x.strip() for x in str(opts["launch"]).split(";") if x.strip()):
        name, sep, spec = item.partition(":")
        try:
            v = json.loads(spec) if sep else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"launch={item!r}: {exc}; write NAME:{{\"bits\": 2, \"layout\": \"mma\", ...}}") from None
        if not isinstance(v, dict) or v.get("layout", "mma") not in ("mma", "rows") or v.get("bits", 2) not in (2, 4):
            raise ValueError(f"launch={item!r}: expected NAME:JSON object with bits 2|4 and layout mma|rows")
        out[name.strip()] = {"bits": 2, "layout": "mma", **v}
        launch_of(out[name.strip()])  # refuse unknown or bad launch fields now
    if not out:
        raise ValueError("variants: nothing to time (variants= and launch= are empty)")
    return out


def check_options(opts: dict[str, Any]) -> None:
    """Refuse bad keys before any device work (names the bad value and what is valid)."""
    variants(opts)
    parts = {p.strip() for p in str(opts["parts"]).split(",") if p.strip()}
    if not parts or parts - {"attention", "quantize"}:
        raise ValueError(f"parts={opts['parts']!r}; valid: attention, quantize (comma-separated)")
    for key in ("head_dims", "batches", "contexts"):
        try:
            vals = _ints(opts[key])
        except ValueError:
            raise ValueError(f"{key}={opts[key]!r}: expected comma-separated integers") from None
        if not vals or min(vals) < 1:
            raise ValueError(f"{key}={opts[key]!r}: expected positive integers")
    if set(_ints(opts["head_dims"])) - {64, 128}:
        raise ValueError(f"head_dims={opts['head_dims']!r}; the kernels take head_dim 64 or 128")


def needs(opts: dict[str, Any]) -> list[host.Need]:
    check_options(opts)
    return [host.cuda_device(), host.python_modules(["triton"], "the kernels", "install triton (the GPU image has it)"),
            host.free_gpu_memory(min(float(opts["mem_gb"]), 20.0))]


# ----------------------------------------------------------------------------------------------------- timing


def time_calls(calls: list[Callable[[], Any]], reps: int = 20, graph: bool = True) -> tuple[float, str]:
    """Median microseconds per call: CUDA-graph replays of all ``calls`` (one per input set), else eager."""
    import torch

    for c in calls:  # warm-up: compilation, plans, allocator
        c()
    torch.cuda.synchronize()
    try:
        if not graph:
            raise RuntimeError("eager timing requested")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for c in calls:
                c()
        mode = "graph"
        run = cuda_graph.replay
    except Exception as exc:  # noqa: BLE001 - capture unsupported for this call: time eager launches instead
        if graph:
            print(f"  graph capture failed ({type(exc).__name__}: {exc}); timing eagerly", file=sys.stderr)
        torch.cuda.synchronize()
        mode = "eager"

        def run() -> None:
            for c in calls:
                c()
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times), mode


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch

    best = 0.0
    for nbytes in (1 << 30, 1 << 31):
        src = torch.randn(nbytes // 4, device="cuda")
        dst = torch.empty_like(src)
        us, _ = time_calls([lambda: dst.copy_(src)], reps=20, graph=False)  # a graph memcpy node is slower
        best = max(best, 2 * nbytes / (us * 1e-6))
        del src, dst
    torch.cuda.empty_cache()
    return best


def _n_sets(bytes_per_set: int, l2: int, factor: int, mem_bytes: int) -> int:
    want = max(1, math.ceil(factor * l2 / max(1, bytes_per_set)))
    fit = max(1, mem_bytes // max(1, bytes_per_set))
    return int(min(want, fit, 16))


# -------------------------------------------------------------------------------------------------- workloads


def bench_sdpa(B: int, T: int, H: int, hkv: int, d: int, backend: str, opts: dict[str, Any], l2: int) -> dict[str, Any]:
    """BF16 SDPA decode (one query per sequence, GQA) with one backend (cudnn | flash): microseconds and bytes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kv_bytes = 2 * B * hkv * T * d * 2
    if kv_bytes > opts["mem_gb"] * 2**30 * 0.6:
        return {"us": float("nan"), "status": "skipped: memory"}
    n = _n_sets(kv_bytes, l2, opts["l2_factor"], int(opts["mem_gb"] * 2**30 * 0.45))
    sets = [(torch.randn(B, H, 1, d, device="cuda", dtype=torch.bfloat16),
             torch.randn(B, hkv, T, d, device="cuda", dtype=torch.bfloat16),
             torch.randn(B, hkv, T, d, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def call(q, k, v):
        def f():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return f

    try:
        us, mode = time_calls([call(*s) for s in sets], reps=opts["reps"])
        status = "ok"
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is a row status
        us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:120]}"
    del sets
    torch.cuda.empty_cache()
    return {"us": us, "timing": mode, "bytes": kv_bytes + 2 * B * H * d * 2, "sets": n, "status": status}


def decode_inputs(B: int, T: int, H: int, hkv: int, d: int, opts: dict[str, Any], n_sets: int, seed: int = 0,
                  bits: int = 2, device: str = "cuda") -> dict[str, Any]:
    """Random pool, shuffled page tables (one set per page range), BF16 windows and transforms: a decode step's
    inputs. The codes are valid in both page layouts, so the same bytes time the mma and the row kernels."""
    import torch

    from oscar.cache.paged import HeadTransform, QuantPages, Segments  # local: keeps torch out of `gpu --help`

    g = torch.Generator(device=device).manual_seed(seed)
    ps, S0, W = opts["page_size"], opts["sink"], opts["recent"]
    t_int = max(0, T - S0 - W)
    pages_per_seq = max(1, -(-t_int // ps))
    npages = n_sets * B * pages_per_seq
    nbytes = d * bits // 8

    def pages() -> tuple:
        codes = torch.randint(0, 256, (npages, hkv, ps, nbytes), device=device, dtype=torch.uint8, generator=g)
        scale = (0.02 + 0.05 * torch.rand(npages, hkv, ps, 1, device=device, generator=g)).to(torch.bfloat16)
        zero = (-0.1 * torch.rand(npages, hkv, ps, 1, device=device, generator=g)).to(torch.bfloat16)
        return codes, scale, zero

    kc, vc = pages(), pages()
    perm = torch.randperm(npages, device=device, generator=g).to(torch.int32)
    tables = [perm[s * B * pages_per_seq:(s + 1) * B * pages_per_seq].reshape(B, pages_per_seq).contiguous()
              for s in range(n_sets)]

    def orth() -> torch.Tensor:
        return torch.linalg.qr(torch.randn(hkv, d, d, device=device, generator=g))[0].contiguous()

    kt = HeadTransform(R=orth(), mu=0.1 * torch.randn(hkv, d, device=device, generator=g),
                       rho=torch.full((hkv,), 0.95, device=device))
    vt = HeadTransform(R=orth(), mu=0.1 * torch.randn(hkv, d, device=device, generator=g),
                       rho=torch.full((hkv,), 0.92, device=device))
    kt_rope = HeadTransform(kt.R, kt.mu, kt.rho, 0.5 * torch.randn(hkv, d, device=device, generator=g),
                            1.0 / 1e6 ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))

    def bf16(n: int) -> torch.Tensor:
        return torch.randn(B, hkv, n, d, device=device, generator=g).to(torch.bfloat16)

    int_len = torch.full((B,), t_int, dtype=torch.int32, device=device)
    def lens(n: int) -> torch.Tensor:
        return torch.full((B,), n, dtype=torch.int32, device=device)

    segs = [Segments(tables[s], int_len, sink_k=bf16(S0), sink_v=bf16(S0), sink_len=lens(S0), recent_k=bf16(W),
                     recent_v=bf16(W), recent_len=lens(W), int_pos0=S0) for s in range(n_sets)]
    qs = [torch.randn(B, H, d, device=device, generator=g).to(torch.bfloat16) for _ in range(n_sets)]
    per_seq = hkv * (t_int * 2 * (nbytes + 2 * 2) + (S0 + W) * d * 2 * 2)
    layouts = {"rows": ("rows", "rows"), "mma": ("mma_k", "mma_v")}
    return dict(pages={lay: (QuantPages(*kc, bits, d, k_lay), QuantPages(*vc, bits, d, v_lay))
                       for lay, (k_lay, v_lay) in layouts.items()},
                kt=kt, vt=vt, kt_rope=kt_rope, segs=segs, qs=qs, bytes=B * (per_seq + 2 * H * d * 2), bits=bits)


def launch_of(variant: dict[str, Any]) -> Any:
    """The launch value of a variant: its keys other than bits/layout/rope as ``MmaLaunch`` (mma pages) or
    ``RowsLaunch`` (row pages) fields; None (the launcher's measured defaults) when it has none."""

    fields = {k: v for k, v in variant.items() if k not in ("bits", "layout", "rope")}
    cls = MmaLaunch if variant["layout"] == "mma" else RowsLaunch
    try:
        return cls(**fields) if fields else None
    except TypeError as exc:
        valid = ", ".join(cls.__dataclass_fields__)
        raise ValueError(f"launch {fields}: {exc}; {cls.__name__} takes {valid}") from None


def decode_call(inp: dict[str, Any], s: int, variant: dict[str, Any], backend: str = "triton") -> Callable[[], Any]:
    """One decode call of input set ``s`` for ``variant`` through the library's dispatcher (the path the caches
    and the serving backend take); ``backend="torch"``: the float32 twin on the same pages."""
    from oscar.cache import paged  # local: keeps torch out of `gpu --help`

    kp, vp = inp["pages"][variant["layout"]]
    kt = inp["kt_rope"] if variant.get("rope") else inp["kt"]
    launch = launch_of(variant) if backend != "torch" else None

    def f():
        return paged.decode_attention(inp["qs"][s], kp, vp, inp["segs"][s], kt, inp["vt"], backend=backend,
                                      launch=launch)
    return f


def bench_decode(B: int, T: int, H: int, hkv: int, d: int, opts: dict[str, Any], l2: int,
                 named: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Time each variant of ``named`` (variants of one bit width share one input pool)."""
    import torch

    t_int = max(0, T - opts["sink"] - opts["recent"])
    out: dict[str, dict[str, Any]] = {}
    for bits in sorted({v["bits"] for v in named.values()}):
        group = {k: v for k, v in named.items() if v["bits"] == bits}
        per_set = 2 * B * hkv * (t_int * (d * bits // 8 + 4) + (opts["sink"] + opts["recent"]) * d * 2)
        n = _n_sets(per_set, l2, opts["l2_factor"], int(opts["mem_gb"] * 2**30 * 0.5))
        inp = decode_inputs(B, T, H, hkv, d, opts, n, bits=bits)
        for name, var in group.items():
            try:
                us, mode = time_calls([decode_call(inp, s, var) for s in range(n)], reps=opts["reps"])
                status = "ok"
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run this shape is a row status
                us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:160]}"
            out[name] = {"us": us, "timing": mode, "bytes": inp["bytes"], "sets": n, "status": status}
        del inp
        torch.cuda.empty_cache()
    return out


def check_against_twin(d: int, opts: dict[str, Any], variant: dict[str, Any]) -> float:
    """Largest relative error per head of ``variant`` against the float32 twin on the same pages (batch 4, 8k)."""
    inp = decode_inputs(4, 8192, opts["q_heads"], opts["kv_heads"], d, opts, 1, seed=3, bits=variant["bits"])
    ref = decode_call(inp, 0, variant, backend="torch")().float()
    out = decode_call(inp, 0, variant)().float()
    return float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max())


def bench_quantize(B: int, d: int, hkv: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Demotion (B rows of K and V: rotation + centering + clip + pack, one fused launch) and prefill
    quantization (8192 rows), in the mma layouts; 16 launches per graph replay for the demotion."""
    import torch

    from oscar.cache.paged import (  # local: keeps torch out of `gpu --help`
        HeadTransform, QuantPages, rotate_quantize_pack, rotate_quantize_pack_kv)

    g = torch.Generator(device="cuda").manual_seed(1)
    ps, W = opts["page_size"], opts["recent"]
    out = []
    for kind, n_rows in (("demote", B), ("prefill", 8192)):
        n_sets = 16 if kind == "demote" else 1  # a single small launch would time the graph launch, not the kernel
        npages = -(-n_rows // ps) + 1
        pages = [[QuantPages.empty(npages, hkv, ps, d, 2, d, "cuda", lay) for lay in ("mma_k", "mma_v")]
                 for _ in range(n_sets)]
        R = torch.linalg.qr(torch.randn(hkv, d, d, device="cuda", generator=g))[0].contiguous()
        t = HeadTransform(R=R, mu=torch.randn(hkv, d, device="cuda", generator=g),
                          rho=torch.full((hkv,), 0.95, device="cuda"))
        slots = torch.randperm(npages * ps, device="cuda", generator=g)[:n_rows]
        calls = []
        for k in range(n_sets):
            if kind == "demote":
                src = torch.randn(n_rows, hkv, W, d, device="cuda", generator=g).to(torch.bfloat16)
                idx = torch.randint(0, W, (n_rows,), device="cuda", generator=g)

                def f(src=src, idx=idx, pg=pages[k]):
                    rotate_quantize_pack_kv(src, src, slots, pg[0], pg[1], t, t, src_index=idx, backend="triton")
            else:
                src = torch.randn(n_rows, hkv, d, device="cuda", generator=g).to(torch.bfloat16)

                def f(src=src, pg=pages[k]):
                    rotate_quantize_pack(src, slots, pg[0], t, backend="triton")
            calls.append(f)
        try:
            us, mode = time_calls(calls, reps=opts["reps"])
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - reported as the row's status
            us, mode, status = float("nan"), "-", f"error: {type(exc).__name__}: {str(exc)[:160]}"
        out.append({"kind": kind, "batch": B, "head_dim": d, "rows": n_rows, "us": us, "timing": mode, "status": status,
                    "layout": "mma"})
    return out


# ------------------------------------------------------------------------------------------------------ table


def measure(opts: dict[str, Any], out: Path, env: dict[str, Any]) -> None:
    """Time every shape x variant (and the quantization kernels); raw rows to ``<stem>_rows.csv``."""
    import torch

    check_options(opts)
    t0 = time.time()
    named = variants(opts)
    name = stem(opts)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    bw = copy_bandwidth()
    env.update(copy_tb_s=bw / 1e12, variants={k: v for k, v in named.items()},
               shape={k: opts[k] for k in ("q_heads", "kv_heads", "sink", "recent", "page_size")})
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    H, hkv = opts["q_heads"], opts["kv_heads"]
    if opts["check"]:
        acc = {}
        for d in _ints(opts["head_dims"]):
            for vname, var in named.items():
                try:
                    acc[f"{vname}_d{d}"] = check_against_twin(d, opts, var)
                except Exception as exc:  # noqa: BLE001 - recorded; its timing row will fail the same way
                    acc[f"{vname}_d{d}"] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
        env["rel_err_vs_twin"] = acc
        print(f"against the float32 twin (batch 4, 8k): {json.dumps(acc)}", flush=True)
    atomic_write_json(out / f"{name}_env.json", env)
    parts = {p.strip() for p in str(opts["parts"]).split(",")}
    rows: list[dict[str, Any]] = []
    shapes = [(d, T, B) for d in _ints(opts["head_dims"]) for T in _ints(opts["contexts"])
              for B in _ints(opts["batches"])]
    for d, T, B in (shapes if "attention" in parts else []):
        if opts["budget_s"] and time.time() - t0 > opts["budget_s"]:
            print(f"budget of {opts['budget_s']} s spent: stopping before d={d} B={B} T={T}", flush=True)
            env["stopped_before"] = f"d={d} batch={B} context={T}"
            break
        sd = {be: bench_sdpa(B, T, H, hkv, d, be, opts, l2) for be in ("cudnn", "flash")}
        ok = [sd[k]["us"] for k in sd if sd[k].get("status") == "ok"]
        best_bf16 = min(ok) if ok else float("nan")
        res = bench_decode(B, T, H, hkv, d, opts, l2, named)
        for vname, r in res.items():
            rows.append({"head_dim": d, "batch": B, "context": T, "variant": vname,
                         "launch": json.dumps(named[vname], sort_keys=True), "us": r["us"], "status": r["status"],
                         "bytes": r["bytes"], "sets": r["sets"], "timing": r["timing"], "cudnn_us": sd["cudnn"]["us"],
                         "flash_us": sd["flash"]["us"], "bf16_best_us": best_bf16, "copy_tb_s": bw / 1e12,
                         "tb_s": r["bytes"] / (r["us"] * 1e-6) / 1e12, "bw_frac": r["bytes"] / (r["us"] * 1e-6) / bw,
                         "speedup": best_bf16 / r["us"]})
        line = " / ".join(f"{k} {r['us']:.1f}" if r["status"] == "ok" else f"{k} {r['status'][:60]}"
                          for k, r in res.items())
        print(f"d={d} B={B} T={T} cudnn={sd['cudnn']['us']:.1f} flash={sd['flash']['us']:.1f} {line} "
              f"({time.time() - t0:.0f} s)", flush=True)
        atomic_write_csv(out / f"{name}_rows.csv", rows)
    q_rows = []
    for d in (_ints(opts["head_dims"]) if "quantize" in parts else []):
        for B in _ints(opts["batches"]):
            q_rows += bench_quantize(B, d, hkv, opts)
    if q_rows:
        atomic_write_csv(out / f"{name}_quantize.csv", q_rows)
    env["layer_weight_mb"] = opts["layer_weight_mb"]
    atomic_write_json(out / f"{name}_env.json", env)


def _read_csv(path: Path) -> list[dict[str, Any]]:
    def conv(k: str, v: str) -> Any:
        if v == "":
            return None
        if k in ("head_dim", "batch", "context", "rows", "sets", "bytes"):
            return int(float(v))
        try:
            return float(v)
        except ValueError:
            return v
    with open(path, newline="") as fh:
        return [{k: conv(k, v) for k, v in r.items()} for r in csv.DictReader(fh)]


def wide_rows(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per shape: the BF16 baselines and each variant's time, speed-up and bandwidth fraction."""
    shapes: dict[tuple, dict[str, Any]] = {}
    for r in raw:
        key = (r["head_dim"], r["batch"], r["context"])
        row = shapes.setdefault(key, {"head_dim": key[0], "batch": key[1], "context": key[2], "cudnn_us": r["cudnn_us"],
                                      "flash_us": r["flash_us"], "bf16_best_us": r["bf16_best_us"],
                                      "copy_tb_s": r["copy_tb_s"]})
        if r["status"] != "ok":
            row[f"{r['variant']}_status"] = r["status"]
            continue
        row[f"{r['variant']}_us"] = r["us"]
        row[f"{r['variant']}_speedup"] = r["speedup"]
        row[f"{r['variant']}_bw_frac"] = r["bw_frac"]
    out = list(shapes.values())
    for row in out:
        if row.get("int2_us") and row.get("int2_rope_us"):
            row["rope_over_plain"] = row["int2_rope_us"] / row["int2_us"]
    return sorted(out, key=lambda r: (-r["head_dim"], r["context"], r["batch"]))


def _f(x: Any, nd: int = 1, suffix: str = "") -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}{suffix}"


def markdown_table(rows: list[dict[str, Any]], names: list[str]) -> list[str]:
    """The table: BF16 baselines, each variant's microseconds, speed-ups over the best BF16, INT2's bandwidth."""
    rope = "int2" in names and "int2_rope" in names
    head = ["d", "batch", "context", "cuDNN", "flash", *[LABELS.get(n, n) for n in names]]
    head += ["rope / plain"] if rope else []
    head += [f"{LABELS.get(n, n)} x best BF16" for n in names if not n.endswith("_rows")]
    head += [f"{LABELS.get(names[0], names[0])} of copy bw"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["head_dim"]), str(r["batch"]), str(r["context"]), _f(r["cudnn_us"]), _f(r["flash_us"])]
        cells += [_f(r.get(f"{n}_us")) or str(r.get(f"{n}_status", ""))[:30] for n in names]
        cells += [_f(r.get("rope_over_plain"), 2)] if rope else []
        cells += [_f(r.get(f"{n}_speedup"), 2, "x") for n in names if not n.endswith("_rows")]
        frac = r.get(f"{names[0]}_bw_frac")
        cells += ["" if frac is None else f"{100 * frac:.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def quantize_lines(q_rows: list[dict[str, Any]], rows: list[dict[str, Any]], env: dict[str, Any]) -> list[str]:
    """The quantization kernels, with the demotion's share of the fastest INT2 attention and of a layer step."""
    bw = float(env.get("copy_tb_s") or float("nan")) * 1e12
    weights_us = float(env.get("layer_weight_mb", DEFAULTS["layer_weight_mb"])) * 1e6 / bw * 1e6
    lines = ["| kind | d | batch | rows | us | share of attention + demotion (fastest INT2 of that batch) | share of a "
             f"layer step (+ {env.get('layer_weight_mb', DEFAULTS['layer_weight_mb']):.0f} MB of BF16 weights at copy "
             "bandwidth, Qwen3-8B) |", "|---|---|---|---|---|---|---|"]
    for r in q_rows:
        share = layer = ""
        if r["kind"] == "demote":
            att = [x["int2_us"] for x in rows if x["batch"] == r["batch"] and x["head_dim"] == r["head_dim"]
                   and x.get("int2_us")]
            if att and r["us"] == r["us"]:
                share = f"{100 * r['us'] / (r['us'] + min(att)):.1f}%"
                layer = f"{100 * r['us'] / (r['us'] + min(att) + weights_us):.1f}%"
        lines.append(f"| {r['kind']} | {r['head_dim']} | {r['batch']} | {r['rows']} | {_f(r['us'])} | {share} | "
                     f"{layer} |")
    return lines


def compare_lines(rows: list[dict[str, Any]], ref_path: Path, names: list[str]) -> list[str]:
    """New against a committed table of the same shapes: ratio new / old per column (median, range, within 5%)."""
    ref = {(r["head_dim"], r["batch"], r["context"]): r for r in _read_csv(ref_path)}
    for r in ref.values():  # the committed v10 table named the row-layout INT4 column int4_rows_v8
        for k in [k for k in r if "_rows_v8_" in k]:
            r.setdefault(k.replace("_rows_v8_", "_rows_"), r[k])
    cols = [("cudnn_us", "cuDNN"), ("flash_us", "flash")] + [(f"{n}_us", LABELS.get(n, n)) for n in names]
    lines = [f"New / committed (`{ref_path}`), per column over the shapes both have (1.00 = the same time):", "",
             "| column | shapes | median | min | max | within +-5% |", "|---|---|---|---|---|---|"]
    per_shape = []
    for key, label in cols:
        ratios = []
        for r in rows:
            old = ref.get((r["head_dim"], r["batch"], r["context"]), {}).get(key)
            if r.get(key) and old:
                ratios.append(r[key] / old)
        if ratios:
            within = sum(abs(x - 1) <= 0.05 for x in ratios)
            lines.append(f"| {label} | {len(ratios)} | {statistics.median(ratios):.3f} | {min(ratios):.3f} | "
                         f"{max(ratios):.3f} | {within}/{len(ratios)} |")
    first = names[0]
    for r in rows:
        old = ref.get((r["head_dim"], r["batch"], r["context"]), {})
        if r.get(f"{first}_us") and old.get(f"{first}_us"):
            per_shape.append(f"| {r['head_dim']} | {r['batch']} | {r['context']} | {_f(old.get('cudnn_us'))} | "
                             f"{_f(r['cudnn_us'])} | {_f(old[f'{first}_us'])} | {_f(r[f'{first}_us'])} | "
                             f"{r[f'{first}_us'] / old[f'{first}_us']:.3f} |")
    if per_shape:
        label = LABELS.get(first, first)
        lines += ["", f"| d | batch | context | cuDNN committed | cuDNN now | {label} committed | {label} now | "
                  f"{label} now / committed |", "|---|---|---|---|---|---|---|---|", *per_shape]
    return lines


def report(out: Path, opts: dict[str, Any]) -> list[Path]:
    """``<stem>.csv``, ``<stem>.md`` and ``<stem>.png`` from the raw rows and the env record of ``measure``."""
    name = stem(opts)
    raw_path = out / f"{name}_rows.csv"
    if not raw_path.is_file():
        raise FileNotFoundError(f"{raw_path}: no raw rows (run `python -m oscar gpu kernels out={out}` on a GPU first)")
    env = host.read_env(out / f"{name}_env.json")
    raw = _read_csv(raw_path)
    rows = wide_rows(raw)
    names = list(dict.fromkeys(r["variant"] for r in raw))
    written = [out / f"{name}.csv", out / f"{name}.md"]
    atomic_write_csv(written[0], rows)
    q_path = out / f"{name}_quantize.csv"
    q_rows = _read_csv(q_path) if q_path.is_file() else []
    shape = env.get("shape", {k: DEFAULTS[k] for k in ("q_heads", "kv_heads", "sink", "recent", "page_size")})
    md = [f"# Decode attention: paged {', '.join(LABELS.get(n, n) for n in names)} vs BF16 SDPA", "",
          host.hardware_line(env) + f" Copy bandwidth (read + write, measured in the run): "
          f"{float(env.get('copy_tb_s', float('nan'))):.2f} TB/s.", "",
          f"Command: `{env.get('command', '?')}`", "",
          f"One layer, {shape['q_heads']} query heads over {shape['kv_heads']} KV heads, one query per sequence; "
          f"sink {shape['sink']} + quantized pages of {shape['page_size']} tokens + recent {shape['recent']}, BF16 "
          "windows. Times in microseconds per call: median of CUDA-graph replays over input sets larger than L2, every "
          "column of a row in the same process on the same random codes (`oscar.bench.kernels.spec`). Baseline: the "
          "faster of torch SDPA's cuDNN and flash backends on the BF16 K/V of the same context. Variants "
          "(`oscar.cache.paged.decode_attention`, default launch): "
          + "; ".join(f"{LABELS.get(n, n)} = `{json.dumps(env.get('variants', {}).get(n, VARIANTS.get(n, {})))}`"
                      for n in names) + ". Bandwidth fraction: the variant's bytes / time / copy bandwidth.", ""]
    acc = env.get("rel_err_vs_twin")
    if acc:
        md += ["Against the float32 dequantize-then-attend twin on the same pages (batch 4, 8k; largest relative "
               "error per head; test tolerance 1.5e-2): " + ", ".join(
                   f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in acc.items()) + ".", ""]
    if env.get("stopped_before"):
        md += [f"The time budget stopped the run before {env['stopped_before']}.", ""]
    md += markdown_table(rows, names)
    if q_rows:
        md += ["", "Quantization kernels (rotation + centering + clip + pack into the mma pages; demotion: K and V of "
               "one token per sequence in one launch, 16 launches per graph replay, time per launch):", ""]
        md += quantize_lines(q_rows, rows, env)
    if opts.get("compare"):
        md += ["", "## Against the committed numbers", ""] + compare_lines(rows, Path(opts["compare"]), names)
    if opts.get("notes") and Path(opts["notes"]).is_file():
        md += ["", Path(opts["notes"]).read_text().rstrip()]
    atomic_write_text(written[1], "\n".join(md) + "\n")
    try:
        plot(rows, names, out / f"{name}.png")
        written.append(out / f"{name}.png")
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    print("\n".join(md))
    return written


def plot(rows: list[dict[str, Any]], names: list[str], path: Path) -> None:
    """Speed-up over the best BF16 against context, one panel per (head_dim, variant), one line per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [n for n in names if not n.endswith("_rows")] or names
    dims = sorted({r["head_dim"] for r in rows}, reverse=True) or [128]
    fig, axes = plt.subplots(len(dims), len(shown), figsize=(5 * len(shown), 4 * len(dims)), squeeze=False,
                             sharey=True)
    for i, d in enumerate(dims):
        for j, n in enumerate(shown):
            ax = axes[i][j]
            for B in sorted({r["batch"] for r in rows}):
                rs = sorted([r for r in rows if r["head_dim"] == d and r["batch"] == B and r.get(f"{n}_speedup")],
                            key=lambda r: r["context"])
                if rs:
                    ax.plot([r["context"] // 1024 for r in rs], [r[f"{n}_speedup"] for r in rs], marker="o",
                            label=f"batch {B}")
            ax.axhline(1, color="black", lw=0.5)
            ax.set(xscale="log", xlabel="context (k tokens)", ylabel="speed-up vs best BF16 SDPA",
                   title=f"{LABELS.get(n, n)}, head_dim {d}")
            if ax.get_lines():
                ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)


def track(out: Path, opts: dict[str, Any], uri: str) -> str:
    """MLflow: experiment ``oscar/gpu/kernels``, a parent run with the report, one child run per shape."""
    from oscar.bench import mirror  # local: keeps omegaconf and pandas out of import time (MLflow only)

    name = stem(opts)
    rows = _read_csv(out / f"{name}.csv")
    cells = []
    for r in rows:
        metrics = {"perf.cudnn_us": r.get("cudnn_us"), "perf.flash_us": r.get("flash_us")}
        for k, v in r.items():
            if k.endswith("_us") and k not in ("cudnn_us", "flash_us", "bf16_best_us"):
                metrics[f"perf.{k}"] = v
            elif k.endswith("_speedup"):
                metrics[f"perf.{k}"] = v
        cells.append(mirror.Cell(f"d{r['head_dim']}/b{r['batch']}/T{r['context']}",
                                 {"head_dim": r["head_dim"], "batch": r["batch"], "context": r["context"]}, metrics))
    files = [out / f"{name}{suffix}" for suffix in (".md", ".csv", ".png", "_rows.csv", "_quantize.csv", "_env.json")]
    return mirror.mirror("kernels", cells, files, host.read_env(out / f"{name}_env.json"), uri)

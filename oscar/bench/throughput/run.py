"""The measuring of the throughput table (``python -m oscar gpu throughput``; ``spec`` calls ``run``): settings, the
device and its memory accounting, one timed point (cache allocated and filled, the decode step captured in
a CUDA graph and timed, its kernels split by category), the largest batch that fits, the GPU
correctness check, and the run that writes the CSV files.

Every point records which decode step it ran (column ``step_path``): ``compiled``, the fused step of
`oscar.models.fused_step` (fused QKV and gate/up GEMMs, the layer bodies compiled around the cache call, one
CUDA graph), the default for every cache; ``hf``, the transformers forward in one CUDA graph ("HF eager +
graph"), kept as a second, labelled baseline for the caches of ``hf_caches`` (default BF16). The largest
batch that fits is probed with eager HF steps (no compilation per probed batch size; the activations of
one decode step are a few MB against GBs of cache).
"""

from __future__ import annotations

import copy
import gc
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import transformers
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel

from oscar.bench.throughput import decode as tp
from oscar.bench.throughput import options
from oscar.bench.throughput.report import read_csv
from oscar.cache import device_cache as dc
from oscar.config import compose
from oscar.core.files import atomic_write_csv as write_csv, atomic_write_text as write_atomic
from oscar.eval.fidelity import block_bootstrap_ci
from oscar.models.fused_step import FusedDecoder

GRID_KEYS = ["model", "cache", "step_path", "layout", "batch", "context", "status", "step_us", "gemm_us", "attention_us",
             "quantize_us", "other_us", "kernel_us", "tokens_per_s", "weight_bytes_read", "kv_bytes", "floor_us",
             "floor_share", "kv_bytes_per_element", "attn_variant", "attn_variants_us", "timing"]
STEP_PATHS = ("compiled", "fused", "hf")  # fused: the fused step uncompiled (compile=false, the CPU)


# ----------------------------------------------------------------------------------------------
# settings


class Settings:
    """The resolved settings of a run: ``experiment.extra.profile`` of the configuration + the flags
    (``oscar.bench.throughput.options.FLAGS``)."""

    def __init__(self, cfg: Any, flags: dict[str, Any]) -> None:
        prof = cfg.experiment.extra.get("profile")
        if prof is None:
            raise ValueError(f"experiment {cfg.experiment.name!r} has no extra.profile section; use experiment=throughput")
        self.prof = OmegaConf.to_container(prof, resolve=True)
        self.tiny = bool(flags["tiny"])
        p = self.prof
        self.models = options.names(flags["models"]) or list(cfg.experiment.models)
        self.caches = options.names(flags["caches"]) or list(cfg.experiment.methods)
        self.batches = options.ints(flags["batches"]) or list(p["batches"])
        self.contexts = options.ints(flags["contexts"]) or list(p["contexts"])
        self.speedup_contexts = list(p.get("speedup_contexts", []))
        self.job_context = int(p["job_context"])
        self.job_batches = list(p["job_batches"])
        self.fit_max = int(p.get("fit_max_batch", 1024))
        self.reps = int(flags["reps"]) or int(p.get("reps", 10))
        self.temperature = float(p.get("temperature", 0.6))
        self.extra_steps = int(p.get("extra_steps", 16))
        self.budget = float(flags["budget_gb"]) * 2**30
        self.layout = str(flags["layout"])
        if self.layout not in options.LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not valid; choose {', '.join(options.LAYOUTS)}")
        self.hf_caches = options.names(flags["hf_caches"])
        self.compile = bool(flags["compile"])  # False: the fused step runs uncompiled (eager) on the GPU too
        self.points = [options.point(x) for x in options.names(flags["points"])]
        self.parts = options.names(flags["parts"])
        bad = [x for x in self.parts if x not in options.PARTS]
        if bad:
            raise ValueError(f"parts {bad} are not valid; choose from {', '.join(options.PARTS)}")
        if self.tiny:
            t = p["tiny"]
            self.models = ["tiny-qwen3"]
            self.batches, self.contexts = list(t["batches"]), list(t["contexts"])
            self.speedup_contexts, self.job_context = [], int(t["job_context"])
            self.job_batches, self.fit_max, self.reps = list(t["job_batches"]), int(t["fit_max_batch"]), int(t["reps"])
            self.prof["check"] = {**p["check"], **t.get("check", {})}

    def architecture(self, name: str, cfg: Any) -> tuple[str, dict[str, Any]]:
        """(family, config kwargs) of a model: registry geometry + extra sizes from the profile settings."""
        if name == "tiny-qwen3":
            return "qwen3", dict(self.prof["tiny"]["architecture"])
        model_cfg = cfg.model if cfg.model.name == name else compose([f"model={name}"]).model
        extra = self.prof.get("architectures", {}).get(name)
        if extra is None:
            raise ValueError(f"no architecture sizes for model {name!r} in experiment.extra.profile.architectures")
        dims = dict(num_hidden_layers=int(model_cfg.num_layers), num_attention_heads=int(model_cfg.num_heads),
                    num_key_value_heads=int(model_cfg.num_kv_heads), head_dim=int(model_cfg.head_dim),
                    hidden_size=int(model_cfg.hidden_size), **extra)
        return str(model_cfg.family), dims


# ----------------------------------------------------------------------------------------------
# measuring


class Machine:
    """Device, memory accounting and timing: CUDA graphs and events on a GPU, eager wall time on the CPU."""

    def __init__(self, device: str, budget: float) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.budget = budget
        self.cpu_bytes = 0  # CPU accounting: bytes of the model and the live cache
        self.bandwidth = math.nan  # measured copy bandwidth, bytes/s (read + write), set by `run`

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else self.cpu_bytes

    def over_budget(self) -> bool:
        return self.budget > 0 and self.allocated() > self.budget

    def is_oom(self, exc: BaseException) -> bool:
        return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower()

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


class BudgetExceeded(MemoryError):
    """A cache that allocates but passes the configured memory budget."""


def _sdpa_backends() -> dict[str, Any]:
    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def pick_bf16_attention(cache: Any, batch: int, heads: int, d: int, machine: Machine, reps: int) -> tuple[str, dict[str, float]]:
    """Time layer 0's decode attention (write + SDPA) for each SDPA backend and GQA layout; the fastest
    name (``backend/layout``) and every variant's median microseconds (failed variants left out)."""
    if not machine.cuda:
        return "math/rows", {}
    q = torch.randn(batch, heads, 1, d, dtype=torch.bfloat16, device=machine.device)
    kv = torch.randn(batch, cache.hkv, 1, d, dtype=torch.bfloat16, device=machine.device)
    times: dict[str, float] = {}
    for bname, backend in _sdpa_backends().items():
        for layout in ("rows", "enable_gqa"):
            cache.gqa = layout
            try:
                with sdpa_kernel([backend]), torch.no_grad():
                    us = tp.time_graph(lambda: cache.attend_and_write(0, q, kv, kv, d ** -0.5), reps=max(reps, 10))
                times[f"{bname}/{layout}"] = tp.median(us)
            except RuntimeError as exc:  # backend not eligible for these shapes
                print(f"  bf16 attention {bname}/{layout}: not available ({str(exc).splitlines()[0][:120]})", file=sys.stderr)
    if not times:
        raise RuntimeError("no SDPA backend (cuDNN, flash) runs the BF16 decode attention here")
    best = min(times, key=times.get)  # type: ignore[arg-type]
    cache.gqa = best.split("/")[1]
    return best, times


def weight_bytes_read(model: Any) -> int:
    """Weight bytes one decode step reads: every parameter once, the input embedding table excepted (a step
    gathers B of its rows) unless the LM head shares it."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    return weight_bytes - (0 if tied else embed.numel() * embed.element_size())


def byte_floor(row: dict[str, Any], weights: int, bandwidth: float) -> None:
    """The point's byte floor: weights read per step + the cache allocation, at the measured copy bandwidth
    (``floor_us``), and the share of it the step reaches (``floor_share`` = floor / step)."""
    row["weight_bytes_read"] = weights
    if row.get("kv_bytes") is None or not bandwidth or math.isnan(bandwidth):
        return
    row["floor_us"] = (weights + float(row["kv_bytes"])) / bandwidth * 1e6
    if row.get("step_us"):
        row["floor_share"] = row["floor_us"] / float(row["step_us"])


def measure_point(model: Any, fmt: Any, batch: int, context: int, s: Settings, machine: Machine,
                  time_it: bool = True, forward: Optional[Any] = None) -> tuple[dict[str, Any], dict[str, float]]:
    """One (cache, batch, context) point: allocate (OOM -> status), fill, capture, time, split, byte floor.
    ``forward``: the fused step (`oscar.models.fused_step.FusedDecoder`; row ``step_path`` ``compiled``), None for
    the transformers forward (``hf``). Returns the row and the per-kernel microseconds of one step."""
    layers, heads, hkv, d = tp.geometry(model)
    path = "hf" if forward is None else ("compiled" if forward.compiled else "fused")
    row: dict[str, Any] = {"cache": fmt.name, "step_path": path, "layout": "-",
                           "batch": batch, "context": context}
    names: dict[str, float] = {}
    cache = runner = None
    try:
        before = machine.allocated()
        cache = tp.new_device_cache(fmt, model, batch, context, extra_steps=s.extra_steps, device=machine.device,
                                    backend="triton" if machine.cuda else "torch")
        row["layout"] = getattr(cache, "layout", "-")
        kv_bytes = machine.allocated() - before if machine.cuda else cache.nbytes()
        machine.cpu_bytes += 0 if machine.cuda else kv_bytes
        row["kv_bytes"] = kv_bytes
        row["kv_bytes_per_element"] = kv_bytes / dc.kv_elements(layers, batch, context, hkv, d)
        if machine.over_budget():
            raise BudgetExceeded(f"{machine.allocated() / 2**30:.1f} GiB over the budget {machine.budget / 2**30:.1f} GiB")
        cache.fill_random(context, generator=torch.Generator(machine.device).manual_seed(batch * 7919 + context))
        tokens = torch.randint(0, model.config.vocab_size, (batch,), device=machine.device)
        backend_ctx: Any = None
        if fmt.transforms is None:
            cache.span = context + 1
            row["attn_variant"], variants = pick_bf16_attention(cache, batch, heads, d, machine, s.reps)
            row["attn_variants_us"] = ";".join(f"{k}={v:.1f}" for k, v in variants.items())
            if machine.cuda:
                backend_ctx = _sdpa_backends()[row["attn_variant"].split("/")[0]]
        else:
            row["attn_variant"] = tp.kernel_label(cache)

        def ctx() -> Any:
            import contextlib

            return sdpa_kernel([backend_ctx]) if backend_ctx is not None else contextlib.nullcontext()

        def eager_step() -> None:
            with ctx(), torch.no_grad():
                dc.decode_step(model, cache, tokens, temperature=s.temperature, advance=False, forward=forward)

        if not time_it:  # memory probe: one eager step holds the activations and workspace
            eager_step()
            row["status"] = "fits"
            return row, names
        if machine.cuda:
            with ctx():
                runner = dc.GraphedDecoder(model, cache, tokens, temperature=s.temperature, advance=False,
                                           forward=forward)
            us = tp.time_graph(runner.replay, reps=s.reps)
            row["timing"] = "cuda graph replay, median"
            kernels, names = tp.kernel_breakdown(eager_step)
            step = tp.median(us)
            row.update(tp.split_step(step, kernels))
            row["kernel_us"] = sum(kernels.values())
        else:
            eager_step()
            us = []
            for _ in range(s.reps):
                t0 = time.perf_counter()
                eager_step()
                us.append((time.perf_counter() - t0) * 1e6)
            step = tp.median(us)
            row["timing"] = "eager wall time, median (CPU: no kernel split)"
        row["step_us"] = step
        row["tokens_per_s"] = batch / (step * 1e-6)
        row["status"] = "ok"
        byte_floor(row, weight_bytes_read(model), machine.bandwidth)
    except Exception as exc:  # noqa: BLE001 - out-of-memory is a result here; anything else is re-raised
        if not machine.is_oom(exc):
            raise
        row["status"] = "OOM"
        row["note"] = str(exc).splitlines()[0][:160]
    finally:
        if cache is not None and not machine.cuda:
            machine.cpu_bytes -= row.get("kv_bytes", 0) or 0
        del runner, cache
        machine.release()
    return row, names


def max_batch(model: Any, fmt: Any, context: int, s: Settings, machine: Machine) -> tuple[int, list[int]]:
    """Largest batch whose cache and one eager decode step fit at ``context`` (doubling, then bisection
    up to ``fit_max``); the batches tried."""
    tried: list[int] = []

    def fits(b: int) -> bool:
        tried.append(b)
        row, _ = measure_point(model, fmt, b, context, s, machine, time_it=False)
        return row["status"] == "fits"

    if not fits(1):
        return 0, tried
    lo, hi = 1, None
    b = 2
    while b <= s.fit_max:
        if fits(b):
            lo, b = b, b * 2
        else:
            hi = b
            break
    if hi is None:
        return lo, tried  # fits up to the cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def run_check(s: Settings, machine: Machine) -> list[dict[str, Any]]:
    """Tiny Qwen3 (head_dim 128, the real kernels' path): greedy tokens and logits of the device path on
    this device (Triton, CUDA graph) against the CPU host-cache path (torch), and KL to the uncached
    forward of each path against the CPU block-bootstrap interval."""
    c = s.prof["check"]
    family, dims = "qwen3", dict(c["architecture"])
    rows = []
    for method in s.caches:
        mcfg = compose([f"method={method}"]).method
        cpu_model = tp.build_random_model(tp.architecture_config(family, dims), device="cpu", dtype=torch.float32,
                                          std=float(c["std"]))
        fmt = tp.timed_cache(mcfg, cpu_model)
        fmt.layout = s.layout
        if fmt.transforms is not None:
            fmt = fmt.with_windows(int(c["sink"]), int(c["recent"]), int(c["page_size"]))
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, dims["vocab_size"], (int(c["batch"]), int(c["prompt"])), generator=gen)
        steps = int(c["steps"])
        rots = tp.timing_rotations(mcfg, cpu_model)[0] if fmt.transforms is not None else []
        t0 = time.perf_counter()
        ref_tok, ref_lg = tp.reference_decode(cpu_model, prompt, fmt, steps, rots)
        ref_kl = tp.teacher_forced_kl(cpu_model, prompt, ref_tok, ref_lg)
        cpu_s = time.perf_counter() - t0
        dev_model = copy.deepcopy(cpu_model).to(machine.device)  # the same weights (device RNGs differ)
        fused = FusedDecoder(dev_model, compile=machine.cuda and s.compile)  # the step every timed point runs
        graph = machine.cuda and fmt.transforms is not None
        labels: dict[str, str] = {}  # of the first (default-backend) device run

        def device_run(forced: Optional[Any], backend: str = "triton" if machine.cuda else "torch",
                       graph: bool = graph, forward: Any = fused) -> tuple[Any, Any]:
            cache = tp.new_device_cache(fmt, dev_model, prompt.shape[0], prompt.shape[1], extra_steps=steps,
                                        device=machine.device, backend=backend, shuffle_pages=True)
            labels.setdefault("kernel", tp.kernel_label(cache))
            labels.setdefault("layout", getattr(cache, "layout", "-"))
            tok, lg = tp.device_decode(dev_model, prompt.to(machine.device), cache, steps, graph=graph, forced=forced,
                                       forward=forward)
            del cache
            return tok.cpu(), lg.cpu()

        tok, lg = device_run(None)  # free running: each path feeds its own greedy tokens
        same = (tok == ref_tok)
        first_diff = [int((~same[b]).nonzero()[0]) if bool((~same[b]).any()) else steps for b in range(same.shape[0])]
        upto = min(first_diff)
        ftok, flg = device_run(ref_tok)  # teacher forced on the CPU tokens: step-by-step comparison
        agree = ftok == ref_tok
        top2 = ref_lg.topk(2, dim=-1).values
        margin = top2[..., 0] - top2[..., 1]
        kl = tp.teacher_forced_kl(dev_model, prompt.to(machine.device), ref_tok.to(machine.device),
                                  flg.to(machine.device)).cpu()
        lo, hi = block_bootstrap_ci([ref_kl[b] for b in range(ref_kl.shape[0])], block=4)
        twins: dict[str, Any] = {}
        if fmt.transforms is not None and machine.cuda:  # where a difference comes from: kernels or the rest
            _, tlg = device_run(ref_tok, backend="torch", graph=False)
            twins = {"twin_forced_max_abs_logit_diff": float((tlg - ref_lg).abs().max()),
                     "twin_forced_argmax_agree": int((tlg.argmax(-1) == ref_tok).sum()),
                     **tp.kernels_against_twins(dev_model, prompt, fmt, machine.device)}
            print(f"  {method} on {machine.device}: torch twins teacher-forced max |dlogit| "
                  f"{twins['twin_forced_max_abs_logit_diff']:.3g}; Triton vs twin: quantized elements differing "
                  f"{twins['quant_elements_differ']:.2e}, attention rel diff {twins['attention_rel_diff_max']:.2e}",
                  flush=True)
        rows.append({
            "cache": method, "layout": labels["layout"], "kernel": labels["kernel"], "device": str(machine.device),
            "path": ("compiled step" if fused.compiled else "fused step") + (", kernels + cuda graph" if graph else
                                                                              (", eager" + (" kernels" if machine.cuda and fmt.transforms is not None else ""))),
            "sequences": int(prompt.shape[0]), "prompt": int(prompt.shape[1]), "steps": steps,
            "tokens_equal": int(same.sum()), "tokens_total": int(same.numel()), "first_divergence": upto,
            "forced_argmax_agree": int(agree.sum()),
            "forced_max_abs_logit_diff": float((flg - ref_lg).abs().max()),
            "forced_disagree_max_margin": float(margin[~agree].max()) if bool((~agree).any()) else math.nan,
            "median_margin": float(margin.median()),
            "logit_scale": float(ref_lg.abs().max()),
            "kl_cpu": float(ref_kl.mean()), "kl_cpu_lo": lo, "kl_cpu_hi": hi, "kl_device": float(kl.mean()),
            "kl_within_cpu_interval": bool(lo <= float(kl.mean()) <= hi), "cpu_s": round(cpu_s, 1),
            **twins, "note": fmt.note,
        })
        print(f"check {method}: free-running tokens {int(same.sum())}/{same.numel()} equal (first divergence at step "
              f"{upto}); teacher-forced argmax {int(agree.sum())}/{agree.numel()}, max |dlogit| "
              f"{float((flg - ref_lg).abs().max()):.3g}; KL cpu {float(ref_kl.mean()):.4g} [{lo:.4g}, {hi:.4g}] "
              f"device {float(kl.mean()):.4g}", flush=True)
        del dev_model
        machine.release()
    return rows


def environment(machine: Machine, command: Optional[str] = None) -> dict[str, Any]:
    """Hardware and software versions of this run, and its command (default: this process's command line)."""
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "host": platform.node(),
                           "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "command": command or " ".join(["python", *sys.argv])}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if machine.cuda:
        props = torch.cuda.get_device_properties(machine.device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                   cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    else:
        env.update(gpu=None, cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def copy_bandwidth(machine: Machine) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (the memory ceiling)."""
    if not machine.cuda:
        return math.nan
    src = torch.randn(1 << 29, device=machine.device)
    dst = torch.empty_like(src)
    us = tp.time_graph(lambda: dst.copy_(src), reps=10)
    del src, dst
    machine.release()
    return 2 * (1 << 31) / (tp.median(us) * 1e-6)


# ----------------------------------------------------------------------------------------------
# the run


def timed_runs(s: Settings) -> list[tuple[str, str, str]]:
    """(method, step path, cache name in the grid) of every timed series: each cache through the compiled
    step (named as the method), the caches of ``hf_caches`` also through the transformers forward (named
    ``<method>+hf``, the labelled "HF eager + graph" baseline)."""
    out = [(m, "compiled" if s.compile else "fused", m) for m in s.caches]
    return out + [(m, "hf", f"{m}+hf") for m in s.caches if m in s.hf_caches]


def keep_rows(rows: list[dict[str, Any]], part: str, s: Settings, remeasured: set[tuple]) -> list[dict[str, Any]]:
    """Rows of an earlier run's file that this run keeps: all of a part it does not run; of the grid (and its
    kernels) those whose (model, cache, batch, context) it does not measure again; of fit and job those of
    the (model, cache) pairs it does not measure."""
    if part not in s.parts:
        return rows
    if part == "grid":
        return [r for r in rows if (r.get("model"), r.get("cache"), r.get("batch"), r.get("context")) not in remeasured]
    return [r for r in rows if not (r.get("model") in s.models and r.get("cache") in s.caches)]


def run(cfg: Any, s: Settings, out: Path, command: Optional[str] = None) -> None:
    """Measure every part asked for; write the CSVs as each part ends (``command``: what ``env.json`` records as
    this run's command line)."""
    device = str(cfg.device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device} asked for but torch sees no CUDA GPU")
    if device == "cpu" and not s.tiny:
        raise RuntimeError("the throughput measurement needs a CUDA GPU for the real architectures (none found); "
                           "the tiny architecture (flag tiny, the tests' path) runs the code on the CPU")
    machine = Machine(device, s.budget)
    env = environment(machine, command)
    machine.bandwidth = copy_bandwidth(machine)
    env["copy_bandwidth_tb_s"] = machine.bandwidth / 1e12
    env["settings"] = {k: v for k, v in vars(s).items() if k != "prof"}
    env["profile"] = s.prof
    notes: dict[str, str] = {}
    if "check" in s.parts:
        write_csv(out / "check.csv", run_check(s, machine))
    # rows this run does not measure again are kept (runs per model, or per batch x context slice, may share
    # one output folder): grid points by (model, cache, batch, context), fit and job rows by (model, cache)
    points = s.points or [(b, c) for b in s.batches for c in s.contexts]
    points += [(1, c) for c in s.speedup_contexts if (1, c) not in points]
    runs = timed_runs(s)  # (method, step path, grid cache name)
    remeasured = {(m, c, b, t) for m in s.models for _, _, c in runs for b, t in points}

    def kept(name: str, part: str) -> list[dict[str, Any]]:
        return keep_rows(read_csv(out / name), part, s, remeasured)

    grid = kept("grid.csv", "grid")
    kernels = kept("kernels.csv", "grid")
    fit_rows = kept("fit.csv", "job" if "job" in s.parts else "fit")
    job_rows = kept("job.csv", "job")
    old_env = json.loads((out / "env.json").read_text()) if (out / "env.json").is_file() else {}
    models_env: dict[str, Any] = {k: v for k, v in old_env.get("models", {}).items() if k not in s.models}
    for name in s.models:
        family, dims = s.architecture(name, cfg)
        t0 = time.perf_counter()
        model = tp.build_random_model(tp.architecture_config(family, dims), device=machine.device,
                                      dtype=torch.bfloat16)
        dc.enable(model)
        fused = FusedDecoder(model, compile=machine.cuda and s.compile)  # fused weights are views: no extra bytes
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        read_bytes = weight_bytes_read(model)
        machine.cpu_bytes = weight_bytes if not machine.cuda else 0
        models_env[name] = {"family": family, "dims": dims, "weight_bytes": weight_bytes,
                            "weight_bytes_read_per_step": read_bytes, "build_s": round(time.perf_counter() - t0, 1)}
        print(f"model {name}: {weight_bytes / 1e9:.2f} GB of BF16 weights", flush=True)
        formats = {}
        for method in s.caches:
            mcfg = compose([f"method={method}"]).method
            formats[method] = tp.timed_cache(mcfg, model)
            formats[method].layout = s.layout
            f = formats[method]
            notes[method] = f.note
            env.setdefault("formats", {})[method] = {"bits": f.bits, "group_size": f.group_size, "sink": f.sink,
                                                     "recent": f.recent, "page_size": f.page_size,
                                                     "head_dim": tp.geometry(model)[3], "layout": _layout_of(f, model, machine)}
        if "grid" in s.parts:
            for method, path, cname in runs:
                for b, c in points:
                    row, names = measure_point(model, formats[method], b, c, s, machine,
                                               forward=None if path == "hf" else fused)
                    row["model"], row["cache"] = name, cname
                    grid.append(row)
                    kernels += [{"model": name, "cache": cname, "batch": b, "context": c, "kernel": k[:200], "us": v,
                                 "category": tp.classify_kernel(k)} for k, v in names.items()]
                    print(f"  {name} {cname:8s} b={b:<4d} T={c:<7d} {row['status']:4s} "
                          f"step={row.get('step_us', float('nan')):9.1f} us "
                          f"floor={100 * row.get('floor_share', float('nan')):5.1f}%", flush=True)
                    write_csv(out / "grid.csv", grid, GRID_KEYS)
            write_csv(out / "kernels.csv", kernels)
        if "fit" in s.parts or "job" in s.parts:
            for method, fmt in formats.items():
                bmax, tried = max_batch(model, fmt, s.job_context, s, machine)
                fit_rows.append({"model": name, "cache": method, "layout": _layout_of(fmt, model, machine),
                                 "context": s.job_context, "max_batch": bmax,
                                 "budget_gib": round((s.budget or _device_memory(machine)) / 2**30, 1),
                                 "tried": " ".join(map(str, tried))})
                print(f"  {name} {method}: largest batch at {s.job_context} = {bmax}", flush=True)
                if "job" not in s.parts:
                    continue
                for b in s.job_batches:
                    run_b = min(b, bmax)
                    if run_b == 0:
                        job_rows.append({"model": name, "cache": method, "layout": _layout_of(fmt, model, machine),
                                         "context": s.job_context, "job_batch": b, "run_batch": 0, "waves": 0, "status": "OOM"})
                        continue
                    known = [r for r in grid if r.get("model") == name and r.get("cache") == method
                             and r.get("batch") == run_b and r.get("context") == s.job_context and r.get("status") == "ok"]
                    if known:
                        row = known[0]
                    else:
                        row, _ = measure_point(model, fmt, run_b, s.job_context, s, machine, forward=fused)
                        row["model"] = name
                        if row["status"] == "ok":
                            grid.append(row)
                            write_csv(out / "grid.csv", grid, GRID_KEYS)
                    job_rows.append({"model": name, "cache": method, "layout": _layout_of(fmt, model, machine),
                                     "context": s.job_context, "job_batch": b, "run_batch": run_b, "waves": math.ceil(b / run_b), "status": row["status"],
                                     "step_us": row.get("step_us"), "tokens_per_s": row.get("tokens_per_s")})
            write_csv(out / "fit.csv", fit_rows)
            if job_rows:
                write_csv(out / "job.csv", job_rows)
        del model
        machine.release()
    env["commands"] = old_env.get("commands", []) + [env["command"]]  # runs that wrote into this folder
    env["models"] = models_env
    env["cache_notes"] = {**old_env.get("cache_notes", {}), **notes}  # caches of earlier runs into this folder too
    env["formats"] = {**old_env.get("formats", {}), **env.get("formats", {})}
    write_atomic(out / "env.json", json.dumps(env, indent=1, sort_keys=True, default=str) + "\n")


def _layout_of(fmt: Any, model: Any, machine: Machine) -> str:
    """The page layout a paged format gets on this machine (``-`` for BF16)."""
    if fmt.transforms is None:
        return "-"
    return fmt.format.resolve_layout(fmt.layout, tp.geometry(model)[3], machine.device)


def _device_memory(machine: Machine) -> float:
    return float(torch.cuda.get_device_properties(machine.device).total_memory) if machine.cuda else math.nan

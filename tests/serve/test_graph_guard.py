"""Every format the pool serves runs a decode step the way SGLang captures it, under `CaptureGuard` (CPU).

SGLang's decode CUDA-graph runner binds the backend's fixed buffers (``init_cuda_graph_state``), runs the padded
step eagerly to warm up, then records it once per batch size. The recorded step may launch kernels and allocate
from the graph pool, nothing else: no host sync, no tensor made from host data (a host-to-device copy on the GPU),
no table built at first use and kept (it would live in the graph's pool). `oscar.serve.graph_guard.CaptureGuard`
fails on each; here it wraps the emulated capture of every pool format, on a fresh process's module caches (a
table built by an earlier test would hide a first use), with the Triton writers (interpreted) that the GPU runs.
The mma-layout attention is a CUDA kernel: on the CPU its torch twin runs with the guard paused (the CUDA tests
run that kernel under a real capture); the row-layout Triton kernels run guarded.

Before the pool prepared its writers at start-up (``OscarTokenToKVPool.prepare_writes``), the per-channel formats
failed here as they failed on the H100: the first block write happened inside the capture (the eager warm-up
completes no block), and ``kernels/quantize.py::_mma_tables`` synced on the host and built its tables there.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oscar.cache import paged
from oscar.cache.formats import ChannelKeyFormat, RotatedFormat
from oscar.cache.torch_cache import LayerRotations
from oscar.core.rope import RopeSpec
from oscar.serve.graph_guard import CaptureGuard, CaptureViolation
from oscar.serve.settings import ServeSettings

HKV, H, D, PAGE, MAX_BS = 2, 4, 64, 32, 4
SPEC = RopeSpec(1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)), 1.0, head_dim=D)

# name: (format kind, per-layer key blocks, layout, sink, recent, rope-centered keys, values' group)
FORMATS = {
    "token-rows": ("rotated", [0, 0], "rows", 32, 64, False, D),
    "token-mma": ("rotated", [0, 0], "mma", 32, 64, False, D),
    "rope-mma": ("rotated", [0, 0], "mma", 32, 64, True, D),
    "channel-mma": ("rotated_channel", [32, 32], "mma", 0, 64, False, D),
    "channel-rows": ("rotated_channel", [32, 32], "rows", 0, 64, False, D),
    "mixed-mma": ("rotated_channel", [0, 32], "mma", 32, 64, True, D),
    "kivi2-rows": ("kivi2", [32, 32], "rows", 0, 64, False, 32),
}


def _rotations(gen: torch.Generator, block: int, rope: bool, kivi: bool) -> LayerRotations:
    if kivi:  # served KIVI-2: no rotation, no centering, no clip
        r = LayerRotations.identity(HKV, D)
        return LayerRotations(r.r_k, r.r_v, k_block=block)
    orth = lambda: torch.linalg.qr(torch.randn(HKV, D, D, generator=gen))[0]  # noqa: E731
    return LayerRotations(orth(), orth(), 0.1 * torch.randn(HKV, D, generator=gen), None, k_block=block,
                          rope_k=3.0 * torch.randn(HKV, D, generator=gen) if rope and not block else None,
                          rope=SPEC if rope and not block else None)


def _pool(name: str, monkeypatch, device: str = "cpu"):
    from oscar.serve import state as serve_state
    from oscar.serve.pool import OscarTokenToKVPool

    kind, blocks, layout, sink, recent, rope, group = FORMATS[name]
    gen = torch.Generator().manual_seed(0)
    if kind == "rotated":
        fmt = RotatedFormat(name="auto", bits=2, group_size=D, sink=sink, recent=recent)
    else:
        fmt = ChannelKeyFormat(name="kivi2" if kind == "kivi2" else "auto", bits=2, group_size=group, sink=sink,
                               recent=recent, page_size=PAGE, key_block=32, layer_blocks=tuple(blocks))
    state = dict(settings=ServeSettings(artifact=Path("unused"), sink=sink, recent=recent, kernels="triton"),
                 rotations=[_rotations(gen, t, rope, kind == "kivi2") for t in blocks], format=fmt, fold=True)
    monkeypatch.setattr(serve_state, "_STATE", state)  # what the plugin's ensure_state leaves in a server process
    return OscarTokenToKVPool(2048, PAGE, torch.bfloat16, HKV, D, len(blocks), device, False, oscar_state=state,
                              oscar_layout=layout)


@pytest.fixture
def fresh_caches(monkeypatch):
    """The module caches of the writers and kernels as a new server process has them: empty."""
    from oscar.core import quant
    from oscar.kernels import decode_mma, extend_paged, quantize

    for mod, names in ((quantize, ("_MMA_TABLES", "_PERMUTED", "_IDENTITY_PERMS")), (extend_paged, ("_MAPS",)),
                       (decode_mma, ("_COPIES",)), (quant, ("_MMA_MAPS",))):
        for n in names:
            monkeypatch.setattr(mod, n, {})


class _Mode:
    def is_decode(self) -> bool:
        return True

    def is_idle(self) -> bool:
        return False


def _attend_twin_on_cpu(pool):
    """The pool's attention: mma-layout pages through the torch twin with the guard paused (a CUDA kernel on the
    GPU), row-layout pages through the Triton kernel (interpreted), guarded."""
    attend = pool.format.attend

    def run(q, pages, segments, transforms, **options):
        if pool.layout != "mma":
            return attend(q, pages, segments, transforms, **options)
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            return attend(q, pages, segments, transforms, **{**options, "backend": "torch", "launch": None})

    return run


def _requests(device: str = "cpu") -> tuple[dict[int, int], torch.Tensor]:
    """Three requests' prompt lengths by request slot (before, at and past a block boundary; slot 3 free) and
    SGLang's ``req_to_token`` holding their pages (one more token each: the decode step's row)."""
    lengths = {0: 95, 1: 130, 2: 64}
    r2t = torch.zeros(5, 512, dtype=torch.int32)
    free = list(range(1, 2048 // PAGE))
    for r, n in lengths.items():
        for j in range((n + 1 + PAGE - 1) // PAGE):
            p = free.pop()
            r2t[r, j * PAGE:(j + 1) * PAGE] = torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int32)
    return lengths, r2t.to(device)


@pytest.mark.parametrize("name", list(FORMATS))
def test_decode_step_of_every_format_is_capturable(name, fresh_caches, monkeypatch):
    from oscar.serve.backend import OscarAttnBackend

    gen = torch.Generator().manual_seed(1)
    pool = _pool(name, monkeypatch)
    lengths, r2t = _requests()
    runner = SimpleNamespace(token_to_kv_pool=pool, device="cpu",
                             req_to_token_pool=SimpleNamespace(req_to_token=r2t))
    be = OscarAttnBackend(runner)
    # the mma launch's split-K is sized from the GPU's SMs once per batch size (in the warm-up)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=132))
    attend = _attend_twin_on_cpu(pool)
    monkeypatch.setattr(type(pool.format), "attend", lambda self, *a, **kw: attend(*a, **kw))  # a frozen dataclass
    layer = lambda i: SimpleNamespace(layer_id=i, tp_q_head_num=H, tp_k_head_num=HKV, qk_head_dim=D,  # noqa: E731
                                      v_head_dim=D, scaling=D**-0.5, sliding_window_size=-1, logit_cap=0)
    q = torch.randn(MAX_BS, H * D, generator=gen).to(torch.bfloat16)
    kv = torch.randn(MAX_BS, HKV * D, generator=gen).to(torch.bfloat16)

    def capture(fb: SimpleNamespace, what: str) -> None:
        """SGLang's capture of one batch size: buffers bound, two eager warm-up runs, the recorded run."""
        def run_once() -> list[torch.Tensor]:
            be.init_forward_metadata_in_graph(fb)
            return [be.forward_decode(q, kv, kv, layer(i), fb) for i in range(pool.layer_num)]

        be.init_forward_metadata_out_graph(fb, in_capture=True)
        for _ in range(2):
            run_once()
        pool.static_block_writes = True  # what torch.cuda.is_current_stream_capturing() says inside the capture
        guard = CaptureGuard()
        try:
            with guard:
                outs = run_once()
        finally:
            pool.static_block_writes = False
        guard.keep(outs)
        guard.check(f"the {name} decode step ({what})")
        assert all(bool(torch.isfinite(o.float()).all()) for o in outs)

    # at server start-up, before any request: SGLang's dummy batch (every entry padded: slot 0, length 1, loc 0)
    be.init_cuda_graph_state(MAX_BS, MAX_BS)
    zeros = torch.zeros(MAX_BS, dtype=torch.int64)
    capture(SimpleNamespace(forward_mode=_Mode(), batch_size=MAX_BS, req_pool_indices=zeros, seq_lens=zeros + 1,
                            seq_lens_cpu=zeros + 1, out_cache_loc=zeros), "start-up capture")
    # and a step of real requests (before, at and past a block boundary; one padded entry) captured the same way
    for r, n in lengths.items():  # the prompts, written as an extend writes them
        k = torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16)
        for i in range(pool.layer_num):
            pool.write(i, k, k, r2t[r, :n].long(), torch.full((n,), r), torch.arange(n), torch.full((n,), n))
    req = torch.tensor([0, 1, 2, 0])
    seq = torch.tensor([lengths[0] + 1, lengths[1] + 1, lengths[2] + 1, 1])
    loc = torch.tensor([int(r2t[r, int(L) - 1]) for r, L in zip(req[:3].tolist(), seq[:3])] + [0])
    capture(SimpleNamespace(forward_mode=_Mode(), batch_size=MAX_BS, req_pool_indices=req, seq_lens=seq,
                            seq_lens_cpu=seq, out_cache_loc=loc), "a batch of real requests")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the real capture of each format on the GPU host")
@pytest.mark.parametrize("name", list(FORMATS))
def test_decode_step_of_every_format_captures_on_cuda(name, fresh_caches, monkeypatch):
    """On the GPU host: the decode step of each format recorded in a real ``torch.cuda.CUDAGraph`` (SGLang's
    order: buffers bound, eager warm-up on a side stream, the capture), then replayed on a batch of real requests;
    the replay's outputs match an eager step's (same kernels, so within BF16 rounding)."""
    from oscar.serve.backend import OscarAttnBackend

    dev = "cuda"
    gen = torch.Generator().manual_seed(1)
    pool = _pool(name, monkeypatch, dev)
    lengths, r2t = _requests(dev)
    be = OscarAttnBackend(SimpleNamespace(token_to_kv_pool=pool, device=dev,
                                          req_to_token_pool=SimpleNamespace(req_to_token=r2t)))
    layer = lambda i: SimpleNamespace(layer_id=i, tp_q_head_num=H, tp_k_head_num=HKV, qk_head_dim=D,  # noqa: E731
                                      v_head_dim=D, scaling=D**-0.5, sliding_window_size=-1, logit_cap=0)
    q = torch.randn(MAX_BS, H * D, generator=gen).to(torch.bfloat16).to(dev)
    kv = torch.randn(MAX_BS, HKV * D, generator=gen).to(torch.bfloat16).to(dev)
    for r, n in lengths.items():  # the prompts, written as an extend writes them
        k = torch.randn(n, HKV, D, generator=gen).to(torch.bfloat16).to(dev)
        for i in range(pool.layer_num):
            pool.write(i, k, k, r2t[r, :n].long(), torch.full((n,), r, device=dev), torch.arange(n, device=dev),
                       torch.full((n,), n, device=dev))
    be.init_cuda_graph_state(MAX_BS, MAX_BS)
    # SGLang's static inputs: the captured step reads these buffers; a replay copies the batch into them
    req_buf = torch.zeros(MAX_BS, dtype=torch.int64, device=dev)
    seq_buf, loc_buf = torch.ones(MAX_BS, dtype=torch.int64, device=dev), torch.zeros(MAX_BS, dtype=torch.int64, device=dev)
    static = SimpleNamespace(forward_mode=_Mode(), batch_size=MAX_BS, req_pool_indices=req_buf, seq_lens=seq_buf,
                             seq_lens_cpu=seq_buf.cpu(), out_cache_loc=loc_buf)

    def run_once(fb: SimpleNamespace) -> list[torch.Tensor]:
        be.init_forward_metadata_in_graph(fb)
        return [be.forward_decode(q, kv, kv, layer(i), fb) for i in range(pool.layer_num)]

    be.init_forward_metadata_out_graph(static, in_capture=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run_once(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    pool.static_block_writes = True
    try:
        with torch.cuda.graph(graph):
            outs = run_once(static)
    finally:
        pool.static_block_writes = False
    # a step of real requests (before, at and past a block boundary; one padded entry): the recorded step replayed
    req = torch.tensor([0, 1, 2, 0], device=dev)
    seq = torch.tensor([lengths[0] + 1, lengths[1] + 1, lengths[2] + 1, 1], device=dev)
    loc = torch.tensor([int(r2t[r, int(L) - 1]) for r, L in zip(req[:3].tolist(), seq[:3].tolist())] + [0], device=dev)
    req_buf.copy_(req)
    seq_buf.copy_(seq)
    loc_buf.copy_(loc)
    static.seq_lens_cpu = seq.cpu()
    be.init_forward_metadata_out_graph(static, in_capture=False)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [o[:3].float().clone() for o in outs]
    real = SimpleNamespace(forward_mode=_Mode(), batch_size=MAX_BS, req_pool_indices=req, seq_lens=seq,
                           seq_lens_cpu=seq.cpu(), out_cache_loc=loc)
    be.init_forward_metadata_out_graph(real, in_capture=False)
    eager = [o[:3].float() for o in run_once(real)]  # the same step again, eagerly (its writes are idempotent)
    for i, (a, b) in enumerate(zip(replayed, eager)):
        assert torch.isfinite(a).all(), (name, i)
        assert torch.allclose(a, b, atol=2e-2, rtol=2e-2), (name, i, float((a - b).abs().max()))


def test_guard_names_what_a_capture_refuses():
    """The guard itself: a host sync, a tensor from host data and a table kept past the step are each named with
    where they happened; plain device work passes."""
    table: dict = {}

    def step(x: torch.Tensor) -> torch.Tensor:
        if "t" not in table:
            table["t"] = torch.arange(4).to(torch.float32)  # built at first use and kept
        if bool((x > 0).any()):  # host sync
            x = x + torch.tensor([1.0, 2.0, 3.0, 4.0])  # host data
        return x * table["t"]

    guard = CaptureGuard()
    with guard:
        out = step(torch.ones(4))
    guard.keep(out)
    with pytest.raises(CaptureViolation) as err:
        guard.check("step")
    msg = str(err.value)
    assert "host sync" in msg and "tensor from host data" in msg and "outlives it" in msg, msg
    clean = CaptureGuard()
    with clean:
        out = (torch.ones(4) * 2).sum(dim=0, keepdim=True)
    clean.keep(out)
    clean.check("clean step")

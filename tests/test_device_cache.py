"""Device-resident decode caches (oscar.cache.device_cache) against the host-driven cache, on tiny random Qwen3
models in BF16 (the dtype the caches store): same greedy tokens, logits within bf16 rounding, no host
synchronisation in a Triton-backend step (what a CUDA graph needs)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oscar.cache import device_cache as dc
from oscar.cache import paged
from oscar.bench.throughput import decode as tp
from oscar.cache.torch_cache import LayerRotations
from oscar.cache.formats import BF16Format, RotatedFormat
from oscar.core.rotation import random_orthogonal

LAYERS, HEADS, HKV, D = 2, 4, 2, 64
# Logits of these models stay under 8 in magnitude, where one bf16 step is 1/32: the two paths store the
# same bf16 rows and codes but reduce in different orders, so a logit may land one bf16 step away.
LOGIT_TOL = 0.05


@pytest.fixture(scope="module")
def model():
    cfg = tp.architecture_config("qwen3", dict(
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HKV, head_dim=D, hidden_size=128,
        intermediate_size=256, vocab_size=320, max_position_embeddings=4096, tie_word_embeddings=False))
    return tp.build_random_model(cfg, device="cpu", dtype=torch.bfloat16, std=0.08)


def rotations(center: bool, rope=None) -> list[LayerRotations]:
    """Per-layer rotations; ``rope`` (an `oscar.core.rope.RopeSpec`): head 0 of each layer rope-centered as well."""
    g = torch.Generator().manual_seed(0)
    out = []
    for layer in range(LAYERS):
        rk = torch.stack([random_orthogonal(D, seed=100 * layer + h, dtype=torch.float32) for h in range(HKV)])
        rv = torch.stack([random_orthogonal(D, seed=100 * layer + h + 50, dtype=torch.float32) for h in range(HKV)])
        mu_k = 0.1 * torch.randn(HKV, D, generator=g) if center else None
        mu_v = 0.1 * torch.randn(HKV, D, generator=g) if center else None
        rope_k = None
        if rope is not None:
            rope_k = torch.zeros(HKV, D)
            rope_k[0] = 0.5 * torch.randn(D, generator=g)
        out.append(LayerRotations(rk, rv, mu_k, mu_v, torch.full((HKV,), 0.9), torch.full((HKV,), 0.9), rope_k,
                                  rope if rope_k is not None else None))
    return out


def oscar_format(rots: list[LayerRotations], bits: int = 2, layout: str = "auto") -> tp.TimedCache:
    # the mma layout stores blocks of 16 tokens: its pages hold 16 (two pages still cover the prompt's middle)
    fmt = RotatedFormat(name="oscar", bits=bits, group_size=D, sink=4, recent=8,
                      page_size=16 if layout == "mma" else 4)
    return tp.TimedCache(fmt, transforms=tp.head_transforms(rots), layout=layout)


def prompt(n: int = 30, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 320, (batch, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("bits,center,layout", [(2, True, "rows"), (2, True, "mma"), (2, "rope", "mma"),
                                                 pytest.param(4, False, "rows", marks=pytest.mark.slow),
                                                 pytest.param(4, "rope", "mma", marks=pytest.mark.slow)])
def test_oscar_device_cache_matches_host_cache(model, bits, center, layout):
    """Prompt past sink + recent (quantized prefill rows), then decode steps that demote every step, through
    a shuffled page table: greedy tokens equal, logits within one bf16 step; in the row layout and in the
    fragment-order (mma) layout of the v9/v10 kernel (torch twins of its writer and attention); with
    rope-centered keys (positions of prefill rows and demoted rows, the rope term at int_pos0 = sink)."""
    rope = None
    if center == "rope":
        from oscar.models.adapters import key_rope

        rope, why = key_rope(model, 0, positions=64)
        assert rope is not None, why
    rots = rotations(bool(center), rope)
    fmt = oscar_format(rots, bits, layout)
    ids, steps = prompt(40 if layout == "mma" else 24), 8
    ref_tok, ref_lg = tp.reference_decode(model, ids, fmt, steps, rots)
    cache = tp.new_device_cache(fmt, model, 2, ids.shape[1], extra_steps=steps, device="cpu", backend="torch",
                                shuffle_pages=True)
    assert cache.layout == ("rows" if layout == "auto" else layout)
    assert [p.layout for p in (cache.k_pages[0], cache.v_pages[0])] == (
        ["mma_k", "mma_v"] if layout == "mma" else ["rows", "rows"])
    tok, lg = tp.device_decode(model, ids, cache, steps)
    assert torch.equal(tok, ref_tok)
    assert (lg - ref_lg).abs().max().item() <= LOGIT_TOL
    assert cache.seq_len == ids.shape[1] + steps - 1
    assert torch.equal(cache.pos, torch.full((2,), cache.seq_len))


def test_static_bf16_cache_matches_host_cache(model):
    ids, steps = prompt(), 8
    ref_tok, ref_lg = tp.reference_decode(model, ids, tp.TimedCache(BF16Format(name="bf16")), steps, [])
    for gqa in ("rows", "enable_gqa"):
        cache = tp.new_device_cache(tp.TimedCache(BF16Format(name="bf16")), model, 2, ids.shape[1], extra_steps=steps, device="cpu")
        cache.gqa = gqa
        tok, lg = tp.device_decode(model, ids, cache, steps)
        assert torch.equal(tok, ref_tok)
        assert (lg - ref_lg).abs().max().item() <= LOGIT_TOL


def test_step_indices_follow_the_window_convention():
    """Lengths and slots of each step from pos alone: sink fill, ring fill, then one demotion per step into
    consecutive quantized positions; sequences that demote nothing write the spare page."""
    t = tp.head_transforms([LayerRotations.identity(1, 16)])[0]
    fmt = RotatedFormat(bits=2, group_size=16, sink=2, recent=3, page_size=4)
    cache = dc.DeviceOscarCache(fmt, num_layers=1, batch=1, num_kv_heads=1, head_dim=16, quant_capacity=8, transforms=[t],
                                shuffle_pages=True)
    seen_slots = []
    for p in range(12):
        cache.set_length(p)
        cache.prepare()
        st = cache.step
        assert int(st["sink_len"]) == min(p + 1, 2)
        assert int(st["recent_len"]) == min(max(p + 1 - 2, 0), 3)
        assert int(st["int_len"]) == max(p + 1 - 5, 0)
        assert int(st["write_idx"]) == (p if p < 2 else 2 + (p - 2) % 3)  # sink slot, else ring slot after the sink
        if p >= 5:
            q = p - 5
            expect = int(cache.page_table[0, q // 4]) * 4 + q % 4
            assert int(st["demote_slot"]) == expect
            assert int(st["ring_idx"]) == (p - 2) % 3  # the oldest ring row is the slot the new token takes
            seen_slots.append(expect)
        else:
            assert int(st["demote_slot"]) == cache.trash_slot
    assert len(set(seen_slots)) == len(seen_slots) and cache.trash_slot not in seen_slots


class _SyncCounter(TorchDispatchMode):
    SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.item")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(str(func).startswith(s) for s in self.SYNCING):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_triton_step_matches_torch_and_never_syncs(model):
    """The Triton backend (interpreted here) gives the torch backend's tokens, and a whole decode step
    (embeddings, layers, demotion, attention, LM head, sampling) reads nothing back to the host."""
    rots = rotations(False)
    fmt = oscar_format(rots)
    ids = prompt(16)
    toks = {}
    for backend in ("torch", "triton"):
        cache = tp.new_device_cache(fmt, model, 2, ids.shape[1], extra_steps=8, device="cpu", backend=backend,
                                    shuffle_pages=True)
        toks[backend], _ = tp.device_decode(model, ids, cache, 3)
    assert torch.equal(toks["torch"], toks["triton"])
    counter = _SyncCounter()
    with counter, torch.no_grad():
        dc.decode_step(model, cache, toks["triton"][:, -1], temperature=0.6)
    assert counter.ops == []


def test_capacity_is_checked_on_the_host(model):
    fmt = oscar_format(rotations(False))
    cache = tp.new_device_cache(fmt, model, 1, 10, extra_steps=2, device="cpu", backend="torch")
    with pytest.raises(ValueError, match="capacity"):
        cache.check_room(cache.capacity + 1)
    with pytest.raises(ValueError, match="capacity"):
        cache.set_length(cache.capacity)


def test_kernel_classification():
    assert tp.classify_kernel("nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNT") == "gemm"
    assert tp.classify_kernel("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "gemm"
    assert tp.classify_kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma") == "attention"
    assert tp.classify_kernel("_planes_kernel") == "attention"
    assert tp.classify_kernel("void oscar_decode_mma<128, 4, 8, 4, 2>(Params)") == "attention"
    assert tp.classify_kernel("_rotate_quantize_kernel") == "quantize"
    assert tp.classify_kernel("void at::native::vectorized_elementwise_kernel<4, silu>") == "other"
    split = tp.split_step(100.0, {"gemm": 50.0, "attention": 30.0, "quantize": 5.0, "other": 9.0})
    assert split == {"gemm_us": 50.0, "attention_us": 30.0, "quantize_us": 5.0, "other_us": 15.0}


@pytest.mark.parametrize("steps", [0, 2])
def test_warm_up_leaves_the_next_step_unchanged(model, steps):
    """Warm-up steps (before a CUDA graph capture) rewrite the ring slot the next step demotes from; after
    warm_up the next steps give exactly the tokens and logits of a cache that never warmed up."""
    fmt = oscar_format(rotations(False))
    ids = prompt(24)
    out = []
    for warm in (0, steps):
        cache = tp.new_device_cache(fmt, model, 2, ids.shape[1], extra_steps=8, device="cpu", backend="torch")
        dc.enable(model)
        with torch.no_grad():
            lg, kv = dc.prefill(model, ids)
            dc.import_prefill(cache, kv)
            tok = lg.argmax(-1)
            dc.warm_up(model, cache, tok, steps=warm)
            logits = []
            for _ in range(4):
                tok, lg = dc.decode_step(model, cache, tok)
                logits.append(lg)
        out.append(torch.stack(logits))
    assert torch.equal(out[0], out[1])


def test_a_repeated_step_without_restore_would_demote_the_new_token(model):
    """Why warm_up restores the BF16 buffers: the same step run twice demotes the token it wrote."""
    fmt = oscar_format(rotations(False))
    ids = prompt(24)
    cache = tp.new_device_cache(fmt, model, 2, ids.shape[1], extra_steps=8, device="cpu", backend="torch")
    dc.enable(model)
    with torch.no_grad():
        lg, kv = dc.prefill(model, ids)
        dc.import_prefill(cache, kv)
        tok = lg.argmax(-1)
        before = [t.clone() for t in cache.step_state()]
        dc.decode_step(model, cache, tok, advance=False)
    assert any(not torch.equal(a, b) for a, b in zip(before, cache.step_state()))


def test_mma_and_row_layouts_hold_the_same_cache(model):
    """The same prompt and decode steps through row pages and through mma pages (torch backend): the layouts
    differ only in where the codes lie, so the dequantized cache of every layer is bit-identical (same
    arithmetic, same page table order), and the BF16 windows too."""
    rots = rotations(True)
    ids, steps = prompt(40), 6
    caches = {}
    for layout in ("rows", "mma"):
        fmt = oscar_format(rots, 2, layout)
        fmt = fmt.with_windows(fmt.sink, fmt.recent, 16)  # equal page tables in both layouts
        caches[layout] = tp.new_device_cache(fmt, model, 2, ids.shape[1], extra_steps=steps, device="cpu",
                                             backend="torch", shuffle_pages=True)
        tp.device_decode(model, ids, caches[layout], steps)
    rows, mma = caches["rows"], caches["mma"]
    assert torch.equal(rows.page_table, mma.page_table)
    assert rows.k_pages[0].codes.shape == mma.k_pages[0].codes.shape  # same bytes per token
    n = rows.seq_len - rows.sink - rows.recent  # quantized tokens per sequence
    assert n > 16  # the pages hold more than one block of 16 tokens
    for layer in range(LAYERS):
        for b in range(2):
            for a, c in ((rows.k_pages[layer], mma.k_pages[layer]), (rows.v_pages[layer], mma.v_pages[layer])):
                assert torch.equal(paged.gather_dequantize(a, rows.page_table, b, n),
                                   paged.gather_dequantize(c, mma.page_table, b, n))
        assert torch.equal(rows.bf16[layer], mma.bf16[layer])
    assert not torch.equal(rows.k_pages[0].codes, mma.k_pages[0].codes)  # the layouts do differ in place


def test_layout_setting_resolves_and_refuses():
    """auto: mma only on CUDA and where the format allows it (INT2 and INT4, one group per row, pages of 16k
    tokens); an explicit mma outside that is refused with the reason; unknown names are refused."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def layout(want: str, bits: int, group: int, d: int, page: int, dev: torch.device) -> str:
        return RotatedFormat(bits=bits, group_size=group, recent=1, page_size=page).resolve_layout(want, d, dev)

    assert layout("auto", 2, 128, 128, 64, cuda) == "mma"
    assert layout("auto", 2, 128, 128, 64, cpu) == "rows"
    assert layout("auto", 4, 128, 128, 64, cuda) == "mma"  # Saw-INT4 reads the v10 INT4 mma pages
    assert layout("auto", 2, 32, 128, 64, cuda) == "rows"
    assert layout("auto", 2, 128, 128, 8, cuda) == "rows"
    assert layout("rows", 2, 128, 128, 64, cuda) == "rows"
    assert layout("mma", 2, 64, 64, 16, cpu) == "mma"
    with pytest.raises(ValueError, match="bits=3"):
        layout("mma", 3, 128, 128, 64, cuda)  # no such format
    with pytest.raises(ValueError, match="one group per row"):
        layout("mma", 2, 32, 128, 64, cuda)
    with pytest.raises(ValueError, match="layout='planar'"):
        layout("planar", 2, 128, 128, 64, cuda)


def test_mma_pages_need_the_cuda_kernel_or_the_twin(model):
    """On a CPU the Triton backend cannot attend over mma pages (the v9 kernel is CUDA C++): the step is
    refused with the way out, not run through a wrong path."""
    fmt = oscar_format(rotations(False), 2, "mma")
    ids = prompt(40)
    cache = tp.new_device_cache(fmt, model, 2, ids.shape[1], extra_steps=4, device="cpu", backend="triton")
    assert tp.kernel_label(cache) == "v9 CUDA mma kernel, mma pages"
    dc.enable(model)
    with torch.no_grad():
        _, kv = dc.prefill(model, ids)
        dc.import_prefill(cache, kv)  # the Triton writer (interpreted here) stores the mma layout
        with pytest.raises(ValueError, match="backend='torch'"):
            dc.decode_step(model, cache, ids[:, -1])

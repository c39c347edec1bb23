"""Per-channel key pages on the paged path (docs/DESIGN.md "Per-channel key pages on the paged path", issue 33).

The writer's torch twin against `oscar.core.quant.quantize_channels`, the Triton writer and the row-layout Triton
decode kernel against the twins (TRITON_INTERPRET=1 on a CPU), the recent ring of W..W+T-1 rows, the device cache
demoting whole blocks against the torch cache (teacher forced over several block boundaries, layers with per-token
and per-channel keys mixed), served KIVI-2 against the simulated KIVI cache, and the errors of bad inputs.
"""

from __future__ import annotations

import os

import pytest
import torch

from oscar.bench.throughput import decode as tp
from oscar.cache import paged
from oscar.cache.formats import BF16Format, CacheFormat, ChannelKeyFormat, KiviFormat, RotatedFormat, record_format
from oscar.cache.torch_cache import LayerRotations
from oscar.core import quant
from oscar.core.rotation import random_orthogonal
from oscar.kernels.launch import RowsLaunch

LAYERS, HEADS, HKV, D = 2, 4, 2, 64
LOGIT_TOL = 0.05  # one bf16 step of these models' logits (< 8 in magnitude), as tests/test_device_cache.py
# Kernel paths against the twins: fp16 dequantized keys and float32 sums in another order (measured <= 4e-4 on
# outputs of magnitude ~1 for the shapes below).
ATTN_TOL = 2e-3

triton_cpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="Triton on a CPU needs TRITON_INTERPRET=1")


def _rot(d: int, seed: int, hkv: int = HKV) -> torch.Tensor:
    return torch.stack([random_orthogonal(d, seed=seed + h, dtype=torch.float32) for h in range(hkv)])


def key_transform(d: int, block: int, *, hkv: int = HKV, rope: bool = False, clip: bool = True) -> paged.HeadTransform:
    g = torch.Generator().manual_seed(block)
    rope_mu = rope_freq = None
    if rope:
        rope_mu = torch.zeros(hkv, d)
        rope_mu[0] = 0.5 * torch.randn(d, generator=g)
        rope_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    return paged.HeadTransform(_rot(d, 3, hkv), 0.1 * torch.randn(hkv, d, generator=g),
                               torch.tensor([0.9, 1.0][:hkv]) if clip else None, rope_mu, rope_freq, 1.0, block)


def block_slots(page_table_row: torch.Tensor, n: int, page: int) -> torch.Tensor:
    pos = torch.arange(n)
    return page_table_row[pos // page].long() * page + pos % page


# -- writer --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["rows", "mma_k"])
def test_writer_twin_is_quantize_channels(layout):
    """The twin stores `quantize_channels` of the rotated, centered, rope-centered rows: per-channel scale/zero at
    [page, h, slot // T, c], per-token codes; the pages read back (`gather_dequantize`) as `dequantize_channels`."""
    d, T, page = 64, 16, 32
    kt = key_transform(d, T, rope=True)
    pages = paged.QuantPages.empty(6, HKV, page, d, 2, d, "cpu", layout, T)
    table = torch.tensor([[4, 1, 3]], dtype=torch.int32)
    n, first = 3 * T, 7  # three blocks, the first at token position 7
    x = torch.randn(n, HKV, d).to(torch.bfloat16)
    pos = first + torch.arange(n)
    paged.rotate_quantize_pack(x, block_slots(table[0], n, page), pages, kt, positions=pos)
    rows = x.float() - paged.rope_offsets(kt, pos) - kt.mu
    rows = torch.einsum("nhd,hde->nhe", rows, kt.R)
    ref = quant.quantize_channels(rows.reshape(3, T, HKV, d).transpose(1, 2), 2, T, d, kt.rho)
    # blocks 0 and 1 in page 4 (rows 0, 1 of its scale/zero), block 2 in page 1 (row 0)
    assert torch.equal(pages.scale[4, :, 0], ref.scale[0, :, 0]) and torch.equal(pages.zero[4, :, 1], ref.zero[1, :, 0])
    assert torch.equal(pages.scale[1, :, 0], ref.scale[2, :, 0])
    got = paged.gather_dequantize(pages, table, 0, n)  # [Hkv, n, d]
    want = quant.dequantize_channels(ref).permute(1, 0, 2, 3).reshape(HKV, n, d)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    bits = quant.bits_per_element_of(page, d, [pages.codes[4, 0], pages.scale[4, 0], pages.zero[4, 0]])
    assert bits == quant.channel_bits_per_element(d, 2, T) == 2 + 32 / T


@triton_cpu
@pytest.mark.parametrize("layout,d,group,block,bits,rope", [("rows", 64, 32, 16, 2, True), ("mma_k", 64, 64, 16, 2, True),
                                                           ("rows", 32, 16, 4, 2, False), ("rows", 64, 64, 32, 4, False)])
def test_triton_writer_matches_the_twin(layout, d, group, block, bits, rope):
    """Same rows, same slots (rope-centered keys: same positions): the Triton writer's pages against the twin's (a
    rotation sums in another order, so a code may move one step at a rounding boundary: dequantized rows within one
    step of the block's scale)."""
    page = 32
    kt = key_transform(d, block, rope=rope)
    a = paged.QuantPages.empty(6, HKV, page, d, bits, group, "cpu", layout, block)
    b = paged.QuantPages.empty(6, HKV, page, d, bits, group, "cpu", layout, block)
    table = torch.tensor([[5, 2, 3]], dtype=torch.int32)
    n = 2 * block
    x = torch.randn(n, HKV, d).to(torch.bfloat16)
    slots = block_slots(table[0], n, page)
    pos = 5 + torch.arange(n)
    paged.rotate_quantize_pack(x, slots, a, kt, backend="torch", positions=pos)
    paged.rotate_quantize_pack(x, slots, b, kt, backend="triton", positions=pos)
    torch.testing.assert_close(a.scale.float(), b.scale.float(), rtol=1e-2, atol=1e-3)
    assert (a.codes != b.codes).float().mean() <= 0.01
    step = a.scale.float().max().item()
    ra, rb = (paged.gather_dequantize(p, table, 0, n) for p in (a, b))
    assert (ra - rb).abs().max().item() <= step * 1.01 + 1e-3


@triton_cpu
@pytest.mark.parametrize("layout,rope", [("rows", False), ("mma_k", True)])
def test_decode_block_writer_is_the_gather_then_the_block_writer(layout, rope):
    """A decode step's per-channel key blocks in one launch (`quantize_key_blocks_from_ring`) leave the pages and the
    window buffers the pool's gather-then-write leaves: each entry that completes a block has its ``T - 1`` ring rows
    and its new row quantized by the block writer at its slots (exact: the same kernel math on the same rows), the
    tail moved where it moves; an entry that completes no block touches nothing."""
    from oscar.kernels.quantize import quantize_key_blocks_from_ring, rotate_quantize_pack_channels

    d, T, page, S0, W = 64, 16, 32, 16, 32
    gen = torch.Generator().manual_seed(5)
    kt = key_transform(d, T, rope=rope)
    tail, cols = S0 + W, S0 + W + T - 1
    win_k = torch.randn(6, HKV, cols, d, generator=gen).to(torch.bfloat16)
    win_v = torch.randn(6, HKV, cols, d, generator=gen).to(torch.bfloat16)
    new = torch.randn(4, HKV, d, generator=gen).to(torch.bfloat16)
    req = torch.tensor([3, 1, 5, 0])
    done = torch.tensor([True, False, True, True])
    src = torch.tensor([S0, S0 + T, tail, S0 + T])  # entry 2 completes the block past the window: it moves the tail
    slot0 = torch.tensor([2 * page, 0, 5 * page + T, 3 * page])
    move_row = torch.tensor([0, 0, 5, 0])  # 0: the padding slot (nothing that is read moves)
    move_dst = torch.tensor([S0, S0, S0 + T, S0])
    pos = torch.tensor([S0 + T - 1, 40, S0 + 3 * T - 1, S0 + 2 * T - 1])

    def pages():
        return paged.QuantPages.empty(8, HKV, page, d, 2, d, "cpu", layout, T)

    a, b = pages(), pages()
    wk, wv = win_k.clone(), win_v.clone()
    kplain = kt.without_rope() if rope else kt
    offsets = paged.rope_offsets(kt, (pos[:, None] - (T - 1) + torch.arange(T)).clamp(min=0)).contiguous() if rope else None
    quantize_key_blocks_from_ring(new, wk, wv, req, done, src, slot0, move_row, move_dst, tail, a, kplain,
                                  offsets=offsets, token_map=paged.mma_map(a))
    for e in done.nonzero().flatten().tolist():  # the reference: gather, then the block writer
        rows = torch.cat([win_k[req[e], :, src[e]:src[e] + T - 1].transpose(0, 1), new[e][None]]).float()
        if rope:
            rows = rows - offsets[e]
        rotate_quantize_pack_channels(rows, slot0[e] + torch.arange(T), b, kplain, token_map=paged.mma_map(b))
    for t in ("codes", "scale", "zero"):
        assert torch.equal(getattr(a, t), getattr(b, t)), t
    want_k, want_v = win_k.clone(), win_v.clone()
    want_k[5, :, S0 + T:S0 + 2 * T - 1] = win_k[5, :, tail:tail + T - 1]
    want_v[5, :, S0 + T:S0 + 2 * T - 1] = win_v[5, :, tail:tail + T - 1]
    want_k[0, :, S0:S0 + T - 1] = win_k[0, :, tail:tail + T - 1]  # the padding slot's rows (done, no move)
    want_v[0, :, S0:S0 + T - 1] = win_v[0, :, tail:tail + T - 1]
    assert torch.equal(wk, want_k) and torch.equal(wv, want_v)
    assert not a.codes[0].any() and not a.scale[0].any()  # entry 1 (not done) wrote nothing into its slots
    with pytest.raises(ValueError, match=r"offsets must be float32 \[B=4, T=16"):
        quantize_key_blocks_from_ring(new, wk, wv, req, done, src, slot0, move_row, move_dst, tail, a, kplain,
                                      offsets=torch.zeros(4, T, HKV, d, dtype=torch.bfloat16), token_map=paged.mma_map(a))
    with pytest.raises(ValueError, match="done must be"):
        quantize_key_blocks_from_ring(new, wk, wv, req, done[:2], src, slot0, move_row, move_dst, tail, a, kplain,
                                      token_map=paged.mma_map(a))


# -- reads ---------------------------------------------------------------------------------------------


def _filled_pages(d: int, group: int, block: int, bits: int, hkv: int, page: int, lens: list[int]):
    num_pages = 1 + sum(-(-n // page) for n in lens)
    perm = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(0)) + 1  # shuffled page table
    width = max(-(-n // page) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    kt = key_transform(d, block, hkv=hkv, clip=False)
    vt = paged.HeadTransform(_rot(d, 40, hkv), 0.1 * torch.randn(hkv, d))
    kp = paged.QuantPages.empty(num_pages, hkv, page, d, bits, group, "cpu", "rows", block)
    vp = paged.QuantPages.empty(num_pages, hkv, page, d, bits, group, "cpu", "rows")
    for b, n in enumerate(lens):
        k = -(-n // page)
        table[b, :k] = perm[used:used + k].to(torch.int32)
        used += k
        slots = block_slots(table[b], n, page)
        paged.rotate_quantize_pack_kv(torch.randn(n, hkv, d), torch.randn(n, hkv, d), slots, kp, vp, kt, vt)
    return kp, vp, kt, vt, table


@triton_cpu
@pytest.mark.parametrize("d,group,block,bits,heads,hkv,page", [(64, 64, 16, 2, 4, 2, 32), (64, 32, 32, 2, 8, 1, 64),
                                                              (32, 16, 4, 2, 2, 2, 8), (64, 64, 16, 4, 3, 1, 16)])
def test_rows_kernel_reads_per_channel_key_pages(d, group, block, bits, heads, hkv, page):
    """The row-layout Triton kernel against the torch twin on per-channel K pages (GQA 1..8, pages smaller than the
    kernel's blocks, shuffled page tables, both output frames); the twin against dequantize-then-attend in float64."""
    lens = [3 * block, 5 * block + 0]
    kp, vp, kt, vt, table = _filled_pages(d, group, block, bits, hkv, page, lens)
    B, S0, W = 2, 4, 8
    g = torch.Generator().manual_seed(2)
    seg = paged.Segments(table, torch.tensor(lens, dtype=torch.int32),
                         sink_k=torch.randn(B, hkv, S0, d, generator=g), sink_v=torch.randn(B, hkv, S0, d, generator=g),
                         sink_len=torch.tensor([4, 2], dtype=torch.int32),
                         recent_k=torch.randn(B, hkv, W, d, generator=g), recent_v=torch.randn(B, hkv, W, d, generator=g),
                         recent_len=torch.tensor([8, 5], dtype=torch.int32))
    q = torch.randn(B, heads, d, generator=g)
    for frame in ("original", "rotated"):
        twin = paged.decode_attention(q, kp, vp, seg, kt, vt, backend="torch", output_frame=frame)
        kern = paged.decode_attention(q, kp, vp, seg, kt, vt, backend="triton", output_frame=frame)
        assert (twin - kern).abs().max().item() <= ATTN_TOL
    if block > 16:  # key blocks longer than the kernel's tiles of rows
        kern = paged.decode_attention(q, kp, vp, seg, kt, vt, backend="triton", launch=RowsLaunch(block_n=16))
        assert (paged.decode_attention(q, kp, vp, seg, kt, vt) - kern).abs().max().item() <= ATTN_TOL
    # the twin is dequantize-then-attend: sequence 1, no windows, in float64
    k_rot = paged.gather_dequantize(kp, table, 1, lens[1]).double()
    v_rot = paged.gather_dequantize(vp, table, 1, lens[1]).double()
    keys = torch.einsum("htd,hed->hte", k_rot, kt.R.double()) + kt.mu.double()[:, None]
    vals = torch.einsum("htd,hed->hte", v_rot, vt.R.double()) + vt.mu.double()[:, None]
    qg = q[1].double().reshape(hkv, heads // hkv, d)
    p = torch.softmax(torch.einsum("hrd,htd->hrt", qg, keys) / d ** 0.5, -1)
    want = torch.einsum("hrt,htd->hrd", p, vals).reshape(heads, d)
    only = paged.Segments(table[1:], torch.tensor(lens[1:], dtype=torch.int32))
    got = paged.decode_attention(q[1:], kp, vp, only, kt, vt, backend="torch")[0]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_mma_pages_with_channel_keys_wait_for_the_cuda_kernel(monkeypatch):
    """Until the CUDA mma kernel reads per-channel key pages (`decode_mma.CHANNEL_KEYS`), the Triton backend refuses
    them by name (no silent fallback) and `layout="auto"` resolves to rows; the torch twin reads them."""
    from oscar.kernels import decode_mma

    monkeypatch.setattr(decode_mma, "CHANNEL_KEYS", False, raising=False)
    d, T = 64, 16
    kp = paged.QuantPages.empty(3, HKV, 32, d, 2, d, "cpu", "mma_k", T)
    vp = paged.QuantPages.empty(3, HKV, 32, d, 2, d, "cpu", "mma_v")
    kt = key_transform(d, T)
    slots = torch.arange(32, 64)
    paged.rotate_quantize_pack_kv(torch.randn(32, HKV, d), torch.randn(32, HKV, d), slots, kp, vp, kt,
                                  paged.HeadTransform())
    seg = paged.Segments(torch.tensor([[1]], dtype=torch.int32), torch.tensor([32], dtype=torch.int32))
    q = torch.randn(1, 4, d)
    assert torch.isfinite(paged.decode_attention(q, kp, vp, seg, kt, paged.HeadTransform(), backend="torch")).all()
    with pytest.raises(NotImplementedError, match=r"block=16.*CHANNEL_KEYS is false.*layout='rows'"):
        paged.decode_attention(q, kp, vp, seg, kt, paged.HeadTransform(), backend="triton")
    fmt = ChannelKeyFormat(name="c", bits=2, group_size=d, sink=4, recent=32, page_size=32, key_block=T)
    assert fmt.resolve_layout("auto", d, "cuda") == "rows"
    monkeypatch.setattr(decode_mma, "CHANNEL_KEYS", True, raising=False)
    assert fmt.resolve_layout("auto", d, "cuda") == "mma"
    with pytest.raises(ValueError, match="read by a CUDA kernel"):  # past the refusal: the CPU check
        paged.decode_attention(q, kp, vp, seg, kt, paged.HeadTransform(), backend="triton")


# -- the ring and the device cache ---------------------------------------------------------------------


@pytest.mark.parametrize("recent,block", [(8, 4), (64, 32), (16, 16)])
def test_the_ring_holds_w_to_w_plus_t_minus_1_rows_as_a_prefix(recent, block):
    """Simulated token by token: the ring's valid rows are always slots 0..recent_len-1 and hold exactly the tokens
    past the demoted blocks, recent_len stays in [W, W + T - 1] once W tokens are in, demoted blocks arrive whole
    and in order, and `channel_ring_slots` finds every token (how a prefill is imported)."""
    C = recent + block - 1
    ring: list = [None] * C
    demoted: list[int] = []
    for r in range(3 * C + 5):
        st = paged.channel_ring(torch.tensor([r]), recent, block)
        if bool(st["demote"][0]):
            blk = [ring[int(s)] for s in st["src"][0]]
            assert blk == st["qpos"][0].tolist()
            demoted += blk
            for a, b in zip(st["move_src"][0].tolist(), st["move_dst"][0].tolist()):
                ring[b] = ring[a]
        ring[int(st["write"][0])] = r
        n_rec, n_int = int(st["recent_len"][0]), int(st["int_len"][0])
        assert sorted(ring[:n_rec]) == list(range(n_int, r + 1)) and demoted == list(range(n_int))
        assert n_int % block == 0 and (r + 1 < recent or recent <= n_rec <= recent + block - 1)
        slots = paged.channel_ring_slots(torch.arange(n_int, r + 1), torch.tensor(r + 1), recent, block)
        assert [ring[s] for s in slots.tolist()] == list(range(n_int, r + 1))


@pytest.fixture(scope="module")
def model():
    cfg = tp.architecture_config("qwen3", dict(
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HKV, head_dim=D, hidden_size=128,
        intermediate_size=256, vocab_size=320, max_position_embeddings=4096, tie_word_embeddings=False))
    return tp.build_random_model(cfg, device="cpu", dtype=torch.bfloat16, std=0.08)


def mixed_rotations(blocks: tuple[int, ...], rope=None) -> list[LayerRotations]:
    """Seeded rotations, means and clip ratios; layer ``l`` keys per channel over ``blocks[l]`` tokens (0: per
    token); ``rope``: head 0 of each layer rope-centered."""
    g = torch.Generator().manual_seed(0)
    out = []
    for layer, block in enumerate(blocks):
        rope_k = None
        if rope is not None:
            rope_k = torch.zeros(HKV, D)
            rope_k[0] = 0.5 * torch.randn(D, generator=g)
        out.append(LayerRotations(_rot(D, 100 * layer), _rot(D, 100 * layer + 50), 0.1 * torch.randn(HKV, D, generator=g),
                                  0.1 * torch.randn(HKV, D, generator=g), torch.full((HKV,), 0.9),
                                  torch.full((HKV,), 0.9), rope_k, rope, k_block=block))
    return out


def _device_vs_torch(model, fmt, rots, ids, steps, backend):
    t = tp.TimedCache(fmt, transforms=tp.head_transforms(rots), layout="rows")
    ref_tok, ref_lg = tp.reference_decode(model, ids, t, steps, rots)
    cache = tp.new_device_cache(t, model, ids.shape[0], ids.shape[1], extra_steps=steps, device="cpu", backend=backend,
                                shuffle_pages=True)
    tok, lg = tp.device_decode(model, ids, cache, steps, forced=ref_tok[:, :-1])
    return cache, tok, lg, ref_tok, ref_lg


def test_device_cache_demotes_whole_blocks_like_the_torch_cache(model):
    """Layer 0 per-channel keys (T = 4, ring of W..W+T-1 = 8..11 rows), layer 1 per-token, rope-centered key heads:
    the device cache (torch twins, shuffled pages) against the torch cache, teacher forced over 10 decode steps that
    cross three block boundaries: the same greedy tokens and logits within one bf16 step; the quantized lengths per
    layer follow the rule of `OscarLayer._int_end`."""
    from oscar.models.adapters import key_rope

    rope, why = key_rope(model, 0, positions=64)
    assert rope is not None, why
    fmt = ChannelKeyFormat(name="ch", bits=2, group_size=D, sink=4, recent=8, page_size=8, key_block=4,
                           layer_blocks=(4, 0))
    ids = torch.randint(0, 320, (2, 19), generator=torch.Generator().manual_seed(1))  # 15 past the sink
    cache, tok, lg, ref_tok, ref_lg = _device_vs_torch(model, fmt, mixed_rotations((4, 0), rope), ids, 11, "torch")
    assert torch.equal(tok, ref_tok)
    assert (lg - ref_lg).abs().max().item() <= LOGIT_TOL
    n = cache.seq_len - fmt.sink  # tokens past the sink
    assert cache.step["ch_int_len"].tolist() == [4 * ((n - 1 - 8) // 4)] * 2  # the last step's view (token n - 1)
    assert cache.step["int_len"].tolist() == [n - 8] * 2


@triton_cpu
def test_device_cache_on_the_triton_kernels(model):
    """The same cache on the Triton writer and row kernel (interpreted on a CPU), teacher forced on the torch cache's
    tokens across a block boundary (the second decode step demotes a block): logits within the kernels' tolerance
    (tests/test_formats.py, CUDA_LOGIT_TOL)."""
    fmt = ChannelKeyFormat(name="ch", bits=2, group_size=D, sink=4, recent=8, page_size=8, key_block=4,
                           layer_blocks=(4, 0))
    from oscar.cache import device_cache as dc
    from tests.test_device_cache import _SyncCounter

    ids = torch.randint(0, 320, (1, 22), generator=torch.Generator().manual_seed(3))
    cache, tok, lg, _, ref_lg = _device_vs_torch(model, fmt, mixed_rotations((4, 0)), ids, 3, "triton")
    assert (lg - ref_lg).abs().max().item() <= 0.1
    counter = _SyncCounter()  # a whole step (block demotion, ring move, attention) reads nothing back: graph-safe
    with counter, torch.no_grad():
        dc.decode_step(model, cache, tok[:, -1], advance=False)
    assert counter.ops == []


# -- KIVI-2 served -------------------------------------------------------------------------------------


def test_kivi2_served_through_the_paged_path(model):
    """Served KIVI-2 (`KiviFormat.served`: identity transforms, keys per channel over blocks of G, values per token,
    no sink, residual W): the device cache against the torch cache of the served format (same tokens, one bf16 step),
    and against the simulated KIVI cache: identical where the simulated value boundary falls on a key block (the
    served one keeps up to G - 1 more values in BF16, K and V demoting together), close elsewhere."""
    sim = KiviFormat(name="kivi2", bits=2, group_size=8, recent=16)
    served = sim.served(D, page_size=8)
    assert (served.sink, served.recent, served.key_block, served.group_size) == (0, 16, 8, 8)
    rots = served.layer_rotations(LAYERS, HKV, D)
    t = tp.TimedCache(served, transforms=served.identity_transforms(LAYERS), layout="rows")
    ids = torch.randint(0, 320, (2, 23), generator=torch.Generator().manual_seed(4))  # 23 + 1 - 16 = 8: aligned
    steps = 4
    ref_tok, ref_lg = tp.reference_decode(model, ids, t, steps, rots)
    cache = tp.new_device_cache(t, model, 2, ids.shape[1], extra_steps=steps, device="cpu", backend="torch")
    tok, lg = tp.device_decode(model, ids, cache, steps, forced=ref_tok[:, :-1])
    assert torch.equal(tok, ref_tok) and (lg - ref_lg).abs().max().item() <= LOGIT_TOL
    _, sim_lg = tp.reference_decode(model, ids, tp.TimedCache(sim), steps, [])
    _, bf16 = tp.reference_decode(model, ids, tp.TimedCache(BF16Format(name="bf16")), steps, [])
    # teacher forcing differs (each path its own tokens): compare while the paths agree on the tokens fed
    assert (lg[:, 1] - sim_lg[:, 1]).abs().max().item() <= LOGIT_TOL  # first decode step: the same quantized rows
    moved = (sim_lg[:, 1:] - bf16[:, 1:]).abs().max().item()
    assert moved > LOGIT_TOL  # the simulated format does move the logits there
    assert (lg[:, 2] - sim_lg[:, 2]).abs().max().item() <= moved  # one more value kept in BF16: a smaller change


# -- the format and its records ------------------------------------------------------------------------


def test_the_artifact_records_the_channel_format(tmp_path):
    """An artifact with per-channel key layers records the rotated_channel format (its layers' blocks), reads it back,
    and an artifact written before formats were recorded gets it from `meta["key_block"]`; bits per key element of a
    per-channel layer are b + 32/T, and the pool's bytes per token are what a device cache allocates."""
    from oscar.cache import device_cache as dc
    from oscar.config import compose
    from oscar.core.artifact import read_meta, save_artifact
    from oscar.models.methods import in_code_artifact

    mcfg = compose(["method=quarot", "method.clip=none", "method.sink=4", "method.recent=64"]).method
    art = in_code_artifact(mcfg, num_layers=3, num_kv_heads=HKV, head_dim=D, model_id="m", config_hash="h")
    art.meta["key_block"] = [32, 0, 32]
    fmt = record_format(art, mcfg)
    assert isinstance(fmt, ChannelKeyFormat) and fmt.layer_blocks == (32, 0, 32) and fmt.key_block == 32
    save_artifact(art, tmp_path / "a")
    meta = read_meta(tmp_path / "a")
    assert CacheFormat.of_artifact(meta) == fmt
    assert CacheFormat.of_artifact({k: v for k, v in meta.items() if k != "cache_format"}) == fmt
    all_ch = fmt.replace(layer_blocks=None)
    n = 1 << 20
    k_bits = 2 * all_ch.expected_bits(n, D) - quant.bits_per_element(n, D, 2, D, 4, 64)
    assert k_bits == pytest.approx(2 + 32 / 32, abs=1e-3)
    small = ChannelKeyFormat(name="c", bits=2, group_size=32, sink=4, recent=8, page_size=8, key_block=4,
                             layer_blocks=(4, 0))
    tr = [(paged.HeadTransform(block=b), paged.HeadTransform()) for b in (4, 0)]
    cache = dc.DeviceOscarCache(small, num_layers=2, batch=1, num_kv_heads=HKV, head_dim=D, quant_capacity=16,
                                transforms=tr, layout="rows")
    pages = sum(t.numel() * t.element_size() for p in cache.k_pages + cache.v_pages for t in (p.codes, p.scale, p.zero))
    assert pages == cache.k_pages[0].codes.shape[0] * 8 * small.bytes_per_token(2, HKV, D)


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match=r"key block=24 must be a power of two dividing page_size=64.*\[1, 2, 4, 8"):
        paged.QuantPages.empty(2, HKV, 64, D, 2, D, "cpu", "rows", 24)
    with pytest.raises(ValueError, match=r"key block=128 must be a power of two dividing page_size=64"):
        ChannelKeyFormat(name="c", bits=2, group_size=D, recent=128, page_size=64, key_block=128)
    with pytest.raises(ValueError, match=r"recent=12: .* multiple of 8"):
        ChannelKeyFormat(name="c", bits=2, group_size=D, recent=12, page_size=64, key_block=8)
    with pytest.raises(ValueError, match=r"layer_blocks \[16\] differ from key_block=8"):
        ChannelKeyFormat(name="c", bits=2, group_size=D, recent=8, key_block=8, layer_blocks=(8, 16))
    with pytest.raises(ValueError, match=r"stores per-token keys; a layer with per-channel keys \(block=8\) needs the "
                                         r"rotated_channel format"):
        RotatedFormat(name="r", bits=2, group_size=D, recent=8).new_pages(2, HKV, D, "cpu", "rows", key_block=8)
    pages = paged.QuantPages.empty(2, HKV, 16, D, 2, D, "cpu", "rows", 8)
    with pytest.raises(ValueError, match=r"whole blocks of 8 rows; got 6 rows"):
        paged.rotate_quantize_pack(torch.randn(6, HKV, D), torch.arange(6), pages, paged.HeadTransform(block=8))
    with pytest.raises(ValueError, match=r"blocks of 8 consecutive slots starting at a multiple of 8; block 0 has slots "
                                         r"\[4, 5, 6, 7\]"):
        paged.rotate_quantize_pack(torch.randn(8, HKV, D), torch.arange(4, 12), pages, paged.HeadTransform(block=8))
    with pytest.raises(ValueError, match=r"scale/zero of shape \(2, 2, 16, 1\).* expected \[P, 2, 2, 64\]"):
        paged.QuantPages(pages.codes, torch.zeros(2, HKV, 16, 1, dtype=torch.bfloat16),
                         torch.zeros(2, HKV, 16, 1, dtype=torch.bfloat16), 2, D, "rows", 8)
    with pytest.raises(ValueError, match="block=-1 must be 0"):
        paged.HeadTransform(block=-1)
    fmt = ChannelKeyFormat(name="c", bits=2, group_size=D, sink=4, recent=8, page_size=8, key_block=4)
    with pytest.raises(ValueError, match=r"layer 1: a layer's key block 8 is not one of this format's \(0 or key_block=4\)"):
        fmt.device_cache(num_layers=2, batch=1, num_kv_heads=HKV, head_dim=D, context=16,
                         transforms=[(paged.HeadTransform(block=4), paged.HeadTransform()),
                                     (paged.HeadTransform(block=8), paged.HeadTransform())])

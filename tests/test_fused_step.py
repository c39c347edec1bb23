"""The fused decode step (oscar.models.fused_step) against the transformers forward on tiny random models of every
family that has one, through the static BF16 cache and the paged OSCAR cache (torch twins), on the CPU.

Tolerance: in float32 both paths run the same operations on the same values; only the fused GEMMs ([q;k;v]
and [gate;up] in one matrix) may block their reductions differently from three or two separate GEMMs. Each
logit is then a float32 sum over at most 256 products per GEMM through 2 layers: relative rounding of order
1e-6. Measured on this CPU the logits are identical; the test allows 1e-4 of the largest logit magnitude (a
logit-level difference a hundred times float32 rounding, a thousand times under the 0.05 the device-cache
tests accept for BF16 storage)."""

from __future__ import annotations

import pytest
import torch

from oscar.cache import device_cache as dc
from oscar.bench.throughput import decode as tp
from oscar.cache.torch_cache import LayerRotations
from oscar.cache.formats import RotatedFormat
from oscar.models.fused_step import FusedDecoder, fused_decoder
from oscar.models.adapters import UnsupportedModel
from oscar.core.rotation import random_orthogonal

LAYERS, HEADS, HKV, D = 2, 4, 2, 64
REL_TOL = 1e-4


def tiny(family: str, **extra) -> torch.nn.Module:
    cfg = tp.architecture_config(family, dict(
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HKV, head_dim=D, hidden_size=128,
        intermediate_size=256, vocab_size=320, max_position_embeddings=4096, tie_word_embeddings=False, **extra))
    model = tp.build_random_model(cfg, device="cpu", dtype=torch.float32, std=0.08)
    with torch.no_grad():  # non-trivial norm weights and biases, so a dropped term shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    dc.enable(model)
    return model


def oscar_cache(batch: int, length: int, steps: int) -> dc.DeviceOscarCache:
    rots = [LayerRotations(torch.stack([random_orthogonal(D, seed=10 * i + h, dtype=torch.float32) for h in range(HKV)]),
                           torch.stack([random_orthogonal(D, seed=10 * i + h + 5, dtype=torch.float32) for h in range(HKV)]),
                           None, None, None, None) for i in range(LAYERS)]
    fmt = tp.TimedCache(RotatedFormat(name="oscar", bits=2, group_size=D, sink=4, recent=8, page_size=4),
                        transforms=tp.head_transforms(rots), layout="rows")
    model_like = type("M", (), {"config": type("C", (), dict(num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                                             num_key_value_heads=HKV, head_dim=D))()})()
    return tp.new_device_cache(fmt, model_like, batch, length, extra_steps=steps, device="cpu", backend="torch",
                               dtype=torch.float32)


def decode(model: torch.nn.Module, kind: str, forward, steps: int = 5) -> torch.Tensor:
    """Logits ``[steps, B, V]`` of greedy decode steps after a 20-token prompt (past sink + recent: every
    OSCAR step demotes a row into the pages)."""
    ids = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(1))
    if kind == "bf16":
        cache = dc.StaticBF16Cache(num_layers=LAYERS, batch=2, num_kv_heads=HKV, head_dim=D, capacity=40,
                                   dtype=torch.float32)
    else:
        cache = oscar_cache(2, 20, steps)
    out = []
    with torch.no_grad():
        lg, kv = dc.prefill(model, ids)
        dc.import_prefill(cache, kv)
        tok = lg.argmax(-1)
        for _ in range(steps):
            tok, lg = dc.decode_step(model, cache, tok, forward=forward)
            out.append(lg)
    return torch.stack(out)


@pytest.mark.parametrize("family,extra,kind", [
    ("qwen3", {}, "bf16"), ("qwen3", {}, "oscar"), ("qwen2", {}, "bf16"),
    ("llama", {"attention_bias": True, "mlp_bias": True}, "bf16")])
def test_fused_step_equals_the_transformers_forward(family, extra, kind):
    """Same greedy tokens and logits within REL_TOL of the largest logit, step after step (the caches are written
    by each path itself, so a wrong K/V would show in the next steps too)."""
    model = tiny(family, **extra)
    ref = decode(model, kind, None)
    fused = FusedDecoder(model, compile=False)
    assert not fused.compiled
    got = decode(model, kind, fused)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert float((got - ref).abs().max()) <= REL_TOL * float(ref.abs().max())


def test_fused_weights_are_views_and_the_transformers_forward_is_unchanged():
    """Fusing at load time makes each q/k/v and gate/up weight a view of one concatenated matrix: no byte
    is held twice, and the transformers forward (the HF baseline) computes exactly what it did (the same
    GEMMs on the same values)."""
    model = tiny("qwen3")
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    ref = decode(model, "bf16", None)
    fused = FusedDecoder(model, compile=False)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    w = fused.layers[1].wqkv
    assert attn.q_proj.weight.data_ptr() == w.data_ptr()
    assert attn.k_proj.weight.data_ptr() == w.data_ptr() + HEADS * D * w.shape[1] * w.element_size()
    assert mlp.up_proj.weight.data_ptr() == fused.layers[1].wgu[256:].data_ptr()
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == before
    assert torch.equal(decode(model, "bf16", None), ref)


@pytest.mark.slow
def test_compiled_step_traces_as_one_graph_per_piece():
    """torch.compile with fullgraph=True (the aot_eager backend: the tracing and functionalization inductor
    gets, without a C++ toolchain) runs the same step: no graph break around the cache call's neighbours."""
    model = tiny("qwen3")
    ref = decode(model, "oscar", None)
    got = decode(model, "oscar", FusedDecoder(model, compile=True, backend="aot_eager"))
    assert float((got - ref).abs().max()) <= REL_TOL * float(ref.abs().max())


def test_families_without_a_fused_step_are_refused_by_name(capsys):
    class Gemma:
        config = type("C", (), {"model_type": "gemma3_text"})()

    with pytest.raises(UnsupportedModel, match="family 'gemma3' has no fused decode step"):
        FusedDecoder(Gemma())  # type: ignore[arg-type]
    assert fused_decoder(Gemma()) is None  # type: ignore[arg-type]
    assert "fused decode step not available" in capsys.readouterr().err


def test_a_norm_that_is_not_plain_rmsnorm_is_refused():
    """A module that computes something else than weight * x / rms(x) (here Gemma's (1 + w) scaling) is caught
    on the model's own module at load time, not approximated."""
    model = tiny("qwen3")
    norm = model.model.layers[0].post_attention_layernorm
    plain = type(norm).forward
    type(norm).forward = lambda self, x: plain(self, x) * (1 + self.weight) / self.weight.clamp_min(1e-3)
    try:
        with pytest.raises(UnsupportedModel, match="does not compute weight"):
            FusedDecoder(model, compile=False)
    finally:
        type(norm).forward = plain


def test_compiling_raises_the_recompile_limit_past_one_graph_per_model_and_batch():
    """Each compiled piece is one code object for every decoder: a profile of two models over five batch sizes
    and the check compiles it more often than dynamo's default limit of 8, a hard failure under fullgraph."""
    import torch._dynamo.config as dynamo_config

    FusedDecoder(tiny("qwen3"), compile=True, backend="aot_eager")  # builds the wrappers, compiles nothing yet
    assert dynamo_config.recompile_limit >= 64

"""The SGLang client's view of the served format (`oscar.serve.client`): which format the pool serves for a
method (KIVI-2's paged twin, `auto`'s per-channel key layers from its artifact), the windows it passes, what it
refuses, and the per-request bits an eval cell records (`request_info`, attached by `oscar.eval.runner`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oscar.cache.formats import ChannelKeyFormat, KiviFormat, RotatedFormat
from oscar.config import compose
from oscar.core.artifact import save_artifact
from oscar.models.methods import in_code_artifact
from oscar.serve.client import SGLangEngine, pool_format, served_windows

HKV, D = 2, 64


def _artifact(tmp: Path, overrides: list[str], key_block: list[int] | None = None) -> Path:
    mcfg = compose(overrides).method
    art = in_code_artifact(mcfg, num_layers=3, num_kv_heads=HKV, head_dim=D, model_id="m", config_hash="h")
    if key_block is not None:  # an `auto` artifact whose layers chose per-channel keys
        art.meta["key_block"] = key_block
        from oscar.cache.formats import record_format

        record_format(art, mcfg)
    save_artifact(art, tmp)
    return tmp


def test_kivi2_is_served_as_its_paged_twin(tmp_path):
    fmt = pool_format(KiviFormat(name="kivi2", bits=2, group_size=32, sink=0, recent=64), D)
    assert isinstance(fmt, ChannelKeyFormat) and fmt.key_block == 32 and fmt.sink == 0 and fmt.recent == 64
    rotated = RotatedFormat(name="auto", bits=2, group_size=64, sink=16, recent=64)
    assert pool_format(rotated, D) is rotated
    # the in-code KIVI-2 artifact (what the client writes for engine=sglang method=kivi2) fits the method; the
    # method's sink (KIVI-2 has none) is not passed, its residual is the artifact's
    art = _artifact(tmp_path / "kivi", ["method=kivi2", "method.sink=16", "method.recent=64"])
    method = pool_format(KiviFormat(name="kivi2", bits=2, group_size=32, sink=16, recent=64), D)
    assert served_windows(method, art) == {}
    assert served_windows(method.replace(recent=96), art) == {"OSCAR_RECENT": "96"}


def test_auto_with_per_channel_layers_serves_the_artifacts_format(tmp_path):
    art = _artifact(tmp_path / "auto", ["method=quarot", "method.clip=none", "method.sink=0", "method.recent=64"],
                    key_block=[32, 0, 32])
    method = RotatedFormat(name="quarot", bits=2, group_size=64, sink=0, recent=64)
    assert served_windows(method, art) == {}  # the artifact's key blocks make the method's format rotated_channel
    assert served_windows(method.replace(sink=32), art) == {"OSCAR_SINK": "32"}
    with pytest.raises(ValueError, match=r"rotated_channel format INT2 group 64, but method 'quarot' asks for "
                                         r"rotated_channel INT4"):
        served_windows(method.replace(bits=4), art)


def test_a_kivi_method_refuses_a_rotated_artifact(tmp_path):
    art = _artifact(tmp_path / "q", ["method=quarot", "method.clip=none"])
    kivi = pool_format(KiviFormat(name="kivi2", bits=2, group_size=32, sink=0, recent=64), D)
    with pytest.raises(ValueError, match=r"calibrated for the rotated format .* asks for rotated_channel"):
        served_windows(kivi, art)


class _Tok:
    """Whitespace tokenizer: one id per word."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text.split())))}


def test_request_info_is_the_served_formats_accounting_at_the_requests_length():
    cfg = compose(["method=auto", "method.sink=16", "method.recent=64"])
    eng = SGLangEngine.__new__(SGLangEngine)  # no server: the accounting only
    eng.cfg, eng.tokenizer = cfg, _Tok()
    eng.served = {"cuda_graph": True, "radix": True, "chunked_prefill_size": None, "prefix_reuse": "exact",
                  "prefill_stage_mib": 2048}
    eng.format = RotatedFormat(name="auto", bits=2, group_size=64, sink=16, recent=64)
    info = eng.request_info("w " * 300, "x " * 100)
    assert info["steps"] == 100 and info["cuda_graph"] is True and info["radix"] is True
    assert info["prefix_reuse"] == "exact" and info["prefill_stage_mib"] == 2048
    assert info["kv_bits_per_element"] == pytest.approx(eng.format.expected_bits(400, int(cfg.model.head_dim)))
    assert 2.0 < info["kv_bits_per_element"] < 16.0
    assert eng.request_info("w " * 10, "")["kv_bits_per_element"] == pytest.approx(16.0)  # all in the windows


def test_the_runner_records_an_engines_per_request_info(monkeypatch):
    from oscar.eval import runner

    class Engine:
        last_info: list = []

        def generate(self, prompts, **kw):
            self.last_info = [{"kv_bits_per_element": 3.0 + i, "steps": 7, "other": 1, "cuda_graph": True}
                              for i in range(len(prompts))]
            return ["out"] * len(prompts)

    class Item:
        def __init__(self, i):
            self.id = f"t/{i}"

    monkeypatch.setattr(runner, "generation_prompt", lambda engine, cfg, item: f"prompt {item.id}")
    monkeypatch.setattr(runner, "grade_generation", lambda cfg, item, prompt, out: {"id": item.id})
    cfg = compose(["benchmark=humaneval"])
    recs = runner.process_batch(Engine(), cfg, [Item(0), Item(1)])
    assert recs == [{"id": "t/0", "kv_bits_per_element": 3.0, "steps": 7, "cuda_graph": True},
                    {"id": "t/1", "kv_bits_per_element": 4.0, "steps": 7, "cuda_graph": True}]


def test_served_config_is_production_on_a_gpu_and_says_so():
    from types import SimpleNamespace

    from oscar.serve.client import served_config

    auto = SimpleNamespace(cuda_graph="auto", radix="auto", chunked_prefill_size="auto")
    assert served_config(auto, "cuda") == {"cuda_graph": True, "radix": True, "chunked_prefill_size": None,
                                           "prefix_reuse": "exact",  # a radix hit reuses the BF16 sink only
                                           "prefill_stage_mib": 2048}  # chunks read their earlier chunks in BF16
    assert served_config(auto, "cpu") == {"cuda_graph": False, "radix": False, "chunked_prefill_size": -1,
                                          "prefix_reuse": "exact", "prefill_stage_mib": 2048}
    debug = SimpleNamespace(cuda_graph=False, radix=True, chunked_prefill_size=4096, prefix_reuse="quantized",
                            prefill_stage_mib=0)
    assert served_config(debug, "cuda") == {"cuda_graph": False, "radix": True, "chunked_prefill_size": 4096,
                                            "prefix_reuse": "quantized", "prefill_stage_mib": 0}
    with pytest.raises(ValueError, match="engine.prefill_stage_mib=-1 is not valid; choose auto or MiB >= 0"):
        served_config(SimpleNamespace(cuda_graph="auto", radix="auto", chunked_prefill_size="auto",
                                      prefill_stage_mib=-1), "cuda")
    with pytest.raises(ValueError, match="engine.prefix_reuse='int2' is not valid; choose one of exact, quantized"):
        served_config(SimpleNamespace(cuda_graph="auto", radix="auto", chunked_prefill_size="auto",
                                      prefix_reuse="int2"), "cuda")
    with pytest.raises(ValueError, match="engine.cuda_graph='yes' is not valid; choose auto, true or false"):
        served_config(SimpleNamespace(cuda_graph="yes", radix="auto", chunked_prefill_size="auto"), "cuda")

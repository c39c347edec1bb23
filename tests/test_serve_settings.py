"""OSCAR serving settings and start-up validation (oscar.serve.settings): plain Python, no sglang import,
so the default environment tests them too; tests/serve/ runs the same checks through a real server."""

from __future__ import annotations

import shutil
import sys

import pytest

from oscar.cache.formats import RotatedFormat
from oscar.serve.settings import OscarServeError, ServeSettings, check_architecture, validate


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoConfig

    from oscar.core.artifact import config_hash_of, model_config_fields, save_artifact
    from oscar.config import compose
    from oscar.models.methods import in_code_artifact
    from oscar.models.tiny import save_random_model

    root = tmp_path_factory.mktemp("serve_settings")
    model = save_random_model("llama", root / "model")
    hf = AutoConfig.from_pretrained(str(model))
    f = model_config_fields(hf)
    art = in_code_artifact(compose(["method=quarot", "method.clip=none"]).method, num_layers=f["num_layers"],
                           num_kv_heads=f["num_kv_heads"], head_dim=f["head_dim"], config_hash=config_hash_of(hf))
    save_artifact(art, root / "quarot")
    return hf, root / "quarot"


def test_from_env_defaults_and_errors():
    s = ServeSettings.from_env({"OSCAR_ARTIFACT": "/a"})
    assert (s.sink, s.recent, s.kernels) == (None, None, None)  # windows: the artifact's format
    assert s.kernel_backend("cpu") == "torch" and s.kernel_backend("cuda") == "triton"
    assert s.prefill_stage_mib == 2048 and ServeSettings.from_env({"OSCAR_ARTIFACT": "/a",
                                                                   "OSCAR_PREFILL_STAGE_MIB": "0"}).prefill_stage_mib == 0
    with pytest.raises(OscarServeError, match="needs OSCAR_ARTIFACT"):
        ServeSettings.from_env({})
    for env, msg in (({"OSCAR_SINK": "x"}, "OSCAR_SINK='x' is not an integer"),
                     ({"OSCAR_RECENT": "0"}, "OSCAR_RECENT=0 must be >= 1"),
                     ({"OSCAR_BITS": "4"}, "OSCAR_BITS are no longer read: the artifact's meta.json fixes"),
                     ({"OSCAR_GROUP_SIZE": "32"}, "OSCAR_GROUP_SIZE are no longer read"),
                     ({"OSCAR_KERNELS": "cuda"}, "choose 'torch' or 'triton'"),
                     ({"OSCAR_PREFILL_STAGE_MIB": "-1"}, "OSCAR_PREFILL_STAGE_MIB=-1 must be >= 0"),
                     ({"OSCAR_PREFILL_STAGE_MIB": "1G"}, "OSCAR_PREFILL_STAGE_MIB='1G' is not an integer")):
        with pytest.raises(OscarServeError, match=msg):
            ServeSettings.from_env({"OSCAR_ARTIFACT": "/a", **env})


def test_validate_loads_matching_artifact(tiny):
    hf, art = tiny
    rotations, fmt = validate(ServeSettings.from_env({"OSCAR_ARTIFACT": str(art)}), hf)
    assert (len(rotations), fmt.kind, fmt.bits, fmt.group_size) == (hf.num_hidden_layers, "rotated", 2, 64)
    assert (fmt.sink, fmt.recent) == (64, 256)  # the quarot method's windows, recorded at calibration
    _, moved = validate(ServeSettings.from_env({"OSCAR_ARTIFACT": str(art), "OSCAR_SINK": "16", "OSCAR_RECENT": "32"}), hf)
    assert (moved.sink, moved.recent, moved.bits) == (16, 32, 2)  # serve-time windows over the artifact's format
    assert tuple(rotations[0].r_k.shape) == (hf.num_key_value_heads, hf.head_dim, hf.head_dim)


def test_validate_refuses_bad_artifacts(tiny, tmp_path):
    hf, art = tiny
    with pytest.raises(OscarServeError, match="is not a directory"):
        validate(ServeSettings(artifact=tmp_path / "none"), hf)
    broken = tmp_path / "broken"
    shutil.copytree(art, broken)
    (broken / "rotations.safetensors").write_bytes(b"garbage")
    with pytest.raises(OscarServeError, match="do not belong together"):
        validate(ServeSettings(artifact=broken), hf)
    other = type(hf).from_dict({**hf.to_dict(), "num_hidden_layers": 3})
    with pytest.raises(OscarServeError, match="config_hash"):
        validate(ServeSettings(artifact=art), other)


@pytest.mark.parametrize("change, msg", [
    ({"model_type": "mistral"}, "no adapter for model_type 'mistral'"),
    ({"use_sliding_window": True, "sliding_window": 128}, "sliding-window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer types"),
    ({"kv_lora_rank": 512}, "multi-head latent attention"),
    ({"head_dim": 96 + 4}, "unsupported head_dim"),
])
def test_check_architecture_refuses(tiny, change, msg):
    from types import SimpleNamespace

    hf, _ = tiny
    cfg = SimpleNamespace(**{**hf.to_dict(), **change})
    with pytest.raises(OscarServeError, match=msg):
        check_architecture(cfg)
    check_architecture(hf)


def test_bytes_accounting():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, INT2 with one group per row
    smol = RotatedFormat(bits=2, group_size=64, sink=64, recent=256)
    assert smol.bytes_per_token(30, 3, 64) == 2 * 30 * 3 * (16 + 4)
    assert 2 * 30 * 3 * 64 * 2 / smol.bytes_per_token(30, 3, 64) == pytest.approx(6.4)
    # head_dim 128 at group 128 (Qwen3 geometry): 32 code bytes + 4 bytes scale/zero per row, 7.1x under BF16
    qwen = RotatedFormat(bits=2, group_size=128, recent=1)
    assert qwen.bytes_per_token(1, 1, 128) == 2 * (32 + 4)
    assert 2 * 128 * 2 / qwen.bytes_per_token(1, 1, 128) == pytest.approx(512 / 72)
    assert smol.window_bytes(30, 3, 64) == 2 * 30 * 3 * 320 * 64 * 2


def test_default_environment_does_not_import_sglang():
    assert "sglang" not in sys.modules


def test_verbs_without_an_sglang_path_refuse_it(capsys):
    from oscar.commands import fidelity, generate

    assert generate.main(["engine=sglang", "prompt=hi"]) == 2
    assert "engine=sglang is not supported" in capsys.readouterr().err
    assert fidelity.main(["engine=sglang"]) == 2
    assert "engine=sglang is not supported" in capsys.readouterr().err


def test_engine_enters_the_cell_hash_only_when_not_embedded():
    from oscar.config import compose
    from oscar.eval.runner import cell_config_hash

    base = compose(["benchmark=mmlu"])
    assert cell_config_hash(base) == cell_config_hash(compose(["benchmark=mmlu", "engine=embedded"]))
    assert cell_config_hash(base) != cell_config_hash(compose(["benchmark=mmlu", "engine=sglang"]))


def test_mma_launch_options_parse_and_refuse():
    from oscar.serve.settings import OscarServeError, ServeSettings, parse_mma

    assert parse_mma("") == ()
    assert parse_mma("warps=8, stages=6,waves=3") == (("warps", 8), ("stages", 6), ("waves", 3))
    assert ServeSettings.from_env({"OSCAR_ARTIFACT": "/a", "OSCAR_MMA": "splits=12,min_blocks=2"}).mma == (
        ("splits", 12), ("min_blocks", 2))
    for bad, match in (("warp=8", "'warp=8' is not valid"), ("stages=x", "'stages=x'"), ("splits=0", "'splits=0'"),
                       ("waves=2,splits=4", "both waves and splits")):
        with pytest.raises(OscarServeError, match=match):
            parse_mma(bad)

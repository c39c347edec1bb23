"""Adding a model of a supported family takes one conf file: a tiny random-weight Gemma 3 (mixed sliding-window
and full-attention layers) registered only by `conf/model/<name>.yaml` calibrates, loads its artifact and scores
through the OSCAR cache; a conf naming an unsupported family is refused before any work."""

from __future__ import annotations

import json

import random
import shutil

import pytest
import torch

from oscar.config import CONF_DIR, Composer
from oscar.models.tiny import save_random_model

WORDS = "alpha beta gamma delta key value query cache token rotate quantize group head layer model text".split()


def _conf_tree(tmp_path, text: str):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "model" / "my-gemma.yaml").write_text(text)
    return conf


def _conf_text(snapshot, family: str = "gemma3") -> str:
    return f"""# a user's model: nothing but this file
name: my-gemma
hf_id: {snapshot}
family: {family}
num_layers: 3
num_heads: 4
num_kv_heads: 1
head_dim: 64
hidden_size: 64
max_context: 4096
offline: false
"""


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    root = tmp_path_factory.mktemp("newmodel")
    snap = save_random_model("gemma3", root / "gemma3", seed=0, num_layers=3, num_heads=4, num_kv_heads=1, head_dim=64, hidden_size=64)
    corpus = root / "corpus.txt"
    rng = random.Random(0)
    corpus.write_text(" ".join(rng.choice(WORDS) for _ in range(3000)))
    return snap, corpus


def test_a_conf_file_alone_adds_a_model_of_a_supported_family(snapshot, tmp_path):
    from oscar.commands.calibrate import run_calibrate
    from oscar.models.engine import Engine, next_token_kl

    snap, corpus = snapshot
    conf = _conf_tree(tmp_path, _conf_text(snap))
    common = ["model=my-gemma", "calibration.corpus=file", f"calibration.path={corpus}", "calibration.num_tokens=128",
              "calibration.seq_len=64", "calibration.holdout_tokens=64", f"results_dir={tmp_path / 'results'}", "device=cpu",
              "method.sink=2", "method.recent=8"]
    with Composer(conf_dir=conf) as c:
        cfg = c.compose([*common, "method=oscar"])
        bf16 = c.compose([*common, "method=bf16"])
    results = run_calibrate(cfg)
    assert [r.stage for r in results] == ["dump", "rotations", "clip"]
    meta = json.loads((results[-1].path / "meta.json").read_text())
    assert meta["clip"]["edges"]["key_heads"] == 1  # fitted clip ratios with their grid-edge counts: the full layer only
    assert meta["clip"]["skipped_window_layers"] == [0, 1]  # sliding layers are never quantized: no clip fit
    engine = Engine.from_config(cfg, fold_values=False)
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    logits = engine.score(ids, mode="decode_equivalent")
    ref = Engine(engine.model, engine.tokenizer, bf16.method).score(ids, mode="decode_equivalent")
    kl = next_token_kl(ref, logits)[0]
    assert kl[:10].abs().max() < 1e-9  # inside sink + recent: only BF16 rows
    assert torch.isfinite(kl).all() and kl[10:].mean() > 0  # the full-attention layer reads INT2 history
    cache = engine.new_cache("decode_equivalent")
    assert [type(layer).__name__ for layer in cache.layers] == ["WindowLayer", "WindowLayer", "OscarLayer"]


def test_a_conf_with_an_unsupported_family_is_refused_before_any_work(snapshot, tmp_path):
    from oscar.models import UnsupportedModel, load_model

    snap, _ = snapshot
    conf = _conf_tree(tmp_path, _conf_text(snap, family="llama"))
    with Composer(conf_dir=conf) as c:
        cfg = c.compose(["model=my-gemma"])
    with pytest.raises(ValueError, match="conf says family 'llama', the loaded model_type 'gemma3_text' maps to 'gemma3'"):
        load_model(cfg.model)
    snap_cfg = snap / "config.json"
    text = snap_cfg.read_text()
    try:
        snap_cfg.write_text(text.replace('"attn_logit_softcapping": null', '"attn_logit_softcapping": 50.0'))
        conf2 = _conf_tree(tmp_path / "b", _conf_text(snap))
        with Composer(conf_dir=conf2) as c:
            cfg = c.compose(["model=my-gemma"])
        with pytest.raises(UnsupportedModel, match="soft-capping"):
            load_model(cfg.model)
    finally:
        snap_cfg.write_text(text)

"""Shared test configuration: offline environment and one shared copy of the real small model."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# MKL's code path pinned before torch loads (oscar/__init__.py says why): Intel and AMD compute alike.
os.environ.setdefault("MKL_CBWR", "AVX2")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton picks interpreted or compiled mode when `@triton.jit` runs (module import), so the switch
# must be set before any test module imports a kernel: without a GPU, every kernel is interpreted.
if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def single_thread():
    """Small matrices: one intra-op thread is fastest and immune to oversubscribed cores."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M loaded once per test session (float32, CPU): (model, tokenizer, model_cfg)."""
    from oscar.config import compose
    from oscar.models import load_model

    cfg = compose(["model=smollm2-135m"])
    model, tokenizer = load_model(cfg.model, device="cpu")
    model.eval()
    return model, tokenizer, cfg.model

"""Shared test fixtures: the tiny model, and the GPU marker.

This file is copied into every chapter checkpoint by `tools/steps.py check`, so it may only use
what every checkpoint has: pytest, torch, and `tools/make_tiny_model.py`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "models" / "tiny-qwen3"
GPU_SKIP_REASON = "needs a CUDA GPU (run on a GPU machine with `tools/steps.py check --gpu`)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped on CPU, an error under --gpu")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on CPU")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Under `steps.py check --gpu` GPU tests always run, so a missing GPU fails them loudly.
    if os.environ.get("MINISGL_REQUIRE_GPU") == "1" or _has_cuda():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP_REASON))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen3 checkpoint, built by tools/make_tiny_model.py on first use."""
    if not (TINY_MODEL / "model.safetensors").exists():
        tool = ROOT / "tools" / "make_tiny_model.py"
        subprocess.run([sys.executable, str(tool), "--out", str(TINY_MODEL)], check=True,
                       cwd=ROOT)
    return TINY_MODEL


@pytest.fixture(scope="session")
def device() -> str:
    """The device GPU tests run on."""
    return "cuda" if _has_cuda() else "cpu"

"""Shared test fixtures: the tiny model, the GPU marker, and importing a repository script.

This file is copied into every chapter checkpoint by `tools/steps.py check`, so it may only use
what every checkpoint has: pytest, torch, and `tools/make_tiny_model.py`.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "models" / "tiny-qwen3"
# tools/ is not a package: the tests import the server harness (tools/server_process.py) by name.
if str(ROOT / "tools") not in sys.path:
    sys.path.append(str(ROOT / "tools"))
GPU_SKIP_REASON = "needs a CUDA GPU (run on a GPU machine with `tools/steps.py check --gpu`)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped on CPU, an error under --gpu")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on CPU")


def _has_torch() -> bool:
    return importlib.util.find_spec("torch") is not None


def _has_cuda() -> bool:
    if not _has_torch():  # an exercise run in the browser (Pyodide) has no torch
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Under `steps.py check --gpu` GPU tests always run, so a missing GPU fails them loudly.
    if os.environ.get("MINISGL_REQUIRE_GPU") == "1" or _has_cuda():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # a marker, not a folder named gpu
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP_REASON))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny Qwen3 checkpoint, built by tools/make_tiny_model.py on first use. Without
    torch (an exercise in the browser) only its config files are there, which is all such a
    test reads."""
    if not _has_torch() and (TINY_MODEL / "config.json").exists():
        return TINY_MODEL
    if not (TINY_MODEL / "model.safetensors").exists():
        tool = ROOT / "tools" / "make_tiny_model.py"
        subprocess.run([sys.executable, str(tool), "--out", str(TINY_MODEL)], check=True,
                       cwd=ROOT)
    return TINY_MODEL


@pytest.fixture(scope="session")
def device() -> str:
    """The device GPU tests run on."""
    return "cuda" if _has_cuda() else "cpu"


def decode_without_waiting(scheduler: Any, steps: int) -> None:
    """Step ``scheduler`` (on CUDA) to its first decode batch, then ``steps`` decode steps
    with PyTorch's sync debug mode raising on any call that makes the host wait for the
    device (chapters 12 and 21: an overlapped step must not)."""
    import torch

    while scheduler.step().phase != "decode":  # the prefill, then a first decode batch
        pass
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            assert scheduler.step().phase == "decode"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def load_repo_script(relative: str) -> ModuleType:
    """Import a script of the repository, e.g. ``benchmark/offline.py``, as a fresh module
    (``tools/`` and ``benchmark/`` are not packages)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location("_script_" + path.stem, path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def repo_script() -> Callable[[str], ModuleType]:
    """:func:`load_repo_script`, for tests that import a script of the repository."""
    return load_repo_script


SHAKESPEARE_DIR = ROOT / "models" / "tiny-shakespeare"  # the trained tiny model, committed


@pytest.fixture(scope="module")
def shakespeare_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``python -m minisgl --device cpu`` serving the trained tiny model as model ``"m"``, for
    the tests of chapter 15 on (the harness, tools/server_process.py, comes with chapter 15)."""
    from server_process import ServerProcess

    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(SHAKESPEARE_DIR, device="cpu", log_path=log,
                       args=("--served-model-name", "m")) as running:
        yield running

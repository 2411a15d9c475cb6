"""Loading a safetensors checkpoint into a model, one shard file at a time.

Two passes. The names come first, from the shards' JSON headers: a checkpoint that does not fit
the model fails before a byte of weights is read, naming the missing and unexpected tensors.
Then the tensors stream one at a time to the ``load_weight`` of the layer that owns them, so
peak host memory is about one tensor. Chapter 3 tells the story.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from minisgl.distributed import get_tp_info
from minisgl.layers.base import copy_checked
from minisgl.models.base import BaseLLMModel
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES_SHOWN = 10


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensor names do not match the model's parameters."""


def checkpoint_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint directory, in a stable order.

    With an index file, exactly the shards it lists (a directory may hold other safetensors
    files, such as a consolidated copy of the same weights); otherwise every ``*.safetensors``.
    """
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: expected a non-empty 'weight_map' object")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def _read_names(files: list[Path]) -> list[str]:
    """All tensor names of the checkpoint, read from the shards' headers only."""
    names: list[str] = []
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def iter_checkpoint_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor, one shard open at a time, on the CPU.

    ``safe_open`` maps the file into memory; ``get_tensor`` reads one tensor. Nothing keeps a
    reference to a tensor once the caller has copied it, so memory stays at about one tensor.
    """
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@dataclass
class _LoadPlan:
    """Where each checkpoint tensor goes, worked out from the names alone."""

    targets: dict[str, tuple[str, Hashable]] = field(default_factory=dict)  # ckpt -> (param, slot)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def _owner(model: nn.Module, param_name: str) -> tuple[nn.Module, str]:
    module_name, _, attr = param_name.rpartition(".")
    return model.get_submodule(module_name), attr


def _plan(model: BaseLLMModel, names: list[str]) -> _LoadPlan:
    plan = _LoadPlan()
    # named_parameters() lists a shared tensor once, under the name it was first registered
    # with; the other names of the same tensor are aliases (lm_head.weight when tied).
    params = dict(model.named_parameters())
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - params.keys()
    filled: set[tuple[str, Hashable]] = set()
    for name in names:
        if name in aliases:
            continue  # a tied duplicate: the same values load under the canonical name
        param_name, shard_id = model.checkpoint_to_param(name)
        if param_name not in params:
            plan.unexpected.append(name)
            continue
        plan.targets[name] = (param_name, shard_id)
        filled.add((param_name, shard_id))
    for param_name in params:
        module, attr = _owner(model, param_name)
        expected = module.shard_ids(attr) if hasattr(module, "shard_ids") else (None,)
        for shard_id in expected:
            if (param_name, shard_id) not in filled:
                plan.missing.append(model.param_to_checkpoint(param_name, shard_id))
    return plan


def _shorten(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    more = len(names) - _MAX_NAMES_SHOWN
    return shown + (f" ... and {more} more" if more > 0 else "")


def _check(plan: _LoadPlan, model_dir: Path, model: nn.Module) -> None:
    problems = []
    if plan.missing:
        problems.append(f"missing tensor(s) the model needs: {_shorten(plan.missing)}")
    if plan.unexpected:
        problems.append(f"unexpected tensor(s) the model has no place for: "
                        f"{_shorten(plan.unexpected)}")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {model_dir} does not match {type(model).__name__}: "
            + "; ".join(problems)
        )


def load_weights(
    model: BaseLLMModel, model_dir: str | os.PathLike[str], progress: bool = True
) -> None:
    """Fill every parameter of ``model`` from the safetensors checkpoint in ``model_dir``.

    Raises :class:`CheckpointMismatchError` naming the missing or unexpected tensors before
    anything is loaded, and ``ValueError`` naming the tensor if a shape does not match.
    """
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    names = _read_names(files)
    plan = _plan(model, names)
    _check(plan, model_dir, model)

    start = time.perf_counter()
    show = progress and get_tp_info().is_primary
    # disable=None: tqdm shows the bar on a terminal and stays silent in logs and pipes.
    with tqdm(total=len(names), desc="Loading weights", unit="tensor",
              disable=None if show else True) as bar:
        for name, tensor in iter_checkpoint_tensors(files):
            bar.update(1)
            if name not in plan.targets:
                continue  # a tied duplicate (the plan skipped it)
            param_name, shard_id = plan.targets[name]
            module, attr = _owner(model, param_name)
            try:
                if hasattr(module, "load_weight"):
                    # The layer picks this rank's slice and its slot in a merged parameter.
                    module.load_weight(tensor, shard_id, param_name=attr)
                else:
                    copy_checked(getattr(module, attr), tensor, param_name)
            except ValueError as exc:
                raise ValueError(f"cannot load checkpoint tensor {name!r}: {exc}") from None
    logger.debug("loaded %d tensors from %d file(s) in %.2f s (%d tied duplicate(s) skipped)",
                 len(plan.targets), len(files), time.perf_counter() - start,
                 len(names) - len(plan.targets))

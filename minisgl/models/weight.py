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
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from minisgl.distributed import get_tp_info
from minisgl.layers.base import BaseLayer
from minisgl.models.base import BaseLLMModel
from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_MAX_NAMES_SHOWN = 10
Slot = tuple[str, Hashable]  # (parameter name, shard_id): where one checkpoint tensor goes


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


def _owner(model: nn.Module, param_name: str) -> tuple[BaseLayer, str]:
    module_name, _, attr = param_name.rpartition(".")
    return model.get_submodule(module_name), attr


def _shorten(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    more = len(names) - _MAX_NAMES_SHOWN
    return shown + (f" ... and {more} more" if more > 0 else "")


def _plan(model: BaseLLMModel, names: list[str], model_dir: Path) -> dict[str, Slot]:
    """Checkpoint name -> (parameter, slot) for every tensor to load, worked out from the names
    alone; raises :class:`CheckpointMismatchError` naming every missing and unexpected tensor."""
    # named_parameters() lists a shared tensor once, under the name it was first registered
    # with; the other names of the same tensor are aliases (lm_head.weight when tied).
    params = dict(model.named_parameters())
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - params.keys()
    targets: dict[str, Slot] = {}
    unexpected = []
    for name in names:
        if name in aliases:
            continue  # a tied duplicate: the same values load under the canonical name
        param_name, shard_id = model.checkpoint_to_param(name)
        if param_name in params:
            targets[name] = (param_name, shard_id)
        else:
            unexpected.append(name)
    filled = set(targets.values())
    missing = []
    for param_name in params:  # per slot: a checkpoint lacking only k_proj is caught too
        module, attr = _owner(model, param_name)
        missing += [model.param_to_checkpoint(param_name, shard_id)
                    for shard_id in module.shard_ids(attr) if (param_name, shard_id) not in filled]
    problems = []
    if missing:
        problems.append(f"missing tensor(s) the model needs: {_shorten(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s) the model has no place for: {_shorten(unexpected)}")
    if problems:
        raise CheckpointMismatchError(f"checkpoint {model_dir} does not match "
                                      f"{type(model).__name__}: " + "; ".join(problems))
    return targets


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
    targets = _plan(model, names, model_dir)

    start = time.perf_counter()
    show = progress and get_tp_info().is_primary
    # disable=None: tqdm shows the bar on a terminal and stays silent in logs and pipes.
    for name, tensor in tqdm(iter_checkpoint_tensors(files), total=len(names),
                             desc="Loading weights", unit="tensor", disable=None if show else True):
        if name not in targets:
            continue  # a tied duplicate (the plan skipped it)
        param_name, shard_id = targets[name]
        module, attr = _owner(model, param_name)
        try:  # the layer picks this rank's slice and its slot in a merged parameter
            module.load_weight(tensor, shard_id, param_name=attr)
        except ValueError as exc:
            raise ValueError(f"cannot load checkpoint tensor {name!r}: {exc}") from None
    logger.debug("loaded %d tensors from %d file(s) in %.2f s (%d tied duplicate(s) skipped)",
                 len(targets), len(files), time.perf_counter() - start,
                 len(names) - len(targets))

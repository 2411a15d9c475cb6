"""Finding a checkpoint (a local directory or a Hugging Face hub id) and reading its config.json.

Every entry point that takes ``--model`` goes through :func:`resolve_model_path` once, at the
edge, and from then on the engine only ever sees a local directory. The hub client is imported
lazily, so a local run never imports it and a test never touches the network.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from minisgl.utils.logger import get_logger

logger = get_logger(__name__)

# What the engine reads from a checkpoint: configs (*.json), weights (*.safetensors), and the
# tokenizer in its several spellings (tokenizer.json, merges.txt, a sentencepiece
# tokenizer.model, a chat template kept in a .jinja file). Not *.bin/*.pt/*.gguf copies of
# the weights, which some repositories also carry and which can be many gigabytes.
HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model")

# "org/name" with the characters the hub allows; one slash, nothing before or after.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ModelPathError(ValueError):
    """``--model`` names neither a usable local checkpoint nor a downloadable hub repository."""


def looks_like_hub_id(text: str) -> bool:
    """True for ``org/name`` (``Qwen/Qwen3-0.6B``); False for ``./x``, ``/a/b`` or ``a/b/c``."""
    return bool(_HUB_ID.match(text)) and ".." not in text


# --8<-- [start:resolve]
def resolve_model_path(path_or_id: str | os.PathLike[str]) -> Path:
    """The local checkpoint directory for ``path_or_id``, downloading it first if it is a hub id.

    - an existing directory is used as it is (it must hold ``config.json``);
    - otherwise a string of the form ``org/name`` is fetched with
      ``huggingface_hub.snapshot_download`` (configs, tokenizer and safetensors only) into the
      hub's usual cache, so a second call finds it there without downloading again;
    - anything else is an error that says which of the two was expected.

    A ``pathlib.Path`` argument always means a local directory, never a hub id.
    """
    text = os.fspath(path_or_id)
    path = Path(text).expanduser()
    if text.strip() and path.is_dir():  # Path("") is ".", which is not what an empty flag means
        _require_config(path, text)
        return path.resolve()
    if text.strip() and path.exists():
        raise ModelPathError(f"--model {text!r} is a file; expected a checkpoint directory "
                             "(the one that holds config.json) or a hub id such as Qwen/Qwen3-0.6B")
    if isinstance(path_or_id, os.PathLike) or not looks_like_hub_id(text):  # includes ""
        raise ModelPathError(f"--model {text!r} is neither an existing directory nor a Hugging "
                             "Face hub id of the form 'org/name' (e.g. Qwen/Qwen3-0.6B)")
    return _download_from_hub(text)


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download  # lazy: only a hub id pays for this import

    logger.info("%s is not a local directory: fetching it from the Hugging Face hub", repo_id)
    try:
        local = snapshot_download(repo_id=repo_id, allow_patterns=list(HUB_ALLOW_PATTERNS))
    except Exception as exc:  # network, auth, missing repo: all reach the user the same way
        hint = ""
        if Path(repo_id).parent.is_dir():  # "models/tiny-qwen3" when the directory is missing
            hint = (f" ('{Path(repo_id).parent}' is a local directory: if you meant a path, "
                    f"{repo_id!r} does not exist)")
        raise ModelPathError(f"--model {repo_id!r} is not a local directory, and fetching it "
                             f"from the Hugging Face hub failed: {type(exc).__name__}: {exc}"
                             f"{hint}") from exc
    path = Path(local)
    _require_config(path, repo_id)
    return path
# --8<-- [end:resolve]


def _require_config(path: Path, given: str) -> None:
    if not (path / "config.json").is_file():
        raise ModelPathError(f"--model {given!r}: {path} has no config.json, so it is not a "
                             "Hugging Face checkpoint directory")


def example_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory an example script was given, or exit with how to build one.

    For scripts only: a missing tiny model is the one mistake every first run makes, so the
    examples stop with the command that fixes it instead of a traceback.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SystemExit(f"{path} has no config.json, so it is not a checkpoint directory. "
                         "Build the tiny model first:\n    python tools/make_tiny_model.py")
    return path


# --8<-- [start:load_hf_config]
def load_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``config.json`` of a local checkpoint directory (or of the file itself).

    This is plain JSON reading on purpose: no transformers import, no model-class defaults
    filled in behind our back. :class:`minisgl.models.config.ModelConfig` decides what the
    keys mean.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        # a ValueError, not a TypeError: the file's content is malformed, not our argument
        raise ValueError(  # noqa: TRY004
            f"{file}: expected a JSON object at the top level, got {type(data).__name__}")
    return data
# --8<-- [end:load_hf_config]

"""Finding a checkpoint (a local directory or a Hugging Face hub id) and reading its config.json.

Every entry point of the engine goes through :func:`resolve_model_path` once, at the edge; from
then on the engine only sees a local directory. A ``--model`` that reads as a local path is
never sent to the hub, and the hub client is imported only for a hub id. Chapter 1 tells the
story.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
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

# The repository this package lives in (the directory above ``minisgl/``): its ``models/``
# holds the book's checkpoints and its ``tools/`` the script that writes the tiny one.
REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = "models"
TRAINED_MODEL = "tiny-shakespeare"  # the book's tiny model, trained on Shakespeare's plays
TINY_MODEL = "tiny-qwen3"  # random weights, written offline in seconds
MAKE_TINY_MODEL = "python tools/make_tiny_model.py"


class ModelPathError(ValueError):
    """``--model`` names neither a usable local checkpoint nor a downloadable hub repository."""


def looks_like_hub_id(text: str) -> bool:
    """True for ``org/name`` (``Qwen/Qwen3-0.6B``); False for ``./x``, ``/a/b`` or ``a/b/c``."""
    return bool(_HUB_ID.match(text)) and ".." not in text


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
    if looks_like_local_path(text):  # never the network for what reads as a path
        raise ModelPathError(f"--model {text!r} is neither an existing directory nor a Hugging "
                             f"Face hub id (it reads as a local path, so the hub was not asked); "
                             f"to make the tiny model: {MAKE_TINY_MODEL} "
                             f"(writes {MODELS_DIR}/{TINY_MODEL})")
    if isinstance(path_or_id, os.PathLike) or not looks_like_hub_id(text):  # includes ""
        raise ModelPathError(f"--model {text!r} is neither an existing directory nor a Hugging "
                             "Face hub id of the form 'org/name' (e.g. Qwen/Qwen3-0.6B)")
    return _download_from_hub(text)


def looks_like_local_path(text: str) -> bool:
    """True for what a user means as a directory here, not as a hub id: a path starting with
    ``.``, ``/`` or ``~``, one under ``models/`` (where the book's checkpoints live), one with
    more than one separator, or one whose parent directory exists here."""
    text = text.strip().replace(os.sep, "/")
    parent = Path(text).parent
    return (text.startswith((".", "/", "~", f"{MODELS_DIR}/")) or text.count("/") > 1
            or (parent != Path(".") and parent.is_dir()))


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download  # lazy: only a hub id pays for this import

    logger.info("%s is not a local directory: fetching it from the Hugging Face hub", repo_id)
    try:
        local = snapshot_download(repo_id=repo_id, allow_patterns=list(HUB_ALLOW_PATTERNS))
    except Exception as exc:  # network, auth, missing repo: all reach the user the same way
        raise ModelPathError(f"--model {repo_id!r} is not a local directory, and fetching it "
                             f"from the Hugging Face hub failed: {type(exc).__name__}: {exc}"
                             ) from exc
    path = Path(local)
    _require_config(path, repo_id)
    return path


def _require_config(path: Path, given: str) -> None:
    if not (path / "config.json").is_file():
        raise ModelPathError(f"--model {given!r}: {path} has no config.json, so it is not a "
                             "Hugging Face checkpoint directory")


def example_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory an example script was given, or exit with how to build one.

    For scripts only. A missing tiny model is the one mistake every first run makes, so when
    ``path`` is the tiny model's directory it is built (seconds, offline); any other missing
    checkpoint stops the example with the command that makes one instead of a traceback.
    """
    path = Path(path)
    if not (path / "config.json").is_file() and path.name == TINY_MODEL:
        try:
            build_tiny_model(path)
        except ModelPathError as exc:
            raise SystemExit(str(exc)) from None
    if not (path / "config.json").is_file():
        raise SystemExit(f"{path} has no config.json, so it is not a checkpoint directory. "
                         f"Build the tiny model first:\n    {MAKE_TINY_MODEL}")
    return path


def default_model(root: Path = REPO_ROOT) -> Path:
    """The checkpoint to serve when no ``--model`` is given: the book's default, found locally.

    ``models/tiny-shakespeare`` (the book's trained tiny model) when the repository has it,
    else ``models/tiny-qwen3``, written by ``tools/make_tiny_model.py``'s builder if it is not
    there yet. Never the network: a first run on a fresh clone works offline. The path is
    relative to the working directory when it lies inside it (``models/x``, as a user would
    type it), else absolute.
    """
    path = root / MODELS_DIR / TRAINED_MODEL
    if (path / "config.json").is_file():
        logger.info("no --model given: serving %s, the book's trained tiny model", path)
    else:
        path = root / MODELS_DIR / TINY_MODEL
        why = f"no --model given and no {MODELS_DIR}/{TRAINED_MODEL}"
        if (path / "config.json").is_file():
            logger.info("%s: serving %s (random weights)", why, path)
        else:
            logger.info("%s: building %s (random weights, seconds) and serving it", why, path)
            build_tiny_model(path, root)
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def build_tiny_model(out: Path, root: Path = REPO_ROOT) -> Path:
    """Write the tiny Qwen3 checkpoint to ``out`` with ``tools/make_tiny_model.py``.

    It is written to a temporary directory beside ``out`` and renamed into place, so a process
    that starts meanwhile never sees half a checkpoint, and two that build at once both end
    with a whole one.
    """
    script = root / "tools" / "make_tiny_model.py"
    if not script.is_file():
        raise ModelPathError(f"the tiny model is missing and {script} (which writes it) is not "
                             "there: run from a clone of the repository, or give --model")
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run([sys.executable, str(script), "--out", str(partial)], check=True,
                   stdout=subprocess.DEVNULL)
    try:
        partial.rename(out)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(partial, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    return out


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

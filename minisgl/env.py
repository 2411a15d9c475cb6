"""Every ``MINISGL_*`` environment variable, declared, parsed and validated in one place.

An environment variable is input from outside, like a flag: it is read at one edge, parsed into
a typed value, and a bad value is rejected with an error that names the variable, the value and
what is allowed. Nothing else in ``minisgl`` reads ``os.environ`` for a ``MINISGL_*`` name; it
calls :func:`read_env`. Chapter 1 tells the story.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Generic, TypeVar

PREFIX = "MINISGL_"
T = TypeVar("T")


class EnvError(ValueError):
    """A ``MINISGL_*`` environment variable holds a value that cannot be used."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_MEM_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
_MEM_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?$")


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``, in any case; anything else is an error."""
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")
    return word in _TRUE


def parse_log_level(text: str) -> str:
    """A :mod:`logging` level name, in any case, returned in upper case."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)} (any case)")
    return level


def parse_mem_bytes(text: str) -> int:
    """A positive memory size: plain bytes (``268435456``) or with a unit (``256MiB``, ``2G``).

    Units are K, M, G, T, optionally followed by ``B`` or ``iB``; all are powers of 1024,
    because the sizes this describes are memory, not disk.
    """
    match = _MEM_RE.match(text.strip().upper())
    if match is None:
        raise ValueError("expected a size such as 268435456, 512MiB, 1.5G "
                         "(K/M/G/T = powers of 1024)")
    number, unit = match.groups()
    size = int(float(number) * _MEM_UNITS[unit])
    if size <= 0:
        raise ValueError("expected a size greater than zero")
    return size


def parse_threads(text: str) -> int:
    """A number of CPU threads: a whole number >= 1, or 0 for "choose for me"."""
    if not text.strip().isdecimal():
        raise ValueError("expected a whole number of threads >= 1 (0 = choose from the cores)")
    return int(text)


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One declared variable: its name, default, parser and a sentence on what it controls."""

    name: str
    default: T
    parse: Callable[[str], T]
    help: str

    @property
    def field(self) -> str:
        """The :class:`Env` attribute that holds the parsed value (name without the prefix)."""
        return self.name.removeprefix(PREFIX).lower()

    def read(self, environ: Mapping[str, str]) -> T:
        """The parsed value from ``environ``; unset or blank means the default."""
        raw = environ.get(self.name)
        if raw is None or not raw.strip():  # `MINISGL_X= cmd` is the shell's way to unset
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise EnvError(f"{self.name}={raw!r} is not valid: {exc}") from None


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("MINISGL_LOG_LEVEL", "INFO", parse_log_level,
           "Lowest level that minisgl's loggers print: DEBUG, INFO, WARNING, ERROR or CRITICAL."),
    EnvVar("MINISGL_CPU_KV_MEMORY", 256 * 1024**2, parse_mem_bytes,
           "Memory for the paged KV cache on CPU, where there is no free-memory query to size it "
           "from (e.g. 256MiB, 1G). GPU runs size the cache from free GPU memory instead."),
    EnvVar("MINISGL_CPU_THREADS", 0, parse_threads,
           "Torch threads of the process that runs the model (the scheduler, LLM, an example). "
           "0 chooses: OMP_NUM_THREADS when it is set, else one less than the usable cores. The "
           "server's tokenizer, detokenizer and API processes use one thread each."),
    EnvVar("MINISGL_DISABLE_OVERLAP", False, parse_bool,
           "Turn overlap scheduling off: the CPU awaits each GPU step before planning the next."),
    EnvVar("MINISGL_REQUIRE_GPU", False, parse_bool,
           "Tests: fail GPU-only tests on a machine without CUDA instead of skipping them "
           "(set by `tools/steps.py check --gpu`)."),
)


@dataclass(frozen=True)
class Env:
    """The parsed values of all ``MINISGL_*`` variables; one field per entry of ``ENV_VARS``."""

    log_level: str
    cpu_kv_memory: int
    cpu_threads: int
    disable_overlap: bool
    require_gpu: bool


def read_env(environ: Mapping[str, str] | None = None) -> Env:
    """Parse every declared variable from ``environ`` (default: ``os.environ``), freshly.

    Raises :class:`EnvError` for the first variable whose value cannot be used. A ``MINISGL_*``
    name that is not declared is almost always a typo, so it gets a warning naming the closest
    declared name (a warning, not an error: a stray variable changes nothing).
    """
    environ = os.environ if environ is None else environ
    known = {var.name for var in ENV_VARS}
    for name in sorted(n for n in environ if n.startswith(PREFIX) and n not in known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.warn(f"unknown environment variable {name} is ignored{hint}", stacklevel=2)
    return Env(**{var.field: var.read(environ) for var in ENV_VARS})


assert [f.name for f in fields(Env)] == [var.field for var in ENV_VARS], "Env and ENV_VARS differ"

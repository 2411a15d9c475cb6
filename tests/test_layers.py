"""The engine's layers: every module of ``minisgl`` imports only packages below its own.

The order is declared once, here, as :data:`PACKAGE_ORDER`. Every ``import`` and
``from ... import`` counts, wherever it stands: at module level, inside a function (imports
deferred for speed or for optional GPU packages still make the dependency), and under
``if TYPE_CHECKING:`` (a type name that points up the order is a dependency a reader has to
follow just the same, and it turns into a cycle the day the annotation is evaluated).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "minisgl"

# The packages of ``minisgl`` (and its top-level modules), lowest first: each may import only
# itself and those before it.
# - ``env`` holds the MINISGL_* variables, read by the logger in ``utils``; ``core`` (requests,
#   batches, sampling settings: plain data that everything reads) checks its fields with
#   ``utils.checks``, so it sits above ``utils``, which needs nothing of it.
# - ``kernel`` holds GPU kernels beside the plain code they replace; it needs only torch and
#   ``utils``, and the layers reach it through one seam (``layers/fast.py``), so it sits below.
# - ``distributed`` needs tensors and a logger, and the layers shard across it: it sits between
#   the two. ``message`` (the messages between processes and their codec) needs only core.
# - ``moe`` holds the mixture-of-experts layer that a model's blocks are built from, so it
#   sits below ``models``, not above.
# - ``speculative`` (verifying proposed tokens, prompt lookup) is arithmetic on tensors and
#   token lists that the engine calls; it needs nothing but torch, ``core`` and ``utils``.
# - ``kvcache`` (the pool, the page allocator and the page table) is state that attention
#   reads; the engine owns one of each; the scheduler decides who gets which pages.
# - ``shell`` drives a server's frontend from a terminal, so it sits above ``server``;
#   ``__main__`` chooses between the two. ``llm`` (the offline API) needs only the scheduler.
# - ``grammar`` (chapter 22) compiles schemas to grammars and holds each request's matcher and
#   the bitmask: the engine masks logits with it, the scheduler feeds it the sampled tokens and
#   the server compiles with it, so it sits below the engine; it needs only core and utils.
PACKAGE_ORDER = (
    "env", "utils", "kernel", "core", "speculative", "distributed", "message", "layers", "moe",
    "models", "kvcache", "attention", "grammar", "engine", "scheduler", "tokenizer", "server",
    "shell", "llm",
    "__main__",
)


def package_of(path: Path) -> str:
    """The layer a file of ``minisgl/`` belongs to: its package, or its module's name."""
    first = path.relative_to(PACKAGE_ROOT).parts[0]
    return first.removesuffix(".py")


def imported_modules(path: Path, root: Path = PACKAGE_ROOT) -> list[tuple[int, str]]:
    """Every ``minisgl`` module that ``path`` (a file under ``root``) imports, with its line."""
    # A relative import counts from the importing module's package (for ``__init__.py``, the
    # package it starts).
    package_parts = ["minisgl", *path.relative_to(root).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "minisgl":  # ``from minisgl import engine`` names the packages themselves
                found += [(node.lineno, f"minisgl.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, base))
    return [(line, name) for line, name in found if name.startswith("minisgl.")]


def upward_imports() -> list[str]:
    """Every import in ``minisgl/`` of a package later in :data:`PACKAGE_ORDER` than its own."""
    found = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        if path == PACKAGE_ROOT / "__init__.py":
            continue  # the package's own docstring module: it imports nothing of the engine
        importer = package_of(path)
        for line, name in imported_modules(path):
            imported = name.split(".")[1]
            if PACKAGE_ORDER.index(imported) > PACKAGE_ORDER.index(importer):
                found.append(f"{path.relative_to(PACKAGE_ROOT.parent)}:{line}: {importer} "
                             f"imports {name}, above itself")
    return found


def test_every_package_has_a_place_in_the_order() -> None:
    packages = {package_of(p) for p in PACKAGE_ROOT.rglob("*.py")} - {"__init__"}
    missing = sorted(packages - set(PACKAGE_ORDER))
    assert not missing, f"packages with no place in PACKAGE_ORDER: {missing}"


def test_no_package_imports_one_above_itself() -> None:
    problems = upward_imports()
    assert not problems, "imports that go up the package order:\n" + "\n".join(problems)


@pytest.mark.parametrize("source, expected", [
    ("import minisgl.scheduler.cache\n", [(1, "minisgl.scheduler.cache")]),
    ("def f():\n    from minisgl.server import launch\n", [(2, "minisgl.server")]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from minisgl.llm import LLM\n",
     [(3, "minisgl.llm")]),
    ("from .. import scheduler\n", [(1, "minisgl.scheduler")]),
    ("from .base import BaseKVPool\n", [(1, "minisgl.kvcache.base")]),
    ("import torch\nfrom collections import deque\n", []),
])
def test_the_reader_sees_every_kind_of_import(tmp_path: Path, source: str,
                                              expected: list) -> None:
    # A module of a stand-in ``kvcache`` package, so that relative imports resolve from there.
    module = tmp_path / "kvcache" / "mod.py"
    module.parent.mkdir()
    module.write_text(source, encoding="utf-8")
    assert imported_modules(module, root=tmp_path) == expected

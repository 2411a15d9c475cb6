"""The engine imports only what installing it brings.

Every top-level package that a module of ``minisgl/`` imports must be the standard library, a
runtime dependency in ``pyproject.toml`` (``[project].dependencies``), or a package of an
optional extra (``gpu``) imported where its absence cannot break a CPU install: in a ``try``
that handles the ``ImportError`` (inside a function, or at module level when a decorator such as
``triton.jit`` needs the name there). Test and client tools (``httpx``,
``openai``, ``pytest``) belong to the ``dev`` extra and stay outside the package.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# Import names that differ from their distribution's name (after PEP 503 normalisation).
DISTRIBUTION_OF = {"zmq": "pyzmq", "yaml": "pyyaml", "flashinfer": "flashinfer-python"}
# Exceptions that a guard must handle for an optional import to count as guarded.
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    """The distribution names of PEP 508 requirement strings (versions and markers dropped)."""
    return {normalized(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group()) for r in requirements}


def project(root: Path = ROOT) -> dict:
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def distribution_of(import_name: str) -> str:
    return normalized(DISTRIBUTION_OF.get(import_name, import_name))


def is_guarded(chain: list[ast.AST]) -> bool:
    """True when an import, reached through ``chain`` (its ancestors, outermost first), runs
    inside a ``try`` body whose handlers catch an import failure."""
    for parent, child in zip(chain, chain[1:]):
        if isinstance(parent, ast.Try) and child in parent.body:
            caught = set()
            for handler in parent.handlers:
                names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                caught |= {n.id for n in names if isinstance(n, ast.Name)}
            if caught & IMPORT_ERRORS:
                return True
    return False


def third_party_imports(source: str) -> list[tuple[int, str, bool]]:
    """Each import of a package outside the standard library and ``minisgl``: its line, its
    top-level name and whether it is guarded (:func:`is_guarded`)."""
    found = []

    def visit(node: ast.AST, chain: list[ast.AST]) -> None:
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top != "minisgl" and top not in sys.stdlib_module_names:
                found.append((node.lineno, top, is_guarded([*chain, node])))
        for child in ast.iter_child_nodes(node):
            visit(child, [*chain, node])

    visit(ast.parse(source), [])
    return found


def undeclared_imports(root: Path = ROOT) -> list[str]:
    """Every import under ``root/minisgl`` that ``root/pyproject.toml`` does not allow."""
    info = project(root)
    runtime = requirement_names(info["dependencies"])
    optional = requirement_names([r for name, reqs in info["optional-dependencies"].items()
                                  if name != "dev" for r in reqs])
    problems = []
    for path in sorted((root / "minisgl").rglob("*.py")):
        for line, name, guarded in third_party_imports(path.read_text(encoding="utf-8")):
            dist = distribution_of(name)
            where = f"{path.relative_to(root)}:{line}: {name} ({dist})"
            if dist in runtime:
                continue
            if dist not in optional:
                problems.append(f"{where} is not a runtime dependency in pyproject.toml")
            elif not guarded:
                problems.append(f"{where} is optional: import it in a try "
                                "that handles ImportError")
    return problems


def test_the_package_imports_only_its_runtime_dependencies() -> None:
    problems = undeclared_imports()
    assert not problems, "\n".join(problems)


def test_the_import_name_map_agrees_with_the_installed_distributions() -> None:
    installed = importlib.metadata.packages_distributions()
    for import_name, dist in DISTRIBUTION_OF.items():
        if import_name in installed:  # flashinfer is absent from a CPU install
            assert normalized(dist) in {normalized(d) for d in installed[import_name]}, \
                f"{import_name} is installed by {installed[import_name]}, not {dist}"


@pytest.mark.parametrize("source, expected", [
    ("import httpx\n", [(1, "httpx", False)]),
    ("import os\nfrom minisgl.core import Req\n", []),
    ("def f():\n    import flashinfer\n", [(2, "flashinfer", False)]),
    ("try:\n    import flashinfer\nexcept ImportError:\n    pass\n", [(2, "flashinfer", True)]),
    ("def f():\n    try:\n        from flashinfer.norm import rmsnorm\n"
     "    except (ImportError, OSError):\n        return None\n", [(3, "flashinfer", True)]),
    ("def f():\n    try:\n        import flashinfer\n    except ValueError:\n        pass\n",
     [(3, "flashinfer", False)]),
])
def test_the_reader_tells_guarded_imports_from_others(source: str, expected: list) -> None:
    assert third_party_imports(source) == expected


def test_a_dev_only_import_is_reported(tmp_path: Path) -> None:
    (tmp_path / "minisgl").mkdir()
    (tmp_path / "minisgl" / "client.py").write_text("import httpx\n", encoding="utf-8")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text("utf-8"), "utf-8")
    assert undeclared_imports(tmp_path) == [
        "minisgl/client.py:1: httpx (httpx) is not a runtime dependency in pyproject.toml"]

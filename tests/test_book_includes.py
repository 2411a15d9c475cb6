"""The book includes code by qualified name: `--8<-- "minisgl/core.py::Req.append_token"`.

The docs hook (docs/hooks/book.py) finds the symbol with `ast` and shows its source with its
decorators and the comment lines directly above it. These tests check the resolver on a small
module written here, and, on every symbol of the engine that a page includes, against what
`inspect` says the symbol's source and comments are.
"""
from __future__ import annotations

import importlib
import inspect
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME_INCLUDE = re.compile(r'--8<-- "(?P<path>[^":]+)::(?P<names>[^"]+)"')

SOURCE = '''\
"""A module to include from."""
import functools

# ---------------------------------------------------------------------------- limits
LIMIT = 3  # requests at once


class Outer:
    """Holds things."""

    size: int = 4
    label: str = "outer"

    # Cached: the answer never changes.
    # A second comment line.
    @staticmethod
    @functools.cache
    def method(x: int) -> int:
        return x + 1

    class Inner:
        flag = True

    def other(self) -> None:
        pass


if LIMIT > 2:
    def optional() -> int:
        return LIMIT
'''


@pytest.fixture(scope="module")
def hook(repo_script: Callable[[str], ModuleType]) -> ModuleType:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    return repo_script("docs/hooks/book.py")


def lines_between(first: str, last: str) -> str:
    """SOURCE's lines from the one containing `first` to the one containing `last`, dedented."""
    lines = SOURCE.splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    end = next(i for i, line in enumerate(lines) if i >= start and last in line)
    return textwrap.dedent("\n".join(lines[start:end + 1]))


def test_a_method_comes_with_its_decorators_and_the_comments_above_it(hook: ModuleType) -> None:
    shown = hook.symbols_source(SOURCE, ["Outer.method"])
    assert shown == lines_between("# Cached", "return x + 1")
    assert shown.startswith("# Cached: the answer never changes.\n# A second comment line.\n")
    assert "@staticmethod\n@functools.cache\ndef method" in shown, "decorators, dedented"


def test_nested_names_and_assignments_resolve(hook: ModuleType) -> None:
    assert hook.symbols_source(SOURCE, ["Outer.Inner"]) == lines_between("class Inner", "flag")
    assert hook.symbols_source(SOURCE, ["Outer.Inner.flag"]) == "flag = True"
    assert hook.symbols_source(SOURCE, ["Outer.size"]) == "size: int = 4"  # a dataclass field
    # A section rule heads a part of the file, not the constant under it.
    assert hook.symbols_source(SOURCE, ["LIMIT"]) == "LIMIT = 3  # requests at once"
    # A definition under a module-level `if` is the module's.
    assert hook.symbols_source(SOURCE, ["optional"]) == lines_between("def optional", "return")


def test_several_names_keep_the_files_spacing_between_neighbours(hook: ModuleType) -> None:
    # Neighbours in the file: no blank line between them, as there.
    assert hook.symbols_source(SOURCE, ["Outer.size", "Outer.label"]) == \
        lines_between("size: int", "label: str")
    # Not neighbours: one blank line, in the order the include gives.
    shown = hook.symbols_source(SOURCE, ["Outer.other", "LIMIT"])
    assert shown == lines_between("def other", "pass") + "\n\nLIMIT = 3  # requests at once"


def test_a_class_can_leave_members_out(hook: ModuleType) -> None:
    shown = hook.symbols_source(SOURCE, ["Outer", "-Outer.method", "-Outer.other"])
    whole = hook.symbols_source(SOURCE, ["Outer"])
    assert shown.startswith('class Outer:\n    """Holds things."""')
    assert "class Inner" in shown and "def method" not in shown and "def other" not in shown
    assert "# Cached" not in shown, "the comments above a left-out member go with it"
    assert not shown.endswith("\n") and "\n\n\n" not in shown
    assert len(shown.splitlines()) < len(whole.splitlines())


@pytest.mark.parametrize(("names", "missing"), [
    (["Outer.nope"], "Outer.nope"),
    (["Nope.method"], "Nope.method"),
    (["LIMIT.real"], "LIMIT.real"),  # an assignment has no members
    (["Outer.Inner", "-Outer.other"], "-Outer.other"),  # not inside what is shown
])
def test_a_name_that_does_not_resolve_is_an_error_naming_it(
    hook: ModuleType, names: list[str], missing: str
) -> None:
    with pytest.raises(hook.SymbolNotFound, match=re.escape(missing)):
        hook.symbols_source(SOURCE, names)


def included_symbols() -> list[tuple[str, str]]:
    """(path, name) of every single-name include of `minisgl/` in the book's pages."""
    pages = [*ROOT.glob("chapters/*.md"), *ROOT.glob("docs/*.md"),
             *ROOT.glob("practice/*/README.md")]
    found = {(m.group("path"), m.group("names"))
             for page in pages for m in NAME_INCLUDE.finditer(page.read_text("utf-8"))}
    return sorted((path, names) for path, names in found
                  if path.startswith("minisgl/") and " " not in names)


def test_every_included_engine_symbol_reads_as_inspect_sees_it(hook: ModuleType) -> None:
    """Independent of `ast`: `inspect` finds a function's or class's source from the live
    object; the page shows exactly that, with the comments `inspect` finds above it."""
    compared = 0
    for path, name in included_symbols():
        module_name = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        try:
            obj: object = importlib.import_module(module_name)
            for part in name.split("."):
                obj = inspect.getattr_static(obj, part)
        except (ImportError, AttributeError):  # an optional dependency, or an instance field
            continue
        obj = getattr(obj, "__func__", obj)  # staticmethod / classmethod
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue  # constants, fields and properties have no source of their own
        comments = "".join(line for line in (inspect.getcomments(obj) or "").splitlines(True)
                           if not hook.SECTION_RULE.match(line))
        expected = textwrap.dedent(comments + inspect.getsource(obj)).rstrip("\n")
        shown = hook.symbols_source((ROOT / path).read_text("utf-8"), [name])
        assert shown == expected, f"{path}::{name} differs from its source"
        compared += 1
    assert compared >= 50, f"only {compared} included symbols could be compared"


# Pages that still show, in places, a later chapter's version of a symbol; each is to include
# `tools/versions/chNN/<path>` instead, and leaves this set when it does.
SHOWS_LATER_CODE: set[str] = set()


def test_a_chapter_shows_each_symbol_as_its_own_checkpoint_has_it(
    hook: ModuleType, repo_script: Callable[[str], ModuleType]
) -> None:
    """A page that includes the final file (`minisgl/...::name`) must show `name` as the
    chapter's checkpoint holds it: where a later chapter changed it, the page includes the
    chapter's own version (`tools/versions/chNN/...`), whose caption says what changed it."""
    steps = repo_script("tools/steps.py")
    manifest = steps.load_manifest(ROOT)
    compared, later = 0, []
    for ch in manifest.chapters:
        page = ROOT / ch.page
        if not page.exists() or ch.id in SHOWS_LATER_CODE:
            continue
        for m in NAME_INCLUDE.finditer(page.read_text("utf-8")):
            path = m.group("path")
            if not path.startswith("minisgl/"):
                continue
            source = steps.source_of(manifest, path, ch.id)
            if isinstance(source, Path):
                continue  # no later chapter changes the file: the final file is the chapter's
            own = steps.snapshots.earlier_version(manifest, path, source.chapter)
            final = (ROOT / path).read_text("utf-8")
            for name in (n for n in m.group("names").split() if not n.startswith("-")):
                compared += 1
                if hook.symbols_source(own, [name]) != hook.symbols_source(final, [name]):
                    later.append(f"{ch.page}: {path}::{name} (include tools/versions/"
                                 f"{source.chapter}/{path})")
    assert not later, "pages showing a later chapter's version:\n" + "\n".join(later)
    assert compared > 0
    assert SHOWS_LATER_CODE <= {c.id for c in manifest.chapters if (ROOT / c.page).exists()}

"""One owner of KV pages and page-table rows: nothing else in ``minisgl`` moves a page.

:class:`~minisgl.kvcache.request_pages.RequestPages` holds the page allocator and the page table
together. Any other module that allocates or frees a page, hands out or takes back a row, or
appends pages to a row would be a second owner, and the two would sooner or later disagree
about a page (a leak, or two requests writing the same slots). This test reads every module of
``minisgl/`` with ``ast`` and fails on such a call, or on a second allocator or table being
built, anywhere but in the owner.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "minisgl"
OWNER = PACKAGE_ROOT / "kvcache" / "request_pages.py"
# The modules that define those moves may build one move out of another (``self.extend_rows``).
DEFINERS = {PACKAGE_ROOT / "kvcache" / "page_table.py", PACKAGE_ROOT / "kvcache" / "allocator.py"}
# The methods of PageAllocator and PageTable that move a page or a row.
MOVES = {"alloc", "free", "alloc_row", "free_row", "append_pages", "extend_rows"}
# Building one of these is owning one.
OWNED_TYPES = {"PageAllocator", "PageTable"}


def page_moves(source: str, allow_self: bool = False) -> list[tuple[int, str]]:
    """Every call in ``source`` that moves a page or a row, or builds an allocator or a table:
    ``(line, name)``; with ``allow_self``, not the calls on ``self``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if allow_self and isinstance(func, ast.Attribute) and \
                getattr(func.value, "id", None) == "self":
            continue
        if (isinstance(func, ast.Attribute) and name in MOVES) or name in OWNED_TYPES:
            found.append((node.lineno, name))
    return found


def test_the_finder_sees_every_kind_of_page_move() -> None:
    """The check below is only as good as this finder: it must flag each way to move a page."""
    source = "\n".join(["engine.allocator.alloc(3)", "self.allocator.free(pages)",
                        "table.alloc_row()", "self.page_table.free_row(row)",
                        "t.append_pages(row, [1])", "t.extend_rows([0], [1], [5])",
                        "PageAllocator(8)",
                        "kv.PageTable(2, 4, page_size=1)", "alloc(3)", "pages.reserve(req)"])
    assert [name for _, name in page_moves(source)] == [
        "alloc", "free", "alloc_row", "free_row", "append_pages", "extend_rows", "PageAllocator",
        "PageTable"]


def test_only_the_owner_moves_pages_and_rows() -> None:
    outside = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        if path == OWNER:
            continue
        for line, name in page_moves(path.read_text(encoding="utf-8"), path in DEFINERS):
            outside.append(f"{path.relative_to(PACKAGE_ROOT.parent)}:{line}: {name}")
    assert not outside, ("only minisgl/kvcache/request_pages.py may allocate or free pages and "
                         "rows (ask engine.pages instead):\n" + "\n".join(outside))


def test_the_owner_is_where_the_moves_are() -> None:
    """The owner itself does each of them: were it renamed or moved, the check above would pass
    for the wrong reason."""
    names = {name for _, name in page_moves(OWNER.read_text(encoding="utf-8"))}
    assert names == MOVES | OWNED_TYPES

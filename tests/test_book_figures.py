"""The figures a chapter page derives from a recorded output, recomputed from that recording.

A page reads its recording line by line and does arithmetic on it ("the prompts take
2,048 − 936 = 1,112 pages"). When the example changes and is recorded again, these tests fail
until the page's figures are brought up to date.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def recording(name: str) -> str:
    """The text of `docs/recorded/<name>.txt`."""
    return (ROOT / "docs" / "recorded" / f"{name}.txt").read_text(encoding="utf-8")


def page(chapter: str) -> str:
    """The chapter page `chapters/<chapter>_*.md`, with line breaks turned into spaces so a
    figure the page wraps over two lines is still found."""
    (path,) = (ROOT / "chapters").glob(f"{chapter}_*.md")
    return " ".join(path.read_text(encoding="utf-8").split())


def number(text: str, pattern: str) -> int:
    """The integer the first group of `pattern` captures in `text` (commas allowed)."""
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not found in the recording"
    return int(m.group(1).replace(",", ""))


def assert_on_page(chapter: str, *figures: str) -> None:
    text = page(chapter)
    missing = [f for f in figures if f not in text]
    assert not missing, f"{chapter}'s page does not state {missing}, which its recording gives"


# --------------------------------------------------------------------------- chapter 5
def ch05_free_pages(page_size: int) -> list[int]:
    """The four 'free pages' counts of one page size's story in chapter 5's recording."""
    text = recording("ch05_paged_kv-cpu")
    block = text.split(f"page size {page_size}:")[1].split("\n\n")[0]
    return [int(n) for n in re.findall(r"free pages\s+(\d+) /", block)]


def test_ch05_pages_taken_and_returned_follow_from_the_free_counts() -> None:
    text = recording("ch05_paged_kv-cpu")
    slots = number(text, r"= ([\d,]+) token slots")
    arrive, finish, newcomers, decoded = ch05_free_pages(1)
    small = ch05_free_pages(16)
    assert_on_page(
        "ch05",
        f"{slots:,} − {arrive} = {slots - arrive:,} pages",
        f"{finish:,} − {arrive} = {finish - arrive}",
        f"{finish:,} − {newcomers} = {finish - newcomers}",
        f"leaving {decoded}",
        f"128 − {small[0]} = {128 - small[0]}",
        f"{small[1] - small[0]} come back",
        f"newcomers take {small[1] - small[2]}",
    )


def test_ch05_memory_table_and_worked_slot_follow_from_the_rows() -> None:
    text = recording("ch05_paged_kv-cpu")
    rows = re.findall(r"row\s+\d+\s+(r\d+)\s+(\d+) tokens\s+\[([\d ]+)\]", text)
    live_tokens = sum(int(n) for _, n, _ in rows)
    held_16 = sum(16 * len(pages.split()) for _, _, pages in rows)
    reserved = 512 * len(rows)
    assert live_tokens == number(text, r"\(([\d,]+) tokens\)")
    assert_on_page(
        "ch05",
        f"hold {live_tokens:,} tokens",
        f"{reserved:,} slots, {reserved - live_tokens:,} of them ({round(100 * (reserved - live_tokens) / reserved)}%)",
        f"16-token pages hold {held_16:,}",
        f"the {held_16 - live_tokens} idle slots",
    )
    # The page's worked slots: r9's positions 100 and 130.
    pages = [int(p) for p in next(p for name, _, p in rows if name == "r9").split()]
    first, last = (pages[100 // 16], 100 % 16), (pages[130 // 16], 130 % 16)
    assert_on_page(
        "ch05",
        f"[{' '.join(map(str, pages))}]",
        f"page {first[0]}, offset {first[1]}: slot {first[0]} × 16 + {first[1]} = "
        f"{first[0] * 16 + first[1]}",
        f"page {last[0]} at offset {last[1]}: slot {last[0] * 16 + last[1]:,}",
    )

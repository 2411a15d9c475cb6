"""A batch's attention metadata, built from plain lists (reference solution)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Span = tuple[int, int, int]  # (page-table row, cached tokens, new tokens) of one request


def _pages_of(span: Span, page_rows: Mapping[int, Sequence[int]], page_size: int) -> list[int]:
    """The pages holding the request's tokens 0 .. cached + new - 1, in position order."""
    row, cached, new = span
    needed = -(-(cached + new) // page_size)  # ceiling division
    held = list(page_rows.get(row, []))
    if len(held) < needed:
        raise ValueError(f"row {row} holds {len(held)} page(s) but its {cached + new} tokens "
                         f"need {needed} of {page_size} tokens")
    return held[:needed]  # pages past the last token are not part of this pass


def new_token_fields(spans: Sequence[Span], page_rows: Mapping[int, Sequence[int]],
                     page_size: int) -> dict[str, list[int]]:
    positions: list[int] = []
    out_loc: list[int] = []
    last_indices: list[int] = []
    for span in spans:
        pages = _pages_of(span, page_rows, page_size)
        _, cached, new = span
        for pos in range(cached, cached + new):
            positions.append(pos)
            out_loc.append(pages[pos // page_size] * page_size + pos % page_size)
        last_indices.append(len(positions) - 1)
    return {"positions": positions, "out_loc": out_loc, "last_indices": last_indices}


def _indptr(lengths: Sequence[int]) -> list[int]:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


def page_arrays(spans: Sequence[Span], page_rows: Mapping[int, Sequence[int]],
                page_size: int) -> dict[str, list[int]]:
    pages = [_pages_of(span, page_rows, page_size) for span in spans]
    totals = [cached + new for _, cached, new in spans]
    return {
        "qo_indptr": _indptr([new for _, _, new in spans]),
        "page_indptr": _indptr([len(p) for p in pages]),
        "page_indices": [page for p in pages for page in p],
        "last_page_len": [total - (len(p) - 1) * page_size for total, p in zip(totals, pages)],
    }

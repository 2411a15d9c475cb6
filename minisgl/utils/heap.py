"""Keep the garbage collector's full passes out of the step loop.

An engine holds hundreds of thousands of objects from its start-up that will not become garbage
while it serves; a full pass over them takes tens of milliseconds, in which the host prepares
nothing and, under overlap scheduling, the device runs dry. ``gc.freeze()`` moves them into a
generation no pass scans. Chapter 12 tells the story.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_depth = 0  # nested blocks: the outermost one freezes and unfreezes


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Within the block, the objects alive when it began are left out of every collection.

    They are handed back at its end, so a cycle among them is still freed afterwards: an
    engine dropped after its run is collected as usual.
    """
    global _depth
    if _depth == 0:
        gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()

"""Keep the garbage collector's full passes out of the step loop.

CPython finds reference cycles by scanning the objects it tracks, youngest generations often
and the oldest now and then. An engine holds hundreds of thousands of old objects from its
start-up (modules, the model's layers, the Python side of its tensors and graphs), none of
which will become garbage while it serves, and a full pass over them takes tens of
milliseconds. In the step loop that is a pause in which the host prepares nothing, and under
overlap scheduling the device runs dry. ``gc.freeze()`` moves every object alive now into a
permanent generation that no pass scans; what is allocated afterwards is collected as before,
and ``gc.unfreeze()`` hands the frozen objects back.
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

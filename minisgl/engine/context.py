"""One forward pass made ready to run: a batch, its attention layout and its input ids.

It sits in the engine package, not in ``minisgl.core``: it names the attention layout, and the
core types sit below attention, which reads requests but is never read by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from minisgl.attention import BatchLayout
    from minisgl.core import Batch


@dataclass
class Context:
    """One forward pass made ready to run.

    The engine builds it from a :class:`Batch` (:meth:`Engine.prepare`) once the requests'
    page-table rows hold pages for all their tokens. It carries what does not depend on *how*
    the pass runs: run eagerly, the attention backend then plans for ``layout``; replayed as a
    CUDA graph, the graph runner pads ``layout`` and ``input_ids`` to a captured
    size instead.

    The model itself never sees this object: it receives tensors, and the attention layers
    reach the backend through ``use_attention_backend``.

    Attributes:
        batch: the requests.
        layout: each request's page-table row, cached length and new length, as the attention
            backends take them.
        input_ids: ``[T]`` int64 token ids of the new tokens, on the engine's device.
    """

    batch: Batch
    layout: BatchLayout
    input_ids: torch.Tensor

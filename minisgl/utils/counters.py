"""Counters a worker publishes and another process reads, with no message.

A queue would make the reader wait for the writer's next message and the writer send numbers
nobody asked for; shared memory lets each side go at its own pace. Chapter 14 tells the story.
"""

from __future__ import annotations

from collections.abc import Iterable

from minisgl.utils.processes import SPAWN


class SharedCounters:
    """Named 64-bit integers in shared memory: one process writes them, others read them.

    The scheduler publishes its state this way and the API server reads it for ``/metrics``.
    Make it in the parent, before starting the worker, and pass it to the worker as an
    argument: the memory is shared, not copied.

    A lock keeps a group of values written together (:meth:`update`) consistent for a reader
    that takes them together (:meth:`snapshot`).
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        if not self.names or len(set(self.names)) != len(self.names):
            raise ValueError(f"counters need distinct names, got {self.names!r}")
        self._index = {name: i for i, name in enumerate(self.names)}
        # From the spawn context, like the workers: a fork context's lock cannot go to them.
        self._values = SPAWN.Array("q", len(self.names))  # "q": signed 64-bit, zeroed

    def update(self, **values: int) -> None:
        """Set the named counters, all at once."""
        with self._values.get_lock():
            for name, value in values.items():
                self._values[self._slot(name)] = value

    def __getitem__(self, name: str) -> int:
        return self._values[self._slot(name)]

    def snapshot(self) -> dict[str, int]:
        """Every counter, read at one instant."""
        with self._values.get_lock():
            return dict(zip(self.names, self._values[:]))

    def _slot(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no counter named {name!r}; the counters are "
                           f"{', '.join(self.names)}") from None

    def __repr__(self) -> str:
        return f"SharedCounters({self.snapshot()})"

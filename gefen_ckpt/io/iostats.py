"""What this rank's last save or load moved: bytes to and from storage, requests to the store,
files opened, and bytes over the process group (``gefen_ckpt.last_io_stats()``). The storage
layer and the exchanges count as they go; ``measuring`` brackets one operation."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@dataclasses.dataclass
class IOStats:
    """Counters of one operation on one rank. ``requests``: reads, objects written, listings
    and publications the store served (a local file's ``pread`` chunks count as one read each)."""

    operation: str = ""
    bytes_written: int = 0
    bytes_read: int = 0
    requests: int = 0
    files_opened: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_lock = threading.Lock()
_current: IOStats | None = None
_last = IOStats()


def count(**deltas: int) -> None:
    """Add ``deltas`` to the operation being measured (nothing when none is)."""
    current = _current
    if current is None:
        return
    with _lock:
        for name, value in deltas.items():
            setattr(current, name, getattr(current, name) + value)


@contextmanager
def measuring(operation: str) -> Iterator[IOStats]:
    """Count what the block moves; on exit (error or not) it becomes ``last_io_stats()``. Nested
    blocks (an async save's writer inside its caller) count into the outermost one."""
    global _current, _last
    if _current is not None:
        yield _current
        return
    stats, start = IOStats(operation), time.perf_counter()
    _current = stats
    try:
        yield stats
    finally:
        stats.seconds = time.perf_counter() - start
        _current, _last = None, stats


def last_io_stats() -> IOStats:
    """A copy of this rank's counters of its last finished ``save``, ``load`` or ``async_save`` write."""
    with _lock:
        return dataclasses.replace(_last)

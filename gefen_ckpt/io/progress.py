"""A byte-progress bar for long checkpoint operations (torch-free, rich imported on demand)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


def columns() -> tuple:
    """A byte-progress bar's columns: what, bar, bytes done, speed, time left (also the CLI's)."""
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    return (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn())


@contextmanager
def progress_bar(enabled: bool, description: str, total: int) -> Iterator[Callable[[int], None] | None]:
    """A rich byte-progress bar on stderr (stdout stays clean for ``--json`` output)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(*columns(), console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)

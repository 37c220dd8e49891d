"""A byte-progress bar for long checkpoint operations (torch-free, rich imported on demand)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(enabled: bool, description: str, total: int) -> Iterator[Callable[[int], None] | None]:
    """A rich byte-progress bar on stderr (stdout stays clean for ``--json`` output)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)

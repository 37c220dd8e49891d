"""The documented exception types: every gefen_ckpt failure is a ``CheckpointError``."""

from collections.abc import Iterator
from contextlib import contextmanager


class CheckpointError(Exception):
    """Base class of every error gefen_ckpt raises on bad input or bad data."""


class CheckpointFormatError(CheckpointError, ValueError):
    """The manifest or a data file's header is malformed, hostile, or of an unsupported version."""


class CheckpointCorruptError(CheckpointError):
    """Stored bytes do not match the manifest: a checksum, size or file is wrong or missing."""


class CheckpointIncompleteError(CheckpointError):
    """No committed checkpoint at that location (absent, or a save that never finished)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A valid checkpoint that does not fit the live optimizer (FQNs, shapes, optimizer type)."""


class UnsupportedLayoutError(CheckpointError, ValueError):
    """A parameter is sharded in a way the block geometry cannot slice exactly (e.g. Shard(1))."""


class CheckpointStorageError(CheckpointError, OSError):
    """The storage failed (disk full, permission, unreachable endpoint, missing credentials);
    the message names the path. An ``OSError`` too, so I/O handlers keep working."""


class CheckpointLockedError(CheckpointError):
    """Another save to the same location holds its writer lock: this save was refused."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A collective save/load gave up waiting for the ranks it names."""


@contextmanager
def naming(where: str, catch: type | tuple[type, ...], as_type: type | None = None) -> Iterator[None]:
    """Errors of the ``catch`` types raised in the block are re-raised naming ``where`` (the
    checkpoint or file they are about), as ``as_type`` (default: their own type). A
    ``CheckpointError`` keeps its type (a corrupt file stays corruption, never a "mismatch"), and
    one that already names ``where`` passes unchanged."""
    try:
        yield
    except catch as exc:
        if isinstance(exc, CheckpointError):
            if str(exc).startswith(f"{where}:"):
                raise
            raise type(exc)(f"{where}: {exc}") from exc
        raise (as_type or type(exc))(f"{where}: {exc}") from exc

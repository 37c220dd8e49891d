"""The two checks every read of a stored piece makes -- all of its bytes arrived, and their
checksum is the manifest's -- with the errors that name the file, the tensor and the rows; and
the chunked read that hashes a piece of any size in a bounded buffer."""

from __future__ import annotations

from collections.abc import Callable

from gefen_ckpt.errors import CheckpointCorruptError
from gefen_ckpt.storage import RangeReader, Store
from gefen_ckpt.wire import checksum
from gefen_ckpt.wire.manifest import PieceRecord, TensorRecord


def check_length(store: Store, tensor: TensorRecord, piece: PieceRecord, got: int) -> None:
    if got != piece.nbytes:
        raise CheckpointCorruptError(f"{store.path(piece.file)}: {tensor.label} rows {list(piece.rows)} end after "
                                     f"{got} of {piece.nbytes} bytes (truncated file)")


def check_checksum(store: Store, tensor: TensorRecord, piece: PieceRecord, value: int) -> None:
    if value != piece.checksum:
        raise CheckpointCorruptError(f"{store.path(piece.file)}: checksum mismatch in {tensor.label} rows "
                                     f"{list(piece.rows)} (tensor {piece.key!r}): the data is corrupt")


def hash_chunks(reader: RangeReader, piece: PieceRecord, buffer: memoryview, wait: Callable[[int], None] | None = None,
                each: Callable[[int, memoryview], None] | None = None) -> tuple[int, int]:
    """(checksum, bytes read) of a piece read into ``buffer`` a chunk at a time; ``wait(end)``
    runs before each read, ``each(position in the piece, chunk)`` after it."""
    value, done = 0, 0
    while done < piece.nbytes:
        view = buffer[:min(len(buffer), piece.nbytes - done)]
        if wait is not None:
            wait(piece.offset + done + len(view))
        got = reader.read_into(piece.offset + done, view)
        value = checksum.update(value, view[:got])
        if each is not None:
            each(done, view[:got])
        done += got
        if got < len(view):
            break
    return value, done

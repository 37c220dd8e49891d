"""The records the manifest and the per-writer indexes share: a stored piece, the search for
the pieces that overlap some rows, msgpack's decoding limits (one module below both, so
neither imports the other), and the checks every read of a stored piece makes."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

from gefen_ckpt.errors import CheckpointCorruptError, CheckpointFormatError
from gefen_ckpt.wire import checksum
from gefen_ckpt.wire.dtypes import itemsize

if TYPE_CHECKING:
    from gefen_ckpt.io.storage import RangeReader, Store

MAX_LEN = 2**22  # elements of one array or map: params, files, pieces of one tensor
MAX_STR = 65536


class PieceRecord(NamedTuple):
    """Rows ``[rows[0], rows[1])`` of one tensor, stored at ``offset`` in data file ``file``
    (``key``: its name in messages, ``<tensor>@<start>:<stop>``). ``fqn`` is None for
    optimizer-wide fields."""

    fqn: str | None
    field: str
    rows: tuple[int, int]
    file: str
    key: str
    offset: int
    nbytes: int
    checksum: int


class TensorShape:
    """What a tensor record (``index.SplitTensor``) derives from its ``fqn``, ``field``, ``dtype``
    and ``shape``: the one home of rows and of its label."""

    __slots__ = ()

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * itemsize(self.dtype)

    @property
    def label(self) -> str:
        return f"global field {self.field!r}" if self.fqn is None else f"{self.fqn}/{self.field}"


def tensor_key(fqn: str | None, field: str) -> str:
    """A tensor's name in piece keys (``<name>@<start>:<stop>``)."""
    return f"__global__/{field}" if fqn is None else f"{fqn}/{field}"


def fail(path: str, message: str):
    """Refuse the manifest entry at ``path`` (the manifest's and the indexes' checks)."""
    raise CheckpointFormatError(f"manifest {path}: {message}")


def pieces_overlapping(pieces: Sequence, start: int, stop: int, rows: Callable = attrgetter("rows")) -> tuple:
    """The pieces (sorted, tiling; ``rows(piece)``: its ``(start, stop)``) overlapping ``[start, stop)``."""
    out = []
    for p in pieces[max(bisect.bisect_right(pieces, start, key=lambda p: rows(p)[0]) - 1, 0):]:
        first, last = rows(p)
        if first >= max(stop, start + 1):
            break
        if last > start:
            out.append(p)
    return tuple(out)


def _no_ext(code, data):
    raise ValueError(f"msgpack extension type {code} is not allowed")


#: msgpack's options for every decode of a manifest (docs/format.md, "Decoding limits")
DECODING = {"raw": False, "strict_map_key": True, "ext_hook": _no_ext, "max_str_len": MAX_STR,
            "max_bin_len": MAX_STR, "max_ext_len": 0, "max_array_len": MAX_LEN, "max_map_len": MAX_LEN}


# ----- reading a piece: all of its bytes arrived, and their checksum is the manifest's ---------
def check_length(store: Store, tensor: TensorShape, piece: PieceRecord, got: int) -> None:
    if got != piece.nbytes:
        raise CheckpointCorruptError(f"{store.path(piece.file)}: {tensor.label} rows {list(piece.rows)} end after "
                                     f"{got} of {piece.nbytes} bytes (truncated file)")


def check_checksum(store: Store, tensor: TensorShape, piece: PieceRecord, value: int) -> None:
    if value != piece.checksum:
        raise CheckpointCorruptError(f"{store.path(piece.file)}: checksum mismatch in {tensor.label} rows "
                                     f"{list(piece.rows)} (tensor {piece.key!r}): the data is corrupt")


def hash_chunks(reader: RangeReader, piece: PieceRecord, buffer: memoryview,
                wait: Callable[[int], None] | None = None,
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

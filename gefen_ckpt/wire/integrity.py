"""The two checks every read of a stored piece makes -- all of its bytes arrived, and their
checksum is the manifest's -- with the errors that name the file, the tensor and the rows."""

from __future__ import annotations

from gefen_ckpt.errors import CheckpointCorruptError
from gefen_ckpt.storage import Store
from gefen_ckpt.wire.manifest import PieceRecord, TensorRecord


def check_length(store: Store, tensor: TensorRecord, piece: PieceRecord, got: int) -> None:
    if got != piece.nbytes:
        raise CheckpointCorruptError(f"{store.path(piece.file)}: {tensor.label} rows {list(piece.rows)} end after "
                                     f"{got} of {piece.nbytes} bytes (truncated file)")


def check_checksum(store: Store, tensor: TensorRecord, piece: PieceRecord, value: int) -> None:
    if value != piece.checksum:
        raise CheckpointCorruptError(f"{store.path(piece.file)}: checksum mismatch in {tensor.label} rows "
                                     f"{list(piece.rows)} (tensor {piece.key!r}): the data is corrupt")

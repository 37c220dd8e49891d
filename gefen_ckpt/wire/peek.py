"""Torch-free reads of small stored tensors (a codebook, a step counter) as numpy arrays, verified
like every read, for tools that summarise a checkpoint without importing torch (``gefen-ckpt
inspect``). Loading state goes through ``reader``."""

from __future__ import annotations

import numpy as np

from gefen_ckpt.errors import CheckpointCorruptError
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire import checksum
from gefen_ckpt.wire.dtypes import NUMPY
from gefen_ckpt.wire.index import SplitTensor
from gefen_ckpt.wire.records import check_checksum, check_length


def readable(dtype: str) -> bool:
    return dtype in NUMPY or dtype == "bfloat16"  # bfloat16 is widened by hand


def read_values(store: Store, tensor: SplitTensor) -> np.ndarray:
    """Every element of ``tensor`` as a flat float64 array (each piece's length and checksum
    verified; ``CheckpointCorruptError`` names the file and tensor)."""
    if not readable(tensor.dtype):
        raise ValueError(f"{tensor.label}: {tensor.dtype} has no numpy equivalent")
    parts = []
    for piece in tensor.pieces:
        try:
            data = store.read(piece.file, piece.offset, piece.offset + piece.nbytes)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{store.path(piece.file)}: data file is missing") from None
        check_length(store, tensor, piece, len(data))
        check_checksum(store, tensor, piece, checksum.update(0, data))
        if tensor.dtype == "bfloat16":
            parts.append((np.frombuffer(data, "<u2").astype("<u4") << 16).view("<f4"))
        else:
            parts.append(np.frombuffer(data, NUMPY[tensor.dtype]))
    return np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)

"""The per-piece checksum: CRC-32 (ISO-HDLC, the zlib/PNG/gzip one).

CRC-32 is in every standard library, so any reader can verify a checkpoint. ``update`` uses
the C library (``gefen_ckpt.native``: carry-less-multiply folding, 2-4x ``zlib.crc32``'s
1.6-3 GB/s measured here) when it is usable; otherwise ``zlib.crc32``. Same values either way;
both release the GIL, so hashing overlaps I/O in a helper thread (docs/decisions.md).
"""

from __future__ import annotations

import os
import zlib

import numpy as np

from gefen_ckpt import native

ALGORITHM = "crc32"
#: Pieces at least this large are hashed in a helper thread while the next one is read from
#: disk (measured +9% cold load). Saves hash in the write loop: see ``write_hashed``.
READ_THREAD_MIN_BYTES = 2**20
#: Below this many bytes the ctypes call costs more than zlib's slower loop.
NATIVE_MIN_BYTES = 4096


_lib = native.lib
_native = _lib.gefen_crc32 if _lib is not None else None


def accelerated() -> bool:
    return _native is not None


def update(value: int, data) -> int:
    """Extend a running checksum (start from 0) with ``data`` (any contiguous buffer)."""
    if _native is None:
        return zlib.crc32(data, value)
    view = np.frombuffer(data, dtype=np.uint8)
    if view.nbytes < NATIVE_MIN_BYTES:
        return zlib.crc32(view, value)
    return _native(value, view.ctypes.data, view.nbytes)


def of_ranges(data: np.ndarray, offsets: list[int], sizes: list[int]) -> list[int]:
    """The checksum of each range ``[offsets[i], offsets[i] + sizes[i])`` of the uint8 array
    ``data`` (ranges must lie inside it), in one C call (GIL released) when accelerated."""
    if _lib is None:
        return [update(0, data[o:o + n]) for o, n in zip(offsets, sizes)]
    addresses = np.asarray(offsets, np.uint64) + np.uint64(data.ctypes.data)
    sizes_ = np.asarray(sizes, np.int64)
    crcs = np.zeros(len(sizes_), np.uint32)
    _lib.gefen_crc32_many(len(sizes_), addresses.ctypes.data, sizes_.ctypes.data, crcs.ctypes.data)
    return crcs.tolist()


def native_io() -> bool:
    """Are ``read_hashed`` and ``write_hashed`` available (the C library, on POSIX)?"""
    return native.io


def read_hashed(fd: int, offsets: list[int], sizes: list[int], addresses: list[int],
                chunk: int) -> tuple[list[int], list[int]]:
    """Read ``sizes[i]`` bytes at ``offsets[i]`` of ``fd`` into memory at ``addresses[i]`` and
    checksum them in the same pass (one C call, GIL released; see ``native_io``).
    Returns (bytes read, checksum) lists; fewer bytes only at end of file; ``OSError`` on a
    failed read."""
    n = len(offsets)
    arrays = [np.asarray(offsets, np.int64), np.asarray(sizes, np.int64), np.asarray(addresses, np.uint64)]
    got, crcs = np.zeros(n, np.int64), np.zeros(n, np.uint32)
    rc = _lib.gefen_read_hashed(fd, n, *(a.ctypes.data for a in arrays), chunk, got.ctypes.data, crcs.ctypes.data)
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))
    return got.tolist(), crcs.tolist()


def write_hashed(fd: int, spans: list[tuple[int, int]], chunk: int, writeback_every: int,
                 progress: list[int]) -> list[int]:
    """Append the memory at each ``(address, size)`` to ``fd`` and return the checksum of each, in
    one C call (GIL released; see ``native_io``). ``progress`` is ``[bytes written, bytes handed
    to writeback]`` of the file so far, updated in place (also when a write fails: ``OSError``)."""
    n = len(spans)
    table = np.asarray(spans, np.int64).reshape(n, 2)
    addresses, sizes = np.ascontiguousarray(table[:, 0]), np.ascontiguousarray(table[:, 1])
    state = np.asarray(progress, np.int64)
    crcs = np.zeros(n, np.uint32)
    rc = _lib.gefen_write_hashed(fd, n, addresses.ctypes.data, sizes.ctypes.data, chunk, writeback_every,
                                 state.ctypes.data, crcs.ctypes.data)
    progress[:] = state.tolist()
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))
    return crcs.tolist()

"""The optional C library ``gefen_ckpt._native`` (``csrc/``: the fast CRC-32 and the I/O loops that
run without the GIL); the one module that calls it. ``lib`` is None when it is not built, the CPU
lacks the carry-less multiply, or it does not reproduce ``zlib.crc32``: then zlib (same values)
and the callers' Python I/O paths."""

from __future__ import annotations

import ctypes
import os
import zlib

import numpy as np

from gefen.clib import load

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {  # name -> (argument types, result type)
    "gefen_crc32": ([ctypes.c_uint32, _P, ctypes.c_size_t], ctypes.c_uint32),
    "gefen_crc32_many": ([_I64, _P, _P, _P], None),
    "gefen_crc32_accelerated": ([], ctypes.c_int),
}
_IO_SIGNATURES = {  # csrc/file_io.c: POSIX only
    "gefen_read_hashed": ([ctypes.c_int, _I64, _P, _P, _P, _I64, _P, _P], ctypes.c_int),
    "gefen_write_hashed": ([ctypes.c_int, _I64, _P, _P, _I64, _I64, _P, _P], ctypes.c_int),
    "gefen_fsync_start": ([ctypes.c_char_p], _P),
    "gefen_fsync_wait": ([_P], ctypes.c_int),
    "gefen_prefetch_start": ([_I64, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_I64), _I64, _I64], _P),
    "gefen_prefetch_wait": ([_P, _I64], _I64),
    "gefen_prefetch_stop": ([_P], None),
    "gefen_prefetch_free": ([_P], None),
}
#: Below this many bytes the ctypes call costs more than zlib's slower loop.
NATIVE_MIN_BYTES = 4096


def _load():
    signatures = {**_SIGNATURES, **(_IO_SIGNATURES if os.name == "posix" else {})}
    lib = load("gefen_ckpt._native", signatures)
    if lib is None or not lib.gefen_crc32_accelerated():
        return None
    probe = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    for n, start in ((100_003, 0), (4096, 7), (65, 1), (1000, 12345)):
        data = probe[:n]
        if lib.gefen_crc32(start, data.ctypes.data, n) != zlib.crc32(data, start):
            return None
    return lib


lib = _load()
#: The C I/O loops (``read_hashed`` ... ``prefetch_start``) are usable: the library, on POSIX.
io = lib is not None and os.name == "posix"


def _check(rc: int) -> None:
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))


def accelerated() -> bool:
    return lib is not None


def crc32(value: int, data) -> int:
    """``zlib.crc32(data, value)``: extend a running checksum (start from 0) with ``data`` (any
    contiguous buffer)."""
    if lib is None:
        return zlib.crc32(data, value)
    view = np.frombuffer(data, dtype=np.uint8)
    if view.nbytes < NATIVE_MIN_BYTES:
        return zlib.crc32(view, value)
    return lib.gefen_crc32(value, view.ctypes.data, view.nbytes)


def crc32_ranges(data: np.ndarray, offsets: list[int], sizes: list[int]) -> list[int]:
    """The checksum of each range ``[offsets[i], offsets[i] + sizes[i])`` of the uint8 array
    ``data`` (ranges must lie inside it), in one C call when accelerated."""
    if lib is None:
        return [crc32(0, data[o:o + n]) for o, n in zip(offsets, sizes)]
    if len(sizes) == 1:  # a lazy read verifies one piece at a time: no arrays to build for it
        return [lib.gefen_crc32(0, data.ctypes.data + offsets[0], sizes[0])]
    addresses = np.asarray(offsets, np.uint64) + np.uint64(data.ctypes.data)
    sizes_ = np.asarray(sizes, np.int64)
    crcs = np.zeros(len(sizes_), np.uint32)
    lib.gefen_crc32_many(len(sizes_), addresses.ctypes.data, sizes_.ctypes.data, crcs.ctypes.data)
    return crcs.tolist()


def read_hashed(fd: int, offsets: list[int], sizes: list[int], addresses: list[int],
                chunk: int) -> tuple[list[int], list[int]]:
    """Read ``sizes[i]`` bytes at ``offsets[i]`` of ``fd`` into memory at ``addresses[i]`` and
    checksum them in the same pass (one C call, GIL released). Returns (bytes read, checksum)
    lists; fewer bytes only at end of file; ``OSError`` on a failed read."""
    n = len(offsets)
    arrays = [np.asarray(offsets, np.int64), np.asarray(sizes, np.int64), np.asarray(addresses, np.uint64)]
    got, crcs = np.zeros(n, np.int64), np.zeros(n, np.uint32)
    _check(lib.gefen_read_hashed(fd, n, *(a.ctypes.data for a in arrays), chunk, got.ctypes.data, crcs.ctypes.data))
    return got.tolist(), crcs.tolist()


def write_hashed(fd: int, spans: list[tuple[int, int]], chunk: int, writeback_every: int,
                 progress: list[int]) -> list[int]:
    """Append the memory at each ``(address, size)`` to ``fd`` and return the checksum of each, in
    one C call (GIL released). ``progress`` is ``[bytes written, bytes handed to writeback]`` of
    the file so far, updated in place (also when a write fails: ``OSError``)."""
    n = len(spans)
    table = np.asarray(spans, np.int64).reshape(n, 2)
    addresses, sizes = np.ascontiguousarray(table[:, 0]), np.ascontiguousarray(table[:, 1])
    state = np.asarray(progress, np.int64)
    crcs = np.zeros(n, np.uint32)
    rc = lib.gefen_write_hashed(fd, n, addresses.ctypes.data, sizes.ctypes.data, chunk, writeback_every,
                                state.ctypes.data, crcs.ctypes.data)
    progress[:] = state.tolist()
    _check(rc)
    return crcs.tolist()


def fsync_start(path: str):
    """Start fsync'ing ``path`` on a C thread; returns a waiter that joins it (``OSError`` if the
    fsync failed), or None when no thread could be started."""
    handle = lib.gefen_fsync_start(os.fsencode(path))
    if handle is None:
        return None

    def wait() -> None:
        error = lib.gefen_fsync_wait(handle)
        if error:
            raise OSError(error, os.strerror(error), path)

    return wait


def prefetch_start(files: list[tuple[str, int]], chunk: int, lead: int):
    """A C thread reading ``files`` ((path, size), in order) into the page cache, at most ``lead``
    bytes ahead of the furthest position waited for; its handle, or None if none could start."""
    paths = (ctypes.c_char_p * len(files))(*(os.fsencode(path) for path, _ in files))
    sizes = (ctypes.c_int64 * len(files))(*(size for _, size in files))
    return lib.gefen_prefetch_start(len(files), paths, sizes, chunk, lead) or None


def prefetch_wait(handle, position: int) -> int:
    """Block until ``position`` (files end to end) is cached or the prefetch ended; bytes cached."""
    return lib.gefen_prefetch_wait(handle, position)


def prefetch_stop(handle) -> None:
    lib.gefen_prefetch_stop(handle)


def prefetch_free(handle, owner: int) -> None:
    """Stop, join and free a prefetch; in a forked child (which has no such thread) nothing."""
    if os.getpid() == owner:
        lib.gefen_prefetch_free(handle)

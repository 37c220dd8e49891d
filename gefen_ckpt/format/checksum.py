"""The per-piece checksum: CRC-32 (ISO-HDLC, the zlib/PNG/gzip one).

CRC-32 is in every standard library, so any reader can verify a checkpoint. ``update`` uses
``gefen_ckpt._crc32`` (``gefen_ckpt/csrc/crc32.c``: carry-less-multiply folding, 2-4x
``zlib.crc32``'s 1.6-3 GB/s measured here) when it is built, the CPU has the instruction and it
reproduces ``zlib.crc32`` on a self-check; otherwise ``zlib.crc32``. Same values either way;
both release the GIL, so hashing overlaps I/O in a helper thread (docs/decisions.md).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import zlib

import numpy as np

ALGORITHM = "crc32"
#: Pieces at least this large are hashed in a helper thread while the next one is read from
#: disk (measured +9% cold load). Saves overlap differently: see storage.LocalWriter.
READ_THREAD_MIN_BYTES = 2**20
#: Below this many bytes the ctypes call costs more than zlib's slower loop.
NATIVE_MIN_BYTES = 4096


def _load_native():
    """The accelerated library (``gefen_crc32(crc, ptr, n)``, ``gefen_read_hashed``) when it is
    usable, else None."""
    try:
        spec = importlib.util.find_spec("gefen_ckpt._crc32")
        if spec is None or not spec.origin:
            return None
        lib = ctypes.CDLL(spec.origin)
        fn = lib.gefen_crc32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        lib.gefen_read_hashed.argtypes = [ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [
            ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        lib.gefen_read_hashed.restype = ctypes.c_int
        lib.gefen_crc32_many.argtypes = [ctypes.c_int64] + [ctypes.c_void_p] * 3
        lib.gefen_crc32_many.restype = None
        if not lib.gefen_crc32_accelerated():
            return None
    except (ImportError, OSError, AttributeError):
        return None
    probe = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    for n, start in ((100_003, 0), (4096, 7), (65, 1), (1000, 12345)):
        data = probe[:n]
        if fn(start, data.ctypes.data, n) != zlib.crc32(data, start):
            return None
    return lib


_lib = _load_native()
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


def can_read_hashed() -> bool:
    return _lib is not None and os.name == "posix"


def read_hashed(fd: int, offsets: list[int], sizes: list[int], addresses: list[int],
                chunk: int) -> tuple[list[int], list[int]]:
    """Read ``sizes[i]`` bytes at ``offsets[i]`` of ``fd`` into memory at ``addresses[i]`` and
    checksum them in the same pass (one C call, GIL released; see ``can_read_hashed``).
    Returns (bytes read, checksum) lists; fewer bytes only at end of file; ``OSError`` on a
    failed read."""
    n = len(offsets)
    arrays = [np.asarray(offsets, np.int64), np.asarray(sizes, np.int64), np.asarray(addresses, np.uint64)]
    got, crcs = np.zeros(n, np.int64), np.zeros(n, np.uint32)
    rc = _lib.gefen_read_hashed(fd, n, *(a.ctypes.data for a in arrays), chunk, got.ctypes.data, crcs.ctypes.data)
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))
    return got.tolist(), crcs.tolist()

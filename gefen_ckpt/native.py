"""The optional C library ``gefen_ckpt._crc32`` (``gefen_ckpt/csrc/crc32.c``), loaded with ctypes.

It holds the fast CRC-32 and the I/O loops that must run without the GIL: hashed reads and
writes of whole files, and an fsync and a read-ahead (prefetch) on threads of their own.
``lib`` is None when the library is not built, the CPU lacks the carry-less multiply, or it
does not reproduce ``zlib.crc32`` on a self-check; every caller then has a plain-Python path
with the same results.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import zlib

import numpy as np

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {  # name -> (argument types, result type)
    "gefen_crc32": ([ctypes.c_uint32, _P, ctypes.c_size_t], ctypes.c_uint32),
    "gefen_crc32_many": ([_I64, _P, _P, _P], None),
    "gefen_read_hashed": ([ctypes.c_int, _I64, _P, _P, _P, _I64, _P, _P], ctypes.c_int),
    "gefen_write_hashed": ([ctypes.c_int, _I64, _P, _P, _I64, _I64, _P, _P], ctypes.c_int),
    "gefen_fsync_start": ([ctypes.c_char_p], _P),
    "gefen_fsync_wait": ([_P], ctypes.c_int),
    "gefen_prefetch_start": ([_I64, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_I64), _I64, _I64], _P),
    "gefen_prefetch_wait": ([_P, _I64], _I64),
    "gefen_prefetch_stop": ([_P], None),
    "gefen_prefetch_free": ([_P], None),
}


def _load():
    try:
        spec = importlib.util.find_spec("gefen_ckpt._crc32")
        if spec is None or not spec.origin:
            return None
        lib = ctypes.CDLL(spec.origin)
        for name, (args, result) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, result
        if not lib.gefen_crc32_accelerated():
            return None
    except (ImportError, OSError, AttributeError):
        return None
    probe = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    for n, start in ((100_003, 0), (4096, 7), (65, 1), (1000, 12345)):
        data = probe[:n]
        if lib.gefen_crc32(start, data.ctypes.data, n) != zlib.crc32(data, start):
            return None
    return lib


lib = _load()
#: The C I/O loops are POSIX-only.
io = lib is not None and os.name == "posix"

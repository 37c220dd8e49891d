"""The per-piece checksum: CRC-32 (ISO-HDLC, the zlib/PNG/gzip one).

CRC-32 is in every standard library, so any reader can verify a checkpoint. ``gefen_ckpt.native``
computes it (carry-less-multiply folding in C, 2-4x ``zlib.crc32``'s 1.6-3 GB/s measured here,
when the library is usable; otherwise ``zlib.crc32``). Same values either way; both release the
GIL, so hashing overlaps I/O in a helper thread (docs/decisions.md).
"""

from __future__ import annotations

from gefen_ckpt.native import accelerated  # noqa: F401  (the checksum's names in the format)
from gefen_ckpt.native import crc32 as update  # noqa: F401
from gefen_ckpt.native import crc32_ranges as of_ranges  # noqa: F401

ALGORITHM = "crc32"
#: Pieces at least this large are hashed in a helper thread while the next one is read from
#: disk (measured +9% cold load). Saves hash in the write loop: see ``native.write_hashed``.
READ_THREAD_MIN_BYTES = 2**20

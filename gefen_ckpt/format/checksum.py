"""The per-piece checksum: CRC-32 (ISO-HDLC, the zlib/PNG/gzip one).

Measured here (docs/decisions.md): zlib.crc32 1.3-2.2 GB/s on one core, several times the
disk's 0.27-0.54 GB/s fdatasync'd bandwidth, and it releases the GIL, so hashing overlaps
I/O in a helper thread. xxh3 is 2-3x faster but would add a dependency to every reader in
every language; CRC-32 is in every standard library.
"""

from __future__ import annotations

import zlib

ALGORITHM = "crc32"
#: Pieces at least this large are hashed in a helper thread while I/O goes on. Reading from
#: disk, hashing overlaps the next read (measured +9% cold load); writing goes to the page
#: cache, where a thread hand-off pays only for large pieces.
READ_THREAD_MIN_BYTES = 2**20
WRITE_THREAD_MIN_BYTES = 16 * 2**20


def update(value: int, data) -> int:
    """Extend a running checksum (start from 0) with ``data`` (any contiguous buffer)."""
    return zlib.crc32(data, value)

"""The per-piece checksum: CRC-32 (ISO-HDLC, the zlib one: any reader can verify a checkpoint),
computed by ``gefen_ckpt.io.native`` (C, 2-4x ``zlib.crc32``'s 1.6-3 GB/s) or zlib, the same values;
both release the GIL, so hashing overlaps I/O in a helper thread (docs/decisions.md)."""

from __future__ import annotations

from gefen_ckpt.io.native import accelerated  # noqa: F401  (the checksum's names in the format)
from gefen_ckpt.io.native import crc32 as update  # noqa: F401
from gefen_ckpt.io.native import crc32_ranges as of_ranges  # noqa: F401

ALGORITHM = "crc32"
#: Pieces at least this large are hashed in a helper thread while the next one is read from
#: disk (measured +9% cold load). Saves hash in the write loop: see ``native.write_hashed``.
READ_THREAD_MIN_BYTES = 2**20

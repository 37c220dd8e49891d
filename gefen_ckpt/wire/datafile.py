"""safetensors data files: one ``U8`` tensor ``__data__`` spans the data section, which starts on
an ``ALIGNMENT``-byte boundary (the JSON header is padded with trailing spaces), and the writer's
index places every piece in it (docs/format.md). The stock safetensors library reads them."""

from __future__ import annotations

import json
import struct
from json.encoder import encode_basestring_ascii
from typing import NamedTuple

from gefen_ckpt.wire.dtypes import DTYPES

#: The data section, and every piece of at least ``ALIGN_FROM`` bytes, starts at a multiple of
#: this many bytes from the file's start.
ALIGNMENT = 64
#: safetensors' own limit on the JSON header.
MAX_HEADER_BYTES = 100 * 2**20
_BIG = 10**16  # a data offset no file reaches: sizes headers conservatively
_PAD_ENTRY_BOUND = len(json.dumps({f"__pad__/{_BIG}": {"dtype": "U8", "shape": [_BIG],
                                                           "data_offsets": [_BIG, _BIG]}}))
_ENTRY_FIXED = len(json.dumps({"": {"dtype": "F8_E4M3", "shape": [], "data_offsets": [_BIG, _BIG]}}))
_DIM_BOUND = len(str(_BIG)) + 2  # digits, comma, space


class Entry(NamedTuple):
    key: str
    dtype: str  # manifest dtype name
    shape: tuple[int, ...]
    nbytes: int


def entry_bound(entry: Entry) -> int:
    """Bytes an entry may cost in a file, conservatively (its data, padding, and a header entry of
    its own with a padding entry): the budget writers pack files and pieces by."""
    text = len(encode_basestring_ascii(entry.key)) + _ENTRY_FIXED + _DIM_BOUND * len(entry.shape)
    return text + _PAD_ENTRY_BOUND + 2 * ALIGNMENT + entry.nbytes


#: Bytes of a file beyond its entries' bounds (length prefix, braces, metadata, alignment).
FILE_OVERHEAD = 8 + ALIGNMENT + 256


#: The one tensor of a data file: its whole data section, where the writer's index places every
#: piece. Per-piece header entries would cost ~80 bytes a piece, more than the data of the small
#: pieces a many-rank save has.
DATA_KEY = "__data__"
#: A piece of at least this many bytes starts on an ``ALIGNMENT`` boundary; a smaller one
#: on a multiple of its dtype's size (enough for a view), so small pieces pack without padding.
ALIGN_FROM = 4096


def piece_alignment(entry: Entry) -> int:
    return ALIGNMENT if entry.nbytes >= ALIGN_FROM else DTYPES[entry.dtype][1]


def build_packed(entries: list[Entry], metadata: dict[str, str]) -> tuple[bytes, list[int], int]:
    """A data file's (length prefix + padded JSON header, absolute offset of each entry,
    file size): one ``U8`` tensor ``DATA_KEY`` spanning the data section, pieces packed in it."""
    relative, pos = [], 0
    for e in entries:
        pos += -pos % piece_alignment(e)
        relative.append(pos)
        pos += e.nbytes
    prefix = packed_prefix(pos, metadata)
    return prefix, [len(prefix) + r for r in relative], len(prefix) + pos


def packed_prefix(data_bytes: int, metadata: dict[str, str]) -> bytes:
    """A data file's length prefix and JSON header (as ``json.dumps(..., separators=(",", ":"))``
    writes it) for a data section of ``data_bytes``, padded with spaces so that the data section
    starts on an ``ALIGNMENT`` boundary."""
    meta = json.dumps(dict(metadata), separators=(",", ":"))
    text = (f'{{"__metadata__":{meta},"{DATA_KEY}":{{"dtype":"U8","shape":[{data_bytes}],'
            f'"data_offsets":[0,{data_bytes}]}}}}').encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)
    return struct.pack("<Q", len(text)) + text

"""safetensors data files: one ``U8`` tensor ``__data__`` spans the data section, which starts on
an ``ALIGNMENT``-byte boundary (the JSON header is padded with trailing spaces), and the writer's
index places every piece in it (docs/format.md). The stock safetensors library reads them."""

from __future__ import annotations

import json
import math
import struct
from json.encoder import encode_basestring_ascii
from typing import NamedTuple

from gefen_ckpt.wire.dtypes import DTYPES

#: The data section, and every piece of at least ``ALIGN_FROM`` bytes, starts at a multiple of
#: this many bytes from the file's start.
ALIGNMENT = 64
#: safetensors' own limit on the JSON header.
MAX_HEADER_BYTES = 100 * 2**20
_CODES = {code: name for name, (code, _) in DTYPES.items()}
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


def _entry_json(key: str, code: str, shape, begin: int, end: int) -> str:
    """One header entry, exactly as ``json.dumps(..., separators=(",", ":"))`` writes it."""
    dims = ",".join(map(str, shape))
    return f'{encode_basestring_ascii(key)}:{{"dtype":"{code}","shape":[{dims}],"data_offsets":[{begin},{end}]}}'


def entry_bound(entry: Entry) -> int:
    """Bytes an entry may cost in a file, conservatively (its data, padding, and a header entry of
    its own with a padding entry): the budget writers pack files and pieces by."""
    text = len(encode_basestring_ascii(entry.key)) + _ENTRY_FIXED + _DIM_BOUND * len(entry.shape)
    return text + _PAD_ENTRY_BOUND + 2 * ALIGNMENT + entry.nbytes


#: Bytes of a file beyond its entries' bounds (length prefix, braces, metadata, alignment).
FILE_OVERHEAD = 8 + ALIGNMENT + 256


def _prefix(entries: list[str], metadata: dict[str, str]) -> bytes:
    """The length prefix and the JSON header of ``entries``, padded with spaces so that the data
    section starts on an ``ALIGNMENT`` boundary."""
    meta = '"__metadata__":' + json.dumps(dict(metadata), separators=(",", ":"))
    text = ("{" + ",".join([meta, *entries]) + "}").encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def parse_header(prefix: bytes, file_size: int) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """key -> (safetensors dtype code, shape, absolute begin, absolute end), checked the way the
    stock safetensors validator checks it (raises ``ValueError``). ``prefix`` must hold at
    least the length prefix and the whole header."""
    if len(prefix) < 8:
        raise ValueError("shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise ValueError(f"header length {n} exceeds the file or safetensors' limit")
    if len(prefix) < 8 + n:
        raise ValueError("header truncated")
    try:
        header = json.loads(prefix[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    header.pop("__metadata__", None)
    out, spans = {}, []
    for key, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"tensor {key!r}: malformed entry")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if code not in _CODES or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"tensor {key!r}: bad dtype or shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"tensor {key!r}: bad data_offsets")
        if math.prod(shape) * DTYPES[_CODES[code]][1] != offsets[1] - offsets[0]:
            raise ValueError(f"tensor {key!r}: data_offsets do not match its shape and dtype")
        out[key] = (code, tuple(shape), 8 + n + offsets[0], 8 + n + offsets[1])
        spans.append((offsets[0], offsets[1], key))
    pos = 0
    for begin, end, key in sorted(spans):
        if begin != pos:
            raise ValueError(f"tensor {key!r}: data does not follow the previous tensor (gap or overlap)")
        pos = end
    if 8 + n + pos != file_size:
        raise ValueError(f"tensors end at byte {8 + n + pos}, the file has {file_size}")
    return out


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
    """A data file's length prefix and padded JSON header for a data section of ``data_bytes``."""
    return _prefix([_entry_json(DATA_KEY, "U8", (data_bytes,), 0, data_bytes)], metadata)

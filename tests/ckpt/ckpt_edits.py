"""Deliberate edits of a committed local checkpoint, to reach the checks behind its checksums
(what a hostile or buggy writer could commit), and where its pieces lie."""

from __future__ import annotations

import os

import msgpack

import gefen_ckpt
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire import checksum
from gefen_ckpt.wire.manifest import MANIFEST_NAME, encode, open_checkpoint


def rewrite_manifest(url, change) -> None:
    """``change(m)`` applied to the manifest's map, its checksum recomputed."""
    path = os.path.join(url, MANIFEST_NAME)
    with open(path, "rb") as f:
        m = msgpack.unpackb(f.read())
    change(m)
    with open(path, "wb") as f:
        f.write(encode(m))


def index_name(url, writer: int = 0) -> str:
    return gefen_ckpt.read_manifest(str(url))["writers"][writer][0]


def rewrite_index(url, writer: int, change) -> None:
    """``change(raw)`` applied to writer ``writer``'s index, re-pinned (size and CRC) in the manifest."""
    path = os.path.join(url, index_name(url, writer))
    with open(path, "rb") as f:
        raw = msgpack.unpackb(f.read())
    change(raw)
    data = msgpack.packb(raw)
    with open(path, "wb") as f:
        f.write(data)

    def pin(m):
        m["writers"][writer][1:3] = [len(data), checksum.update(0, data)]

    rewrite_manifest(url, pin)


def index_entry(raw: dict, url, fqn: str | None, field: str) -> list:
    """The pieces ``[start, stop, file, offset, checksum]`` of one tensor in a decoded index."""
    ordinal = open_checkpoint(Store(str(url))).tensors[(fqn, field)].ordinal
    return next(pieces for o, pieces in raw["tensors"] if o == ordinal)


def data_files(url) -> list[str]:
    """Every data file the committed manifest names, writer by writer."""
    return [name for w in gefen_ckpt.read_manifest(str(url))["writers"] for name in w[3::2]]


def stored_files(url) -> set[str]:
    """Every data file and index the committed manifest names."""
    return set(data_files(url)) | {w[0] for w in gefen_ckpt.read_manifest(str(url))["writers"]}


def piece(url, fqn: str | None = "up.weight", field: str = "mv_code", i: int = 0):
    """(path of its data file, record) of piece ``i`` of one tensor."""
    p = open_checkpoint(Store(str(url))).tensors[(fqn, field)].pieces[i]
    return os.path.join(url, p.file), p

"""Streaming writes and the commit protocol, the building blocks a collective save reuses: each
writer ``write_pieces`` its rows, one process builds the manifest and ``commit``s it. Data files
get names no earlier save used, so nothing of the previous checkpoint is touched until the new
manifest has atomically replaced the old one; a piece is at most ``memory_budget // 4`` bytes."""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from gefen.replicas import chunk_rows
from gefen_ckpt.io.storage import Store, Writer
from gefen_ckpt.state.canonical import CanonicalState, EagerSource, LocalPart, TensorSource
from gefen_ckpt.wire import checksum, datafile, many_writers
from gefen_ckpt.wire import manifest as mf
from gefen_ckpt.wire.dtypes import dtype_name, itemsize
from gefen_ckpt.wire.index import MAX_WORLD_SIZE, WriterPin, encode_index, index_entries, index_name
from gefen_ckpt.wire.manifest import FILE_METADATA, MANIFEST_NAME, FileRecord
from gefen_ckpt.wire.many_writers import _in_memory, tensors
from gefen_ckpt.wire.records import PieceRecord, tensor_key
from gefen_ckpt.wire.writelock import WriterLock, acquire

DATA_FILE = re.compile(r"data-[0-9a-f]+-r\d+-\d+\.safetensors")
INDEX_FILE = re.compile(r"index-[0-9a-f]+-r\d+\.msgpack")
TEMP_MANIFEST = re.compile(re.escape(MANIFEST_NAME) + r"\.[0-9a-f]+\.tmp")
MIN_FILE_BYTES = 1024
#: A live state's pieces are written in batches of about this many bytes (one C call each; the
#: progress bar moves once per batch).
WRITE_BATCH_BYTES = 64 * 2**20
#: Pieces read from elsewhere (a checkpoint being converted or resharded) are held until about
#: this many bytes, then written in one call: a reshard to thousands of ranks writes millions of
#: small pieces, and one call each cost more than their data.
READ_BATCH_BYTES = 4 * 2**20
_ZEROS = np.zeros(datafile.ALIGNMENT, np.uint8)  # the padding before a piece is shorter than this
_ZEROS_AT = _ZEROS.ctypes.data
OnBytes = Callable[[int], None]


# ----- what to write ------------------------------------------------------------------------
@dataclass(frozen=True)
class WriteItem:
    """Rows ``[row_start, row_start + source rows)`` of one tensor (``fqn`` None: a global field)."""

    fqn: str | None
    field: str
    row_start: int
    source: TensorSource


class RowRange:
    """Rows ``[start, stop)`` of another source, as a source of its own."""

    def __init__(self, source: TensorSource, start: int, stop: int):
        self.source, self.start, self.stop = source, start, stop
        self.shape, self.dtype = (stop - start, *source.shape[1:]), source.dtype

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.stop - self.start if stop is None else stop
        return self.source.read(self.start + start, self.start + stop)


def items(state: CanonicalState, rank: int = 0, world_size: int | None = None) -> list[WriteItem]:
    """What ``rank`` writes: whole tensors (``world_size`` None, the canonical layout), or its
    ``torch.chunk`` rows of row-sharded fields plus, on rank 0, one copy of every replicated one."""
    out = []
    for fqn, name, src, sharded in tensors(state, world_size is not None):
        if not sharded:
            if rank == 0:
                out.append(WriteItem(fqn, name, 0, src))
            continue
        start, stop = chunk_rows(src.shape[0], world_size, rank)
        if stop > start:
            out.append(WriteItem(fqn, name, start, RowRange(src, start, stop)))
    return out


# ----- planning -----------------------------------------------------------------------------
class _Piece(NamedTuple):
    item: WriteItem
    start: int  # rows of item.source
    stop: int
    dtype: str
    entry: datafile.Entry

    @property
    def global_rows(self) -> tuple[int, int]:
        return self.item.row_start + self.start, self.item.row_start + self.stop


def _key(item: WriteItem, start: int, stop: int) -> str:
    return f"{tensor_key(item.fqn, item.field)}@{item.row_start + start}:{item.row_start + stop}"


def _split(item: WriteItem, max_file_bytes: int, piece_bytes: int) -> list[_Piece]:
    shape, dtype = tuple(item.source.shape), dtype_name(item.source.dtype)
    rows = shape[0] if shape else 1
    row_bytes = itemsize(dtype) * math.prod(shape[1:])
    probe = datafile.Entry(_key(item, rows, rows), dtype, shape, 0)  # the longest key any piece gets
    room = max_file_bytes - datafile.FILE_OVERHEAD - datafile.entry_bound(probe)
    if row_bytes > room:
        raise ValueError(f"one row of {item.fqn or 'global'}/{item.field} ({row_bytes} bytes) does not fit "
                         f"in a data file of max_file_bytes={max_file_bytes}")
    step = max(1, min(room, piece_bytes) // row_bytes) if row_bytes else max(rows, 1)
    pieces = []
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        stored = (stop - start, *shape[1:]) if shape else ()
        entry = datafile.Entry(_key(item, start, stop), dtype, stored, (stop - start) * row_bytes)
        pieces.append(_Piece(item, start, stop, dtype, entry))
    return pieces


def _pack(pieces: Iterable[_Piece], max_file_bytes: int) -> list[list[_Piece]]:
    """Consecutive pieces grouped into files of at most ``max_file_bytes`` (bounds are conservative)."""
    files: list[list[_Piece]] = []
    size = header = 0
    for p in pieces:
        bound = datafile.entry_bound(p.entry)
        text = bound - p.entry.nbytes
        if not files or size + bound > max_file_bytes or header + text > datafile.MAX_HEADER_BYTES // 2:
            files.append([])
            size, header = datafile.FILE_OVERHEAD, 0
        files[-1].append(p)
        size, header = size + bound, header + text
    return files


# ----- writing ------------------------------------------------------------------------------
def _resident(source: TensorSource) -> bool:
    """Does reading ``source`` return views of tensors that live in memory anyway (a live
    optimizer's state), rather than fresh allocations (a checkpoint being converted)?"""
    if isinstance(source, RowRange):
        return _resident(source.source)
    return isinstance(source, (EagerSource, LocalPart))


def _write_file(store: Store, name: str, pieces: list[_Piece], durable: bool,
                on_bytes: OnBytes | None) -> tuple[list[PieceRecord], FileRecord]:
    """One data file. Pieces of a state held in memory anyway (a live optimizer's) go to the
    writer in batches of up to ``WRITE_BATCH_BYTES``, one ``write_hashed`` call each (written and
    hashed without the GIL); pieces read from elsewhere (a checkpoint being converted) are written
    every ``READ_BATCH_BYTES``, so a conversion holds at most that plus one piece."""
    prefix, offsets, size = datafile.build_packed([p.entry for p in pieces], FILE_METADATA)
    records = []
    with store.create(name, durable) as out:
        out.write(prefix)
        end, held = len(prefix), 0
        spans: list[tuple[int, int]] = []  # (address, bytes) to append, padding included
        owners: list[torch.Tensor] = []  # what keeps those addresses valid until written
        placed: list[tuple[_Piece, int, int]] = []  # (piece, file offset, index in spans)
        for p, offset in zip(pieces, offsets):
            if offset > end:
                spans.append((_ZEROS_AT, offset - end))
            owners.append(_in_memory(p.item.source.read(p.start, p.stop), p.entry.key, p.entry.shape, p.dtype))
            placed.append((p, offset, len(spans)))
            spans.append((owners[-1].data_ptr(), p.entry.nbytes))
            end, held = offset + p.entry.nbytes, held + p.entry.nbytes
            if held >= WRITE_BATCH_BYTES or (held >= READ_BATCH_BYTES and not _resident(p.item.source)):
                records += _put(out, name, spans, placed, on_bytes)
                spans, owners, placed, held = [], [], [], 0
        records += _put(out, name, spans, placed, on_bytes)
    return records, FileRecord(name, size)


def _put(out: Writer, name: str, spans: list[tuple[int, int]], placed: list[tuple[_Piece, int, int]],
         on_bytes: OnBytes | None) -> list[PieceRecord]:
    """Append ``spans`` to ``out``; the records of the pieces among them."""
    crcs = out.write_hashed(spans) if spans else []
    if on_bytes is not None and placed:
        on_bytes(sum(p.entry.nbytes for p, _, _ in placed))
    return [PieceRecord(p.item.fqn, p.item.field, p.global_rows, name, p.entry.key, offset, p.entry.nbytes, crcs[i])
            for p, offset, i in placed]


def write_pieces(store: Store, stem: str, to_write: Iterable[WriteItem], *, max_file_bytes: int,
                 memory_budget: int, on_bytes: OnBytes | None = None, durable: bool = True,
                 on_file: Callable[[str], None] | None = None) -> tuple[list[PieceRecord], list[FileRecord]]:
    """Write ``to_write`` into new data files ``<stem>-<n>.safetensors``; the pieces' records. Files
    are complete on return, and durable unless ``durable`` is False (then ``store.durable_soon``
    them before committing); ``on_file(name)`` is called as each is completed."""
    if max_file_bytes < MIN_FILE_BYTES:
        raise ValueError(f"max_file_bytes must be at least {MIN_FILE_BYTES}, got {max_file_bytes}")
    if memory_budget <= 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget}")
    pieces = [p for item in to_write for p in _split(item, max_file_bytes, memory_budget // 4)]
    records, files = [], []
    for i, group in enumerate(_pack(pieces, max_file_bytes)):
        recs, file = _write_file(store, f"{stem}-{i:05d}.safetensors", group, durable, on_bytes)
        records += recs
        files.append(file)
        if on_file is not None:
            on_file(file.name)
    return records, files


def new_token() -> str:
    """A fresh name component for one save's files (never reused, so never overwrites)."""
    return secrets.token_hex(8)


def data_stem(token: str, rank: int) -> str:
    return f"data-{token}-r{rank:05d}"


def write_index(store: Store, token: str, rank: int, records: list[PieceRecord], files: list[FileRecord],
                ordinals: dict, durable: bool = True) -> tuple[WriterPin, bytes]:
    """Writer ``rank``'s index of ``records`` (its pieces, in ``files``); its pin and bytes."""
    data = encode_index(rank, index_entries(records, ordinals, [f.name for f in files]))
    name = index_name(token, rank)
    with store.create(name, durable) as out:
        out.write(data)
    return WriterPin(tuple((f.name, f.nbytes) for f in files), name, len(data), checksum.update(0, data)), data


# ----- committing ---------------------------------------------------------------------------
def begin(store: Store, token: str) -> tuple[WriterLock, set[str] | None]:
    """Start a save with ``token``: take the writer lock (``CheckpointLockedError`` if another
    save holds it), remove the files of a save that held it and died, and return the lock and
    the files the committed manifest names now (None if unreadable: then nothing is deleted)."""
    lock = acquire(store, token)
    try:
        previous = mf.committed_files(store)
        if lock.dead_token and previous is not None:
            drop(store, [n for n in store.listing() if n not in previous and _of_save(n, lock.dead_token)])
    except BaseException:
        lock.release()
        raise
    return lock, previous


def _of_save(name: str, token: str) -> bool:
    return name.startswith((f"data-{token}-", f"index-{token}-")) or name == f"{MANIFEST_NAME}.{token}.tmp"


def commit(store: Store, manifest: dict, token: str, *, previous: set[str] | None,
           wait: Callable[[], object] | None = None, indexes: dict[int, bytes] | None = None) -> None:
    """Publish ``manifest`` atomically, then delete the files of ``previous`` it does not name
    (only what this commit made unreferenced). The manifest, and the ``indexes`` (writer -> bytes)
    this process wrote, are validated against the files first: a checkpoint a reader would refuse
    is never committed. ``wait`` (the data files' fsync) runs before publishing. A failed commit
    removes this save's files, unless the new manifest did become visible."""
    try:
        parsed = mf.validate(manifest)
        for writer, data in (indexes or {}).items():
            parsed.indexes.preset(writer, data)
        data = mf.encode(manifest)
        if wait is not None:
            wait()
        mf.check_files(parsed, store.listing(), store.url)
        store.publish(MANIFEST_NAME, data, temp_name=f"{MANIFEST_NAME}.{token}.tmp")
    except BaseException:
        if not _visible(store, token):
            discard(store, token)
        raise
    if previous is not None:
        drop(store, sorted(previous - {f.name for f in (*parsed.files, *parsed.index_files)}))


def _visible(store: Store, token: str) -> bool:
    """Does the committed manifest name this save's files? (True when it cannot be told.)"""
    try:
        named = mf.committed_files(store)
    except Exception:
        return True
    return named is None or any(_of_save(n, token) for n in named)


def drop(store: Store, names: Iterable[str]) -> None:
    for name in names:
        if DATA_FILE.fullmatch(name) or INDEX_FILE.fullmatch(name) or TEMP_MANIFEST.fullmatch(name):
            store.remove(name)


def write_state(state: CanonicalState, store: Store, *, world_size: int | None, max_file_bytes: int,
                memory_budget: int, on_bytes: OnBytes | None = None) -> dict:
    """Write and commit ``state``: canonical layout (``world_size`` None) or ``world_size`` shards,
    all writers in one pass when every part is one piece and every writer one file
    (``many_writers``), else writer by writer."""
    if world_size is not None and (type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE):
        raise ValueError(f"world_size must be None or an int in [1, {MAX_WORLD_SIZE:,}], got {world_size!r}")
    token = new_token()
    ordinals = mf.tensor_order(state)
    plan = many_writers.regular_plan(state, world_size, max_file_bytes=max_file_bytes, memory_budget=memory_budget,
                                     ordinals=ordinals)
    lock, previous = begin(store, token)
    syncing: list[Callable[[], None]] = []  # each file's fsync starts as soon as it is written
    pins, indexes = [], {}

    def sync(name: str) -> None:
        syncing.append(store.durable_soon(name))

    with lock:
        try:
            if plan is not None:
                pins, indexes, durable = many_writers.write(plan, store, token, memory_budget=memory_budget,
                                                            data_stem=lambda rank: data_stem(token, rank),
                                                            on_bytes=on_bytes)
                syncing.append(durable)
            else:
                for rank in range(world_size or 1):
                    recs, fs = write_pieces(store, data_stem(token, rank), items(state, rank, world_size),
                                            max_file_bytes=max_file_bytes, memory_budget=memory_budget,
                                            on_bytes=on_bytes, durable=False, on_file=sync)
                    pin, indexes[rank] = write_index(store, token, rank, recs, fs, ordinals, durable=False)
                    sync(pin.index)
                    pins.append(pin)
            manifest = mf.build(state, splits(state, world_size, plan.writer_of() if plan else None), pins,
                                layout="canonical" if world_size is None else "sharded", world_size=world_size or 1)
        except BaseException:
            _settle(syncing, quiet=True)
            discard(store, token)
            raise
        try:  # the fsyncs run while the manifest is validated and encoded
            commit(store, manifest, token, previous=previous, wait=lambda: _settle(syncing), indexes=indexes)
        finally:
            _settle(syncing, quiet=True)  # whatever commit did not wait for (it failed first)
    return manifest


def splits(state: CanonicalState, world_size: int | None, writers: tuple[int, ...] | None = None) -> dict:
    """Each tensor's split when ``items`` writes ``state``: row-sharded fields ``torch.chunk``
    over ``world_size`` parts, part ``i`` by writer ``writers[i]`` (default ``i``), everything else
    one part by writer 0."""
    whole = (1, (0,))
    spread = (world_size, writers or tuple(range(world_size))) if world_size is not None else whole
    return {(fqn, name): spread if sharded else whole for fqn, name, _, sharded in tensors(state)}


def _settle(waits: list[Callable[[], None]], quiet: bool = False) -> None:
    """Wait for every started fsync (each once); raise the first failure unless ``quiet``."""
    error = None
    while waits:
        try:
            waits.pop(0)()
        except OSError as exc:
            error = error or exc
    if error is not None and not quiet:
        raise error


def discard(store: Store, token: str, rank: int | None = None) -> None:
    """Best-effort removal of the files of a save that failed before its commit (of one rank's)."""
    prefix = (data_stem(token, rank), index_name(token, rank)) if rank is not None else (f"data-{token}-",)
    with suppress(OSError):  # the failure being reported matters more
        drop(store, [n for n in store.listing() if n.startswith(prefix) or (rank is None and _of_save(n, token))])

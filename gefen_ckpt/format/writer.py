"""Streaming writes and the commit protocol, as building blocks a collective save reuses.

A save is: every writer (one process, or each rank in parallel) calls ``write_pieces`` with
its rows of each tensor and gets back ``PieceRecord``s and ``FileRecord``s; one process then
``build``s the manifest from all records and ``commit``s it. Data files get names no earlier
save used (a fresh token per save), so nothing of the previous checkpoint is touched until
the new manifest has atomically replaced the old one; only then is the old data deleted.

Memory: a tensor is written one piece at a time (a piece is at most ``memory_budget // 4``
bytes, read from its source as one row range), so the extra memory of a save is bounded by
the budget whatever the model's size.
"""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gefen_ckpt.canonical import CanonicalState, EagerSource, LocalPart, TensorSource
from gefen_ckpt.format import checksum, datafile
from gefen_ckpt.format.dtypes import dtype_name, itemsize
from gefen_ckpt.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileRecord,
    PieceRecord,
    build,
    check_files,
    encode,
    validate,
)
from gefen_ckpt.storage import Store

DATA_FILE = re.compile(r"data-[0-9a-f]+-r\d+-\d+\.safetensors")
TEMP_MANIFEST = re.compile(re.escape(MANIFEST_NAME) + r"\.[0-9a-f]+\.tmp")
MIN_FILE_BYTES = 1024
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

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.stop - self.start, *self.source.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.stop - self.start if stop is None else stop
        return self.source.read(self.start + start, self.start + stop)


def chunk_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows under ``torch.chunk`` along dim 0 (FSDP2's ``Shard(0)``; may be empty)."""
    size = -(-rows // world_size)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def _source(value) -> TensorSource:
    """A tensor as a source (a cheap check: ``isinstance`` on the Protocol is slow per call)."""
    return EagerSource(value) if isinstance(value, torch.Tensor) else value


def items(state: CanonicalState, rank: int = 0, world_size: int | None = None) -> list[WriteItem]:
    """What ``rank`` writes: whole tensors (``world_size`` None, the canonical layout), or its
    ``torch.chunk`` rows of row-sharded fields plus, on rank 0, one copy of every replicated one."""
    out = [WriteItem(None, key, 0, _source(src)) for key, src in state.global_fields.items() if rank == 0]
    for fqn, entry in state.params.items():
        leaf = state.contract.child(entry.child) if entry.child else state.contract
        for name, src in entry.fields.items():
            src = _source(src)
            if world_size is None or not src.shape or not leaf.field(name).row_sharded:
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
    name = f"__global__/{item.field}" if item.fqn is None else f"{item.fqn}/{item.field}"
    return f"{name}@{item.row_start + start}:{item.row_start + stop}"


def _split(item: WriteItem, max_file_bytes: int, piece_bytes: int) -> list[_Piece]:
    shape, dtype = tuple(item.source.shape), dtype_name(item.source.dtype)
    rows = shape[0] if shape else 1
    row_bytes = itemsize(dtype) * (math.prod(shape[1:]) if shape else 1)
    probe = datafile.Entry(_key(item, rows, rows), dtype, shape, 0)  # the longest key any piece gets
    room = max_file_bytes - datafile.FILE_OVERHEAD - datafile.entry_bound(probe)
    if row_bytes > room:
        raise ValueError(f"one row of {item.fqn or 'global'}/{item.field} ({row_bytes} bytes) does not fit "
                         f"in a data file of max_file_bytes={max_file_bytes}")
    step = max(1, min(room, piece_bytes) // row_bytes) if row_bytes else max(rows, 1)
    if 0 < rows <= step:  # the common case: one piece
        return [_Piece(item, 0, rows, dtype, datafile.Entry(_key(item, 0, rows), dtype, shape, rows * row_bytes))]
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
def _as_bytes(tensor: torch.Tensor, piece: _Piece):
    """The tensor's bytes as a buffer, after checking the source returned what it promised."""
    want = piece.entry.shape
    if tuple(tensor.shape) != tuple(want) or dtype_name(tensor.dtype) != piece.dtype:
        raise ValueError(f"{piece.entry.key}: the source returned {tuple(tensor.shape)} {tensor.dtype}, "
                         f"expected {tuple(want)} {piece.dtype}")
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _resident(source: TensorSource) -> bool:
    """Does reading ``source`` return views of tensors that live in memory anyway (a live
    optimizer's state), rather than fresh allocations (a checkpoint being converted)?"""
    if isinstance(source, RowRange):
        return _resident(source.source)
    return isinstance(source, (EagerSource, LocalPart))


def _write_file(store: Store, name: str, pieces: list[_Piece], durable: bool,
                on_bytes: OnBytes | None) -> tuple[list[PieceRecord], FileRecord]:
    """One data file. Data already in memory is written behind (the copy into the page cache
    overlaps serialising and hashing the next piece: ~1.3x faster saves measured); streamed
    data is written in line, so a conversion holds one piece at a time."""
    prefix, offsets, size = datafile.build([p.entry for p in pieces],
                                           {"format": FORMAT_NAME, "version": ".".join(map(str, FORMAT_VERSION))})
    records = []
    behind = all(_resident(p.item.source) for p in pieces)
    with store.create(name, durable, write_behind=behind) as out:
        out.write(prefix)
        pos = len(prefix)
        for p, offset in zip(pieces, offsets):
            if offset > pos:
                out.write(datafile.padding(offset - pos))
            data = _as_bytes(p.item.source.read(p.start, p.stop), p)
            out.write(data)
            crc = checksum.update(0, data)
            records.append(PieceRecord(p.item.fqn, p.item.field, p.global_rows, name, p.entry.key, offset,
                                       p.entry.nbytes, crc))
            pos = offset + p.entry.nbytes
            if on_bytes is not None:
                on_bytes(p.entry.nbytes)
    return records, FileRecord(name, size)


def write_pieces(store: Store, stem: str, to_write: Iterable[WriteItem], *, max_file_bytes: int,
                 memory_budget: int, on_bytes: OnBytes | None = None, durable: bool = True,
                 on_file: Callable[[str], None] | None = None) -> tuple[list[PieceRecord], list[FileRecord]]:
    """Write ``to_write`` into new data files ``<stem>-<n>.safetensors``; the pieces' records.

    Each file is at most ``max_file_bytes``; each piece at most ``memory_budget // 4`` bytes
    (at least one row). Files are complete when this returns, and durable unless ``durable``
    is False (then ``store.make_durable`` them before committing). ``on_file(name)`` is called
    as each file is completed (to start its fsync while the next one is written).
    """
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


# ----- committing ---------------------------------------------------------------------------
def commit(store: Store, manifest: dict, token: str, *, wait: Callable[[], object] | None = None) -> None:
    """Publish ``manifest`` atomically (the commit point), then delete what it made garbage.

    The manifest is validated against the files first: a checkpoint a reader would refuse is
    never committed. ``wait`` (e.g. the data files' fsync running in the background) is
    called after validation and before publishing.
    """
    parsed = validate(manifest)
    data = encode(manifest)
    if wait is not None:
        wait()
    check_files(parsed, store.listing(), store.url)
    store.publish(MANIFEST_NAME, data, temp_name=f"{MANIFEST_NAME}.{token}.tmp")
    collect_garbage(store, {f.name for f in parsed.files})


def collect_garbage(store: Store, keep: set[str]) -> list[str]:
    """Delete data files and manifest temporaries that ``keep`` (the committed files) does not name:
    the previous checkpoint's data and whatever an interrupted save left behind."""
    removed = [name for name in store.listing()
               if name not in keep and (DATA_FILE.fullmatch(name) or TEMP_MANIFEST.fullmatch(name))]
    for name in removed:
        store.remove(name)
    return removed


def write_state(state: CanonicalState, store: Store, *, world_size: int | None, max_file_bytes: int,
                memory_budget: int, on_bytes: OnBytes | None = None) -> dict:
    """Write and commit ``state``: canonical layout (``world_size`` None) or ``world_size`` shards."""
    if world_size is not None and (type(world_size) is not int or world_size < 1):
        raise ValueError(f"world_size must be a positive int or None, got {world_size!r}")
    store.makedirs()
    token = new_token()
    records, files = [], []
    # each file's fsync starts as soon as it is written, and runs while the manifest is validated
    with ThreadPoolExecutor(1, thread_name_prefix="gefen-ckpt-fsync") as pool:
        syncing = []

        def sync_soon(name: str) -> None:
            syncing.append(pool.submit(store.make_durable, [name]))

        try:
            for rank in range(world_size or 1):
                recs, fs = write_pieces(store, data_stem(token, rank), items(state, rank, world_size),
                                        max_file_bytes=max_file_bytes, memory_budget=memory_budget,
                                        on_bytes=on_bytes, durable=False, on_file=sync_soon)
                records += recs
                files += fs
            manifest = build(state, records, files, layout="canonical" if world_size is None else "sharded",
                             world_size=world_size or 1)
        except BaseException:
            discard(store, token)
            raise
        commit(store, manifest, token, wait=lambda: [f.result() for f in syncing])
    return manifest


def discard(store: Store, token: str) -> None:
    """Best-effort removal of the data files of a save that failed before its commit."""
    for name in store.listing():
        if name.startswith(f"data-{token}-"):
            store.remove(name)

"""Reading a committed checkpoint's tensors: lazy sources and eager staging (the manifest is
read and validated first, by ``manifest.open_checkpoint``).

Nothing is allocated before the manifest is validated and the files are found with their
sizes, so allocations never exceed the files' bytes. A piece is the checksum unit: every read
verifies the whole pieces it overlaps. Lazy reads return memory of their own (a Gefen optimizer
adopts it instead of copying it again); eager staging returns fresh tensors, or for a caller that
copies what it stages, views of a private mapping (``map_files``). Either way a later save or
delete cannot change a tensor already read.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

from gefen_ckpt.errors import CheckpointCorruptError
from gefen_ckpt.io import iostats, native
from gefen_ckpt.io.storage import READ_CHUNK, LocalReader, Prefetch, RangeReader, Store
from gefen_ckpt.state.canonical import CanonicalState, EagerSource
from gefen_ckpt.wire import checksum
from gefen_ckpt.wire.dtypes import NUMPY, itemsize, torch_dtype
from gefen_ckpt.wire.index import SplitTensor
from gefen_ckpt.wire.manifest import (
    Manifest,
    check_files,
    decoded,
    listed_data_files,
    read_manifest_bytes,
    validated,
)
from gefen_ckpt.wire.records import PieceRecord, check_checksum, check_length, hash_chunks

#: Pieces read per ``read_verified`` call when staging (progress is reported between calls).
STAGE_GROUP_BYTES = 64 * 2**20
#: Pieces of a mapped file checksummed per call: small enough to follow a prefetch closely.
HASH_BATCH_BYTES = 4 * 2**20


# ----- pieces -------------------------------------------------------------------------------
def _stored_shape(tensor: SplitTensor, piece: PieceRecord) -> tuple[int, ...]:
    return (piece.rows[1] - piece.rows[0], *tensor.shape[1:]) if tensor.shape else ()


@contextmanager
def _reading(store: Store, name: str) -> Iterator[RangeReader]:
    """``store.reader(name)``, with a file that vanished reported as corruption."""
    try:
        with store.reader(name) as reader:
            yield reader
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{store.path(name)}: data file is missing (deleted, or replaced by a "
                                     "newer save while this checkpoint was being read)") from None


Batch = list[tuple[PieceRecord, SplitTensor, torch.Tensor]]


def read_verified(store: Store, reader: RangeReader, batch: Batch, hasher: ThreadPoolExecutor | None = None) -> None:
    """Read whole pieces of one file into their tensors (contiguous, of the pieces' sizes) and
    verify every checksum before returning. A local file with the accelerated checksum takes one
    C call that hashes each chunk as it is read (GIL released); otherwise pieces are read one by
    one, and large ones hashed in ``hasher`` while the next is read."""
    for piece, t, dst in batch:  # the C path writes through raw addresses: never past a tensor
        if dst.device.type != "cpu" or not dst.is_contiguous() or dst.numel() * dst.element_size() != piece.nbytes:
            raise ValueError(f"{t.label}: destination {tuple(dst.shape)} {dst.dtype} on {dst.device} is not a "
                             f"contiguous {piece.nbytes}-byte CPU buffer")
    if isinstance(reader, LocalReader) and native.io:
        got, crcs = native.read_hashed(reader.fd, [p.offset for p, _, _ in batch], [p.nbytes for p, _, _ in batch],
                                       [dst.data_ptr() for _, _, dst in batch], READ_CHUNK)
        for (piece, t, _), n, crc in zip(batch, got, crcs):
            check_length(store, t, piece, n)
            check_checksum(store, t, piece, crc)
        return
    pending: list[tuple[Future, SplitTensor, PieceRecord]] = []
    for piece, t, dst in batch:
        buffer = memoryview(dst.reshape(-1).view(torch.uint8).numpy())  # writable, over dst's bytes
        check_length(store, t, piece, reader.read_into(piece.offset, buffer))
        if hasher is None or piece.nbytes < checksum.READ_THREAD_MIN_BYTES:
            check_checksum(store, t, piece, checksum.update(0, buffer))
        else:
            pending.append((hasher.submit(checksum.update, 0, buffer), t, piece))
    for future, t, piece in pending:
        check_checksum(store, t, piece, future.result())


def read_piece(store: Store, tensor: SplitTensor, piece: PieceRecord, out: torch.Tensor | None = None) -> torch.Tensor:
    """One whole piece, verified, into ``out`` (contiguous, of the piece's shape) or a new tensor."""
    if out is None:
        out = torch.empty(_stored_shape(tensor, piece), dtype=torch_dtype(tensor.dtype))
    with _reading(store, piece.file) as reader:
        read_verified(store, reader, [(piece, tensor, out)])
    return out


class PieceSource:
    """A stored tensor as a lazy ``TensorSource``: ``read`` fetches and verifies only the pieces
    that overlap the requested rows (from ``mapped`` files when given: see ``MappedFiles``) into
    a tensor of its own, which the caller may keep."""

    def __init__(self, store: Store, tensor: SplitTensor, mapped: MappedFiles | None = None):
        self.store, self.tensor, self.mapped = store, tensor, mapped
        self.shape, self.dtype = tensor.shape, torch_dtype(tensor.dtype)

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        t = self.tensor
        if not t.shape:
            return self.mapped.piece(t, t.pieces[0]).clone() if self.mapped else read_piece(self.store, t, t.pieces[0])
        stop = t.rows if stop is None else stop
        if not 0 <= start <= stop <= t.rows:
            raise IndexError(f"{t.label}: rows [{start}, {stop}) are outside [0, {t.rows})")
        overlapping = []  # reads only the indexes of the writers holding these rows
        for piece in t.pieces_in(start, stop) if stop > start else ():
            overlapping.append((piece, max(start, piece.rows[0]), min(stop, piece.rows[1])))
        if self.mapped is not None:
            views = [self.mapped.piece(t, piece)[lo - piece.rows[0]:hi - piece.rows[0]] for piece, lo, hi in overlapping]
            return torch.cat(views) if views else torch.empty((0, *t.shape[1:]), dtype=self.dtype)
        out = torch.empty((stop - start, *t.shape[1:]), dtype=self.dtype)
        whole: dict[str, Batch] = {}  # whole pieces, by file: one open and one read call per file
        for piece, lo, hi in overlapping:
            dst = out[lo - start:hi - start]
            if (lo, hi) == piece.rows:
                whole.setdefault(piece.file, []).append((piece, t, dst))
            else:
                _PARTIAL.copy_rows(self.store, t, piece, lo, hi, dst)
        for name, batch in whole.items():
            with _reading(self.store, name) as reader:
                read_verified(self.store, reader, batch)
        return out

    def __repr__(self) -> str:
        return f"PieceSource({self.tensor.label}, shape={self.shape}, dtype={self.dtype})"


class _PartialPieces:
    """Whole pieces read for partial reads, kept (least recently used first out, at most
    ``budget`` bytes): a reshard to many ranks reads each source piece once per target rank
    overlapping it, and would otherwise re-read and re-verify it every time."""

    def __init__(self, budget: int):
        self.budget, self.held = budget, 0
        self._pieces: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def copy_rows(self, store: Store, t: SplitTensor, piece: PieceRecord, lo: int, hi: int, dst: torch.Tensor) -> None:
        """Rows ``[lo, hi)`` of ``piece`` into ``dst``, the whole piece verified. A piece too large
        to keep is streamed instead: its rows are copied as it is read and hashed, so a partial read
        of a large piece holds one chunk, not the piece (what keeps a reshard within its budget)."""
        if piece.nbytes > self.budget // 4:
            _stream_rows(store, t, piece, lo, hi, dst)
            return
        key = (store.url, piece.file, piece.offset, piece.nbytes, piece.checksum)
        with self._lock:
            whole = self._pieces.get(key)
            if whole is not None:
                self._pieces.move_to_end(key)
        if whole is None:
            whole = read_piece(store, t, piece)
            with self._lock:
                self._pieces[key] = whole
                self.held += piece.nbytes
                while self.held > self.budget:
                    _, old = self._pieces.popitem(last=False)
                    self.held -= old.numel() * old.element_size()
        dst.copy_(whole[lo - piece.rows[0]:hi - piece.rows[0]])


def _stream_rows(store: Store, t: SplitTensor, piece: PieceRecord, lo: int, hi: int, dst: torch.Tensor) -> None:
    """Read ``piece`` in ``READ_CHUNK``s, hashing each and copying the bytes of rows ``[lo, hi)``
    into ``dst`` (contiguous); the checksum is checked before returning."""
    row_bytes = piece.nbytes // (piece.rows[1] - piece.rows[0])
    want_lo, want_hi = (lo - piece.rows[0]) * row_bytes, (hi - piece.rows[0]) * row_bytes
    out = dst.reshape(-1).view(torch.uint8).numpy()

    def copy(done: int, chunk: memoryview) -> None:
        a, b = max(done, want_lo), min(done + len(chunk), want_hi)
        if a < b:
            out[a - want_lo:b - want_lo] = chunk[a - done:b - done]

    with _reading(store, piece.file) as reader:
        buffer = memoryview(np.empty(min(READ_CHUNK, piece.nbytes), np.uint8))
        crc, got = hash_chunks(reader, piece, buffer, each=copy)
    check_length(store, t, piece, got)
    check_checksum(store, t, piece, crc)


#: 64 MiB: the pieces a reshard of a model's worth of tensors revisits rank after rank
_PARTIAL = _PartialPieces(64 * 2**20)


class MappedFiles:
    """Private (copy-on-write) mappings of a local checkpoint's data files, for lazy reads of row
    ranges (a collective load): a piece is verified once, on first use, and its rows are copied
    straight from the mapping, with no read into a buffer before."""

    def __init__(self, store: Store):
        self.store = store
        self._maps: dict[str, mmap.mmap] = {}
        self._verified: set[tuple[str, int]] = set()

    def piece(self, t: SplitTensor, piece: PieceRecord) -> torch.Tensor:
        if not piece.nbytes:
            return torch.empty(_stored_shape(t, piece), dtype=torch_dtype(t.dtype))
        mapping = self._maps.get(piece.file)
        if mapping is None:
            with _reading(self.store, piece.file) as reader:
                mapping = self._maps[piece.file] = reader.map_private()
        if (piece.file, piece.offset) not in self._verified:
            iostats.count(bytes_read=piece.nbytes, requests=1)  # the checksum pages the piece in
            data = np.frombuffer(mapping, np.uint8)
            check_length(self.store, t, piece, max(0, min(piece.nbytes, data.nbytes - piece.offset)))
            check_checksum(self.store, t, piece, checksum.of_ranges(data, [piece.offset], [piece.nbytes])[0])
            self._verified.add((piece.file, piece.offset))
        return _view(mapping, t, piece)


#: dtypes numpy lacks (``dtypes.NUMPY``) go through an integer of their size and one ``view``
_CARRIER = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _view(mapping, t: SplitTensor, piece: PieceRecord) -> torch.Tensor:
    """A piece as a tensor viewing ``mapping`` (touches no data). Made through numpy: a torch
    operation per piece would release the GIL per piece, which costs a switch interval (5 ms)
    each while another thread of the process runs Python (docs/decisions.md)."""
    shape = _stored_shape(t, piece)
    if not piece.nbytes:
        return torch.empty(shape, dtype=torch_dtype(t.dtype))
    numpy_dtype, size = NUMPY.get(t.dtype), itemsize(t.dtype)
    array = np.frombuffer(mapping, numpy_dtype or _CARRIER[size], count=piece.nbytes // size, offset=piece.offset)
    tensor = torch.from_numpy(array.reshape(shape))
    return tensor if numpy_dtype is not None else tensor.view(torch_dtype(t.dtype))


def _joined(views: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Consecutive row blocks as one tensor: the view itself when there is one."""
    if len(views) == 1:
        return views[0]
    return torch.cat(views) if views else torch.empty(shape, dtype=dtype)


def lazy_state(store: Store, manifest: Manifest, *, map_files: bool = False) -> CanonicalState:
    """A ``CanonicalState`` whose tensors are read from the files on demand; with ``map_files``
    (local stores) copied from private mappings of the files (``MappedFiles``)."""
    mapped = MappedFiles(store) if map_files and _can_map(store) else None
    return manifest.state({k: PieceSource(store, t, mapped) for k, t in manifest.tensors.items()}, torch_dtype)


def _can_map(store: Store) -> bool:
    return store.local and hasattr(mmap, "MAP_PRIVATE")


def stage_state(store: Store, manifest: Manifest, on_bytes: Callable[[int], None] | None = None, *,
                map_files: bool = False, warming: Prefetch | None = None) -> CanonicalState:
    """Every tensor read and verified into memory, file by file in offset order.

    ``map_files`` (local stores): a tensor stored in one piece becomes a verified view of a
    private mapping of its file: for callers that copy what they stage anyway (a Gefen
    optimizer's load) it saves a copy; a caller that keeps the tensors must not ask for it.
    ``warming``: a ``Store.prefetch`` of the data files, waited for before each read."""
    by_file: dict[str, list[tuple[PieceRecord, SplitTensor, str]]] = {}
    for key, t in manifest.tensors.items():
        for piece in t.pieces:
            by_file.setdefault(piece.file, []).append((piece, t, key))
    stage = _stage_mapped if map_files and _can_map(store) else _stage_read
    tensors = stage(store, manifest, {name: sorted(by_file[name], key=lambda x: x[0].offset) for name in sorted(by_file)},
                    on_bytes or (lambda n: None), warming.wait if warming is not None else (lambda path, end: None))
    return manifest.state({k: EagerSource(v) for k, v in tensors.items()}, torch_dtype)


def stage_checkpoint(store: Store, check: Callable[[Manifest], None] | None = None, *, map_files: bool = False,
                     on_bytes: Callable[[int], None] | None = None) -> CanonicalState:
    """``open_checkpoint``, then ``check(manifest)`` (a refusal before any data is read), then
    ``stage_state``; the data files start loading into the page cache (``Store.prefetch``) as
    soon as the manifest is decoded, so the disk works while the manifest is validated."""
    listing = store.listing()
    raw = decoded(store, read_manifest_bytes(store, listing))
    warming = store.prefetch(listed_data_files(raw, listing))
    try:
        manifest = validated(store, raw)
        check_files(manifest, listing, store.url)
        if check is not None:
            check(manifest)
        return stage_state(store, manifest, on_bytes, map_files=map_files, warming=warming)
    finally:
        if warming is not None:
            warming.stop()


Waiter = Callable[[str, int], None]


def _stage_read(store: Store, manifest: Manifest, by_file: dict, on_bytes: Callable[[int], None], wait: Waiter) -> dict:
    tensors = {k: torch.empty(t.shape, dtype=torch_dtype(t.dtype)) for k, t in manifest.tensors.items()}
    with ThreadPoolExecutor(1, thread_name_prefix="gefen-ckpt-hash") as hasher:
        for name, entries in by_file.items():
            with _reading(store, name) as reader:
                for group in _groups(entries):
                    wait(store.path(name), group[-1][0].offset + group[-1][0].nbytes)
                    batch = [(piece, t, tensors[key] if not t.shape else tensors[key][piece.rows[0]:piece.rows[1]])
                             for piece, t, key in group]
                    read_verified(store, reader, batch, hasher)
                    on_bytes(sum(piece.nbytes for piece, _, _ in group))
    return tensors


def _stage_mapped(store: Store, manifest: Manifest, by_file: dict, on_bytes: Callable[[int], None], wait: Waiter) -> dict:
    pieces: dict[tuple[str, int], torch.Tensor] = {}
    for name, entries in by_file.items():
        with _reading(store, name) as reader:
            mapping = reader.map_private() if any(piece.nbytes for piece, _, _ in entries) else b""
        data, path = np.frombuffer(mapping, np.uint8), store.path(name)
        for piece, t, key in entries:  # views touch no data: made while the prefetch reads
            check_length(store, t, piece, max(0, min(piece.nbytes, data.nbytes - piece.offset)))
            pieces[(key, piece.rows[0])] = _view(mapping, t, piece)
        for batch in _groups(entries, HASH_BATCH_BYTES):
            wait(path, batch[-1][0].offset + batch[-1][0].nbytes)
            crcs = checksum.of_ranges(data, [piece.offset for piece, _, _ in batch], [piece.nbytes for piece, _, _ in batch])
            iostats.count(bytes_read=sum(piece.nbytes for piece, _, _ in batch), requests=1)
            for (piece, t, _), crc in zip(batch, crcs):
                check_checksum(store, t, piece, crc)
            on_bytes(sum(piece.nbytes for piece, _, _ in batch))
    return {key: _joined([pieces[(key, p.rows[0])] for p in t.pieces], t.shape, torch_dtype(t.dtype))
            for key, t in manifest.tensors.items()}


def _groups(batch: list, size_limit: int = STAGE_GROUP_BYTES) -> Iterator[list]:
    """Consecutive runs of about ``size_limit`` bytes."""
    group, size = [], 0
    for entry in batch:
        group.append(entry)
        size += entry[0].nbytes
        if size >= size_limit:
            yield group
            group, size = [], 0
    if group:
        yield group

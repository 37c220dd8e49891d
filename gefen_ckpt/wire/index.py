"""Splits and indexes (docs/format.md): the manifest splits each tensor's rows among writers by a
shared rule (``torch.chunk`` over P parts) or explicit parts; each writer's piece records live in
its own index file, pinned in the manifest by size and CRC-32, so a reader of some rows reads
only the indexes of the writers that hold them."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

import msgpack

from gefen.replicas import ChunkRule
from gefen_ckpt.errors import CheckpointCorruptError, CheckpointFormatError
from gefen_ckpt.wire import checksum
from gefen_ckpt.wire.records import DECODING, PieceRecord, TensorShape, pieces_overlapping, tensor_key
from gefen_ckpt.wire.records import fail as _fail

INDEX_FORMAT = "gefen-ckpt-index"
#: An index is at most this large (a writer's pieces of every tensor: ~20 bytes per piece).
MAX_INDEX_BYTES = 256 * 2**20
_KINDS = ("chunk",)


# ----- splits -------------------------------------------------------------------------------
#: The most writers (ranks) a save or reshard may target: beyond it a world size is refused before
#: anything is planned or written (2**31 would be allocated per rank). ~10x the largest jobs run
#: today; a reader accepts manifests of up to 2**31 writers.
MAX_WORLD_SIZE = 2**20


Rule = ChunkRule  # the format records the replica rule's own object


@dataclass(frozen=True)
class Explicit:
    """Parts listed one by one (sorted, tiling the rows): where no rule describes the split."""

    parts: tuple[tuple[int, int, int], ...]

    def parts_of(self, rows: int, writer: int) -> list[tuple[int, int]]:
        return [(a, b) for a, b, w in self.parts if w == writer]

    def writers_in(self, rows: int, start: int, stop: int) -> set[int]:
        return {w for _, _, w in pieces_overlapping(self.parts, start, stop, itemgetter(0, 1))}


Split = Rule | Explicit


def parse_rules(x, writers: int) -> list[Rule]:
    if not isinstance(x, list):
        _fail("rules", "expected an array")
    out = []
    for i, r in enumerate(x):
        path = f"rules[{i}]"
        if not isinstance(r, dict) or not {"kind", "parts", "writers"} <= r.keys():
            _fail(path, "expected a map with kind, parts and writers (and optionally sub)")
        if r["kind"] not in _KINDS:
            _fail(f"{path}.kind", f"unknown rule {r['kind']!r} (this gefen_ckpt knows {list(_KINDS)})"[:300])
        parts, ws, sub = r["parts"], r["writers"], r.get("sub", 1)
        for key, value in (("parts", parts), ("sub", sub)):
            if type(value) is not int or not 1 <= value <= 2**31:
                _fail(f"{path}.{key}", f"expected a positive integer, got {value!r}"[:200])
        if not isinstance(ws, list) or len(ws) != parts * sub:
            _fail(f"{path}.writers", f"expected {parts * sub} writer indexes, one per part and sub-part (the rule "
                                     "does not tile the rows)")
        if not all(type(w) is int and 0 <= w < writers for w in ws):
            _fail(f"{path}.writers", f"writer indexes must lie in [0, {writers})")
        out.append(Rule(parts, tuple(ws), sub))
    return out


def parse_split(x, path: str, rows: int, rules: Sequence[Rule], writers: int) -> Split:
    """A tensor's ``split`` (``path``: the tensor's): a rule's index, or explicit parts that tile
    ``[0, rows)`` exactly."""
    if type(x) is int and 0 <= x < len(rules):
        return rules[x]
    path += ".split"
    if type(x) is int:
        _fail(path, f"rule {x} does not exist ({len(rules)} rules)")
    if not isinstance(x, list):
        _fail(path, "expected a rule index or a list of [start, stop, writer] parts")
    parts, covered = [], 0
    for i, p in enumerate(x):
        if not (isinstance(p, list) and len(p) == 3 and all(type(v) is int for v in p)):
            _fail(f"{path}[{i}]", "expected [start, stop, writer]")
        a, b, w = p
        if not 0 <= w < writers:
            _fail(f"{path}[{i}]", f"writer {w} does not exist ({writers} writers)")
        if a != covered or not a < b <= rows:
            what = "overlap" if a < covered else "do not tile the rows"
            _fail(f"{path}[{i}]", f"parts {what}: [{a}, {b}) after row {covered} of {rows}")
        covered = b
        parts.append((a, b, w))
    if covered != rows:
        _fail(path, f"rows [{covered}, {rows}) are in no part")
    return Explicit(tuple(parts))


# ----- records --------------------------------------------------------------------------------
class WriterPin(NamedTuple):
    """One writer in the manifest: its data files (name, bytes) and its index (name, bytes, CRC),
    stored flat as ``[index, index_bytes, index_checksum, file, bytes, file, bytes, ...]`` (one
    container per writer: 16,384 writers decode in milliseconds)."""

    files: tuple[tuple[str, int], ...]
    index: str
    index_bytes: int
    index_checksum: int

    def to_raw(self) -> list:
        return [self.index, self.index_bytes, self.index_checksum, *(v for f in self.files for v in f)]

    @classmethod
    def from_raw(cls, raw: list) -> WriterPin:
        return cls(tuple(zip(raw[3::2], raw[4::2])), raw[0], raw[1], raw[2])


class SplitTensor(TensorShape):
    """A tensor of the manifest: its dtype, shape and split, with its pieces found through the
    writers' indexes."""

    __slots__ = ("fqn", "field", "dtype", "shape", "split", "ordinal", "_indexes", "_all")

    def __init__(self, fqn, field, dtype, shape, split: Split, ordinal: int, indexes: IndexSet):
        self.fqn, self.field, self.dtype, self.shape = fqn, field, dtype, shape
        self.split, self.ordinal, self._indexes, self._all = split, ordinal, indexes, None

    def pieces_in(self, start: int, stop: int) -> tuple:
        """The pieces holding rows ``[start, stop)``, sorted; reads (and validates) only the
        indexes of the writers holding those rows (a validated index holds exactly its writer's
        parts of the tensor, so its pieces that overlap the rows are the ones wanted)."""
        if self._all is not None:
            return pieces_overlapping(self._all, start, stop)
        found = []
        for w in self.split.writers_in(self.rows, start, max(stop, start + 1)):
            found += pieces_overlapping(self._indexes.pieces(w, self.ordinal), start, stop)
        found.sort(key=lambda p: p.rows)
        return tuple(found)

    @property
    def pieces(self) -> tuple:
        if self._all is None:
            self._all = self.pieces_in(0, self.rows)
        return self._all

    def __repr__(self) -> str:
        return f"SplitTensor({self.label}, {self.dtype} {list(self.shape)})"


# ----- index files ----------------------------------------------------------------------------
def index_name(token: str, rank: int) -> str:
    return f"index-{token}-r{rank:05d}.msgpack"


def encode_index(writer: int, entries: Sequence[tuple[int, list[list[int]]]]) -> bytes:
    """An index: per tensor ordinal, its pieces ``[start, stop, file, offset, checksum]`` (``file``
    indexes this writer's files; a piece's bytes follow from its rows)."""
    return msgpack.packb({"format": INDEX_FORMAT, "version": [2, 0], "writer": writer,
                          "tensors": [[o, pieces] for o, pieces in entries]}, use_bin_type=True)


def index_entries(records, ordinals: dict, files: Sequence[str]) -> list[tuple[int, list[list[int]]]]:
    """``records`` (``PieceRecord`` s) grouped by tensor ordinal, in ordinal order."""
    position = {name: i for i, name in enumerate(files)}
    grouped: dict[int, list[list[int]]] = {}
    for p in records:
        grouped.setdefault(ordinals[(p.fqn, p.field)], []).append(
            [p.rows[0], p.rows[1], position[p.file], p.offset, p.checksum])
    return sorted(grouped.items())


class IndexSet:
    """The writers' indexes of one checkpoint, each read, verified against its pin in the
    manifest (size and CRC-32, before decoding) and validated against the manifest's splits on
    first use, then cached. Thread-safe (lazy sources may be read from helper threads)."""

    def __init__(self, writers: Sequence[WriterPin], tensors: list, files: dict[str, int]):
        self.writers, self.tensors, self.files = writers, tensors, files
        self.store = None
        self._loaded: dict[int, dict[int, tuple]] = {}
        self._lock = threading.Lock()
        self.reads = 0  # how many indexes were read (what a rank's load planning costs)

    def pieces(self, writer: int, ordinal: int) -> tuple:
        with self._lock:
            loaded = self._loaded.get(writer)
            if loaded is None:
                try:
                    loaded = self._loaded[writer] = self._load(writer)
                except (CheckpointCorruptError, CheckpointFormatError) as exc:
                    loaded = self._loaded[writer] = exc  # refused once, refused every time
        if isinstance(loaded, Exception):
            raise loaded
        return loaded.get(ordinal, ())

    def preset(self, writer: int, data: bytes) -> None:
        """Validate an index this process holds in memory (a writer checking its own before the
        commit) exactly as a reader will."""
        with self._lock:
            self._loaded[writer] = self.parse(writer, data)

    def _load(self, writer: int) -> dict[int, tuple]:
        pin = self.writers[writer]
        if self.store is None:
            raise CheckpointFormatError(f"index {pin.index}: no store to read it from")
        where = self.store.path(pin.index)
        try:
            data = self.store.read(pin.index, 0, pin.index_bytes + 1)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{where}: index of writer {writer} is missing") from None
        self.reads += 1
        return self.parse(writer, data)

    def parse(self, writer: int, data: bytes) -> dict[int, tuple]:
        """ordinal -> sorted ``PieceRecord`` s of one writer's index, after every check."""
        pin = self.writers[writer]
        where = self.store.path(pin.index) if self.store is not None else pin.index
        if len(data) != pin.index_bytes:
            raise CheckpointCorruptError(f"{where}: index of writer {writer} has {len(data)} bytes, the manifest says "
                                         f"{pin.index_bytes} (truncated or replaced)")
        if checksum.update(0, data) != pin.index_checksum:
            raise CheckpointCorruptError(f"{where}: index of writer {writer} does not match its checksum in the "
                                         "manifest: the index is corrupt")

        def bad(message: str):
            raise CheckpointFormatError(f"{where}: {message}"[:500])

        try:
            raw = msgpack.unpackb(data, **DECODING)
        except Exception as exc:
            bad(f"index is not valid msgpack: {type(exc).__name__}: {exc}")
        if not (isinstance(raw, dict) and raw.get("format") == INDEX_FORMAT and raw.get("writer") == writer
                and isinstance(raw.get("tensors"), list)):
            bad(f"not the index of writer {writer}")
        if not (isinstance(raw.get("version"), list) and raw["version"][:1] == [2]):
            bad(f"index version {raw.get('version')!r} is not 2.x")
        files = [(name, self.files[name]) for name, _ in pin.files]
        out: dict[int, tuple] = {}
        spans: list[tuple[int, ...]] = []  # (file, begin, end, ordinal, start row, stop row)
        for entry in raw["tensors"]:
            if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
                    and 0 <= entry[0] < len(self.tensors) and isinstance(entry[1], list)):
                bad("malformed tensor entry")
            ordinal, stored = entry
            if ordinal in out:
                bad(f"tensor {ordinal} is listed twice")
            t = self.tensors[ordinal]
            row_bytes, pieces, rows, nfiles = t.row_bytes, [], t.rows, len(files)
            key = tensor_key(t.fqn, t.field)
            for p in stored:
                if type(p) is not list or len(p) != 5:
                    bad(f"{t.label}: malformed piece {p!r}"[:300])
                start, stop, f, offset, crc = p
                if not (type(start) is type(stop) is type(f) is type(offset) is type(crc) is int
                        and 0 <= start < stop <= rows and 0 <= f < nfiles and offset >= 0 and 0 <= crc < 2**32):
                    bad(f"{t.label}: piece {p!r} is malformed or out of range"[:300])
                name, size = files[f]
                nbytes = (stop - start) * row_bytes
                if offset + nbytes > size:
                    bad(f"{t.label} rows [{start}, {stop}): bytes [{offset}, {offset + nbytes}) lie beyond the end "
                        f"of {name} ({size} bytes)")
                spans.append((f, offset, offset + nbytes, ordinal, start, stop))
                pieces.append(PieceRecord(t.fqn, t.field, (start, stop), name, f"{key}@{start}:{stop}", offset,
                                          nbytes, crc))
            pieces.sort(key=lambda q: q.rows)
            _check_tiles(t, t.split.parts_of(t.rows, writer), pieces, bad, writer)
            out[ordinal] = tuple(pieces)
        for t in self.tensors:  # every part the manifest gives this writer is in its index
            if t.ordinal not in out and t.split.parts_of(t.rows, writer):
                bad(f"{t.label}: the manifest gives writer {writer} rows {t.split.parts_of(t.rows, writer)[:3]}, "
                    "its index has none of them")
        spans.sort()
        for a, b in zip(spans, spans[1:]):
            if a[0] == b[0] and b[1] < a[2]:
                what = [f"{self.tensors[s[3]].label} rows [{s[4]}, {s[5]})" for s in (b, a)]
                bad(f"{what[0]} overlaps {what[1]} in {files[a[0]][0]}")
        return out


def _check_tiles(t, parts: list[tuple[int, int]], pieces: list, bad, writer: int) -> None:
    """The pieces tile exactly the rows the manifest assigns to ``writer`` (no gap, no overlap);
    a piece may span consecutive parts of the writer (their rows are contiguous)."""
    runs: list[list[int]] = []
    for a, b in sorted(parts):
        if runs and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    i = 0
    for a, b in runs:
        covered = a
        while i < len(pieces) and pieces[i].rows[0] < b:
            start, stop = pieces[i].rows
            if start != covered or stop > b:
                what = "overlap" if start < covered else "do not match the manifest's split"
                bad(f"{t.label}: writer {writer}'s pieces {what} (rows [{start}, {stop}), its rows [{a}, {b}))")
            covered = stop
            i += 1
        if covered != b:
            bad(f"{t.label}: writer {writer}'s index is missing rows [{covered}, {b})")
    if i != len(pieces):
        start, stop = pieces[i].rows
        bad(f"{t.label}: rows [{start}, {stop}) in writer {writer}'s index are not its part of the tensor")

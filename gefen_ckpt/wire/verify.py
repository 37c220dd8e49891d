"""Full verification: every checksum, full coverage, and each data file's safetensors header,
reporting every problem (a read stops at the first). Pieces are hashed in bounded chunks; local
files are prefetched into the page cache ahead of the hashing (``Store.prefetch``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gefen_ckpt.errors import CheckpointError
from gefen_ckpt.io.progress import progress_bar
from gefen_ckpt.io.storage import Prefetch, RangeReader, Store
from gefen_ckpt.wire import checksum, datafile
from gefen_ckpt.wire.index import SplitTensor
from gefen_ckpt.wire.manifest import (
    FORMAT_NAME,
    MANIFEST_NAME,
    Manifest,
    parse_manifest,
    read_manifest_bytes,
    total_tensor_bytes,
)
from gefen_ckpt.wire.records import PieceRecord, hash_chunks
from gefen_ckpt.wire.writelock import LOCK_NAME

_CHUNK = 16 * 2**20


@dataclass
class VerifyReport:
    """``ok`` is False when any problem was found; ``warnings`` (e.g. files no manifest
    references, left by an interrupted save) do not make a checkpoint bad."""

    url: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    files_checked: int = 0
    pieces_checked: int = 0
    tensors: int = 0
    bytes_checked: int = 0

    def problem(self, message: str) -> None:
        self.ok = False
        self.problems.append(message)


def _header_problems(store: Store, name: str, size: int, pieces: list[tuple[SplitTensor, PieceRecord]],
                     version: str) -> tuple[list[str], int]:
    """(problems, start of the data section) of a data file's header. It must be exactly what
    ``datafile.packed_prefix`` writes for ``size`` (docs/format.md 5): compared byte by byte, naming
    the first damaged byte (no checksum covers it; a reader never needs it). Then every piece lies
    in the data section, aligned as the writer aligns it (``datafile.piece_alignment``)."""
    metadata, length = {"format": FORMAT_NAME, "version": version}, 0
    for _ in range(4):  # the header's length depends on the digits of the data's: a fixed point
        want = datafile.packed_prefix(max(size - length, 0), metadata)
        if len(want) == length:
            break
        length = len(want)
    have = store.read(name, 0, len(want))
    if have != want or len(want) != length:
        at = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b), min(len(have), len(want)))
        return [f"{store.path(name)}: byte {at} of the header differs from the header the format defines "
                f"(found {have[at:at + 1]!r}, expected {want[at:at + 1]!r}): the header is damaged"], length
    out = []
    for t, p in pieces:
        align = datafile.piece_alignment(datafile.Entry(p.key, t.dtype, (), p.nbytes))
        if p.offset < length or p.offset % align:
            out.append(f"{store.path(name)}: {t.label} rows {list(p.rows)} start at byte {p.offset}, outside the "
                       f"data section or not a multiple of {align}")
    return out, length


def _gap_problems(store: Store, reader: RangeReader, name: str, size: int, data_start: int,
                  pieces: list[tuple[SplitTensor, PieceRecord]]) -> list[str]:
    """The alignment padding of a data file (the bytes of its data section outside every piece)
    is zero, as the format requires: the first non-zero byte is named by its offset."""
    gaps, at = [], data_start
    for _, p in sorted(pieces, key=lambda tp: tp[1].offset):
        if p.offset > at:
            gaps.append((at, p.offset))
        at = max(at, p.offset + p.nbytes)
    if size > at:
        gaps.append((at, size))
    for begin, end in gaps:
        for start in range(begin, end, _CHUNK):
            buf = bytearray(min(_CHUNK, end - start))
            got = reader.read_into(start, memoryview(buf))
            if any(buf[:got]):
                bad = next(i for i, b in enumerate(buf[:got]) if b)
                return [f"{store.path(name)}: byte {start + bad} (padding between pieces) is "
                        f"{buf[bad]:#04x}, not zero as the format requires"]
    return []


def _check_file(store: Store, report: VerifyReport, name: str, expected: int, actual: int | None,
                pieces: list[tuple[SplitTensor, PieceRecord]], manifest: Manifest,
                buffer: memoryview, on_bytes, warming: Prefetch | None) -> None:
    where = store.path(name)
    if actual is None:
        holds = f"(holds {', '.join(sorted({t.label for t, _ in pieces})[:4])})"
        try:
            store.refuse_special(name)
            report.problem(f"{where}: data file is missing {holds}")
        except CheckpointError as exc:
            report.problem(f"{exc} {holds}")
        return
    report.files_checked += 1
    if actual != expected:
        report.problem(f"{where}: {actual} bytes, the manifest says {expected} (truncated or replaced)")
    header, data_start = _header_problems(store, name, actual, pieces, ".".join(map(str, manifest.raw["version"])))
    for message in header:
        report.problem(message)
    wait = (lambda end: warming.wait(where, end)) if warming is not None else (lambda end: None)
    with store.reader(name) as reader:
        if not header and actual == expected:
            for message in _gap_problems(store, reader, name, actual, data_start, pieces):
                report.problem(message)
        for run in _runs(sorted(pieces, key=lambda tp: tp[1].offset), len(buffer)):
            for (t, p), (value, got) in zip(run, _hash_run(reader, run, buffer, wait)):
                report.pieces_checked += 1
                report.bytes_checked += got
                if got != p.nbytes:
                    report.problem(f"{where}: {t.label} rows {list(p.rows)}: only {got} of {p.nbytes} bytes present")
                elif value != p.checksum:
                    report.problem(f"{where}: {t.label} rows {list(p.rows)} (tensor {p.key!r}): checksum mismatch")
            if on_bytes is not None:
                on_bytes(sum(p.nbytes for _, p in run))


def _runs(pieces: list, span: int) -> list[list]:
    """Consecutive pieces (by offset) whose bytes, gaps included, fit one ``span``-byte read; a
    larger piece is a run of its own. A many-rank checkpoint has millions of pieces of a few
    bytes: one read and one checksum call per piece cost more than their data."""
    runs: list[list] = []
    first = None  # offset of the open run's first piece (``pieces`` are sorted by offset)
    for tp in pieces:
        p = tp[1]
        if first is not None and p.offset + p.nbytes - first <= span:
            runs[-1].append(tp)
        else:
            runs.append([tp])
            first = p.offset if p.nbytes <= span else None
    return runs


def _hash_run(reader: RangeReader, run: list, buffer: memoryview, wait: Callable[[int], None]) -> list[tuple[int, int]]:
    """(checksum, bytes read) of each piece of a run, in one read (a lone large piece in chunks)."""
    if len(run) == 1:
        return [hash_chunks(reader, run[0][1], buffer, wait)]
    start = run[0][1].offset
    end = max(p.offset + p.nbytes for _, p in run)
    wait(end)
    view = buffer[:end - start]
    got = reader.read_into(start, view)
    data = np.frombuffer(view, np.uint8)[:got]
    whole = [p.offset + p.nbytes - start <= got for _, p in run]
    crcs = iter(checksum.of_ranges(data, [p.offset - start for (_, p), w in zip(run, whole) if w],
                                   [p.nbytes for (_, p), w in zip(run, whole) if w]))
    return [(next(crcs), p.nbytes) if w else (0, max(0, got - (p.offset - start))) for (_, p), w in zip(run, whole)]


def verify(url: str, progress: bool = False, *, storage_options: dict | None = None) -> VerifyReport:
    """Check every checksum, the coverage of every tensor and every data file's header; all
    problems go into the report (``ok`` False), none is raised. Torch-free."""
    store = Store(url, storage_options)
    report = VerifyReport(store.url)
    try:
        listing = store.listing()
        manifest = parse_manifest(store, read_manifest_bytes(store, listing))
    except CheckpointError as exc:  # includes coverage: validate() proves every row is stored once
        report.problem(str(exc))
        return report
    report.tensors = len(manifest.tensors)
    by_file: dict[str, list[tuple[SplitTensor, PieceRecord]]] = {f.name: [] for f in manifest.files}
    for t in manifest.tensors.values():
        try:  # through the writers' indexes, each verified against its pin and the manifest
            pieces = t.pieces
        except CheckpointError as exc:
            if str(exc) not in report.problems:
                report.problem(str(exc))
            continue
        for p in pieces:
            by_file[p.file].append((t, p))
    buffer = memoryview(bytearray(_CHUNK))
    files = sorted(manifest.files, key=lambda f: f.name)  # the order the prefetch reads them in
    warming = store.prefetch({f.name: listing[f.name] for f in files if f.name in listing})
    try:
        with progress_bar(progress, f"verifying {url}", total_tensor_bytes(manifest)) as on_bytes:
            for f in files:
                _check_file(store, report, f.name, f.nbytes, listing.get(f.name), by_file[f.name], manifest, buffer,
                            on_bytes, warming)
    finally:
        if warming is not None:
            warming.stop()
    for f in manifest.index_files:
        if listing.get(f.name) != f.nbytes and not any(f.name in p for p in report.problems):
            report.problem(f"{store.path(f.name)}: index has {listing.get(f.name)} bytes, the manifest says {f.nbytes}")
    referenced = {f.name for f in (*manifest.files, *manifest.index_files)} | {MANIFEST_NAME, LOCK_NAME}
    for name in sorted(set(listing) - referenced):
        report.warnings.append(f"{store.path(name)}: not part of the checkpoint (left by an interrupted save?)")
    return report

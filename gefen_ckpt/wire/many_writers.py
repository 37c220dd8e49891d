"""A sharded write to many writers in one pass over the state (``writer.write_state``).

Writer by writer, 4,096 writers of a 200-tensor state cost 2.5M pieces' Python objects (minutes
for 18 MB). When every writer's part of every tensor is one piece in one file, the layout is
computed here as arrays: the writer-by-writer path's files byte for byte, except that from
``GROUP_FROM`` parts on consecutive small parts share a writer. Lock and commit stay the caller's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii

import msgpack
import numpy as np
import torch

from gefen_ckpt.state.canonical import CanonicalState, EagerSource, TensorSource
from gefen_ckpt.wire import checksum, datafile
from gefen_ckpt.wire.dtypes import dtype_name, itemsize
from gefen_ckpt.wire.index import WriterPin, encode_index, index_name
from gefen_ckpt.wire.manifest import FILE_METADATA
from gefen_ckpt.wire.records import TensorShape, tensor_key

#: Writers x tensors handled per batch (the arrays of one batch: a few tens of MB).
BATCH_CELLS = 2**20
#: A writer's part of a tensor smaller than this is scattered with one fancy-indexed copy per
#: tensor and batch; a larger one is copied as a slice per writer.
SCATTER_MAX_BYTES = 256
#: Digits of the largest row index a key can hold (a conservative bound on a key's length).
_DIGITS = 20


# ----- the state's tensors, as both write paths take them -----------------------------------
def _source(value) -> TensorSource:
    """A tensor as a source (a cheap check: ``isinstance`` on the Protocol is slow per call)."""
    return EagerSource(value) if isinstance(value, torch.Tensor) else value


def tensors(state: CanonicalState,
            split: bool = True) -> Iterator[tuple[str | None, str, TensorSource, bool]]:
    """Every tensor of ``state`` (globals, then each parameter's fields) as a source, and whether
    a sharded save splits its rows among writers (with ``split``: a row-sharded field with rows)."""
    for key, src in state.global_fields.items():
        yield None, key, _source(src), False
    for fqn, entry in state.params.items():
        leaf = state.contract.leaf(entry.child)
        for name, src in entry.fields.items():
            src = _source(src)
            yield fqn, name, src, split and bool(src.shape) and leaf.field(name).row_sharded


def _in_memory(got: torch.Tensor, key: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """What a source returned for ``key`` as a contiguous CPU tensor, checked to be the promised
    ``shape`` and ``dtype``. A live tensor already is: then only attributes are read, since each
    torch op releases the GIL and may wait a switch interval to get it back (docs/decisions.md)."""
    if tuple(got.shape) != tuple(shape) or dtype_name(got.dtype) != dtype:
        raise ValueError(f"{key}: the source returned {tuple(got.shape)} {got.dtype}, "
                         f"expected {tuple(shape)} {dtype}")
    if got.device.type != "cpu" or not got.is_contiguous():
        got = got.detach().cpu().contiguous()
    return got


@dataclass(frozen=True)
class _Tensor(TensorShape):
    fqn: str | None
    field: str
    source: object
    sharded: bool
    dtype: str
    shape: tuple[int, ...]


def _tensors(state: CanonicalState) -> list[_Tensor]:
    return [_Tensor(fqn, name, src, sharded, dtype_name(src.dtype), tuple(src.shape))
            for fqn, name, src, sharded in tensors(state)]


class WritePlan:
    """Where every writer's part of every tensor lies, when the regular layout applies."""

    def __init__(self, tensors: list[_Tensor], world_size: int, ordinals: dict):
        self.tensors, self.world_size = tensors, world_size
        self.ordinal = np.array([ordinals[(t.fqn, t.field)] for t in tensors], np.int64)
        self.by_ordinal = np.argsort(self.ordinal, kind="stable")
        self.rows = np.array([t.rows for t in tensors], np.int64)
        self.row_bytes = np.array([t.row_bytes for t in tensors], np.int64)
        self.items = np.array([itemsize(t.dtype) for t in tensors], np.int64)
        self.sharded = np.array([t.sharded for t in tensors], bool)
        self.size = -(-self.rows // world_size)
        self.group = 1  # consecutive parts (ranks) per writer: ``choose_group``

    @property
    def writers(self) -> int:
        return -(-self.world_size // self.group)

    def writer_of(self) -> tuple[int, ...]:
        """The writer of each part of a row-sharded tensor (the manifest's rule)."""
        return tuple(r // self.group for r in range(self.world_size))

    def parts(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, stop) rows of each of ``ranks`` (rows) for each tensor (columns)."""
        r = ranks[:, None]
        start = np.where(self.sharded, np.minimum(r * self.size, self.rows), 0)
        stop = np.where(self.sharded, np.minimum(start + self.size, self.rows), np.where(r == 0, self.rows, 0))
        return start, stop

    def writer_rows(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, stop) rows of each writer of ``ranks`` (whole groups, one row each) for each
        tensor: a writer's consecutive parts are contiguous rows, stored as one piece."""
        start, stop = self.parts(ranks)
        if self.group == 1:
            return start, stop
        writer = ranks // self.group
        firsts = np.concatenate([[0], np.nonzero(writer[1:] != writer[:-1])[0] + 1])
        held = stop > start
        a = np.minimum.reduceat(np.where(held, start, np.iinfo(np.int64).max), firsts, axis=0)
        b = np.maximum.reduceat(np.where(held, stop, 0), firsts, axis=0)
        return np.where(b > 0, a, 0), b

    def offsets(self, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(offset in the data section of each piece, data section size) per writer: the pieces in
        tensor order, each at a multiple of ``datafile.piece_alignment``."""
        pos = np.zeros(nbytes.shape[0], np.int64)
        out = np.zeros_like(nbytes)
        align = np.where(nbytes >= datafile.ALIGN_FROM, datafile.ALIGNMENT, self.items)
        for t in range(nbytes.shape[1]):
            n = nbytes[:, t]
            pos = np.where(n > 0, pos + (-pos % align[:, t]), pos)
            out[:, t] = pos
            pos = pos + n
        return out, pos


def regular_plan(state: CanonicalState, world_size: int | None, *, max_file_bytes: int, memory_budget: int,
                 ordinals: dict) -> WritePlan | None:
    """The regular layout of ``state`` over ``world_size`` (> 1) writers, or None when the writer-by-
    writer path would split a part into several pieces or a writer's data into several files
    (checked with upper bounds of ``writer._split``'s and ``writer._pack``'s sizes, so a layout
    returned here is exactly theirs)."""
    tensors = _tensors(state) if (world_size or 1) > 1 else []
    if not tensors or any(t.rows == 0 or t.row_bytes == 0 for t in tensors):
        return None
    plan = WritePlan(tensors, world_size, ordinals)
    name_len = np.array([len(encode_basestring_ascii(tensor_key(t.fqn, t.field))) for t in tensors], np.int64)
    ndim = np.array([len(t.shape) for t in tensors], np.int64)
    text = name_len + 2 + 2 * _DIGITS + datafile._ENTRY_FIXED + datafile._DIM_BOUND * ndim  # header text bound
    bound_extra = text + datafile._PAD_ENTRY_BOUND + 2 * datafile.ALIGNMENT
    room = max_file_bytes - datafile.FILE_OVERHEAD - bound_extra
    most_rows = np.maximum(1, np.minimum(room, memory_budget // 4) // plan.row_bytes)
    biggest = np.where(plan.sharded, plan.size, plan.rows)  # the largest part of each tensor
    if (plan.row_bytes > room).any() or (biggest > most_rows).any():
        return None
    # per writer: FILE_OVERHEAD + sum of its entries' bounds <= max_file_bytes, and the header text bound
    per_rank_rows = _held_rows(plan)
    total = datafile.FILE_OVERHEAD + per_rank_rows @ plan.row_bytes + (per_rank_rows > 0) @ bound_extra
    texts = (per_rank_rows > 0) @ text
    if total.max() > max_file_bytes or texts.max() > datafile.MAX_HEADER_BYTES // 2:
        return None
    plan.group = choose_group(plan, int(total.max()), max_file_bytes, most_rows)
    return plan


#: A writer of small parts takes consecutive parts until its data reaches about this size ...
MIN_WRITER_BYTES = 2**20
#: ... when there are at least this many parts (below, the files are few anyway).
GROUP_FROM = 128


def choose_group(plan: WritePlan, rank_bound: int, max_file_bytes: int, most_rows: np.ndarray) -> int:
    """Parts per writer. Creating a file costs ~1-2 ms on a loaded ext4 (4,096 ranks' files took
    8-16 s, more than their bytes), so consecutive small parts share a writer while its data stays
    under ``MIN_WRITER_BYTES``, its pieces within ``most_rows`` and its file within
    ``max_file_bytes``. Large parts keep one writer each, as a collective save has."""
    if plan.world_size < GROUP_FROM:
        return 1
    per_rank = int((plan.rows * plan.row_bytes).sum()) // plan.world_size + 1
    fits = (max_file_bytes - datafile.FILE_OVERHEAD) // max(1, rank_bound - datafile.FILE_OVERHEAD)
    piece_fits = (most_rows // plan.size)[plan.sharded].min(initial=plan.world_size)
    return int(max(1, min(MIN_WRITER_BYTES // per_rank, fits, piece_fits, plan.world_size)))


def _held_rows(plan: WritePlan) -> np.ndarray:
    """Rows each writer holds of each tensor, for the two kinds of writer rows that occur: the
    bounds use the largest (a full part), so one row per distinct part suffices."""
    full = np.where(plan.sharded, plan.size, 0)
    first = np.where(plan.sharded, plan.size, plan.rows)  # writer 0 also holds the replicated tensors
    return np.stack([np.minimum(first, plan.rows), np.minimum(full, plan.rows)])


def write(plan: WritePlan, store, token: str, *, memory_budget: int, data_stem: Callable[[int], str],
          on_bytes: Callable[[int], None] | None) -> tuple[list[WriterPin], dict[int, bytes], Callable[[], None]]:
    """Write every writer's data file and index; their pins, the indexes of the first, middle and
    last writers (for the commit to validate as a reader does: the others are checked here as
    arrays, see ``_check``), and a wait for all the files to be durable (``Store.durable_many``)."""
    per_rank = max(1, int((plan.rows * plan.row_bytes).sum() // plan.world_size))
    step = max(1, min(BATCH_CELLS // len(plan.tensors), (memory_budget // 2) // per_rank) // plan.group) * plan.group
    pins: list[WriterPin] = []
    sample: dict[int, bytes] = {}
    covered = np.zeros(len(plan.tensors), np.int64)  # rows of each tensor written so far, in rank order
    names: list[str] = []
    for r0 in range(0, plan.world_size, step):
        ranks = np.arange(r0, min(plan.world_size, r0 + step), dtype=np.int64)
        pins += _write_batch(plan, store, token, ranks, data_stem, on_bytes, sample, covered, names)
    if not np.array_equal(covered, plan.rows):
        raise AssertionError("the many-writer layout does not cover every tensor's rows (a gefen_ckpt bug)")
    return pins, sample, store.durable_many(names)


def _write_batch(plan: WritePlan, store, token, ranks, data_stem, on_bytes, sample, covered, names) -> list[WriterPin]:
    """The writers of ``ranks`` (whole groups): each writer's data section is its piece of each
    tensor (the rows of its consecutive parts), in tensor order."""
    start, stop = plan.writer_rows(ranks)
    nbytes = (stop - start) * plan.row_bytes
    rel, data_size = plan.offsets(nbytes)
    first_writer = int(ranks[0]) // plan.group
    count = nbytes.shape[0]
    prefixes = [datafile.packed_prefix(int(n), FILE_METADATA) for n in data_size.tolist()]
    head = np.array([len(p) for p in prefixes], np.int64)
    file_size = head + data_size
    base = np.concatenate([[0], np.cumsum(file_size)[:-1]])
    buffer = np.zeros(int(file_size.sum()), np.uint8)
    offset = head[:, None] + rel  # each piece's offset in its writer's file
    at = base[:, None] + offset
    for i, prefix in enumerate(prefixes):
        buffer[base[i]:base[i] + len(prefix)] = np.frombuffer(prefix, np.uint8)
    for t, tensor in enumerate(plan.tensors):
        held = np.nonzero(nbytes[:, t])[0]
        if not len(held):
            continue
        a, b = int(start[held[0], t]), int(stop[held[-1], t])
        data = _bytes(tensor, a, b)
        src = (start[held, t] - a) * tensor.row_bytes
        _scatter(buffer, at[held, t], data, src, nbytes[held, t])
        if on_bytes is not None:
            on_bytes(int(nbytes[held, t].sum()))
    present = nbytes > 0
    _check(start, stop, present, rel, nbytes, data_size, covered)
    crcs = np.zeros(nbytes.shape, np.int64)
    crcs[present] = checksum.of_ranges(buffer, at[present].tolist(), nbytes[present].tolist())
    has_data = present.any(axis=1)  # a writer of no rows writes no data file
    data_names = [f"{data_stem(first_writer + i)}-00000.safetensors" for i in range(count)]
    store.write_files([(data_names[i], memoryview(buffer)[base[i]:base[i] + file_size[i]])
                       for i in np.nonzero(has_data)[0].tolist()])
    names += [data_names[i] for i in np.nonzero(has_data)[0].tolist()]
    # the index: an entry per (writer, tensor), in ordinal order, each of one piece
    order = plan.by_ordinal
    keep = present[:, order]  # row-major: writer by writer
    columns = [np.broadcast_to(plan.ordinal[order], keep.shape)[keep]] + [c[:, order][keep]
                                                                          for c in (start, stop, offset, crcs)]
    body, ends = _index_records(columns)
    entries = keep.sum(axis=1)
    bounds = np.concatenate([[0], ends])[np.concatenate([[0], np.cumsum(entries)])]  # each writer's bytes
    pins, files = [], []
    for i in range(count):
        wid = first_writer + i
        data = _index_head(wid, int(entries[i])) + body[bounds[i]:bounds[i + 1]].tobytes()
        iname = index_name(token, wid)
        files.append((iname, memoryview(data)))
        pins.append(WriterPin(((data_names[i], int(file_size[i])),) if has_data[i] else (), iname, len(data),
                              checksum.update(0, data)))
        if wid in (0, plan.writers // 2, plan.writers - 1):
            sample[wid] = data
    store.write_files(files)
    names += [f for f, _ in files]
    return pins


def _index_head(writer: int, entries: int) -> bytes:
    """``index.encode_index``'s bytes up to the items of its ``tensors`` array (its last key)."""
    return encode_index(writer, [])[:-1] + msgpack.Packer().pack_array_header(entries)


#: msgpack's unsigned integer encodings, smallest first: (largest value, marker byte or -1 for a
#: positive fixint, bytes of the value)
_UINTS = ((127, -1, 1), (2**8 - 1, 0xCC, 1), (2**16 - 1, 0xCD, 2), (2**32 - 1, 0xCE, 4), (2**64 - 1, 0xCF, 8))


def _width(v: np.ndarray) -> np.ndarray:
    w = np.full(v.shape, 9, np.int64)
    for top, marker, size in reversed(_UINTS):
        w[v <= top] = size + (marker >= 0)
    return w


def _index_records(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The msgpack bytes of index entries of one piece each, ``[ordinal, [[start, stop, 0, offset,
    checksum]]]``, laid end to end exactly as msgpack packs them (each integer in its smallest
    encoding); and each entry's end. ``columns``: ordinal, start, stop, offset, checksum."""
    values = [np.asarray(c, np.int64).astype(np.uint64) for c in columns]
    n = len(values[0])
    byte = lambda b: ("b", np.full(n, b, np.uint64))  # noqa: E731
    # "b" one byte, "v" one msgpack unsigned integer
    items = [byte(0x92), ("v", values[0]), byte(0x91), byte(0x95), ("v", values[1]), ("v", values[2]), byte(0),
             ("v", values[3]), ("v", values[4])]
    widths = [np.ones(n, np.int64) if kind == "b" else _width(v) for kind, v in items]
    length = sum(widths)
    ends = np.cumsum(length)
    out = np.zeros(int(ends[-1]) if n else 0, np.uint8)
    cursor = ends - length
    for (kind, v), w in zip(items, widths):
        if kind == "b":
            out[cursor] = v.astype(np.uint8)
        else:
            for _, marker, size in _UINTS:
                sel = w == size + (marker >= 0)
                if not sel.any():
                    continue
                at, x = cursor[sel], v[sel]
                if marker < 0:
                    out[at] = x.astype(np.uint8)
                    continue
                out[at] = marker
                out[at[:, None] + 1 + np.arange(size)] = x.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - size:]
        cursor += w
    return out, ends


def _bytes(tensor: _Tensor, a: int, b: int) -> np.ndarray:
    """Rows ``[a, b)`` of a tensor's source as bytes, after checking it returned what it promised."""
    got = tensor.source.read(a, b) if tensor.shape else tensor.source.read()
    want = (b - a, *tensor.shape[1:]) if tensor.shape else ()
    got = _in_memory(got, f"{tensor_key(tensor.fqn, tensor.field)}@{a}:{b}", want, tensor.dtype)
    got = got.detach().reshape(-1)
    return got.view(torch.uint8).numpy() if got.numel() else np.zeros(0, np.uint8)


def _scatter(buffer: np.ndarray, at: np.ndarray, data: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
    """``buffer[at[i]:at[i] + nbytes[i]] = data[src[i]:src[i] + nbytes[i]]`` for every i."""
    big = nbytes > SCATTER_MAX_BYTES
    for i in np.nonzero(big)[0].tolist():
        buffer[at[i]:at[i] + nbytes[i]] = data[src[i]:src[i] + nbytes[i]]
    small = ~big
    for n in np.unique(nbytes[small]).tolist():  # a few distinct sizes: full parts and a short last one
        sel = small & (nbytes == n)
        lanes = np.arange(n, dtype=np.int64)
        buffer[at[sel][:, None] + lanes] = data[src[sel][:, None] + lanes]


def _check(start, stop, present, rel, nbytes, data_size, covered) -> None:
    """What a reader checks of each index, as arrays: taken writer after writer, each tensor's
    pieces follow one another from row 0 (so, with the end check in ``write``, they tile its rows
    exactly once); a writer's pieces lie one after another inside its data section."""
    lengths = np.where(present, stop - start, 0)
    expected = covered + np.cumsum(lengths, axis=0) - lengths  # where each piece must start
    ends = rel + nbytes
    prev_end = np.maximum.accumulate(np.where(present, ends, 0), axis=1)
    ok = (np.array_equal(start[present], expected[present]) and bool((ends <= data_size[:, None]).all())
          and bool((rel >= 0).all()) and bool(np.where(present[:, 1:], rel[:, 1:] >= prev_end[:, :-1], True).all()))
    if not ok:
        raise AssertionError("the many-writer layout does not tile the tensors' rows (a gefen_ckpt bug)")
    covered += lengths.sum(axis=0)

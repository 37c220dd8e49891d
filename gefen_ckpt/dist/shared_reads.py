"""Read-once loads: rows that several ranks hold are read from storage by one of them and sent
to the others over the process group.

Who reads what is ``gefen.replicas.assign`` over the *live* layout (the rule a save writes by, so
the reading is as balanced as the writing), whatever layout wrote the checkpoint. Each reader
verifies the pieces it reads (their CRC-32s, as any load), every message carries the CRC-32 of
its bytes and is checked on arrival, and the rows land in this rank's staging tensors: nothing
reaches the optimizer before every rank has agreed that everything arrived intact.
"""

from __future__ import annotations

import math
import struct
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from gefen.geometry import rows_and_row_numel
from gefen.replicas import Holders, chunk_rows
from gefen_ckpt.dist import collective, placement
from gefen_ckpt.dist.optimizer_state import live_params
from gefen_ckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointTimeoutError
from gefen_ckpt.io import iostats
from gefen_ckpt.state.canonical import CanonicalState, LocalPart
from gefen_ckpt.wire import checksum

Key = tuple  # (fqn or None, field)


@dataclass(frozen=True)
class Span:
    """Rows ``[start, stop)`` of tensor ``key``, read by rank ``reader`` for ranks ``to``."""

    key: Key
    start: int
    stop: int
    reader: int
    to: tuple[int, ...]
    piece: tuple[int, int]  # the stored piece's rows, which ``reader`` reads whole
    order: tuple  # (tensor, piece, column): the one order every rank sends and receives in


@dataclass
class Held:
    """This rank's rows ``[start, stop)`` of a tensor and the ranks holding it (None: no rule)."""

    holders: Holders | None
    start: int
    stop: int


def held_rows(optimizer, state: CanonicalState, model=None) -> dict[Key, Held]:
    """For each tensor of ``state``: the rows this rank loads and who else holds them, from the
    live parameters (``placement``: the save's own view of the layout)."""
    out = {(None, key): Held(placement.every_rank(), 0, rows_and_row_numel(src.shape)[0])
           for key, src in state.global_fields.items()}
    for _, leaf, _, fqn, p in live_params(optimizer, model):
        entry = state.params.get(fqn)
        for name, src in (entry.fields.items() if entry is not None else ()):
            sharded = leaf.field(name).row_sharded and bool(src.shape)
            start, stop = placement.local_rows(p, fqn) if sharded else (0, rows_and_row_numel(src.shape)[0])
            out[(fqn, name)] = Held(placement.holders(p, sharded), start, stop)
    return out


def plan_spans(state: CanonicalState, held: dict[Key, Held]) -> list[Span]:
    """Who reads each stored piece this rank needs, and which of its rows go to which ranks; in
    one global order (every rank derives its share of the same list).

    A piece is read whole (its CRC-32 covers all of it) by one rank needing it: where every
    column of holders needs it (every rank of the grid knows it), by a greedy that spreads them
    (largest first, to the least-loaded rank); where it lies in one part of the live rule, by that
    part's rank (a checkpoint written by this layout: the save's own balance); otherwise by a
    fixed choice among the ranks needing it."""
    keys = [k for k in held if held[k].holders is not None]
    sources = {k: _source(state, k) for k in keys}
    rules = placement.replica_rules(sources, {k: held[k].holders for k in keys})
    spans: list[Span] = []
    everywhere: dict[int, list] = {}  # id(holders) -> (-bytes, ordinal, key, piece rows, columns)
    for ordinal, key in enumerate(keys):
        h, rule = held[key], rules[key]
        grid, rows = h.holders.grid, rows_and_row_numel(sources[key].shape)[0]
        size = -(-rows // h.holders.shards) if rows else 1
        shards_used = -(-rows // size) if rows else 0
        for a, b, nbytes in _pieces(sources[key], rule, rows, h):
            columns = range(a // size, -(-b // size))
            if len(columns) == shards_used == h.holders.shards:
                everywhere.setdefault(id(h.holders), []).append((-nbytes, ordinal, key, a, b, columns))
                continue
            owners = rule.writers_in(rows, a, b)
            needers = sorted(int(r) for c in columns for r in grid[:, c])
            reader = owners.pop() if len(owners) == 1 else needers[(ordinal * 1_000_003 + a) % len(needers)]
            spans += _to_columns(ordinal, key, a, b, reader, columns, grid, size, rows)
    for group in everywhere.values():
        group.sort(key=lambda x: x[:2] + (x[3],))
        ranks = held[group[0][2]].holders.grid.reshape(-1).tolist()
        load = dict.fromkeys(ranks, 0)
        for minus_bytes, ordinal, key, a, b, columns in group:
            grid = held[key].holders.grid
            reader = min(ranks, key=lambda r: (load[r], r))
            load[reader] -= minus_bytes
            rows = rows_and_row_numel(sources[key].shape)[0]
            spans += _to_columns(ordinal, key, a, b, reader, columns, grid, -(-rows // held[key].holders.shards), rows)
    spans.sort(key=lambda span: span.order)
    return spans


def _pieces(source, rule, rows: int, held: Held) -> list[tuple[int, int, int]]:
    """``(start, stop, bytes)`` of the stored pieces overlapping this rank's rows (a source that
    is not a checkpoint's: the rule's parts)."""
    record = getattr(source, "tensor", None)
    if hasattr(record, "pieces_in"):
        found = record.pieces if not record.shape else record.pieces_in(held.start, held.stop)
        return [(p.rows[0], p.rows[1], p.nbytes) if record.shape else (0, 1, p.nbytes) for p in found]
    row_bytes = placement.rows_and_bytes(source)[1]
    return sorted((a, b, (b - a) * row_bytes) for w in rule.writers_in(rows, held.start, held.stop)
                  for a, b in rule.parts_of(rows, w) if a < held.stop and b > held.start)


def _to_columns(ordinal: int, key: Key, a: int, b: int, reader: int, columns, grid, size: int, rows: int) -> list:
    """The spans of piece ``[a, b)``: each column's rows of it, for that column's ranks."""
    out = []
    for c in columns:
        lo, hi = max(a, c * size), min(b, (c + 1) * size, rows)
        to = tuple(int(r) for r in grid[:, c] if r != reader)
        out.append(Span(key, lo, hi, reader, to, (a, b), (ordinal, a, c)))
    return out


def _source(state: CanonicalState, key: Key):
    return state.global_fields[key[1]] if key[0] is None else state.params[key[0]].fields[key[1]]


def _check_held(held: dict[Key, Held], state: CanonicalState, rank: int) -> None:
    """This rank's rows are its column's ``torch.chunk`` part (what the rule assumes)."""
    for key, h in held.items():
        if h.holders is None:
            continue
        where = np.argwhere(h.holders.grid == rank)
        rows = rows_and_row_numel(_source(state, key).shape)[0]
        want = chunk_rows(rows, h.holders.shards, int(where[0][1])) if len(where) else None
        if want != (h.start, h.stop):
            raise CheckpointError(f"{key[0] or 'global'}/{key[1]}: rank {rank} holds rows [{h.start}, {h.stop}), "
                                  f"the replica rule expects {want}: a layout read-once loads cannot describe")


def share_reads(optimizer, state: CanonicalState, url: str, *, model=None, budget: int) -> CanonicalState:
    """``state`` (lazy, from the checkpoint) with every shared tensor replaced by this rank's rows
    in memory: read once among their holders and exchanged. Raises on every rank together."""
    import torch.distributed as dist

    rank, error = dist.get_rank(), None
    staged: dict[Key, torch.Tensor] = {}
    outgoing: dict[Span, torch.Tensor] = {}  # the rows this rank read for others
    spans: list[Span] = []
    held: dict[Key, Held] = {}
    try:
        held = held_rows(optimizer, state, model)
        _check_held(held, state, rank)
        spans = plan_spans(state, held)
        for key, h in held.items():
            if h.holders is not None:
                src = _source(state, key)
                staged[key] = torch.empty((h.stop - h.start, *src.shape[1:]) if src.shape else (), dtype=src.dtype)
        read: dict[tuple, torch.Tensor] = {}
        for span in spans:
            if span.reader == rank:
                if (span.key, span.piece) not in read:
                    a, b = span.piece
                    read[span.key, span.piece] = _source(state, span.key).read(a, b)
                rows = read[span.key, span.piece]
                if held[span.key].start <= span.start and span.stop <= held[span.key].stop:  # its own column
                    _rows_of(staged[span.key], held[span.key], span).copy_(
                        rows if not rows.dim() else rows[span.start - span.piece[0]:span.stop - span.piece[0]])
                outgoing[span] = rows if not rows.dim() else rows[span.start - span.piece[0]:span.stop - span.piece[0]]
    except Exception as exc:
        error = exc
    collective.agree(error, f"reading {url}")
    error = None
    try:
        _exchange(spans, staged, outgoing, held, rank, budget, url)
    except Exception as exc:
        error = exc
    collective.agree_in_store(error, f"sharing the rows of {url}")  # a timed-out transfer closes gloo pairs

    by_name = {key[1] if key[0] is None else f"{key[0]}/{key[1]}": key for key in staged}  # tensors()' names

    def source(name: str, src):
        if (key := by_name.get(name)) is None:
            return src
        return LocalPart(staged[key], held[key].start, src.shape, False, held[key].holders)

    return state.with_sources(source)


def _rows_of(tensor: torch.Tensor, held: Held, span: Span) -> torch.Tensor:
    return tensor if tensor.dim() == 0 else tensor[span.start - held.start:span.stop - held.start]


# ----- the exchange ---------------------------------------------------------------------------
_TRAILER = 8  # a message's last bytes: the CRC-32 of the ones before it (little-endian, padded)


def _batches(spans: list[Span], sizes: dict[Key, int], budget: int) -> list[list[Span]]:
    """One sender's spans to one set of receivers, in messages of about ``budget`` bytes (a span
    larger than that travels alone)."""
    out, current, size = [], [], 0
    for span in spans:
        n = (span.stop - span.start) * sizes[span.key]
        if current and size + n > budget:
            out.append(current)
            current, size = [], 0
        current.append(span)
        size += n
    if current:
        out.append(current)
    return out


def _exchange(spans: list[Span], staged: dict, outgoing: dict, held: dict, rank: int, budget: int, url: str) -> None:
    """Every span goes from its reader to the other ranks holding its rows, in messages of about
    ``budget`` bytes per route (reader, receivers), one message in flight per rank; rows are
    copied into place once their CRC-32 matched."""
    import torch.distributed as dist

    sizes = {key: t.element_size() * math.prod(t.shape[1:]) for key, t in staged.items()}  # bytes per row
    by_route: dict[tuple[int, tuple[int, ...]], list[Span]] = {}
    for span in spans:
        if span.to:
            by_route.setdefault((span.reader, span.to), []).append(span)
    # the messages this rank takes part in, in the order of their first span: every rank waits
    # for its messages in that one order, so the earliest pending message always completes
    messages = sorted(((batch[0].order, reader, to, batch) for (reader, to), route in by_route.items()
                       if reader == rank or rank in to for batch in _batches(route, sizes, budget)),
                      key=lambda m: m[0])
    timeout = collective.current_timeout()
    dev = collective.device()  # NCCL moves CUDA tensors; the bytes are checked on the host either way
    corrupt, sequence = None, {}  # (src, dst) -> messages so far: the tag both ends count alike
    for _, reader, to, batch in messages:
        nbytes = sum((s.stop - s.start) * sizes[s.key] for s in batch)
        pairs = [(reader, dst) for dst in to] if reader == rank else [(reader, rank)]
        tags = [sequence.get(pair, 0) for pair in pairs]
        for pair in pairs:
            sequence[pair] = sequence.get(pair, 0) + 1
        if reader == rank:
            payload = torch.cat([outgoing[s].reshape(-1).view(torch.uint8) for s in batch]
                                + [torch.zeros(_TRAILER, dtype=torch.uint8)])
            crc = checksum.update(0, payload[:nbytes].numpy())
            payload[nbytes:nbytes + 4] = torch.frombuffer(bytearray(struct.pack("<I", crc)), dtype=torch.uint8)
            wire, works = payload.to(dev), []
            for dst, tag in zip(to, tags):
                with _naming_peer(f"sending rows of {url} to rank {dst}"):
                    works.append((dst, dist.isend(wire, dst, tag=tag % 2**30)))
            for dst, work in works:
                _wait(work, timeout, f"sending rows of {url} to rank {dst}")
            iostats.count(bytes_sent=payload.numel() * len(to))
        else:
            wire = torch.empty(nbytes + _TRAILER, dtype=torch.uint8, device=dev)
            what = f"receiving rows of {url} from rank {reader}"
            with _naming_peer(what):
                work = dist.irecv(wire, reader, tag=tags[0] % 2**30)
            _wait(work, timeout, what)
            payload = wire.cpu()
            iostats.count(bytes_received=payload.numel())
            (crc,) = struct.unpack("<I", payload[nbytes:nbytes + 4].numpy().tobytes())
            if crc != checksum.update(0, payload[:nbytes].numpy()):
                first = batch[0]
                corrupt = corrupt or CheckpointCorruptError(
                    f"{url}: rows [{first.start}, {first.stop}) of {first.key[0] or 'global'}/{first.key[1]} (and "
                    f"{len(batch) - 1} more spans) arrived from rank {reader} with a CRC-32 that does not match "
                    "their bytes (corrupted in transit)")
                continue
            offset = 0
            for s in batch:
                out = _rows_of(staged[s.key], held[s.key], s)
                n = out.numel() * out.element_size()
                out.reshape(-1).view(torch.uint8).copy_(payload[offset:offset + n])
                offset += n
    if corrupt is not None:
        raise corrupt


def _wait(work, seconds: float, what: str) -> None:
    collective.wait_for(work, seconds, f"{what}: no transfer within {seconds:g} s (stalled or dead)",
                        f"{what}: the transfer failed; nothing was changed")


@contextmanager
def _naming_peer(what: str):
    """A send or receive that fails in the backend names ``what`` (the peer), like a timeout."""
    try:
        yield
    except CheckpointError:
        raise
    except RuntimeError as exc:  # gloo's timeout, or a connection the peer closed
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointTimeoutError(f"{what}: the transfer failed ({first[:200]}); nothing was changed") from exc

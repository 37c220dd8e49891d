"""Which rank acts for which rows of replicated state: one rule, derived alike on every rank.

A tensor's holders form a grid: its rows are ``torch.chunk``-split over ``S`` shards (FSDP2
``Shard(0)``; one shard when nothing splits rows) and each shard is held by ``R`` replicas (DDP:
every rank; HSDP: the replicate dimension). ``assign`` gives every row exactly one rank among its
holders, spreading the bytes over all of them: a tensor whose shard is more than
``1 / SPLIT_SHARE`` of a rank's fair share is split by rows among its replicas (each shard
``torch.chunk``-split again over ``R``); smaller tensors go whole, largest first, to the replica
whose busiest rank is least loaded so far (so no rank gets many tiny pieces). The result depends
only on the shapes and grids, so every rank computes the same one without exchanging a plan; a
save writes by it and a load reads by it. Torch-free: offline tools plan with it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: A tensor is split among its replicas when one shard of it exceeds this fraction of the mean
#: bytes per rank: whole tensors below it then unbalance a rank by at most 1/16 of the mean.
SPLIT_SHARE = 16


class Holders:
    """The ranks holding a tensor: ``grid[r, s]`` is replica ``r``'s rank for shard ``s``."""

    __slots__ = ("grid",)

    def __init__(self, grid):
        grid = np.asarray(grid, dtype=np.int64)
        if grid.ndim != 2 or grid.size == 0 or len(np.unique(grid)) != grid.size or grid.min() < 0:
            raise ValueError(f"a holder grid is R x S distinct ranks, got {grid.tolist()!r}"[:300])
        self.grid = grid

    @classmethod
    def replicated(cls, ranks: Sequence[int]) -> Holders:
        """Every rank of ``ranks`` holds every row."""
        return cls(np.asarray(ranks, dtype=np.int64).reshape(-1, 1))

    @property
    def replicas(self) -> int:
        return self.grid.shape[0]

    @property
    def shards(self) -> int:
        return self.grid.shape[1]

    def __repr__(self) -> str:
        return f"Holders({self.replicas} replicas x {self.shards} shards)"


@dataclass(frozen=True)
class ChunkRule:
    """Rows ``torch.chunk``-split over ``parts``, each part split again over ``sub`` (replicas
    sharing a shard's rows); sub-part ``j`` of part ``i`` held by ``writers[i * sub + j]``: what
    ``assign`` decides and how a manifest records it (docs/format.md, "the chunk rule")."""

    parts: int
    writers: tuple[int, ...]
    sub: int = 1

    def __post_init__(self):
        positions: dict[int, list[int]] = {}
        for i, w in enumerate(self.writers):
            positions.setdefault(w, []).append(i)
        object.__setattr__(self, "_positions", positions)
        object.__setattr__(self, "_parts", {})  # (rows, writer) -> parts_of: tensors share row counts

    def writers_in(self, rows: int, start: int, stop: int) -> set[int]:
        """The writers of the non-empty parts overlapping rows ``[start, stop)`` (one slice of the
        outer parts: a whole tensor split over 16,384 parts is not 16,384 part computations)."""
        size = -(-rows // self.parts) if rows else 1
        first, last = start // size, min(self.parts, -(-stop // size), -(-rows // size))
        if self.sub == 1:
            return set(self.writers[first:last])
        out: set[int] = set()
        for i in range(first, last):
            a, b = chunk_rows(rows, self.parts, i)
            step = -(-(b - a) // self.sub)
            lo, hi = (max(start, a) - a) // step, min(self.sub, -(-(min(stop, b) - a) // step))
            out.update(self.writers[i * self.sub + lo:i * self.sub + hi])
        return out

    def parts_of(self, rows: int, writer: int) -> list[tuple[int, int]]:
        """The non-empty row ranges ``[start, stop)`` of ``writer``."""
        cached = self._parts.get((rows, writer))
        if cached is not None:
            return cached
        out = []
        for k in self._positions.get(writer, ()):
            a, b = nested_chunk(rows, self.parts, self.sub, k)
            if a < b:
                out.append((a, b))
        if len(self._parts) < 2**16:
            self._parts[(rows, writer)] = out
        return out


def chunk_sizes(rows: int, parts: int) -> np.ndarray:
    """Rows of each ``torch.chunk`` part: ``ceil(rows / parts)`` each, the trailing ones short or empty."""
    size = -(-rows // parts) if rows else 0
    return np.clip(rows - np.arange(parts, dtype=np.int64) * size, 0, size)


def sub_chunk_sizes(shard_rows: np.ndarray, sub: int) -> np.ndarray:
    """``[j, s]``: rows of sub-part ``j`` when each shard's rows are ``torch.chunk``-split over ``sub``."""
    step = -(-shard_rows // sub)
    return np.clip(shard_rows[None, :] - np.arange(sub, dtype=np.int64)[:, None] * step[None, :], 0, step[None, :])


def chunk_rows(rows: int, parts: int, rank: int) -> tuple[int, int]:
    """Part ``rank``'s rows ``[start, stop)`` when ``torch.chunk`` (and so FSDP2 ``Shard(0)``) splits
    ``rows`` over ``parts``: ``ceil(rows/parts)`` each, trailing parts possibly short or empty.
    The one home of the split rule (torch-free: readers of a manifest need it)."""
    if parts < 1 or rows < 0:
        raise ValueError(f"cannot split {rows} rows over {parts} parts")
    size = -(-rows // parts)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


def nested_chunk(rows: int, parts: int, sub: int, k: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of sub-part ``k % sub`` of part ``k // sub``: each ``torch.chunk``
    part split by ``torch.chunk`` again."""
    start, stop = chunk_rows(rows, parts, k // sub)
    a, b = chunk_rows(stop - start, sub, k % sub)
    return start + a, start + b


def assign(tensors: Sequence[tuple[int, int, Holders]]) -> list[ChunkRule]:
    """Who acts for each tensor's rows: ``tensors`` are ``(rows, bytes per row, holders)``."""
    world = 1 + max((int(h.grid.max()) for _, _, h in tensors), default=0)
    load = np.zeros(world, dtype=np.float64)
    total = sum(rows * row_bytes for rows, row_bytes, _ in tensors)
    distinct = {id(h): h.grid.reshape(-1) for _, _, h in tensors}
    ranks = len(np.unique(np.concatenate(list(distinct.values())))) if distinct else 1
    threshold = total / ranks / SPLIT_SHARE
    shared: dict[tuple, ChunkRule] = {}  # one object per distinct rule: it indexes its writers once

    def made(h: Holders, r: int | None) -> ChunkRule:
        key = (id(h), r)  # callers share one Holders per mesh: hashing a 16,384-rank grid per tensor is slow
        if key not in shared:
            if r is None:
                shared[key] = ChunkRule(h.shards, tuple(h.grid.T.reshape(-1).tolist()), h.replicas)
            else:
                shared[key] = ChunkRule(h.shards, tuple(h.grid[r].tolist()))
        return shared[key]

    out: list[ChunkRule | None] = [None] * len(tensors)
    whole = []
    for k, (rows, row_bytes, h) in enumerate(tensors):
        if h.shards == 1:  # replicated whole (DDP, scalars, codebooks): plain integers, no arrays
            shard_bytes = rows * row_bytes
            if h.replicas > 1 and shard_bytes > threshold:
                out[k] = made(h, None)
                load[h.grid[:, 0]] += chunk_sizes(rows, h.replicas) * row_bytes
            else:
                whole.append((-shard_bytes, k, shard_bytes))
            continue
        shard_bytes = chunk_sizes(rows, h.shards) * row_bytes
        if h.replicas == 1:
            out[k] = made(h, 0)
            load[h.grid[0]] += shard_bytes
        elif shard_bytes.max(initial=0) > threshold:
            out[k] = made(h, None)
            load[h.grid] += sub_chunk_sizes(chunk_sizes(rows, h.shards), h.replicas) * row_bytes
        else:
            whole.append((-int(shard_bytes.sum()), k, shard_bytes))
    whole.sort(key=lambda x: x[:2])
    for _, k, shard_bytes in whole:
        h = tensors[k][2]
        if h.shards == 1:
            column = h.grid[:, 0]
            r = int(np.argmin(load[column]))
            load[column[r]] += shard_bytes
        else:
            r = int(np.argmin((load[h.grid] + shard_bytes).max(axis=1)))
            load[h.grid[r]] += shard_bytes
        out[k] = made(h, r)
    return out

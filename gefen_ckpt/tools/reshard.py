"""Offline resharding: rewrite a checkpoint for another world size or mesh, streaming.

Because every block lies inside a row of the global parameter, the target layout is just a
``torch.chunk``-style split of each row-sharded field along dim 0; replicated fields are
stored once. No process group, and memory is bounded by the writer's budget whatever the
model's size: sources are read piece by piece.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gefen_ckpt.wire.index import MAX_WORLD_SIZE

if TYPE_CHECKING:  # planning from a manifest needs no torch (``plan_manifest``)
    from gefen_ckpt.state.canonical import CanonicalState


@dataclass(frozen=True)
class Mesh:
    """``replicate x shard``: data is split over ``shard`` ranks, ``replicate`` copies read it."""

    replicate: int
    shard: int

    def __post_init__(self):
        if self.replicate < 1 or self.shard < 1:
            raise ValueError(f"mesh dimensions must be positive, got {self.replicate}x{self.shard}")
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"a world size of {self.world_size:,} ranks is over the maximum of {MAX_WORLD_SIZE:,}")

    @classmethod
    def parse(cls, text: str) -> Mesh:
        try:
            r, s = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"mesh must look like RxS (e.g. 2x4), got {text!r}") from None
        return cls(r, s)

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard


@dataclass(frozen=True)
class RankPlan:
    """What each shard rank ``rank`` .. ``last`` (inclusive) of the target will own and read: a run
    of consecutive ranks with the same figures, so a plan has O(tensors) entries, not O(ranks)."""

    rank: int
    last: int
    sharded_bytes: int
    replicated_bytes: int
    empty_fields: int  # row-sharded fields of which each of these ranks holds no rows

    @property
    def read_bytes(self) -> int:
        return self.sharded_bytes + self.replicated_bytes

    @property
    def count(self) -> int:
        return self.last - self.rank + 1


def plan(state: CanonicalState, shards: int) -> list[RankPlan]:
    """Bytes each of ``shards`` target ranks will hold (reads no tensor data)."""
    from gefen_ckpt.state.canonical import nbytes

    fields = ((src.shape, nbytes(src), state.contract.leaf(entry.child).field(name).row_sharded)
              for entry in state.params.values() for name, src in entry.fields.items())
    return plan_tensors([*((src.shape, nbytes(src), False) for src in state.global_fields.values()), *fields], shards)


def plan_manifest(manifest, shards: int) -> list[RankPlan]:
    """``plan`` of a validated portable manifest (``format.manifest.Manifest``), torch-free: what
    ``gefen-ckpt reshard --dry-run`` prints without importing torch or opening any tensor."""
    from gefen_ckpt.wire.dtypes import itemsize

    params = manifest.raw["params"]

    def tensors():
        for (fqn, name), t in manifest.tensors.items():
            sharded = fqn is not None and manifest.contract.leaf(params[fqn].get("child")).field(name).row_sharded
            yield t.shape, math.prod(t.shape) * itemsize(t.dtype), sharded

    return plan_tensors(tensors(), shards)


def plan_tensors(tensors: Iterable[tuple[tuple[int, ...], int, bool]], shards: int) -> list[RankPlan]:
    """``(shape, bytes, row-sharded)`` of every tensor -> runs of ranks that hold alike, from the
    chunk rule alone: under ``torch.chunk`` a tensor of R rows gives ranks ``[0, full)`` ``ceil(R /
    shards)`` rows, at most one rank the rest and the others none, so each distinct row count
    changes the figures at two ranks at most: O(tensors) work whatever ``shards`` is (a plan for
    2**20 ranks costs what one for 8 does)."""
    if type(shards) is not int or not 1 <= shards <= MAX_WORLD_SIZE:
        raise ValueError(f"shards must be an int in [1, {MAX_WORLD_SIZE:,}], got {shards!r}")
    replicated = 0
    by_rows: dict[int, list[int]] = {}  # rows -> [bytes per row summed, tensors]
    for shape, size, row_sharded in tensors:
        if not row_sharded or not shape:
            replicated += size
            continue
        acc = by_rows.setdefault(shape[0], [0, 0])
        acc[0] += size // shape[0] if shape[0] else 0
        acc[1] += 1
    steps: dict[int, list[int]] = {0: [0, 0]}  # rank -> [change of sharded bytes, change of empty fields]

    def change(at: int, nbytes: int, empty: int) -> None:
        if at < shards:
            step = steps.setdefault(at, [0, 0])
            step[0] += nbytes
            step[1] += empty

    for rows, (row_bytes, count) in by_rows.items():
        if not rows:
            change(0, 0, count)
            continue
        size = -(-rows // shards)
        full, rest = min(rows // size, shards), rows % size
        change(0, size * row_bytes, 0)
        change(full, (rest - size) * row_bytes, 0 if rest else count)
        if rest:
            change(full + 1, -rest * row_bytes, count)
    runs, sharded, empty = [], 0, 0
    at = sorted(steps)
    for i, rank in enumerate(at):
        sharded, empty = sharded + steps[rank][0], empty + steps[rank][1]
        last = (at[i + 1] if i + 1 < len(at) else shards) - 1
        if runs and (runs[-1].sharded_bytes, runs[-1].empty_fields) == (sharded, empty):
            runs[-1] = RankPlan(runs[-1].rank, last, sharded, replicated, empty)
        else:
            runs.append(RankPlan(rank, last, sharded, replicated, empty))
    return runs


def retarget(state: CanonicalState, mesh: Mesh) -> CanonicalState:
    """``state`` with its topology metadata describing the target ``mesh``."""
    topology = {"kind": "sharded", "world_size": mesh.world_size, "mesh": [mesh.replicate, mesh.shard],
                "resharded_from": state.metadata.get("source_topology", {})}
    return dataclasses.replace(state, metadata={**state.metadata, "source_topology": topology})

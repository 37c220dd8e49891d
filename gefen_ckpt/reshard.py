"""Offline resharding: rewrite a checkpoint for another world size or mesh, streaming.

Because every block lies inside a row of the global parameter, the target layout is just a
``torch.chunk``-style split of each row-sharded field along dim 0; replicated fields are
stored once. No process group, and memory is bounded by the writer's budget whatever the
model's size: sources are read piece by piece.
"""

from __future__ import annotations

from dataclasses import dataclass

from gefen_ckpt.canonical import CanonicalState, nbytes
from gefen_ckpt.layout import chunk_rows


@dataclass(frozen=True)
class Mesh:
    """``replicate x shard``: data is split over ``shard`` ranks, ``replicate`` copies read it."""

    replicate: int
    shard: int

    @classmethod
    def parse(cls, text: str) -> Mesh:
        try:
            r, s = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"mesh must look like RxS (e.g. 2x4), got {text!r}") from None
        if r < 1 or s < 1:
            raise ValueError(f"mesh dimensions must be positive, got {text!r}")
        return cls(r, s)

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard


@dataclass(frozen=True)
class RankPlan:
    """What one shard rank of the target will own and read."""

    rank: int
    sharded_bytes: int
    replicated_bytes: int
    empty_fields: int  # row-sharded fields of which this rank holds no rows

    @property
    def read_bytes(self) -> int:
        return self.sharded_bytes + self.replicated_bytes


def plan(state: CanonicalState, shards: int) -> list[RankPlan]:
    """Bytes each of ``shards`` target ranks will hold (reads no tensor data)."""
    replicated = sum(nbytes(src) for src in state.global_fields.values())
    per_rank = [[0, 0] for _ in range(shards)]
    for entry in state.params.values():
        leaf = state.contract.leaf(entry.child)
        for name, src in entry.fields.items():
            size = nbytes(src)
            if not leaf.field(name).row_sharded or not src.shape:
                replicated += size
                continue
            rows = src.shape[0]
            for r in range(shards):
                start, stop = chunk_rows(rows, shards, r)
                per_rank[r][0] += size * (stop - start) // rows if rows else 0
                per_rank[r][1] += stop <= start
    return [RankPlan(r, b, replicated, e) for r, (b, e) in enumerate(per_rank)]


def retarget(state: CanonicalState, mesh: Mesh) -> CanonicalState:
    """``state`` with its topology metadata describing the target ``mesh``."""
    metadata = dict(state.metadata)
    metadata["source_topology"] = {"kind": "sharded", "world_size": mesh.world_size,
                                   "mesh": [mesh.replicate, mesh.shard], "resharded_from": state.metadata.get(
                                       "source_topology", {})}
    return CanonicalState(state.contract, state.param_groups, state.params, state.global_fields, metadata)

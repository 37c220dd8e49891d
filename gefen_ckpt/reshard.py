"""Offline resharding: rewrite a checkpoint for another world size or mesh, streaming.

Because every block lies inside a row of the global parameter, the target layout is just a
``torch.chunk``-style split of each row-sharded field along dim 0; replicated fields are
stored once. No process group, and memory is bounded by the writer's budget whatever the
model's size: sources are read piece by piece.
"""

from __future__ import annotations

from dataclasses import dataclass

from gefen_ckpt.canonical import CanonicalState, nbytes


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
    """Bytes each of ``shards`` target ranks will hold (reads no tensor data). Tensors with the
    same number of rows split alike, so the work is one vector operation per distinct row
    count, not one per tensor and rank (a 405B-parameter state planned for 12,288 ranks)."""
    import numpy as np

    replicated = sum(nbytes(src) for src in state.global_fields.values())
    by_rows: dict[int, list[int]] = {}  # rows -> [bytes per row summed, tensors]
    for entry in state.params.values():
        leaf = state.contract.leaf(entry.child)
        for name, src in entry.fields.items():
            if not leaf.field(name).row_sharded or not src.shape:
                replicated += nbytes(src)
                continue
            rows = src.shape[0]
            acc = by_rows.setdefault(rows, [0, 0])
            acc[0] += nbytes(src) // rows if rows else 0
            acc[1] += 1
    sharded, empty = np.zeros(shards, np.int64), np.zeros(shards, np.int64)
    for rows, (row_bytes, count) in by_rows.items():
        counts = _rows_held(rows, shards)
        sharded += counts * row_bytes
        empty += (counts == 0) * count
    return [RankPlan(r, int(b), replicated, int(e)) for r, (b, e) in enumerate(zip(sharded.tolist(), empty.tolist()))]


def _rows_held(rows: int, shards: int):
    """Rows each of ``shards`` ranks holds under ``chunk_rows`` (full ranks, one short one, empty ones)."""
    import numpy as np

    size = -(-rows // shards) if rows else 1
    full = min(rows // size, shards)
    out = np.zeros(shards, np.int64)
    out[:full] = size if rows else 0
    if full < shards and rows % size:
        out[full] = rows % size
    return out


def retarget(state: CanonicalState, mesh: Mesh) -> CanonicalState:
    """``state`` with its topology metadata describing the target ``mesh``."""
    metadata = dict(state.metadata)
    metadata["source_topology"] = {"kind": "sharded", "world_size": mesh.world_size,
                                   "mesh": [mesh.replicate, mesh.shard], "resharded_from": state.metadata.get(
                                       "source_topology", {})}
    return CanonicalState(state.contract, state.param_groups, state.params, state.global_fields, metadata)

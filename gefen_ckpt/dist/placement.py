"""Where a rank's part of a parameter lies in the global tensor.

Block geometry is defined inside rows, so every supported layout (single process, DDP
replicas, FSDP2 ``Shard(0)`` with uneven or empty shards, HSDP replicate x shard) gives each
rank one contiguous range of global rows; that range is all the checkpoint code needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from gefen.distributed import is_dtensor  # noqa: F401  (the DTensor helpers' one home)
from gefen.distributed import local_tensor as to_local  # noqa: F401
from gefen.geometry import first_copy, rows_and_row_numel
from gefen.replicas import Holders, assign
from gefen_ckpt.errors import UnsupportedLayoutError


def local_rows(param: torch.Tensor, name: str = "parameter") -> tuple[int, int]:
    """``[start, stop)`` of the global rows this rank holds (0-D tensors are one row)."""
    rows = rows_and_row_numel(param.shape)[0]
    if not is_dtensor(param):
        return 0, rows
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for placement in param.placements:
        if placement.is_shard() and placement.dim != 0:
            raise UnsupportedLayoutError(
                f"{name}: unsupported layout {param.placements} shards dim {placement.dim}; gefen_ckpt's own formats "
                "need whole rows on every rank (Shard(0) and Replicate): checkpoint tensor-parallel state with "
                "torch's get_state_dict + dcp.save (docs/dcp.md)"
            )
        if placement.is_partial():
            raise UnsupportedLayoutError(f"{name}: Partial placements hold no definite values")
    if param.dim() == 0:
        return 0, 1
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return offset[0], offset[0] + local_shape[0]


def rows_per_chunk(shape: tuple[int, ...], itemsize: int, budget: int) -> int:
    """Whole rows of a tensor of ``shape`` that fit in ``budget`` bytes (at least one)."""
    return max(1, budget // max(1, rows_and_row_numel(shape)[1] * itemsize))


def row_ranges(shape: tuple[int, ...], itemsize: int, budget: int, cuts: Iterable[int] = ()) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` ranges of whole rows (0-D: one row) of at most ``budget`` bytes (at least
    one row) that never cross a row in ``cuts``: how a tool reads a tensor in bounded memory."""
    rows, step = rows_and_row_numel(shape)[0], rows_per_chunk(shape, itemsize, budget)
    bounds = sorted({0, rows, *[c for c in cuts if 0 < c < rows]})
    for lo, hi in zip(bounds, bounds[1:]):
        for start in range(lo, hi, step):
            yield start, min(hi, start + step)


def replica_rules(sources: dict, holders: dict) -> dict:
    """Each tensor's ``ChunkRule`` by ``gefen.replicas.assign``, from its global shape and dtype
    (``sources``) and the ranks holding it (``holders``, same keys): the plan a save writes by and
    a read-once load reads by."""
    keys = list(sources)
    return dict(zip(keys, assign([(*rows_and_bytes(sources[k]), holders[k]) for k in keys])))


def rows_and_bytes(source) -> tuple[int, int]:
    """Rows of a tensor source and bytes per row."""
    rows, row_numel = rows_and_row_numel(source.shape)
    return rows, row_numel * source.dtype.itemsize


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def holders(param: torch.Tensor, row_sharded: bool) -> Holders | None:
    """The ranks holding a field of ``param`` as ``gefen.replicas`` sees them: its rows split over
    the mesh dimension that shards dim 0, replicated over the others (a plain tensor: every rank
    holds all of it). None where rows are split over several mesh dimensions (no chunk rule)."""
    if not is_dtensor(param):
        return every_rank()
    mesh, placements = param.device_mesh, tuple(param.placements)
    sharded = [i for i, pl in enumerate(placements) if pl.is_shard() and pl.dim == 0] if row_sharded else []
    if any(type(pl).__name__ == "_StridedShard" for pl in placements) or len(sharded) > 1:
        return None
    ranks = mesh.mesh
    if not sharded or param.dim() == 0:
        return _cached(mesh, (), lambda: Holders.replicated(ranks.reshape(-1).tolist()))
    d = sharded[0]
    return _cached(mesh, d, lambda: Holders(ranks.movedim(d, -1).reshape(-1, ranks.shape[d]).tolist()))


def every_rank() -> Holders:
    """Holders of what every rank of the world holds (a plain tensor, the codebook)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return _cached("world", world, lambda: Holders.replicated(range(world)))


_holders: dict[tuple, tuple[object, Holders]] = {}


def _cached(owner, key, make) -> Holders:
    """One ``Holders`` per mesh (or world size) and sharded dimension: the rule groups tensors by
    holder object. The entry keeps ``owner`` alive, so its id is not reused while cached."""
    hit = _holders.get((id(owner), key))
    if hit is None or hit[0] is not owner:
        if len(_holders) > 256:
            _holders.clear()
        hit = _holders[(id(owner), key)] = (owner, make())
    return hit[1]


def first_writer(param: torch.Tensor, row_sharded: bool) -> bool:
    """Is this rank the copy at index 0 along every mesh dimension holding copies of its rows
    (of a plain tensor: rank 0)? The one writer where no rule applies, and ``transport.gather``'s source."""
    if not is_dtensor(param):
        return rank() == 0
    placements = param.placements
    copies = [i for i, pl in enumerate(placements) if pl.is_replicate()] if row_sharded else range(param.device_mesh.ndim)
    return first_copy(param.device_mesh.get_coordinate(), copies)

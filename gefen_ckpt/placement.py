"""Where a rank's part of a parameter lies in the global tensor.

Block geometry is defined inside rows, so every supported layout (single process, DDP
replicas, FSDP2 ``Shard(0)`` with uneven or empty shards, HSDP replicate x shard) gives each
rank one contiguous range of global rows; that range is all the checkpoint code needs.
"""

from __future__ import annotations

import torch

from gefen.distributed import is_dtensor  # noqa: F401  (the DTensor helpers' one home)
from gefen.distributed import local_tensor as to_local  # noqa: F401
from gefen.geometry import first_copy, rows_and_row_numel
from gefen_ckpt.errors import UnsupportedLayoutError
from gefen_ckpt.wire.index import chunk_rows  # noqa: F401  (the split rule's one home)


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


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def ownership(param: torch.Tensor, row_sharded: bool) -> tuple[bool, tuple[int, tuple[int, ...]] | None]:
    """``(writer, split)`` of a field of ``param``: does this rank write its rows (one replica of
    each row range; of a replicated field, one rank), and how a sharded save stores them, a rule
    every rank derives alike from the mesh: ``(parts, writers)``, rows ``torch.chunk``-split over
    ``parts``, part ``i`` written by global rank ``writers[i]`` (None: rows sharded over several
    mesh dimensions, no single chunk rule)."""
    if not is_dtensor(param):
        return rank() == 0, (1, (0,))
    mesh, placements = param.device_mesh, param.placements
    copies = [i for i, pl in enumerate(placements) if pl.is_replicate()] if row_sharded else range(mesh.ndim)
    writer = first_copy(mesh.get_coordinate(), copies)
    sharded = [i for i, pl in enumerate(placements) if pl.is_shard() and pl.dim == 0]
    if not row_sharded or param.dim() == 0 or not sharded:
        return writer, (1, (int(mesh.mesh.reshape(-1)[0]),))
    if len(sharded) > 1:
        return writer, None
    # the writers along the sharded dimension, index 0 along every other one
    writers = mesh.mesh.movedim(sharded[0], 0).reshape(mesh.mesh.shape[sharded[0]], -1)[:, 0].tolist()
    return writer, (len(writers), tuple(writers))

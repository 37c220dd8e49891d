"""Geometry (docs/design.md 4): where a state field lies relative to its parameter. Torch-free.

Every block is a contiguous run of ``P`` elements inside one row of the *global* parameter
(``rows = shape[0]``, ``row_numel = prod(shape[1:])``), so any split along dim 0 hands every rank
whole blocks: what makes the compressed state reshardable bit-exactly (docs/design.md 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: geometry -> does it follow the parameter's dim-0 slice (True) or stay replicated (False)
GEOMETRIES = {
    "scalar": False,  # shape (), replicated
    "param": True,  # the parameter's shape, same slice
    "block": True,  # [rows, row_numel // P], same row slice
    "row": True,  # [rows], same row slice
    "col": False,  # [row_numel], a global reduction: replicated (split where dim 1 is)
    "global": False,  # optimizer-wide (e.g. the codebook), one copy
}


def rows_and_row_numel(shape: Sequence[int]) -> tuple[int, int]:
    """Split a global shape into (rows, elements per row); a 0-D tensor is one row of one."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), int(math.prod(shape[1:]))


def block_shape(shape: Sequence[int], period: int) -> tuple[int, int]:
    """Global shape of per-block state (scales, block second moment) for period ``period``."""
    rows, row_numel = rows_and_row_numel(shape)
    if period <= 0 or row_numel % period:
        raise ValueError(f"period {period} does not divide the row length {row_numel} of shape {tuple(shape)}")
    return rows, row_numel // period


def as_blocks(tensor: torch.Tensor, period: int) -> torch.Tensor:
    """View a (row-sharded, possibly empty) parameter-shaped tensor as ``[rows, blocks_per_row, period]``."""
    rows, row_numel = rows_and_row_numel(tensor.shape)
    return tensor.reshape(rows, row_numel // period, period)


def uses_row_period(shape: Sequence[int]) -> bool:
    """1-D and 0-D tensors keep per-element state (P = 1): lossless and a negligible share."""
    return len(shape) >= 2


def shape_period(shape: Sequence[int]) -> int:
    """The block length of a parameter of global ``shape``: one block per row for tensors of two or
    more dimensions, P = 1 for 1-D/0-D tensors and empty rows. The shape alone decides, so state
    exists before the first gradient and every rank agrees (docs/decisions.md, "Block length from
    the shape alone")."""
    if not uses_row_period(shape):
        return 1
    return max(rows_and_row_numel(shape)[1], 1)


def period_of_blocks(shape: Sequence[int], blocks: int) -> int:
    """The block length of a ``block`` field with ``blocks`` per row of a parameter of ``shape``."""
    return rows_and_row_numel(shape)[1] // blocks


def shape_problem(geometry: str, shape: Sequence[int], value_shape: Sequence[int]) -> str | None:
    """Why ``value_shape`` cannot be the global shape of a ``geometry`` field of a parameter of
    global ``shape`` (a ``block`` field has ``shape_period``'s blocks); None if it can."""
    shape, value_shape = tuple(shape), tuple(value_shape)
    rows, row_numel = rows_and_row_numel(shape)
    ok = {"scalar": value_shape == (), "param": value_shape == shape, "row": value_shape == (rows,),
          "col": value_shape == (row_numel,), "global": True,  # optimizer-wide: any shape
          "block": value_shape == block_shape(shape, shape_period(shape))}[geometry]
    return None if ok else f"shape {list(value_shape)} is not a valid {geometry} shape for {list(shape)}"


def field_local_shape(geometry: str, local: Sequence[int], shape: Sequence[int], period: int) -> tuple[int, ...]:
    """Shape of a ``geometry`` field on a rank holding ``local`` of a parameter of global ``shape``:
    this rank's rows and columns (tensor parallelism's ``Shard(1)``) where the field follows them."""
    if geometry == "param":
        return tuple(local)
    global_shape = field_global_shape(geometry, shape, period)
    if geometry in ("block", "row"):
        return (local[0] if len(local) else 1, *global_shape[1:])
    if geometry == "col" and len(local) > 1:
        return (math.prod(local[1:]),)
    return global_shape


def field_global_shape(geometry: str, shape: Sequence[int], period: int) -> tuple[int, ...]:
    """Global shape of a per-parameter state field of ``geometry`` (see ``gefen.contract``)."""
    if geometry == "block":
        return block_shape(shape, period)
    rows, row_numel = rows_and_row_numel(shape)
    shapes = {"scalar": (), "param": tuple(shape), "row": (rows,), "col": (row_numel,)}
    if geometry not in shapes:
        raise ValueError(f"geometry {geometry!r} is not per-parameter")
    return shapes[geometry]


def first_copy(coordinate: Sequence[int], copy_dims: Iterable[int]) -> bool:
    """Is the block at this mesh ``coordinate`` the copy that acts for all (the one a checkpoint
    writes, a statistic counts)? Index 0 along every mesh dimension ``copy_dims`` that holds copies."""
    return all(coordinate[d] == 0 for d in copy_dims)

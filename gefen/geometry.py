"""Block geometry: where the compressed state's blocks lie inside a parameter.

Every block is a contiguous run of ``P`` elements inside one row of the *global* parameter
(``rows = shape[0]``, ``row_numel = prod(shape[1:])``), so ``P`` always divides ``row_numel``.
Any split along dim 0 therefore hands every rank whole blocks: that is what makes the
compressed state reshardable bit-exactly (docs/design.md 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def rows_and_row_numel(shape: Sequence[int]) -> tuple[int, int]:
    """Split a global shape into (rows, elements per row); a 0-D tensor is one row of one."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


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
    """The block length of a parameter of global ``shape``: one block per row for tensors of
    two or more dimensions, one element (P = 1) for 1-D/0-D tensors and empty rows.

    A function of the shape alone, so a fresh optimizer can allocate its state before its first
    gradient (what torch's ``get_state_dict``/``dcp.load`` flow needs) and every rank and layout
    agrees without a reduction (docs/decisions.md, "Block length from the shape alone").
    """
    if not uses_row_period(shape):
        return 1
    return max(rows_and_row_numel(shape)[1], 1)


def is_valid_period(shape: Sequence[int], period: int) -> bool:
    """Can ``period`` be the block length of a parameter of ``shape``? It must divide every row
    (older checkpoints may carry any divisor; new state uses ``shape_period``)."""
    if period == 1:
        return True
    _, row_numel = rows_and_row_numel(shape)
    return uses_row_period(shape) and period > 1 and row_numel > 0 and row_numel % period == 0


def field_global_shape(geometry: str, shape: Sequence[int], period: int) -> tuple[int, ...]:
    """Global shape of a per-parameter state field of ``geometry`` (see ``gefen.contract``)."""
    if geometry == "scalar":
        return ()
    if geometry == "param":
        return tuple(shape)
    if geometry == "block":
        return block_shape(shape, period)
    if geometry == "row":
        return (rows_and_row_numel(shape)[0],)
    if geometry == "col":
        return (rows_and_row_numel(shape)[1],)
    raise ValueError(f"geometry {geometry!r} is not per-parameter")

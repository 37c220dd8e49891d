"""Block geometry: where the compressed state's blocks lie inside a parameter.

Every block is a contiguous run of ``P`` elements inside one row of the *global* parameter
(``rows = shape[0]``, ``row_numel = prod(shape[1:])``), so ``P`` always divides ``row_numel``.
Any split along dim 0 therefore hands every rank whole blocks: that is what makes the
compressed state reshardable bit-exactly (SPEC section 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: Below this block length the per-block scale costs more than it saves (4 B per block).
MIN_PERIOD = 8
#: Increment credited to the first candidate so a flat curve prefers the smallest period.
FIRST_INCREMENT = 1e-12


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


def period_candidates(shape: Sequence[int]) -> list[int]:
    """Every divisor of ``row_numel``, ascending (the only block lengths the invariant allows)."""
    if not uses_row_period(shape):
        return [1]
    _, n = rows_and_row_numel(shape)
    if n == 0:  # empty rows (e.g. shape (5, 0)): nothing to block; P = 1 keeps block_shape valid
        return [1]
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def period_statistics(grad: torch.Tensor, candidates: Sequence[int]) -> torch.Tensor:
    """Per candidate p: (sum over blocks of the population variance of g^2, block count).

    Returned as float64 ``[len(candidates), 2]`` so that shards can simply all-reduce the sums
    and every rank (and a single process) decides from the same global numbers.

    Hierarchical, so all candidates cost about one pass over the gradient: the blocks of p are
    made of the blocks ("children") of the largest smaller candidate q dividing p, and the
    spread ``T(p) = sum over blocks of sum_j (x_j - block mean)^2`` of x = g^2 is
    ``T(q) + sum over blocks of sum_k (c_k - C / f)^2 / q`` (children sums c_k, block sum C
    = c_1 + ... + c_f left to right, f = p / q). Every term is non-negative -- no
    ``E[x^2] - E[x]^2`` cancellation -- and a block whose children are equal adds exactly 0, so
    flat regions give exactly flat error curves in any summation order.
    ``gefen.native.period_statistics`` computes the same terms in C.
    """
    rows, row_numel = rows_and_row_numel(grad.shape)
    x = grad.detach().reshape(rows, row_numel).to(torch.float64, copy=True).square_()  # exact
    stats = torch.zeros(len(candidates), 2, dtype=torch.float64, device=grad.device)
    sums = {1: x}
    spread = {1: torch.zeros((), dtype=torch.float64, device=grad.device)}
    for i, p in enumerate(candidates):
        if p not in sums:
            q = max(c for c in sums if p % c == 0)
            children = sums[q].reshape(rows, row_numel // p, p // q)
            block = children[..., 0].clone()
            for j in range(1, p // q):
                block += children[..., j]
            if p // q == 2:  # equal children give a mean equal to both: exactly 0, no mask needed
                mean = block / 2
                between = (children[..., 0] - mean).square_() + (children[..., 1] - mean).square_()
            else:
                between = (children - (block / (p // q)).unsqueeze(-1)).square_().sum(-1)
                between.masked_fill_((children == children[..., :1]).all(-1), 0.0)
            sums[p], spread[p] = block, spread[q] + between.sum() / q
        stats[i, 0] = spread[p] / p
        stats[i, 1] = rows * (row_numel // p)
    return stats


def pick_period(candidates: Sequence[int], stats: torch.Tensor) -> int:
    """The SPEC 3.1 rule: the candidate with the smallest increase of the block error.

    ``err(p) = sqrt(mean over blocks of var(g^2))``; walking candidates in ascending order we take
    the smallest increment (ties to the smaller p). A result below ``MIN_PERIOD`` falls back to one
    block per row, because flat error curves would otherwise collapse to P = 1 (9 B/param).
    """
    row_numel = max(candidates)
    if len(candidates) == 1:
        return candidates[0]
    values = stats.tolist()
    err = [math.sqrt(max(s, 0.0) / c) if c else 0.0 for s, c in values]
    best, best_inc = candidates[0], FIRST_INCREMENT
    for k in range(1, len(candidates)):
        inc = err[k] - err[k - 1]
        if inc < best_inc:
            best, best_inc = candidates[k], inc
    if best < MIN_PERIOD:
        return row_numel if row_numel >= MIN_PERIOD else 1
    return best

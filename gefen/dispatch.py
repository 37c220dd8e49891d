"""Which implementation runs each step function, as ``torch.optim.adamw`` picks fused/foreach/single.

Every function takes the arguments of the ``gefen.functional`` reference of the same name and
tries, in order, the Triton kernels (CUDA tensors, ``gefen.triton.dispatch``), the C kernels (CPU,
``gefen.native``), then the reference; a kernel that does not apply touches nothing. The choice
lives here so that the reference stays pure torch, the kernels' own checks can call it directly,
and no gefen module imports one that imports it back. ``batched``, ``m4v4_partials_`` and
``m8_partials_`` are the Triton whole-group paths (phase 1 and the queued launches of a step).
"""

from __future__ import annotations

import torch

from gefen import functional as F
from gefen import native
from gefen.codebook import histogram_normalised_blocks
from gefen.triton import dispatch as triton
from gefen.triton.dispatch import batched, m4v4_partials_, m8_partials_

__all__ = ["adamw_update_", "batched", "block_histogram", "gefen_update_", "m4v4_partials", "m4v4_partials_",
           "m4v4_update_", "m8_partials_", "momenta_", "round_param_", "second_moment_partials", "sr_target",
           "update_momentum_"]


def second_moment_partials(grad, state, beta2):
    return native.fused_partials(grad, state, beta2) or F.second_moment_partials(grad, state, beta2)


def gefen_update_(param, grad, state, codebook, h, *, global_rows, v_row=None, partials=None) -> None:
    kw = dict(global_rows=global_rows, v_row=v_row, partials=partials)
    for run in (triton.gefen_update_, native.fused_update_):
        if run(param, grad, state, codebook, h, **kw):
            return
    F.gefen_update_(param, grad, state, codebook, h, **kw)


def update_momentum_(state, grad, beta, codebook) -> torch.Tensor:
    for run in (native.fused_momentum_, triton.momentum_):
        if (out := run(state, grad, beta, codebook)) is not None:
            return out
    return F.update_momentum_(state, grad, beta, codebook)


def momenta_(items: list[tuple[dict, torch.Tensor, float]], codebook: torch.Tensor) -> list[torch.Tensor]:
    """``update_momentum_`` of every ``(state, grad, beta)``; on CUDA all in one Triton launch
    (which reads bf16 gradients as they are; the others take them as fp32)."""
    if not items:
        return []
    return triton.momenta_(items, codebook) or [update_momentum_(s, g.float(), mu, codebook) for s, g, mu in items]


def m4v4_partials(grad, state, beta2, *, row_sum=None, row_len=None):
    if row_sum is None and (fused := native.fused_m4v4_partials(grad, state, beta2)) is not None:
        return fused
    return F.m4v4_partials(grad, state, beta2, row_sum=row_sum, row_len=row_len)


def m4v4_update_(param, grad, state, codebook, ratio, h, *, global_rows, v_row, partials, pidx, seed, row0=0,
                 col0=0, row_len=None, row_max=None) -> None:
    kw = dict(global_rows=global_rows, v_row=v_row, partials=partials, pidx=pidx, seed=seed, row0=row0, col0=col0,
              row_len=row_len)
    if row_max is None:  # the kernels take whole rows
        for run in (triton.m4v4_update_, native.fused_m4v4_update_):
            if run(param, grad, state, codebook, ratio, h, **kw):
                return
    F.m4v4_update_(param, grad, state, codebook, ratio, h, row_max=row_max, **kw)


def adamw_update_(param, grad, state, h, *, pidx: int, seed: int, row0: int = 0) -> None:
    for run in (triton.adamw_update_, native.fused_adamw_update_):
        if run(param, grad, state, h, pidx=pidx, seed=seed, row0=row0):
            return
    F.adamw_update_(param, grad, state, h, pidx=pidx, seed=seed, row0=row0)


def sr_target(param: torch.Tensor, enabled: bool) -> torch.Tensor:
    """What an update writes: under ``bf16_stochastic_round`` a bf16 parameter's fp32 copy (every
    kernel computes a bf16 parameter in fp32 and rounds once, so the fp32 result is the one the
    nearest rounding would round; ``round_param_`` then rounds it stochastically), else ``param``."""
    return param.float() if enabled and param.dtype == torch.bfloat16 else param


def round_param_(param, work, *, step: int, salt: int, row0: int = 0, col0: int = 0, row_len=None) -> None:
    """``functional.round_param_`` unless ``work`` is ``param`` itself (``sr_target`` kept it)."""
    if work is param:
        return
    kw = dict(step=step, salt=salt, row0=row0, col0=col0, row_len=row_len)
    for run in (triton.round_param_, native.fused_round_param_):
        if run(param, work, **kw):
            return
    triton.drain()  # an update queued in batched() must have written ``work`` first
    F.round_param_(param, work, **kw)


def block_histogram(blocks, num_bins: int) -> torch.Tensor:
    """The first step's histogram: the C pass when it applies, else the torch reference (the same
    counts). A ``(rows, scale)`` pair is a column-split tensor's local rows with the whole rows'
    max-abs (tensor parallelism)."""
    if isinstance(blocks, tuple):
        return histogram_normalised_blocks(blocks[0].unsqueeze(1), num_bins, scale=blocks[1])
    counts = native.block_histogram(blocks, num_bins)
    return histogram_normalised_blocks(blocks, num_bins) if counts is None else counts

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
from gefen.quant import block_scales
from gefen.triton import dispatch as triton
from gefen.triton.dispatch import batched, m4v4_partials_, m8_partials_

__all__ = ["adamw_update_", "batched", "block_histogram", "gefen_update_", "m4v4_partials", "m4v4_partials_",
           "m4v4_row_stats", "m4v4_update_", "m8_partials_", "momenta_", "momentum_scales", "round_param_",
           "second_moment_partials", "sr_target",
           "update_momentum_"]


def second_moment_partials(grad, state, beta2):
    return native.fused_partials(grad, state, beta2) or F.second_moment_partials(grad, state, beta2)


def gefen_update_(param, grad, state, codebook, h, *, global_rows, v_row=None, partials=None) -> None:
    kw = dict(global_rows=global_rows, v_row=v_row, partials=partials)
    for run in (triton.gefen_update_, native.fused_update_):
        if run(param, grad, state, codebook, h, **kw):
            return
    F.gefen_update_(param, grad, state, codebook, h, **kw)


def update_momentum_(state, grad, beta, codebook, scales=None) -> torch.Tensor:
    """``scales``: a column split's rows' scales, reduced over tensor parallelism (``momentum_scales``)."""
    for run in (native.fused_momentum_, triton.momentum_):
        if (out := run(state, grad, beta, codebook, scales)) is not None:
            return out
    if scales is None:
        return F.update_momentum_(state, grad, beta, codebook)
    return F.store_momentum_(state, F.momentum_ema(state, grad, beta, codebook), codebook, scales)


def momentum_scales(state, grad, beta, codebook) -> torch.Tensor:
    """The block scales ``update_momentum_`` would choose, state untouched: a column-split shard's
    part of its rows' scales, which tensor parallelism reduces (max) before ``update_momentum_``."""
    for run in (native.fused_momentum_scales, triton.momentum_scales):
        if (out := run(state, grad, beta, codebook)) is not None:
            return out
    m = F.momentum_ema(state, grad, beta, codebook)
    return block_scales(F.as_blocks(m, F._local_period(state)))


def momenta_(items: list[tuple[dict, torch.Tensor, float]], codebook: torch.Tensor) -> list[torch.Tensor]:
    """``update_momentum_`` of every ``(state, grad, beta)``; on CUDA all in one Triton launch
    (which reads bf16 gradients as they are; the others take them as fp32)."""
    if not items:
        return []
    return triton.momenta_(items, codebook) or [update_momentum_(s, g.float(), mu, codebook) for s, g, mu in items]


def m4v4_partials(grad, state, beta2, *, row_sum=None, row_len=None):
    kw = dict(row_sum=row_sum, row_len=row_len)
    for run in (triton.m4v4_partials, native.fused_m4v4_partials):
        if (out := run(grad, state, beta2, **kw)) is not None:
            return out
    return F.m4v4_partials(grad, state, beta2, **kw)


def m4v4_row_stats(grad, state, codebook, beta1) -> tuple[torch.Tensor, torch.Tensor]:
    """A coded shard's per-row float64 sums of g^2 and max |m| of the new first moment: what a
    column split reduces over tensor parallelism before ``m4v4_partials`` and ``m4v4_update_``."""
    for run in (triton.m4v4_row_stats, native.fused_m4v4_row_stats):
        if (out := run(grad, state, codebook, beta1)) is not None:
            return out
    return F.row_square_sums(grad), F.row_abs_max(F.m4v4_momentum(grad, state, codebook, beta1))


def m4v4_update_(param, grad, state, codebook, ratio, h, *, global_rows, v_row, partials, pidx, seed, row0=0,
                 col0=0, row_len=None, row_max=None) -> None:
    kw = dict(global_rows=global_rows, v_row=v_row, partials=partials, pidx=pidx, seed=seed, row0=row0, col0=col0,
              row_len=row_len, row_max=row_max)
    for run in (triton.m4v4_update_, native.fused_m4v4_update_):
        if run(param, grad, state, codebook, ratio, h, **kw):
            return
    F.m4v4_update_(param, grad, state, codebook, ratio, h, **kw)


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
    blocks, scale = blocks if isinstance(blocks, tuple) else (blocks, None)
    for run in (triton.block_histogram, native.block_histogram):
        if (counts := run(blocks, num_bins, scale)) is not None:
            return counts
    if scale is not None:
        return histogram_normalised_blocks(blocks.unsqueeze(1), num_bins, scale=scale)
    return histogram_normalised_blocks(blocks, num_bins)

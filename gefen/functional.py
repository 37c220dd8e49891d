"""Gefen's per-parameter math (SPEC 3.1), free of optimizer bookkeeping.

A step is two phases so that distributed runs need one all-reduce per step:
``second_moment_partials`` computes what must be summed over ranks (factored tensors only),
the caller sums every parameter's partials at once, then ``gefen_update_`` applies the step.
All functions take the rank-local (row-sharded) tensors plus the *global* row count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gefen import native
from gefen.geometry import as_blocks, block_shape
from gefen.quant import dequantise, quantise


@dataclass(frozen=True)
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def is_factored(global_shape: tuple[int, ...], factored_v_2d: bool) -> bool:
    """Matrices keep a factored second moment (row + column EMAs) when asked; the rest per block."""
    return factored_v_2d and len(global_shape) == 2


def init_momentum_state(param: torch.Tensor, global_shape: tuple[int, ...], period: int) -> dict:
    """Zero step count and compressed first moment (shared by Gefen and GefenMuon)."""
    local_rows = param.shape[0] if param.dim() else 1
    dev = param.device
    return {
        "step": torch.zeros((), dtype=torch.int64),
        "period": torch.tensor(period, dtype=torch.int64),
        "m_code": torch.zeros(param.shape, dtype=torch.uint8, device=dev),
        "m_scale": torch.zeros(local_rows, block_shape(global_shape, period)[1], dtype=torch.float32, device=dev),
    }


def init_state(param: torch.Tensor, global_shape: tuple[int, ...], period: int, factored: bool) -> dict:
    """Zero state for one parameter; ``param`` is the local (row-sharded) tensor."""
    local_rows = param.shape[0] if param.dim() else 1
    blocks_per_row = block_shape(global_shape, period)[1]
    dev = param.device
    state = init_momentum_state(param, global_shape, period)
    if factored:
        state["v_row"] = torch.zeros(local_rows, dtype=torch.float32, device=dev)
        state["v_col"] = torch.zeros(global_shape[1], dtype=torch.float32, device=dev)
    else:
        state["v"] = torch.zeros(local_rows, blocks_per_row, dtype=torch.float32, device=dev)
    return state


def second_moment_partials(grad: torch.Tensor, state: dict, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For a factored tensor: the new ``v_row`` (rank-local) and the float64 partial sums that
    need a global reduction, ``[column sums of g^2..., sum of the new v_row]``."""
    if (fused := native.fused_partials(grad, state, beta2)) is not None:  # same numbers, one C call
        return fused
    sq = grad.float().square()
    v_row = state["v_row"] * beta2 + sq.mean(1) * (1 - beta2)
    partials = torch.cat([sq.sum(0, dtype=torch.float64), v_row.sum(dtype=torch.float64).reshape(1)])
    return v_row, partials


def gefen_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    codebook: torch.Tensor,
    h: Hyper,
    *,
    global_rows: int,
    v_row: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
) -> None:
    """Apply one Gefen step in place (SPEC 3.1 steps 1-4).

    ``v_row``/``partials`` are the factored tensor's results of ``second_moment_partials`` after
    the global sum; block-path tensors pass neither.
    """
    if native.fused_update_(param, grad, state, codebook, h, global_rows=global_rows, v_row=v_row, partials=partials):
        return  # the fused C step (gefen/native.py): bit-identical, used when it applies
    period = int(state["period"])
    g = grad.float()
    step = int(state["step"]) + 1
    bias1 = 1 - h.beta1**step
    bias2_sqrt = math.sqrt(1 - h.beta2**step)

    # 1. second moment -> denominator sqrt(V)/sqrt(1-b2^t) + eps
    if "v_row" in state:
        state["v_row"].copy_(v_row)
        col_mean = (partials[:-1] / global_rows).float()
        state["v_col"].mul_(h.beta2).add_(col_mean, alpha=1 - h.beta2)
        row_mean = (partials[-1] / global_rows).float().clamp_min(torch.finfo(torch.float32).tiny)
        denom = torch.outer(state["v_row"], state["v_col"]).div_(row_mean)
        denom = as_blocks(denom.sqrt_().div_(bias2_sqrt).add_(h.eps), period)
    else:
        block_sq = as_blocks(g, period).square().mean(-1)
        state["v"].mul_(h.beta2).add_(block_sq, alpha=1 - h.beta2)
        denom = state["v"].sqrt().div_(bias2_sqrt).add_(h.eps).unsqueeze(-1)

    # 2. step count and decoupled weight decay
    state["step"].fill_(step)
    work = param if param.dtype in (torch.float32, torch.float64) else param.float()
    if h.weight_decay:
        work.mul_(1 - h.lr * h.weight_decay)

    # 3. momentum: dequantise, EMA, re-quantise
    update = update_momentum_(state, g, h.beta1, codebook)

    # 4. update with the re-quantised momentum
    update.div_(bias1)
    as_blocks(update, period).div_(denom)
    work.add_(update, alpha=-h.lr)
    if work is not param:
        param.copy_(work)


def update_momentum_(state: dict, grad: torch.Tensor, beta: float, codebook: torch.Tensor) -> torch.Tensor:
    """``m = lerp(m, g, 1 - beta)`` stored re-quantised; returns the *re-quantised* momentum (fp32),
    so the update uses exactly the state it leaves behind (shared by Gefen and GefenMuon)."""
    if (fused := native.fused_momentum_(state, grad, beta, codebook)) is not None:
        return fused  # one C call, bit-identical (gefen/native.py)
    period = int(state["period"])
    m = dequantise(state["m_code"], state["m_scale"], codebook, period)
    m.lerp_(grad, 1 - beta)
    codes, scales = quantise(m, codebook, period)
    state["m_code"].copy_(codes)
    state["m_scale"].copy_(scales)
    return dequantise(codes, scales, codebook, period)

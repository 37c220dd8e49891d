"""Gefen's per-parameter math (docs/design.md 3.1), free of optimizer bookkeeping: the pure torch
references of the kernels (``gefen.dispatch`` picks the kernels or these).

A step is two phases so that distributed runs need one all-reduce per step: phase 1
(``m8_partials``, ``m4v4_partials``: each named for its state layout) computes what is summed
over ranks, then phase 2 (``m8_update_``, ``m4v4_update_``; ``adamw_update_`` for 1-D tensors)
applies the step. Every function takes the rank-local (row-sharded) tensors plus the *global* row count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gefen.codecs import M4V4Codec, M8Codec, row_abs_max
from gefen.contract import DIMENSION_FIELDS
from gefen.geometry import as_blocks, block_shape, uses_row_period
from gefen.quant import block_scales, dequantise, quantise
from gefen.stochastic import (
    TINY,
    element_index,
    encode,
    encode_v,
    hash_bits,
    hash_uniform,
    round_bf16,
    salts,
)


@dataclass(frozen=True)
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


#: the step_bound cap (in lr) where AdamW's own lone-gradient step is smaller (docs/design.md, "Bounded steps")
STEP_CAP = 4.0


def step_bound(step: int, beta1: float, beta2: float) -> float:
    """The largest |update| / lr an element may take at step ``step`` (docs/design.md, "Bounded
    steps"): AdamW's own worst case over every gradient history of ``step`` steps (Cauchy-Schwarz
    on the two EMAs' weights), capped at ``max(STEP_CAP, (1 - beta1) / sqrt(1 - beta2))``. A coded
    or factored second moment that underestimates an element meets this floor instead of ``eps``."""
    cap = max(STEP_CAP, (1.0 - beta1) / math.sqrt(1.0 - beta2)) if beta2 < 1 else math.inf
    r = beta1 * beta1 / beta2 if beta2 > 0 else math.inf
    if beta1 >= 1.0 or r == math.inf:
        return cap
    total = float(step) if r == 1.0 else (1.0 - r**step) / (1.0 - r)
    worst = (1.0 - beta1) ** 2 * (1.0 - beta2**step) / ((1.0 - beta2) * (1.0 - beta1**step) ** 2) * total
    return min(math.sqrt(max(worst, 1.0)), cap)


def inverse_step_bound(step: int, beta1: float, beta2: float) -> float:
    """``1 / step_bound``: what the denominator floor multiplies ``|m_hat|`` by (every kernel too)."""
    return 1.0 / step_bound(step, beta1, beta2)


def bounded_denominator(root_v: torch.Tensor, m_hat: torch.Tensor, inv_bound: float, eps: float) -> torch.Tensor:
    """``max(sqrt(v_hat), |m_hat| * inv_bound) + eps``, so ``|m_hat / denominator| <= step_bound``
    whatever the coded or factored second moment says (NaN propagates, as ``torch.maximum``)."""
    return torch.maximum(root_v, m_hat.abs().mul_(inv_bound)).add_(eps)


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


def init_m8_state(param: torch.Tensor, global_shape: tuple[int, ...], period: int, factored: bool) -> dict:
    """Zero m8 state for the local (row-sharded) ``param``."""
    state = init_momentum_state(param, global_shape, period)
    if not factored:
        state["v"] = torch.zeros_like(state["m_scale"])  # one per block
        return state
    state["v_row"] = torch.zeros(state["m_scale"].shape[0], dtype=torch.float32, device=param.device)
    state["v_col"] = torch.zeros(global_shape[1], dtype=torch.float32, device=param.device)
    return state


def m8_partials(grad: torch.Tensor, state: dict, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For a factored tensor: the new ``v_row`` (rank-local) and the float64 partial sums that
    need a global reduction, ``[column sums of g^2..., sum of the new v_row]``."""
    sq = grad.float().square()
    v_row = state["v_row"] * beta2 + sq.mean(1) * (1 - beta2)
    partials = torch.cat([sq.sum(0, dtype=torch.float64), v_row.sum(dtype=torch.float64).reshape(1)])
    return v_row, partials


def m8_update_(param: torch.Tensor, grad: torch.Tensor, state: dict, codebook: torch.Tensor, h: Hyper, *,
               global_rows: int, v_row: torch.Tensor | None = None, partials: torch.Tensor | None = None) -> None:
    """Apply one Gefen step in place (docs/design.md 3.1, m8). ``v_row``/``partials``: the factored
    tensor's results of ``m8_partials`` after the global sum; block-path tensors pass neither."""
    period = int(state["period"])
    g = grad.float()
    step = int(state["step"]) + 1
    bias1 = 1 - h.beta1**step
    bias2_sqrt = math.sqrt(1 - h.beta2**step)

    # 1. second moment -> sqrt(V)/sqrt(1-b2^t)
    if "v_row" in state:
        state["v_row"].copy_(v_row)
        col_mean = (partials[:-1] / global_rows).float()
        state["v_col"].mul_(h.beta2).add_(col_mean, alpha=1 - h.beta2)
        row_mean = (partials[-1] / global_rows).float().clamp_min(TINY)
        root_v = as_blocks(_div(M8Codec.factored(state["v_row"], state["v_col"], row_mean).sqrt_(), bias2_sqrt), period)
    else:
        block_sq = as_blocks(g, period).square().mean(-1)
        state["v"].mul_(h.beta2).add_(block_sq, alpha=1 - h.beta2)
        root_v = _div(state["v"].sqrt(), bias2_sqrt).unsqueeze(-1)

    # 2. step count
    state["step"].fill_(step)

    # 3. momentum: dequantise, EMA, re-quantise
    update = update_momentum_(state, g, h.beta1, codebook)

    # 4. decoupled weight decay and the update with the re-quantised momentum over the bounded denominator
    update = as_blocks(_div(update, bias1), period)
    update.div_(bounded_denominator(root_v, update, inverse_step_bound(step, h.beta1, h.beta2), h.eps))
    decay_and_add_(param, update.view(param.shape), h.lr, h.weight_decay)


def decay_and_add_(param: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float,
                   alpha: float | None = None) -> None:
    """Decoupled weight decay ``p *= 1 - lr * weight_decay`` (none at 0), then ``p += alpha * update``
    (``alpha``: ``-lr`` unless given), in fp32: a bf16 parameter is rounded once, at the end."""
    work = param if param.dtype in (torch.float32, torch.float64) else param.float()
    if weight_decay:
        work.mul_(1 - lr * weight_decay)
    work.add_(update, alpha=-lr if alpha is None else alpha)
    if work is not param:
        param.copy_(work)


def update_momentum_(state: dict, grad: torch.Tensor, beta: float, codebook: torch.Tensor) -> torch.Tensor:
    """``m = lerp(m, g, 1 - beta)`` stored re-quantised; returns the re-quantised momentum (fp32), so
    the update uses exactly the state it leaves behind."""
    return store_momentum_(state, momentum_ema(state, grad, beta, codebook), codebook)


def momentum_ema(state: dict, grad: torch.Tensor, beta: float, codebook: torch.Tensor) -> torch.Tensor:
    """The new compressed-layout first moment before re-quantisation (fp32, shaped like ``grad``):
    the decoded old one, then the EMA."""
    return dequantise(state["m_code"], state["m_scale"], codebook, _local_period(state)).lerp_(grad, 1 - beta)


def store_momentum_(state: dict, m: torch.Tensor, codebook: torch.Tensor,
                    scales: torch.Tensor | None = None) -> torch.Tensor:
    """Re-quantise ``m`` into the state; returns the re-quantised momentum (fp32). ``scales``:
    tensor parallelism's max-abs of each whole row (``[rows, 1]``, the one block per row a column
    split cuts), reduced over the ranks holding the row's other columns (the kernels take it too)."""
    period = _local_period(state)
    codes, scales = quantise(m, codebook, period, scales)
    state["m_code"].copy_(codes)
    state["m_scale"].copy_(scales)
    return dequantise(codes, scales, codebook, period)


def momentum_scales(state: dict, grad: torch.Tensor, beta: float, codebook: torch.Tensor) -> torch.Tensor:
    """The block scales ``update_momentum_`` would choose, state untouched: a column-split shard's
    part of its rows' scales, which tensor parallelism reduces (max) before ``update_momentum_``."""
    return block_scales(as_blocks(momentum_ema(state, grad, beta, codebook), _local_period(state)))


def _local_period(state: dict) -> int:
    """The block length on this rank: the state's ``period``, or, on a shard whose columns tensor
    parallelism splits (one block per whole row, its scale the whole row's), the local row length."""
    period, blocks = int(state["period"]), state["m_scale"].shape[-1]
    local = math.prod(state["m_code"].shape[1:])
    return period if local == period * blocks else max(local, 1)


# ----- the "m4v4" layout (contract version "2"): one byte per element (``gefen.codecs.M4V4Codec``)
M4V4_MATRIX_FIELDS, VECTOR_FIELDS = DIMENSION_FIELDS[("gefen.Gefen", "2")]  # a coded tensor's, the others'
#: under m4v4 the tensors with row blocks (two or more dims) are coded; the rest keep AdamW moments
is_coded = uses_row_period


def init_m4v4_state(param: torch.Tensor, global_shape: tuple[int, ...]) -> dict:
    """Zero m4v4 state for one parameter; ``param`` is the local (row-sharded) tensor."""
    dev = param.device
    state = {"step": torch.zeros((), dtype=torch.int64)}
    if not is_coded(global_shape):
        state["exp_avg"] = torch.zeros(param.shape, dtype=torch.bfloat16, device=dev)
        state["exp_avg_sq"] = torch.zeros(param.shape, dtype=torch.float32, device=dev)
        return state
    local_rows = param.shape[0]
    state["mv_code"] = torch.zeros(param.shape, dtype=torch.uint8, device=dev)
    state["m_row_scale"] = torch.zeros(local_rows, dtype=torch.bfloat16, device=dev)
    state["v_row"] = torch.zeros(local_rows, dtype=torch.float32, device=dev)
    # this rank's columns: all of them unless tensor parallelism splits them
    state["v_col"] = torch.zeros(math.prod(param.shape[1:]), dtype=torch.float32, device=dev)
    return state


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """A >= 2-D tensor as ``[rows, row_numel]`` (its own dtype)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _div(x: torch.Tensor, s: float) -> torch.Tensor:
    """``x / fp32(s)`` as one IEEE division on every device (CUDA turns a division by a Python
    scalar into a multiplication by its reciprocal; by a tensor it divides)."""
    return x / torch.tensor(s, dtype=torch.float32, device=x.device)


def row_square_sums(grad: torch.Tensor) -> torch.Tensor:
    """float64 sums of g^2 along each (local) row: the statistic a column split cuts, so tensor
    parallelism sums it over the ranks holding the row's other columns before ``m4v4_partials``."""
    g = rows_view(grad.float())
    return (g * g).sum(1, dtype=torch.float64)


def m4v4_partials(grad: torch.Tensor, state: dict, beta2: float, *, row_sum: torch.Tensor | None = None,
                  row_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 of an m4v4 step for a coded tensor: the new ``v_row`` (rank-local) and the float64
    partial sums that need a global reduction, ``[column sums of g^2 (C values), sum of the new
    v_row, sum of the old v_row]``. A column split (tensor parallelism) passes its whole rows'
    ``row_square_sums`` and global ``row_len``."""
    g = rows_view(grad.float())
    sq = g * g
    row_sum = sq.sum(1, dtype=torch.float64) if row_sum is None else row_sum
    v_row = state["v_row"] * beta2 + (row_sum / max(g.shape[1] if row_len is None else row_len, 1)).float() * (1 - beta2)
    partials = torch.cat([sq.sum(0, dtype=torch.float64), v_row.sum(dtype=torch.float64).reshape(1),
                          state["v_row"].sum(dtype=torch.float64).reshape(1)])
    return v_row, partials


def m4v4_update_(param: torch.Tensor, grad: torch.Tensor, state: dict, codebook: torch.Tensor, ratio: torch.Tensor,
                 h: Hyper, *, global_rows: int, v_row: torch.Tensor, partials: torch.Tensor, pidx: int, seed: int,
                 row0: int = 0, col0: int = 0, row_len: int | None = None, row_max: torch.Tensor | None = None) -> None:
    """Phase 2 of an m4v4 step for a coded tensor, in place (docs/format.md, "The m4v4 step").
    ``ratio``: ``ratio_table(v_codebook)``; ``v_row``/``partials``: ``m4v4_partials``' after the
    global sum; ``pidx``/``seed``: the noise's salts; ``row0``/``col0``/``row_len``: where the shard
    lies; ``row_max``: a column split's max |m| of each whole row."""
    b1, b2 = h.beta1, h.beta2
    step = int(state["step"]) + 1
    g = rows_view(grad.float())
    rows, cols = g.shape
    sq = g * g
    v_col = state["v_col"] * b2 + (partials[:-2] / max(global_rows, 1)).float() * (1 - b2)
    state["step"].fill_(step)
    if g.numel() == 0:
        state["v_row"].copy_(v_row)
        state["v_col"].copy_(v_col)
        if row_max is not None:  # rows without local columns: the scale the other columns' ranks keep
            state["m_row_scale"].copy_(row_max)
        return
    gidx = element_index(rows, cols, row0=row0, row_len=cols if row_len is None else row_len, col0=col0,
                         device=g.device)
    salt_m, salt_v = salts(pidx, seed)
    codec = M4V4Codec(codebook, ratio)
    vhat_old = codec.vhat(state["v_row"], state["v_col"], partials[-1], global_rows)
    vhat_new = codec.vhat(v_row, v_col, partials[-2], global_rows)

    # second moment: the decoded old one's EMA, coded as v / vhat against the ratio table
    v = codec.second_moment(state["mv_code"].reshape(g.shape), vhat_old) * b2 + sq * (1 - b2)
    vcode = encode_v(v / vhat_new.clamp_min(TINY), ratio, hash_uniform(gidx, step, salt_v))

    # first moment: per-row max-abs scale (bf16), 4-bit code
    m = m4v4_momentum(g, state, codebook, b1)
    x, scale = codec.normalise(m, row_abs_max(m) if row_max is None else row_max)
    codes = codec.pack(encode(x, codebook, hash_uniform(gidx, step, salt_m)), vcode)

    # update: this step's fp32 first moment (its 4-bit code's rounding noise stays out of the step,
    # where the bound would clip the rare rounded-up draws of small elements and bias them) over the
    # second moment decoded from its new code, with the bounded denominator
    m_hat = _div(m, 1 - b1**step)
    denom = bounded_denominator(_div(codec.second_moment(codes, vhat_new).sqrt(), math.sqrt(1 - b2**step)), m_hat,
                                inverse_step_bound(step, b1, b2), h.eps)
    decay_and_add_(param, (m_hat / denom).view(param.shape), h.lr, h.weight_decay)
    state["mv_code"].copy_(codes.view(state["mv_code"].shape))
    state["m_row_scale"].copy_(scale)
    state["v_row"].copy_(v_row)
    state["v_col"].copy_(v_col)


def m4v4_row_stats(grad: torch.Tensor, state: dict, codebook: torch.Tensor,
                   beta1: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A coded shard's per-row float64 sums of g^2 and max |m| of the new first moment: what a
    column split reduces over tensor parallelism before ``m4v4_partials`` and ``m4v4_update_``."""
    return row_square_sums(grad), row_abs_max(m4v4_momentum(grad, state, codebook, beta1))


def m4v4_momentum(grad: torch.Tensor, state: dict, codebook: torch.Tensor, beta1: float) -> torch.Tensor:
    """The new first moment of a coded tensor, fp32 ``[rows, row_numel]`` (before re-quantisation):
    the decoded old one, then the EMA."""
    g = rows_view(grad.float())
    m = M4V4Codec(codebook).momentum(state["mv_code"].reshape(g.shape), state["m_row_scale"])
    return m * beta1 + g * (1 - beta1)


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, state: dict, h: Hyper, *, pidx: int, seed: int,
                  row0: int = 0) -> None:
    """An m4v4 step of a 1-D/0-D tensor, in place: AdamW, its first moment stored in bf16 by unbiased
    stochastic rounding (noise: the hash of the global index ``row0 + i``, the step and the first
    salt), its second in fp32. The update uses the new fp32 moment; only what is stored is rounded."""
    b1, b2 = h.beta1, h.beta2
    step = int(state["step"]) + 1
    g = grad.float()
    m = state["exp_avg"].float() * b1 + g * (1 - b1)
    v = state["exp_avg_sq"] * b2 + (g * g) * (1 - b2)
    m_hat = _div(m, 1 - b1**step)
    denom = bounded_denominator(_div(v.sqrt(), math.sqrt(1 - b2**step)), m_hat, inverse_step_bound(step, b1, b2), h.eps)
    state["step"].fill_(step)
    decay_and_add_(param, m_hat / denom, h.lr, h.weight_decay)
    gidx = torch.arange(row0, row0 + m.numel(), dtype=torch.int64, device=m.device).reshape(m.shape)
    state["exp_avg"].copy_(round_bf16(m, hash_bits(gidx, step, salts(pidx, seed)[0])))
    state["exp_avg_sq"].copy_(v)


# ----- bf16_stochastic_round: the parameter written back ----------------------------------------
def param_rows(param: torch.Tensor, *, row0: int = 0, col0: int = 0,
               row_len: int | None = None) -> tuple[int, int, int, int, int]:
    """``(rows, cols, row0, row_len, col0)`` such that ``element_index`` of a ``[rows, cols]`` view
    of the rank-local ``param`` is each element's flat index in the global parameter (a 1-D shard
    is one row starting at its global offset ``row0``)."""
    if param.dim() >= 2:
        cols = math.prod(param.shape[1:])
        return param.shape[0], cols, row0, cols if row_len is None else row_len, col0
    n = param.numel()
    return 1, n, 0, n, row0


def round_param_(param: torch.Tensor, work: torch.Tensor, *, step: int, salt: int, row0: int = 0, col0: int = 0,
                 row_len: int | None = None) -> None:
    """Write fp32 ``work`` (the updated parameter) into the bf16 ``param`` by unbiased stochastic
    rounding (``round_bf16``), the noise the hash of (global element index, ``step``, ``salt``):
    the same bits for any world size, mesh or device, so a pure-bf16 run stays independent of them."""
    rows, cols, r0, row_len, c0 = param_rows(param, row0=row0, col0=col0, row_len=row_len)
    gidx = element_index(rows, cols, row0=r0, row_len=row_len, col0=c0, device=work.device)
    param.copy_(round_bf16(work.reshape(rows, cols), hash_bits(gidx, step, salt)).view(param.shape))

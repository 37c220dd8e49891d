"""Deterministic stochastic rounding for the "m4v4" state (4-bit first- and second-moment codes).

A 4-bit EMA re-quantised to the nearest code freezes, so both codes are re-quantised by
*unbiased* stochastic rounding (the second moment's in ``v ** V_POWER``, see ``encode_v``), its
noise a counter hash of (the element's index in the *global* parameter, the step, a salt): the
same bits on every world size, mesh and device. The C and Triton kernels reproduce every
function here bit for bit; change them only together.
"""

from __future__ import annotations

import torch

#: the power of v in which the second-moment rounding is unbiased. Rounding unbiased in v (power 1)
#: leaves the decoded v unbiased but its 1/sqrt(v), which the step uses, 8-9% high (the Jensen gap
#: of the codes' spread); power 1/2 makes it unbiased in log v, 1/4 in 1/sqrt(v); 1/3 keeps both
#: biases within ~1.5% (docs/decisions.md, "An unbiased second moment")
V_POWER = 1.0 / 3.0
#: shape of the fixed second-moment codebook: ``sinh(V_GRID_SHAPE * t) / sinh(V_GRID_SHAPE)`` at 16
#: evenly spaced t in [-1, 1], i.e. log-ratio codes 0.25 nats apart at the centre, where the EMA's
#: log(v / vhat) lives, widening to 2.9 nats at +-8, so no gap makes a large rare step
V_GRID_SHAPE = 3.35
#: the second-moment code is ``log(v / vhat) / LOG_RANGE`` in [-1, 1] (e^8 ~ 3000x in v)
LOG_RANGE = 8.0
#: entries of each of the two codebooks (two 4-bit codes share one byte)
CODES = 16
TINY = torch.finfo(torch.float32).tiny
#: fp32(1e-12): the smallest gap between two table entries that the rounding divides by
GUARD = float(torch.tensor(1e-12, dtype=torch.float32))

_MASK = 0xFFFFFFFF
_K_INDEX, _K_STEP, _K_SALT = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D


def salts(pidx: int, seed: int) -> tuple[int, int]:
    """``(salt_m, salt_v)`` of the parameter at position ``pidx`` of the optimizer's flat list."""
    salt_m = (2 * pidx + 7919 * seed) & _MASK
    return salt_m, (salt_m + 1) & _MASK


def param_salt(pidx: int, seed: int) -> int:
    """The salt of the parameter's own stochastic bf16 rounding (``bf16_stochastic_round``): its
    first-moment salt with the top bit flipped, so its noise is not the moments'."""
    return salts(pidx, seed)[0] ^ 0x80000000


def hash_base(step: int, salt: int) -> int:
    """``(step * 0x85EBCA77 + salt * 0xC2B2AE3D) mod 2**32``: the per-parameter part of the hash."""
    return (step * _K_STEP + salt * _K_SALT) & _MASK


def element_index(rows: int, cols: int, *, row0: int, row_len: int, col0: int = 0,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """int64 ``[rows, cols]``: ``(row0 + i) * row_len + (col0 + j)``, each element's flat index in
    the global parameter (``row_len`` = the global row length). Only the low 32 bits are used."""
    r = torch.arange(row0, row0 + rows, dtype=torch.int64, device=device).mul_(row_len)
    c = torch.arange(col0, col0 + cols, dtype=torch.int64, device=device)
    return r[:, None] + c[None, :]


def hash_bits(gidx: torch.Tensor, step: int, salt: int) -> torch.Tensor:
    """int64 tensor of the 32-bit counter hash of (``gidx`` mod 2^32, ``step``, ``salt``). int64
    wrap-around of ``gidx * K`` keeps the low 32 bits exact, so any int64 index works."""
    x = gidx.mul(_K_INDEX).add_(hash_base(step, salt)).bitwise_and_(_MASK)
    x = (x ^ (x >> 16)).mul_(0x7FEB352D).bitwise_and_(_MASK)
    x = (x ^ (x >> 15)).mul_(0x846CA68B).bitwise_and_(_MASK)
    return x ^ (x >> 16)


def hash_uniform(gidx: torch.Tensor, step: int, salt: int) -> torch.Tensor:
    """fp32 uniform noise in [0, 1) (multiples of 2^-24): the hash's top 24 bits."""
    return (hash_bits(gidx, step, salt) >> 8).to(torch.float32).mul_(2.0**-24)


def round_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Unbiased stochastic rounding of fp32 ``x`` to bfloat16: the hash's top 16 bits are added
    below the kept mantissa and the low half is dropped, so ``x`` rounds away from zero with
    probability (dropped part) / 2^16 and ``E[result] = x``. NaN stays NaN. A nearest rounding
    would freeze an EMA whose per-step change is below half a bf16 step (0.2%)."""
    b = x.float().contiguous().view(torch.int32).to(torch.int64).bitwise_and_(_MASK)
    b = b.add_(bits >> 16).bitwise_right_shift_(16).bitwise_and_(0xFFFF)
    out = b.sub_(b.ge(0x8000).long() << 16).to(torch.int16).view(torch.bfloat16)  # two's complement
    return torch.where(x.isnan(), x.to(torch.bfloat16), out)


def encode(x: torch.Tensor, table: torch.Tensor, u: torch.Tensor, kappa: torch.Tensor | None = None) -> torch.Tensor:
    """int64 codes of fp32 ``x`` in the sorted 16-entry ``table``: ``hi`` (the first entry >= x,
    clamped to [1, 15]) with probability ``p = (x - T[lo]) / max(T[hi] - T[lo], GUARD)`` clamped
    to [0, 1] (bent by ``kappa``: ``encode_v``), else ``lo = hi - 1``; decided by ``u < p``.
    Unbiased inside the table's range; out-of-range values go to the end code. NaN: unspecified."""
    lo = torch.searchsorted(table, x.contiguous(), side="left").clamp_(1, table.numel() - 1).sub_(1)
    gaps = torch.clamp_min(table[1:] - table[:-1], GUARD)  # T[hi] - T[lo], per lo
    p = ((x - table.take(lo)) / gaps.take(lo)).clamp_(0.0, 1.0)
    if kappa is not None:
        p = p + kappa.take(lo) * (p * (1.0 - p))
    return lo.add_(u < p)


def encode_v(x: torch.Tensor, table: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """int64 second-moment codes of fp32 ratios ``x = v / vhat`` against ``ratio_table``'s 32
    entries (16 sorted ratios ``R``, then 16 curvatures ``K``): ``encode``'s interpolation
    ``p = clamp((x - R[lo]) / max(R[hi] - R[lo], GUARD), 0, 1)`` bent to ``p + K[lo] * (p * (1 - p))``
    (fp32, in that order), so the rounding is unbiased in ``v ** V_POWER`` rather than in ``v``
    (docs/format.md, "The m4v4 step"); decided by ``u < p``."""
    return encode(x, table[:CODES], u, table[CODES:])


def curvatures(log_ratios: torch.Tensor, power: float) -> torch.Tensor:
    """float64 ``K`` of each interval ``[R[k], R[k + 1]]`` (``log_ratios`` = log R, float64): the
    quadratic ``p + K p (1 - p)`` that maps the fraction ``p`` of the way in ``v`` to the fraction
    of the way in ``v ** power`` matches it at the midpoint, ``K = 4 (f(1/2) - 1/2)``, clamped to
    [-1, 1] so the map stays monotone; 0 for the unused last entry and for empty intervals."""
    rho = torch.exp((log_ratios[1:] - log_ratios[:-1]).clamp_min(0.0))
    wide = rho > 1.0 + 1e-9
    safe = torch.where(wide, rho, 2.0)
    if power == 0.0:  # unbiased in log v
        frac = torch.log((1.0 + safe) / 2.0) / torch.log(safe)
    else:
        frac = (((1.0 + safe) / 2.0) ** power - 1.0) / (safe**power - 1.0)
    frac = torch.where(wide, frac, 0.5)
    kappa = (4.0 * (frac - 0.5)).clamp_(-1.0, 1.0)
    return torch.cat([kappa, kappa.new_zeros(1)])


def ratio_table(v_codebook: torch.Tensor) -> torch.Tensor:
    """32 fp32 values: the 16 ratios ``v / vhat`` the second-moment codes stand for, ``exp(8 * c)``,
    then ``encode_v``'s 16 curvatures (unbiased in ``v ** V_POWER``). Computed on the CPU in float64
    and rounded once, so every device decodes and rounds alike; decoding reads the first 16."""
    logs = v_codebook.detach().cpu().double() * LOG_RANGE
    table = torch.cat([torch.exp(logs), curvatures(logs, V_POWER)]).float()
    return table.to(v_codebook.device)


def v_grid(device: torch.device | str | None = None) -> torch.Tensor:
    """The second-moment codebook (16 sorted fp32 in [-1, 1], code ``c`` = ``log(v / vhat) / 8``):
    fixed rather than learned from the first step, whose single-sample ``g^2 / vhat`` is far wider
    than the EMA's ratio (it spent half the codes beyond -3 nats); computed in float64, rounded once."""
    t = torch.linspace(-1.0, 1.0, CODES, dtype=torch.float64)
    grid = torch.sinh(V_GRID_SHAPE * t) / torch.sinh(torch.tensor(V_GRID_SHAPE, dtype=torch.float64))
    return grid.float().to(device)


def standin_codebook(device: torch.device | str | None = None) -> torch.Tensor:
    """The table used before a codebook is learned (every moment is exactly zero then)."""
    return torch.linspace(-1.0, 1.0, CODES, dtype=torch.float32, device=device)

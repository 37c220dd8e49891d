"""Deterministic stochastic rounding for the "m4v4" state (4-bit first- and second-moment codes).

A 4-bit EMA re-quantised to the nearest code freezes (each step moves ``v`` by ~0.1% with
``beta2 = 0.999``, far below a code step), so both codes are re-quantised by *unbiased*
stochastic rounding between the two neighbouring table entries. The noise is a counter hash
of (the element's index in the *global* parameter, the step, a per-parameter salt): the same
bits on every world size, mesh and device, and nothing to store or to seed per rank.

Every function here is part of the arithmetic that the C and Triton kernels reproduce bit for
bit (docs/format.md, "The m4v4 step"); change them only together.
"""

from __future__ import annotations

import torch

#: the second-moment code is ``log(v / vhat) / LOG_RANGE`` in [-1, 1] (e^8 ~ 3000x in v)
LOG_RANGE = 8.0
#: entries of each of the two codebooks (two 4-bit codes share one byte)
CODES = 16
#: bins of the fixed-range histogram the second-moment codebook is learned from
V_BINS = 16 * CODES
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


def encode(x: torch.Tensor, table: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """int64 codes of fp32 ``x`` in the sorted 16-entry ``table``: ``hi`` (the first entry >= x,
    clamped to [1, 15]) with probability ``p = (x - T[lo]) / max(T[hi] - T[lo], GUARD)`` clamped
    to [0, 1], else ``lo = hi - 1``; decided by ``u < p``. Unbiased inside the table's range;
    out-of-range values go to the end code. NaN: unspecified."""
    lo = torch.searchsorted(table, x.contiguous(), side="left").clamp_(1, table.numel() - 1).sub_(1)
    gaps = torch.clamp_min(table[1:] - table[:-1], GUARD)  # T[hi] - T[lo], per lo
    p = ((x - table.take(lo)) / gaps.take(lo)).clamp_(0.0, 1.0)
    return lo.add_(u < p)


def ratio_table(v_codebook: torch.Tensor) -> torch.Tensor:
    """The 16 fp32 ratios ``v / vhat`` the second-moment codes stand for, ``exp(8 * c)``: computed
    on the CPU in float64 and rounded once, so every device decodes the same values."""
    ratios = torch.exp(v_codebook.detach().cpu().double() * LOG_RANGE).float()
    return ratios.to(v_codebook.device)


def standin_codebook(device: torch.device | str | None = None) -> torch.Tensor:
    """The table used before a codebook is learned (every moment is exactly zero then)."""
    return torch.linspace(-1.0, 1.0, CODES, dtype=torch.float32, device=device)


def histogram_fixed(x: torch.Tensor, num_bins: int) -> torch.Tensor:
    """int64 counts of values in [-1, 1]: bin ``clamp(floor((x + 1) / 2 * num_bins), 0, num_bins - 1)``
    in fp32 in that order (no per-block normalisation: the range is fixed)."""
    if x.numel() == 0:
        return torch.zeros(num_bins, dtype=torch.int64, device=x.device)
    idx = x.float().add(1.0).div_(2.0).mul_(num_bins).to(torch.int64).clamp_(0, num_bins - 1)  # x >= -1
    return torch.bincount(idx.reshape(-1), minlength=num_bins)

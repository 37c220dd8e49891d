"""Newton-Schulz orthogonalisation for Muon (docs/design.md 3.2): the odd matrix polynomial
``X <- a X + (b A + c A^2) X`` (``A = X X^T``) pushes every singular value of the normalised input
into a band around 1, an approximate polar factor ``U V^T`` in a handful of bf16 steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Triple = tuple[float, float, float]

#: Keller Jordan's quintic: fast growth of small singular values, band ~[0.7, 1.1] after 5 steps.
STANDARD: Triple = (3.4445, -4.7750, 2.0315)
#: Fixed-length schedules with per-step coefficients (docs/design.md 3.2); their length is the step count.
TUNED: dict[str, tuple[Triple, ...]] = {
    "tuned3": ((5.0067, -14.4125, 10.6001), (3.7534, -6.8083, 3.3840), (3.2080, -4.3501, 2.0330)),
    "tuned4": ((5.4261, -15.5285, 11.2657), (3.0766, -4.9701, 2.1297), (3.0008, -6.4486, 4.3696),
               (2.8386, -4.1421, 2.5758)),
}
#: The floor of the Frobenius norm the input is divided by (``torch.optim.Muon``'s ``eps``), so
#: that an all-zero update stays zero instead of NaN.
NORM_EPS = 1e-7


def resolve_schedule(schedule: str | Sequence[float] | Sequence[Sequence[float]], ns_steps: int) -> tuple[Triple, ...]:
    """The (a, b, c) of every step: one triple and ``"standard"`` repeat for ``ns_steps`` steps; the
    tuned and per-step schedules carry their own length (``ns_steps`` is still validated)."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}")
    if isinstance(schedule, (list, tuple)) and len(schedule) == 3 and not any(
            isinstance(x, (list, tuple)) for x in schedule):
        return (_triple(0, schedule),) * ns_steps
    if isinstance(schedule, str):
        if schedule == "standard":
            return (STANDARD,) * ns_steps
        if schedule in TUNED:
            return TUNED[schedule]
        raise ValueError(
            f"unknown ns_coefficients {schedule!r}: expected an (a, b, c) triple, 'standard', 'tuned3', 'tuned4' or a "
            "list of per-step (a, b, c)"
        )
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError(f"ns_coefficients must be an (a, b, c) triple, a schedule name or a non-empty list of "
                         f"(a, b, c), got {schedule!r}")
    return tuple(_triple(i, t) for i, t in enumerate(schedule))


def _triple(index: int, triple) -> Triple:
    if not isinstance(triple, (list, tuple)) or len(triple) != 3:
        raise ValueError(f"ns_coefficients[{index}] must be an (a, b, c) triple, got {triple!r}")
    for x in triple:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"ns_coefficients[{index}] must hold three finite numbers, got {triple!r}")
    return tuple(float(x) for x in triple)


def orthogonalise(u: torch.Tensor, schedule: str | Sequence[float] | Sequence[Sequence[float]] = "standard",
                  ns_steps: int = 5, eps: float = NORM_EPS) -> torch.Tensor:
    """bf16 approximation of the polar factor of ``u`` (``[..., rows, cols]``, batched over ``...``).

    Tall matrices are iterated transposed so the Gram matrix ``A`` is the small side. The input
    is divided by ``max(||u||_F, eps)`` (in fp32, then rounded to bf16), as ``torch.optim.Muon``.
    """
    coefficients = resolve_schedule(schedule, ns_steps)
    if u.dim() < 2:
        raise ValueError(f"orthogonalise needs a matrix (or a batch of them), got shape {tuple(u.shape)}")
    tall = u.shape[-2] > u.shape[-1]
    x = (u.mT if tall else u).float().contiguous()  # one layout, so u and u.T give the same bits
    x = x.reshape(-1, *x.shape[-2:])
    x = (x / torch.linalg.matrix_norm(x, keepdim=True).clamp_min(eps)).bfloat16()
    for a, b, c in coefficients:
        gram = _baddbmm(None, x, x.mT)
        x = _baddbmm(x, _baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.reshape(*u.shape[:-2], *x.shape[-2:])
    return x.mT if tall else x


def _baddbmm(bias: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor, beta: float = 1.0,
             alpha: float = 1.0) -> torch.Tensor:
    """``beta * bias + alpha * (x @ y)`` on bf16 batches: fp32 accumulation and one rounding, as a
    fused bf16 GEMM on tensor cores does. On CPU the operands are upcast exactly and multiplied in
    fp32: the same arithmetic up to summation order, ~5x faster where the CPU lacks bf16 units."""
    if x.device.type == "cpu":
        x, y, bias = x.float(), y.float(), None if bias is None else bias.float()
    out = torch.bmm(x, y) if bias is None else torch.baddbmm(bias, x, y, beta=beta, alpha=alpha)
    return out.bfloat16()

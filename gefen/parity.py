"""The parity harness: a kernel family runs only once it agrees with the reference.

``check`` runs small problems with the reference's step functions (``gefen.functional``) and the
kernels' from the same inputs and names the first disagreement under the family's rule:
``identical`` (bit for bit), ``within_m4v4_bound`` (the C m4v4 kernels' stated bound,
docs/design.md, "The m4v4 kernels"), or Triton's ``state_differences`` and ``params_close``.
``gefen.native.calibrate`` and ``gefen.triton.selfcheck`` hold the problems.
"""

from __future__ import annotations

import torch


class Refused(Exception):
    """A kernel declined a problem (its layout checks refused it): a disagreement."""


def outputs(problems, fns) -> list:
    """What each problem ``(run, case)`` leaves, ``run(*case, fns)``: the reference's, computed once
    for several candidates."""
    return [run(*case, fns) for run, case in problems]


def check(problems, kernels, agree, wants: list) -> str | None:
    """None when the kernels' step functions ``kernels`` leave, on every problem, what the
    reference left (``wants``, from ``outputs``) under ``agree(got, want)`` (None: they agree, else
    what differs); else the first disagreement, a declined problem included."""
    for (run, case), want in zip(problems, wants):
        try:
            got = run(*case, kernels)
        except Refused:
            return f"the kernels declined {run.__name__}{case}"
        if (why := agree(got, want)) is not None:
            return f"{why} ({run.__name__}{case})"
    return None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (fp32/bf16 compared as integers, so -0.0 != +0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (torch.float32, torch.bfloat16):
        ints = torch.int32 if a.dtype == torch.float32 else torch.int16
        a, b = a.view(ints), b.view(ints)
    return torch.equal(a, b)


def identical(got, want) -> str | None:
    """The rule of bit-exact kernels on ``(param, state)``: every bit the same."""
    (p, state), (ref_p, ref_state) = got, want
    if not same_bits(p, ref_p):
        return "parameters differ"
    bad = [k for k in ref_state if not same_bits(state[k], ref_state[k])]
    return f"state {bad} differs" if bad else None


#: m8's per-block and per-row second moments are fp32 means of g^2: the eager step sums in torch's
#: order (ATen's cascade on CPU, a tree on CUDA), the Triton kernels in float64 rounded once, so the
#: two agree to a few ulps, not bit for bit. A tree sum of n positive fp32 terms is within about
#: (log2 n + 4) 2^-24 of exact (~1e-6 for the 4236-element blocks of the check): the bound is 4x that
#: (docs/decisions.md, "Triton kernels for m8")
M8_V_RTOL = 4e-6
M8_APPROX = ("v", "v_row")


def state_differences(ref: dict, got: dict, approx: tuple[str, ...] = ()) -> str | None:
    """None when the state ``got`` is ``ref``: every field identical, those in ``approx`` (m8's
    ``M8_APPROX``: fp32 means summed in another order) within ``M8_V_RTOL``."""
    bad = [k for k, v in ref.items()
           if not (torch.allclose(got[k], v, rtol=M8_V_RTOL, atol=0, equal_nan=True) if k in approx
                   else torch.equal(v, got[k]))]
    return f"state {bad} differs from the eager step" if bad else None


def params_close(before: torch.Tensor, ref: torch.Tensor, got: torch.Tensor,
                 update_rtol: float | None = None) -> bool:
    """Equal up to one rounding of the result and of the update (torch's CPU sqrt is MKL's), or
    ``update_rtol`` of the update (m8: ``M8_V_RTOL``, the denominators' share of the second
    moments' difference)."""
    before, r, g = before.float(), ref.float(), got.float()
    eps = torch.finfo(ref.dtype).eps
    tol = eps * r.abs() + (eps if update_rtol is None else update_rtol) * (r - before).abs() + 1e-30
    return bool(((r - g).abs() <= tol).all())


#: The C m4v4 kernels' stated bound against the eager reference (docs/design.md, "The m4v4 kernels"):
#: at most this fraction of the elements is "off" (a code one codebook step away from the
#: reference's, or a parameter outside the tolerance below); no code is more than one step away.
M4V4_OFF_FRACTION = 1e-3
#: every other parameter's change agrees within this fraction of the reference's change plus one
#: unit in the last place of the parameter's dtype
M4V4_PARAM_RTOL = 1e-5
#: the fp32 second-moment statistics (v_row, v_col) agree within this relative error, float64
#: statistics (a column split's row sums) within M4V4_F64_RTOL, the bf16 row scales within one bf16 step
M4V4_STAT_RTOL, M4V4_F64_RTOL = 1e-6, 1e-12


def m4v4_disagreement(param: torch.Tensor, state: dict, ref_param: torch.Tensor, ref_state: dict,
                      before: torch.Tensor) -> str | None:
    """What breaks the m4v4 kernels' bound (``M4V4_*``) between a kernel run and the reference
    run from the same parameter ``before``, or None when nothing does. Fields the bound does not
    name (step counts, the 1-D AdamW moments) must agree bit for bit."""
    if param.shape != ref_param.shape or param.dtype != ref_param.dtype or state.keys() != ref_state.keys():
        return "shapes, dtypes or state fields differ"
    off = torch.zeros(param.numel(), dtype=torch.bool)
    for key, want in ref_state.items():
        got = state[key]
        if not isinstance(want, torch.Tensor):
            if got != want:
                return f"{key} differs"
            continue
        if key == "mv_code":
            a, b = got.reshape(-1).int(), want.reshape(-1).int()
            if bool((((a & 15) - (b & 15)).abs() > 1).any() or (((a >> 4) - (b >> 4)).abs() > 1).any()):
                return "a code is more than one step away"
            off |= a != b
        elif key == "m_row_scale":
            if not torch.allclose(got.float(), want.float(), rtol=2.0**-7, atol=0.0):
                return "a row scale is more than one bf16 step away"
        elif key in ("v_row", "v_col", "row_sum"):
            rtol = M4V4_F64_RTOL if want.dtype == torch.float64 else M4V4_STAT_RTOL
            if not torch.allclose(got, want, rtol=rtol, atol=0.0):
                return f"{key} outside its relative bound"
        elif not same_bits(got, want):
            return f"{key} differs"
    b0 = before.float().reshape(-1)
    d_got, d_want = param.float().reshape(-1) - b0, ref_param.float().reshape(-1) - b0
    ulp = torch.finfo(param.dtype).eps * ref_param.float().reshape(-1).abs()
    bad = (d_got - d_want).abs() > M4V4_PARAM_RTOL * d_want.abs() + ulp
    bad &= ~(param.reshape(-1).isnan() & ref_param.reshape(-1).isnan())
    off |= bad
    frac = off.float().mean().item() if off.numel() else 0.0
    return f"{frac:.2e} of the elements off (bound {M4V4_OFF_FRACTION:g})" if frac > M4V4_OFF_FRACTION else None


def within_m4v4_bound(got, want) -> str | None:
    """The rule of the C m4v4 kernels on ``(param, state, param before)``: ``m4v4_disagreement``."""
    (p, state, before), (ref_p, ref_state, _) = got, want
    return m4v4_disagreement(p, state, ref_p, ref_state, before)

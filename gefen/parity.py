"""The parity harness: a kernel family runs only once it agrees with the reference.

``check`` runs each problem ``(run, case)`` as ``run(*case, fns)`` with the reference's step
functions (``REFERENCE``) and a family's (``kernel_fns``), and names the first disagreement under
the family's rule (``identical``, ``within_m4v4_bound``, ``after_rounding``/``M8_RULE``, ``equal``).
A stepping runner takes ``steps``, ``(by the reference, then by fns)``.
"""

from __future__ import annotations

import types

import torch
from torch.utils._pytree import tree_leaves

from gefen import functional as F
from gefen.codebook import histogram_normalised_blocks
from gefen.codecs import M4V4Codec
from gefen.stochastic import ratio_table


class Refused(Exception):
    """A kernel declined a problem (its layout checks refused it): a disagreement."""


#: The reference's step functions, under the names the problems call.
REFERENCE = types.SimpleNamespace(
    m8_partials=F.m8_partials, m8_update=F.m8_update_, m4v4_partials=F.m4v4_partials,
    m4v4_update=F.m4v4_update_, adamw=F.adamw_update_, row_stats=F.m4v4_row_stats,
    momentum=lambda state, g, beta, codebook: F.update_momentum_(state, g.float(), beta, codebook),
    round=F.round_param_, histogram=histogram_normalised_blocks)


def kernel_fns(**fns) -> types.SimpleNamespace:
    """A family's step functions under ``REFERENCE``'s names; one that declines (returns None or
    False) raises ``Refused``."""
    def strict(fn):
        def run(*args, **kw):
            out = fn(*args, **kw)
            if out is None or out is False:
                raise Refused
            return out
        return run
    return types.SimpleNamespace(**{name: strict(fn) for name, fn in fns.items()})


def check(problems, kernels, agree) -> str | None:
    """None when ``kernels`` leave, on every problem, what the reference leaves under
    ``agree(got, want)``; else the first disagreement, a declined problem included."""
    for run, case in problems:
        want = run(*case, REFERENCE)
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
    """The rule of bit-exact kernels on ``(param, state, ...)``: every bit the same."""
    (p, state, *_), (ref_p, ref_state, *_) = got, want
    if not same_bits(p, ref_p):
        return "parameters differ"
    bad = [k for k in ref_state if not same_bits(state[k], ref_state[k])]
    return f"state {bad} differs" if bad else None


#: m8's per-block and per-row second moments are fp32 means of g^2: the eager step sums in torch's
#: order (ATen's cascade on CPU, a tree on CUDA), the C and Triton kernels in float64 rounded once, so
#: they agree to a few ulps, not bit for bit. A tree sum of n positive fp32 terms is within about
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
                 update_rtol: float | None = None, steps: int = 1) -> bool:
    """Equal up to one rounding of each step's result and two of its update (the kernels' square
    root is correctly rounded, torch's CPU one, MKL's, is not always: its error reaches the update
    through the denominator, 1.4 ulps of the update measured on AMD EPYC), or ``update_rtol`` of
    the update (m8: ``M8_V_RTOL``, the denominators' share of the second moments' difference)."""
    before, r, g = before.float(), ref.float(), got.float()
    eps = torch.finfo(ref.dtype).eps * steps
    tol = eps * r.abs() + (2 * eps if update_rtol is None else update_rtol) * (r - before).abs() + 1e-30
    return bool(((r - g).abs() <= tol).all())


def after_rounding(approx: tuple[str, ...] = (), update_rtol: float | None = None):
    """The Triton kernels' rule on ``(param, state, param before)``: ``state_differences``, then ``params_close``."""
    def agree(got, want) -> str | None:
        (p, state, before), (ref_p, ref_state, _) = got, want
        if (why := state_differences(ref_state, state, approx)) is not None:
            return why
        return None if params_close(before, ref_p, p, update_rtol) else "parameters differ from the eager step beyond rounding"
    return agree


#: The m8 kernels' rule (C and Triton)
M8_RULE = after_rounding(M8_APPROX, M8_V_RTOL)


def equal(got, want) -> str | None:
    """The rule of kernels that must give the reference's values: every tensor of the output equal
    (a zero's sign aside: an all-zero row's scale is +0 or -0 by the order of a max), NaN where the
    reference has NaN (of any pattern: torch's own bf16 cast picks one of two)."""
    for g, w in zip(tree_leaves(got), tree_leaves(want), strict=True):
        nan = w.isnan() if w.is_floating_point() else torch.zeros_like(w, dtype=torch.bool)
        if g.shape != w.shape or not (torch.equal(nan, g.isnan()) and torch.equal(g[~nan], w[~nan])):
            return "the output differs from the eager step's"
    return None


# ----- the problems ------------------------------------------------------------------------------
def _grad(gen, shape, dtype, device) -> torch.Tensor:
    """A random gradient; a matrix of three or more rows gets an all-zero row (zero scales)."""
    g = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen)
    if len(shape) == 2 and shape[0] > 2:
        g[1] = 0
    return g.to(device=device, dtype=dtype)


def run_m8(shape, period, factored, dtype, device, steps, fns):
    """m8 steps of one tensor, a row shard of a tensor three rows longer."""
    gen = torch.Generator().manual_seed(1234 + len(shape) + period)
    p = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    state = F.init_m8_state(p, tuple(shape), period, factored)
    codebook = torch.cat([torch.tensor([-1.0]), torch.sort(torch.rand(62, generator=gen) * 2 - 1).values,
                          torch.tensor([1.0])]).to(device)
    # beta1 <= 0.5 takes ATen's other lerp formula (|weight| >= 0.5): check both
    h = F.Hyper(lr=1e-2, beta1=0.9 if period % 2 else 0.4, beta2=0.99, eps=1e-8, weight_decay=0.05)
    before = None
    for i, fn in enumerate([REFERENCE] * steps[0] + [fns] * steps[1]):
        before = p.clone() if i == steps[0] else before  # the parameter before fns' first step
        g = _grad(gen, shape, dtype, device)
        v_row, partials = fn.m8_partials(g, state, h.beta2) if factored else (None, None)
        fn.m8_update(p, g, state, codebook, h, global_rows=(shape[0] if shape else 1) + 3, v_row=v_row,
                     partials=partials)
    return p, state, before


def _m4v4_problem(seed: int, shape, global_shape, dtype, device):
    """A random m4v4 tensor, its fresh state, codebooks and hyperparameters (and the generator)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    state = F.init_m4v4_state(p, global_shape)
    codebook = torch.sort(torch.rand(16, generator=gen) * 2 - 1).values.to(device)
    ratio = ratio_table(torch.sort(torch.rand(16, generator=gen) * 2 - 1).values).to(device)
    h = F.Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
    return gen, p, state, codebook, ratio, h


def run_m4v4(shape, dtype, device, steps, fns):
    """m4v4 steps of one tensor (the AdamW step of a 1-D or 0-D one)."""
    gen, p, state, codebook, ratio, h = _m4v4_problem(4321 + len(shape), shape, tuple(shape), dtype, device)
    before = None
    for i, fn in enumerate([REFERENCE] * steps[0] + [fns] * steps[1]):
        before = p.clone() if i == steps[0] else before  # the parameter before fns' first step
        g = _grad(gen, shape, dtype, device)
        if len(shape) < 2:
            fn.adamw(p, g, state, h, pidx=3, seed=1, row0=5)
            continue
        v_row, partials = fn.m4v4_partials(g, state, h.beta2)
        fn.m4v4_update(p, g, state, codebook, ratio, h, global_rows=shape[0], v_row=v_row, partials=partials,
                       pidx=3, seed=1, row0=5)
    return p, state, before


def run_m4v4_cut(shape, dtype, device, fns):
    """Two m4v4 steps of a column shard (tensor parallelism): its row statistics, scaled as the
    reduction over the other columns' ranks raises them, then both phases given them, at a column
    offset of a longer row."""
    gen, p, state, codebook, ratio, h = _m4v4_problem(2468, shape, (shape[0], 3 * shape[1]), dtype, device)
    before = p.clone()
    for _ in range(2):
        g = _grad(gen, shape, dtype, device)
        row_sum, row_max = fns.row_stats(g, state, codebook, h.beta1)
        state["row_sum"], state["row_max"] = row_sum.clone(), row_max.clone()  # compared too
        row_sum, row_max = row_sum * 2.5, row_max * 1.5
        v_row, partials = fns.m4v4_partials(g, state, h.beta2, row_sum=row_sum, row_len=3 * shape[1])
        fns.m4v4_update(p, g, state, codebook, ratio, h, global_rows=shape[0], v_row=v_row, partials=partials,
                        pidx=2, seed=1, row0=5, col0=shape[1], row_len=3 * shape[1], row_max=row_max)
    return p, state, before


def run_momentum(shape, period, dtype, device, fns):
    """GefenMuon's compressed momentum, twice: torch's lerp takes its two formulas on either side of
    weight 0.5."""
    gen = torch.Generator().manual_seed(99 + period)
    codebook = torch.sort(torch.rand(256, generator=gen) * 2 - 1).values.to(device)
    state = F.init_momentum_state(torch.zeros(shape, device=device), shape, period)
    return [fns.momentum(state, _grad(gen, shape, dtype, device), beta, codebook) for beta in (0.9, 0.3)], state


def run_round(shape, place, device, fns):
    """bf16_stochastic_round's write-back at ``place`` (row0, col0, row_len) of values across
    magnitudes with +-inf and NaN."""
    gen = torch.Generator().manual_seed(len(shape))
    work = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 8)
    if work.numel() > 3:
        work.view(-1)[:3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    row0, col0, row_len = place
    fns.round(out, work.to(device), step=7, salt=12345, row0=row0, col0=col0, row_len=row_len)
    return out


def run_histogram(shape, dtype, device, fns):
    """The first step's histogram of ``shape``'s blocks, then of its rows normalised by given
    scales (a column split's whole rows')."""
    x = _grad(torch.Generator().manual_seed(len(shape)), shape, dtype, device)
    rows = x.reshape(-1, shape[-1])
    return fns.histogram(x, 4096), fns.histogram(rows, 256, rows.float().abs().amax(1) * 1.5)


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
            if any(bool(((x - y).abs() > 1).any()) for x, y in zip(M4V4Codec.unpack(a), M4V4Codec.unpack(b))):
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

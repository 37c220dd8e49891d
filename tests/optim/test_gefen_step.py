"""Gefen's step against a dense, slow, obvious reference written here (docs/design.md 3.1, m8).

The reference below is the "m8" layout (``moments="m8"``, contract version "1"); the default
"m4v4" step is pinned bit for bit by tests/optim/test_m4v4_reference.py, and the optimizer's plumbing
of it (codebook learning, parameter positions, seeds, groups) by the m4v4 tests at the end.

The reference dequantises with ``codebook[codes.long()] * scale``, lerps, takes the per-block
max-abs, picks codes by ``argmin |x - c|`` (float64, exact for fp32 inputs; ties to the lower
code), builds the factored ``V = outer(v_row, v_col) / mean(v_row)``, bias-corrects and applies
decoupled weight decay. Codes, scales and second moments must be bit-for-bit equal after every
step, parameters within 1 ulp; the fused C step's (``native``) second-moment means within
``parity.M8_V_RTOL`` and parameters within the drift of several steps' rounding. One exception,
on purpose: the implementation stores the scale of an all-zero block as -0.0 (``max(amax, -amin)``
of zeros), the obvious ``|m|.amax()`` gives +0.0; both dequantise to 0, so scales are compared
with the sign of zero ignored.

Floating-point results depend on the order of roundings, so the reference rounds where the
formula of docs/design.md section 3 does: reductions over rows are float64 rounded once (they
cross ranks, see docs/decisions.md), and the EMAs ``b2*v + (1-b2)*x`` on ``v``/``v_col`` and the final
``p - lr*u`` are written as ``torch.add(a, b, alpha=...)`` (one fused multiply-add on CPU) as
the implementation does; ``v_row``'s EMA is two products and a sum.
"""

from __future__ import annotations

import math

import pytest
import torch

from gefen import Gefen, c_kernels, dispatch, parity
from gefen.codebook import learn_codebook
from gefen.functional import (
    Hyper,
    adamw_update_,
    init_m4v4_state,
    inverse_step_bound,
    m4v4_partials,
    m4v4_update_,
)
from gefen.geometry import as_blocks, rows_and_row_numel, shape_period
from gefen.stochastic import ratio_table, v_grid

pytestmark = pytest.mark.usefixtures("one_thread")

HYPER = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


@pytest.fixture(params=["eager", "native"])
def step_path(request, monkeypatch):
    """Run a test on the eager torch step and on the fused native step (when built and verified)."""
    if request.param == "eager":
        monkeypatch.setattr(dispatch, "enabled", False)
    elif not c_kernels.available():
        pytest.skip("the native fused step is not available here")
    return request.param


# ----- the reference --------------------------------------------------------------------------
def nearest_codes(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codebook entry; argmin returns the first (lowest) of tied minima."""
    return (x.double().unsqueeze(-1) - codebook.double()).abs().argmin(-1)


def zero_state(shape, period, factored):
    rows, row_numel = rows_and_row_numel(shape)
    st = {"step": 0, "period": period, "m_code": torch.zeros(shape, dtype=torch.uint8),
          "m_scale": torch.zeros(rows, row_numel // period)}
    if factored:
        st["v_row"], st["v_col"] = torch.zeros(rows), torch.zeros(row_numel)
    else:
        st["v"] = torch.zeros(rows, row_numel // period)
    return st


def reference_step(param, grad, st, codebook, lr, betas, eps, weight_decay):
    """One Gefen step on dense tensors; updates ``st`` and returns the new parameter."""
    beta1, beta2 = betas
    rows, _ = rows_and_row_numel(param.shape)
    P = st["period"]
    g = grad.float().reshape(rows, -1, P)
    st["step"] += 1
    t = st["step"]

    # 1. second moment and the root of the denominator
    if "v_row" in st:
        sq = g.reshape(rows, -1).square()
        st["v_row"] = st["v_row"] * beta2 + sq.mean(1) * (1 - beta2)
        st["v_col"] = torch.add(st["v_col"] * beta2, sq.double().mean(0).float(), alpha=1 - beta2)
        row_mean = st["v_row"].double().mean().float().clamp_min(torch.finfo(torch.float32).tiny)
        V = torch.outer(st["v_row"], st["v_col"]) / row_mean
        root = (V.sqrt() / math.sqrt(1 - beta2**t)).reshape(rows, -1, P)
    else:
        st["v"] = torch.add(st["v"] * beta2, g.square().mean(-1), alpha=1 - beta2)
        root = (st["v"].sqrt() / math.sqrt(1 - beta2**t)).unsqueeze(-1)

    # 2. decoupled weight decay (fp32 arithmetic for low-precision parameters)
    work = param.to(torch.float64 if param.dtype == torch.float64 else torch.float32)
    work = work * (1 - lr * weight_decay)

    # 3. momentum: dequantise, lerp, re-quantise
    m = codebook[st["m_code"].long()].reshape(rows, -1, P) * st["m_scale"].unsqueeze(-1)
    m = torch.lerp(m, g, 1 - beta1)
    scale = m.abs().amax(-1)
    codes = nearest_codes(m / torch.where(scale == 0, 1.0, scale).unsqueeze(-1), codebook)
    codes[scale == 0] = 0
    st["m_code"], st["m_scale"] = codes.to(torch.uint8).reshape(param.shape), scale

    # 4. update with the re-quantised momentum over the bounded denominator
    m_hat = codebook[codes] * scale.unsqueeze(-1) / (1 - beta1**t)
    update = m_hat / (torch.maximum(root, m_hat.abs() * inverse_step_bound(t, beta1, beta2)) + eps)
    return torch.add(work, update.reshape(param.shape), alpha=-lr).to(param.dtype)


# ----- helpers ---------------------------------------------------------------------------------
def structured_grad(shape, period, seed, dtype=torch.float32, zero_block=True):
    """Row scales x per-block scales x noise (so the rule picks ``period``), first block zeroed."""
    gen = torch.Generator().manual_seed(seed)
    rows, row_numel = rows_and_row_numel(shape)
    r = 10 ** (0.3 * (2 * torch.rand(rows, 1, generator=gen) - 1))
    s = (10 ** -torch.rand(rows, row_numel // period, generator=gen)).repeat_interleave(period, 1)
    g = r * s * torch.randn(rows, row_numel, generator=gen)
    if zero_block and row_numel > 1:
        g[0, :period] = 0
    return g.reshape(shape).to(dtype)


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest distance between a and b in units of b's last place (in b's dtype)."""
    mant = {torch.float32: 23, torch.bfloat16: 7, torch.float64: 52}[b.dtype]
    a64, b64 = a.double(), b.double()
    exponent = torch.floor(torch.log2(b64.abs().clamp_min(torch.finfo(b.dtype).tiny)))
    return ((a64 - b64).abs() / torch.exp2(exponent - mant)).max().item() if b.numel() else 0.0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (so -0.0 differs from +0.0, and a NaN equals the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_matches(opt, param, ref_param, ref_state, label):
    st = opt.state[param]
    fused = dispatch.enabled and c_kernels.available() and param.dtype != torch.float64  # summed in another order
    assert int(st["step"]) == ref_state["step"] and int(st["period"]) == ref_state["period"]
    assert st["m_code"].dtype == torch.uint8
    for name in ("m_code", "m_scale", "v", "v_row", "v_col"):
        if name in ref_state:
            got, want = st[name], ref_state[name]
            if name == "m_scale":  # all-zero blocks store -0.0 (max(amax, -amin)); |m|.amax gives +0.0
                got, want = got + 0.0, want + 0.0
            if fused and name in parity.M8_APPROX:
                assert torch.allclose(got, want, rtol=parity.M8_V_RTOL, atol=0), f"{label}: {name} outside its bound"
                continue
            assert same_bits(got, want), f"{label}: {name} differs from the reference"
    books = {"codebook", "v_codebook"} & set(st)  # the optimizer-wide books, shared into each entry
    for name in books:
        assert getattr(opt, name) is None or st[name] is getattr(opt, name), f"{label}: {name} is a copy"
    assert set(st) - books == {"step", "period"} | {k for k in ref_state if k not in ("step", "period")}
    if fused:
        assert torch.allclose(param.detach().float(), ref_param.float(), rtol=torch.finfo(param.dtype).eps, atol=1e-6), \
            f"{label}: parameter off by more than rounding"
    else:
        assert ulps(param.detach(), ref_param) <= 1, f"{label}: parameter more than 1 ulp off"


def run_against_reference(specs, steps=4, **opt_kwargs):
    """Step a Gefen optimizer and the reference side by side on the given parameters.

    ``specs``: list of (shape, planted period, dtype). Gradients change every step; the period
    and codebook come from the optimizer's first step (they have their own tests).
    Returns the optimizer and its parameters after the last comparison.
    """
    hyper = {**HYPER, **{k: v for k, v in opt_kwargs.items() if k in HYPER}}
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape, _, dtype in specs]
    opt = Gefen(params, **{**HYPER, "moments": "m8", **opt_kwargs})
    refs = [p.detach().clone() for p in params]
    states = [None] * len(params)
    for step in range(steps):
        grads = [structured_grad(shape, period, 100 * step + i, dtype) for i, (shape, period, dtype) in enumerate(specs)]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, (p, g) in enumerate(zip(params, grads)):
            if states[i] is None:
                states[i] = zero_state(p.shape, int(opt.state[p]["period"]), "v_row" in opt.state[p])
            refs[i] = reference_step(refs[i], g, states[i], opt.codebook, **hyper)
            assert_matches(opt, p, refs[i], states[i], f"{tuple(p.shape)} {p.dtype} step {step + 1}")
    return opt, params


# ----- tests -----------------------------------------------------------------------------------
CASES = {
    "matrix-factored": ([((48, 96), 32, torch.float32)], dict(factored_v_2d=True)),
    "matrix-block": ([((48, 96), 32, torch.float32)], dict(factored_v_2d=False)),
    "matrix-one-block-per-row": ([((32, 64), 8, torch.float32)], dict()),
    "conv2d-weight": ([((16, 8, 3, 3), 9, torch.float32)], dict()),
    "conv1d-weight": ([((12, 10, 6), 12, torch.float32)], dict()),
    "vector": ([((50,), 1, torch.float32)], dict()),
    "scalar": ([((), 1, torch.float32)], dict()),
    "bf16-factored": ([((48, 96), 32, torch.bfloat16)], dict()),
    "bf16-block-3d": ([((12, 10, 6), 12, torch.bfloat16), ((30,), 1, torch.bfloat16)], dict()),
    "float64": ([((24, 48), 16, torch.float64)], dict()),
    "no-weight-decay-small-codebook": ([((48, 96), 32, torch.float32)], dict(weight_decay=0.0, codebook_size=16)),
    "mixed-model": ([((64, 96), 48, torch.float32), ((96, 64), 64, torch.float32), ((64,), 1, torch.float32),
                     ((8, 6, 5), 10, torch.float32), ((), 1, torch.float32)], dict()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_steps_match_dense_reference(case, step_path):
    """Several steps: codes, scales, second moments bit-for-bit, parameters within 1 ulp."""
    specs, kwargs = CASES[case]
    opt, params = run_against_reference(specs, **kwargs)
    for p in params:
        assert int(opt.state[p]["period"]) == shape_period(p.shape)


def test_zero_gradient_block_keeps_zero_scale_and_code_zero(step_path):
    """A block whose gradients are always zero has scale 0 and code 0 (and its parameters only decay)."""
    opt, (p,) = run_against_reference([((48, 96), 96, torch.float32)], steps=2)
    st = opt.state[p]
    assert st["m_scale"][0, 0] == 0 and st["m_scale"][1, 0] > 0
    assert (st["m_code"][0] == 0).all()


def test_param_groups_use_their_own_hyperparameters(step_path):
    """Two groups with different lr/betas/eps/weight decay/factoring each follow their own numbers."""
    a, b = torch.nn.Parameter(torch.randn(48, 96)), torch.nn.Parameter(torch.randn(48, 96))
    hyper_a = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    hyper_b = dict(lr=2e-2, betas=(0.5, 0.9), eps=1e-4, weight_decay=0.3)
    opt = Gefen([{"params": [a], **hyper_a}, {"params": [b], **hyper_b, "factored_v_2d": False}], moments="m8")
    refs, states = [a.detach().clone(), b.detach().clone()], [None, None]
    for step in range(3):
        grads = [structured_grad(a.shape, 32, 10 * step), structured_grad(b.shape, 32, 10 * step + 1)]
        a.grad, b.grad = grads[0].clone(), grads[1].clone()
        opt.step()
        for i, (p, hyper) in enumerate(((a, hyper_a), (b, hyper_b))):
            if states[i] is None:
                states[i] = zero_state(p.shape, int(opt.state[p]["period"]), factored=i == 0)
            refs[i] = reference_step(refs[i], grads[i], states[i], opt.codebook, **hyper)
            assert_matches(opt, p, refs[i], states[i], f"group {i} step {step + 1}")


def test_codebook_is_learned_once_from_the_first_gradients():
    """The codebook is the exact k-means of the first step's block-normalised gradients (P > 1
    tensors only) and does not change afterwards."""
    specs = [((48, 96), 96), ((16, 8, 3, 3), 72), ((40,), 1)]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape, _ in specs]
    grads = [structured_grad(shape, period, i) for i, (shape, period) in enumerate(specs)]
    for p, g in zip(params, grads):
        p.grad = g
    opt = Gefen(params, codebook_size=32, moments="m8")
    opt.step()
    want = learn_codebook([as_blocks(g, period) for g, (_, period) in zip(grads, specs) if period > 1], 32, 16)
    assert torch.equal(opt.codebook, want)
    assert opt.codebook[0] == -1 and opt.codebook[-1] == 1 and (opt.codebook.diff() >= 0).all()
    for p in params:
        p.grad = torch.randn(p.shape) * 100
    opt.step()
    assert torch.equal(opt.codebook, want)


def test_vectors_follow_torch_adamw():
    """Cross-check with torch: on a 1-D tensor Gefen takes AdamW's steps up to its bf16 first
    moment's unbiased rounding (relative noise up to 2^-8 per step in each update, a random walk):
    after 20 steps of lr 1e-2 (up to 0.2 of movement) the parameters agree to 5% of one step
    (measured: 2.6%), and the gradient-free elements exactly."""
    p1, p2 = torch.nn.Parameter(torch.ones(64)), torch.nn.Parameter(torch.ones(64))
    gefen, adamw = Gefen([p1], **HYPER), torch.optim.AdamW([p2], **HYPER)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        g = torch.randn(64, generator=gen)
        g[:4] = 0
        p1.grad, p2.grad = g.clone(), g.clone()
        gefen.step()
        adamw.step()
    assert float((p1 - p2).detach().abs().max()) < 0.05 * HYPER["lr"]
    assert torch.equal(p1[:4], p2[:4])


def test_step_never_writes_into_the_gradient():
    """The gradient is read only (float64 too: no statistic squares it in place)."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        p = torch.nn.Parameter(torch.randn(24, 40, dtype=dtype))
        p.grad = structured_grad(p.shape, 20, 0, dtype)
        before = p.grad.clone()
        opt = Gefen([p])
        opt.step()
        opt.step()
        assert torch.equal(p.grad, before), dtype


def test_float64_params_keep_float64_precision():
    """lr = 0 leaves float64 parameters bit-identical (no rounding to fp32 on the way)."""
    p = torch.nn.Parameter(torch.randn(24, 40, dtype=torch.float64))
    before = p.detach().clone()
    p.grad = structured_grad(p.shape, 20, 0, torch.float64)
    Gefen([p], lr=0.0, weight_decay=0.1).step()
    assert torch.equal(p.detach(), before)


# ----- the m4v4 layout: the optimizer drives the reference functions ------------------------------
def test_m4v4_learns_both_codebooks_at_the_first_nonzero_step():
    specs = [((48, 96), 96), ((16, 8, 3, 3), 72), ((40,), 1)]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape, _ in specs]
    opt = Gefen(params, betas=(0.9, 0.99))
    for p in params:
        p.grad = torch.zeros(p.shape)
    opt.step()
    assert opt.codebook is None and opt.v_codebook is None  # nothing to learn from yet
    grads = [structured_grad(shape, period, i) for i, (shape, period) in enumerate(specs)]
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    want = learn_codebook([as_blocks(g, period) for g, (_, period) in zip(grads, specs) if period > 1], 16, 16)
    assert torch.equal(opt.codebook, want)
    assert torch.equal(opt.v_codebook, v_grid())  # the second moment's is fixed
    assert opt.v_codebook[0] == -1 and opt.v_codebook[-1] == 1 and (opt.v_codebook.diff() >= 0).all()
    for p in params:
        p.grad = torch.randn(p.shape) * 100
    opt.step()
    assert torch.equal(opt.codebook, want)


@pytest.mark.parametrize("seed", [0, 3])
def test_m4v4_optimizer_steps_are_the_reference_functions(seed, monkeypatch):
    """Several groups, a bf16 and a 1-D tensor: each coded tensor takes ``m4v4_update_`` with its
    position in the flat parameter list and its group's seed, each 1-D tensor ``adamw_update_``
    (on the eager path, bit for bit; the C kernels' bound on the same routing:
    tests/optim/test_native_m4v4.py::test_optimizer_matches_the_reference)."""
    monkeypatch.setattr(dispatch, "enabled", False)
    gen = torch.Generator().manual_seed(seed)
    shapes = [(24, 40), (10,), (12, 5, 3), (40, 24)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    params[3].data = params[3].data.bfloat16()
    hyper_b = dict(lr=2e-2, betas=(0.5, 0.9), eps=1e-4, weight_decay=0.3)
    opt = Gefen([{"params": params[:2]}, {"params": params[2:], **hyper_b, "seed": seed + 1}],
                lr=1e-2, weight_decay=0.1, seed=seed)
    hypers = [Hyper(1e-2, 0.9, 0.999, 1e-8, 0.1)] * 2 + [Hyper(2e-2, 0.5, 0.9, 1e-4, 0.3)] * 2
    seeds = [seed, seed, seed + 1, seed + 1]
    refs = [p.detach().clone() for p in params]
    states = [None] * 4
    for step in range(3):
        grads = [torch.randn(s, generator=gen).to(p.dtype) for s, p in zip(shapes, params)]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ratio = ratio_table(opt.v_codebook)
        for i, (ref, g, h) in enumerate(zip(refs, grads, hypers)):
            if states[i] is None:
                states[i] = init_m4v4_state(ref, tuple(ref.shape))
            if ref.dim() < 2:
                adamw_update_(ref, g, states[i], h, pidx=i, seed=seeds[i])
            else:
                v_row, partials = m4v4_partials(g, states[i], h.beta2)
                m4v4_update_(ref, g, states[i], opt.codebook, ratio, h, global_rows=ref.shape[0], v_row=v_row,
                             partials=partials, pidx=i, seed=seeds[i])
            assert same_bits(params[i].detach(), ref), f"param {i} step {step + 1}"
            for name, value in states[i].items():
                assert same_bits(opt.state[params[i]][name], value), f"param {i} {name} step {step + 1}"


def test_a_state_with_a_learned_v_codebook_loads_and_keeps_it():
    """A version-"2" state may hold a ``v_codebook`` learned at the first step rather than the fixed grid;
    the codes mean the same (decode unchanged), so such a state loads as it is, keeps its codebook
    and steps with the rounding derived from it (the curvatures of its own ratio table)."""
    gen = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(12, 20, generator=gen))
    opt = Gefen([p], lr=1e-2, weight_decay=0.0)
    p.grad = torch.randn(12, 20, generator=gen)
    opt.step()
    learned = torch.tensor([-1.0, -0.79, -0.63, -0.5, -0.38, -0.29, -0.2, -0.13, -0.06, 0.0, 0.05, 0.11,
                            0.19, 0.28, 0.41, 1.0])  # the shape of a first-step DP solution
    opt.v_codebook = learned.clone()
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    resumed = Gefen([q], lr=1e-2, weight_decay=0.0)
    resumed.load_state_dict(sd)
    assert torch.equal(resumed.v_codebook, learned)
    g = torch.randn(12, 20, generator=gen)
    for opt_, param in ((opt, p), (resumed, q)):
        param.grad = g.clone()
        opt_.step()
    assert torch.equal(p.detach(), q.detach())
    assert torch.equal(opt.state[p]["mv_code"], resumed.state[q]["mv_code"])
    assert torch.equal(resumed.v_codebook, learned)  # never re-learned


def test_m4v4_refuses_what_it_cannot_represent():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="codebook_size must be 16"):
        Gefen([p], codebook_size=256)
    with pytest.raises(ValueError, match="factored_v_2d=False needs moments='m8'"):
        Gefen([p], factored_v_2d=False)
    with pytest.raises(ValueError, match="factored_v_2d=False needs moments='m8'"):
        Gefen([{"params": [p], "factored_v_2d": False}])
    with pytest.raises(ValueError, match="moments must be one of"):
        Gefen([p], moments="m2")
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        Gefen([p], seed=-1)
    with pytest.raises(ValueError, match="moments is optimizer-wide"):
        Gefen([{"params": [p], "moments": "m8"}])
    assert Gefen([p], moments="m8").codebook_size == 256 and Gefen([p]).codebook_size == 16

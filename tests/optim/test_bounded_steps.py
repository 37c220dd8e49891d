"""The bounded-steps rule itself (docs/design.md, "Bounded steps"): ``step_bound`` is AdamW's own
worst case, the bounded denominator keeps every update within it on adversarial state for the
reference and the C kernels alike, a zero first moment codes to exactly zero on the C kernel's
least likely noise draw, and state saved with a codebook that has no exact zero still loads and
steps within the bound. End-to-end networks are tests/optim/test_stability.py's."""

from __future__ import annotations

import math

import pytest
import torch

import gefen.c_kernels as c_kernels
import gefen.codebook as codebook_mod
from gefen import Gefen, dispatch
from gefen.functional import (
    STEP_CAP,
    Hyper,
    bounded_denominator,
    init_m4v4_state,
    init_m8_state,
    inverse_step_bound,
    m8_update_,
    step_bound,
)
from gefen.stochastic import hash_bits, ratio_table, salts, v_grid

pytestmark = pytest.mark.timeout(120)
BETAS = [(0.9, 0.999), (0.9, 0.95), (0.5, 0.9), (0.0, 0.999), (0.95, 0.9)]


@pytest.fixture(params=["kernels", "reference"])
def path(request, monkeypatch):
    if request.param == "kernels" and not c_kernels.available():
        pytest.skip("the C kernels are not built or not verified on this machine")
    monkeypatch.setattr(dispatch, "enabled", request.param == "kernels")
    return request.param


def adamw_ratios(grads: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """|m_hat| / sqrt(v_hat) of exact (float64) AdamW moments after each step of ``grads`` ``[T, n]``."""
    m = v = torch.zeros(grads.shape[1], dtype=torch.float64)
    out = []
    for t, g in enumerate(grads.double(), 1):
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        out.append(((m / (1 - beta1**t)).abs() / (v / (1 - beta2**t)).sqrt()).nan_to_num(0.0))  # 0 / 0: no history
    return torch.stack(out)


@pytest.mark.parametrize("beta1,beta2", BETAS)
def test_step_bound_is_adamws_own_worst_case_capped_at_its_lone_gradient_step(beta1, beta2):
    bounds = [step_bound(t, beta1, beta2) for t in range(1, 3001)]
    cap = max(STEP_CAP, (1 - beta1) / math.sqrt(1 - beta2))
    assert bounds[0] == pytest.approx(1.0)
    assert all(b2 >= b1 - 1e-12 for b1, b2 in zip(bounds, bounds[1:])) and max(bounds) <= cap + 1e-12
    assert inverse_step_bound(7, beta1, beta2) == 1 / step_bound(7, beta1, beta2)
    # ordinary histories of exact moments never pass it, so the floor never binds on them:
    # heavy-tailed, sparse (rare spikes after quiet runs) and biased gradients for 1,000 steps
    gen = torch.Generator().manual_seed(0)
    steps, n = 1000, 600
    grads = torch.cat([torch.randn(steps, n, generator=gen) * torch.exp(3 * torch.randn(steps, n, generator=gen)),
                       torch.randn(steps, n, generator=gen) * (torch.rand(steps, n, generator=gen) < 0.02),
                       torch.randn(steps, n, generator=gen) + 0.5], dim=1)
    ratios = adamw_ratios(grads, beta1, beta2)
    limit = torch.tensor(bounds[:steps], dtype=torch.float64)[:, None]
    assert (ratios <= limit * (1 + 1e-9)).all()
    # the Cauchy-Schwarz history (g_k proportional to the weights' ratio) reaches it where the cap does not bind
    t = 40
    k = torch.arange(t - 1, -1, -1, dtype=torch.float64)  # age of each step's gradient
    extremal = (((1 - beta1) * beta1**k) / ((1 - beta2) * beta2**k))[:, None]
    reached = adamw_ratios(extremal, beta1, beta2)[-1, 0].item()
    assert reached == pytest.approx(step_bound(t, beta1, beta2), rel=1e-9) or step_bound(t, beta1, beta2) == cap


def test_bounded_denominator_bounds_every_ratio_and_propagates_nan():
    root = torch.tensor([0.0, 0.0, 1e-30, 2.0, 1.0, float("nan"), 1.0])
    m_hat = torch.tensor([0.0, 5.0, 1e-20, 1.0, -1e6, 1.0, float("nan")])
    den = bounded_denominator(root, m_hat.clone(), 1 / 3.0, 1e-8)
    ratio = (m_hat / den).abs()
    assert ratio[0] == 0 and (ratio[1:5] <= 3.0 * (1 + 1e-6)).all() and ratio[5:].isnan().all()
    assert den[3].item() == pytest.approx(2.0 + 1e-8)  # the second moment governs where it is larger


def _m8_step(p, g, state, codebook, h):
    if "v_row" in state:
        v_row, partials = dispatch.m8_partials(g, state, h.beta2)
        dispatch.m8_update_(p, g, state, codebook, h, global_rows=p.shape[0], v_row=v_row, partials=partials)
    else:
        dispatch.m8_update_(p, g, state, codebook, h, global_rows=p.shape[0])


def _m4v4_step(p, g, state, codebook, h):
    v_row, partials = dispatch.m4v4_partials(g, state, h.beta2)
    dispatch.m4v4_update_(p, g, state, codebook, ratio_table(v_grid()), h, global_rows=p.shape[0], v_row=v_row,
                          partials=partials, pidx=0, seed=0)


@pytest.mark.parametrize("layout", ["m4v4", "m8-factored", "m8-block"])
@pytest.mark.parametrize("scale", [1e-12, 1.0, 1e6])
def test_every_update_is_within_the_bound_on_dead_and_waking_columns(path, layout, scale):
    """Columns dead for 30 steps, then alive; a codebook with no exact zero (state saved before it
    had one), so the dead columns' coded momentum is not zero: |update| / lr <= step_bound(t) anyway,
    at every step, for gradients of any scale."""
    gen = torch.Generator().manual_seed(3)
    rows, cols = 24, 40
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    p = torch.randn(rows, cols, generator=gen)
    if layout == "m4v4":
        state, codebook, step = init_m4v4_state(p, (rows, cols)), torch.linspace(-1, 1, 16), _m4v4_step
    else:
        state = init_m8_state(p, (rows, cols), cols, factored=layout == "m8-factored")
        codebook, step = torch.linspace(-1, 1, 256), _m8_step
    assert not (codebook == 0).any()
    worst = 0.0
    for t in range(1, 61):
        g = torch.randn(rows, cols, generator=gen) * scale
        if t <= 30:
            g[:, :10] = 0  # dead input features
        before = p.clone()
        step(p, g, state, codebook, h)
        moved = (p - before).abs()
        # the parameter's own rounding (half an ulp of |p| ~ 1) is 6e-6 of a step of lr 1e-2: allowed on top
        limit = h.lr * step_bound(t, h.beta1, h.beta2) * (1 + 1e-6) + torch.finfo(p.dtype).eps * before.abs()
        assert moved.isfinite().all() and (moved <= limit).all(), (t, (moved / h.lr).max().item())
        worst = max(worst, (moved / h.lr).max().item())
    assert worst > 0.5 or scale == 1e-12  # the test moved something (eps dominates at 1e-12)


#: a global flat index whose hash at step 1 under salts(0, 0)[0] is the largest uniform, 1 - 2^-24:
#: the one draw for which a stochastic rounding with p a hair below 1 rounds down
_UNLUCKY = 4890400


def test_m4v4_kernel_codes_a_zero_moment_to_zero_on_the_least_likely_draw(path):
    """With a codebook entry d = 0.010441022 below its zero, fp32 1/d times d is 0.99999994: the C
    kernel's reciprocal spacing is rounded up so p is 1 there, and the zero survives u = 1 - 2^-24."""
    assert (hash_bits(torch.tensor([_UNLUCKY]), 1, salts(0, 0)[0]) >> 8).item() == 0xFFFFFF
    d = torch.tensor(0.010441022, dtype=torch.float32)
    assert (d * (1 / d)).item() < 1.0
    book = torch.cat([torch.linspace(-1, -0.1, 7), -d[None], torch.zeros(1), torch.linspace(0.1, 1, 7)])
    cols = 8
    p = torch.randn(1, cols)
    g = torch.zeros(1, cols)
    g[0, 1:] = 1.0  # a live row: its scale is not zero
    state = init_m4v4_state(p, (1, cols))
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    before = p.clone()
    row0 = _UNLUCKY // cols  # element (0, 0) is global index _UNLUCKY
    v_row, partials = dispatch.m4v4_partials(g, state, h.beta2)  # the path fixture picks kernels or reference
    dispatch.m4v4_update_(p, g, state, book, ratio_table(v_grid()), h, global_rows=row0 + 1, v_row=v_row,
                          partials=partials, pidx=0, seed=0, row0=row0)
    assert (state["mv_code"][0, 0] & 15).item() == 8 and p[0, 0] == before[0, 0]


def test_state_without_an_exact_zero_loads_and_steps_within_the_bound(tmp_path, monkeypatch):
    """State whose codebook has no exact zero (learned before it had one) is still 2.0 state: it
    saves and loads bit for bit, and the loaded optimizer steps within the bound."""
    import gefen_ckpt

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with monkeypatch.context() as patch:  # the codebook as learned before: the k-means optimum alone
        patch.setattr(codebook_mod, "with_exact_zero", lambda book: book.copy())
        opt = Gefen(net.named_parameters(), lr=1e-2, weight_decay=0.0)
        x = torch.rand(64, 32)
        x[:, :8] = 0
        for _ in range(3):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    assert not (opt.codebook == 0).any()
    gefen_ckpt.save(opt, tmp_path / "ckpt")
    fresh = Gefen(net.named_parameters(), lr=1e-2, weight_decay=0.0)
    gefen_ckpt.load(fresh, tmp_path / "ckpt")
    assert torch.equal(fresh.codebook, opt.codebook)
    for p in net.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(fresh.state[p][k], v), k
    for t in range(4, 24):
        before = [p.detach().clone() for p in net.parameters()]
        fresh.zero_grad()
        net(x).square().mean().backward()
        fresh.step()
        moved = max(((p.detach() - b).abs().max().item() for p, b in zip(net.parameters(), before))) / 1e-2
        assert moved <= step_bound(t, 0.9, 0.999) * (1 + 1e-5)


def test_m8_update_reference_matches_its_parts():
    """The m8 reference's update is m_hat / bounded_denominator with the block's sqrt(v_hat): one
    block, P = cols, exact arithmetic checked against the formula."""
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(3, 5, generator=gen)
    state, book = init_m8_state(p, (3, 5), 5, factored=False), torch.linspace(-1, 1, 255)
    book = torch.from_numpy(codebook_mod.with_exact_zero(book.double().numpy())).float()
    h = Hyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    g = torch.randn(3, 5, generator=gen)
    before = p.clone()
    m8_update_(p, g, state, book, h, global_rows=3)
    m_hat = book[state["m_code"].long()] * state["m_scale"] / (1 - h.beta1)
    root = (state["v"].sqrt() / math.sqrt(1 - h.beta2))
    want = m_hat / bounded_denominator(root.expand_as(m_hat).clone(), m_hat.clone(), inverse_step_bound(1, 0.9, 0.999),
                                       h.eps)
    assert torch.equal(p, torch.add(before, want, alpha=-h.lr))

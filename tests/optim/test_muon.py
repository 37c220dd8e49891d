"""GefenMuon and Newton-Schulz: singular-value bands, transposition, schedule validation, one step
against a dense reference, the compressed momentum against Gefen's encoder, state round trips."""

from __future__ import annotations

import io
import math

import pytest
import torch

import gefen.newton_schulz as ns
from gefen import Gefen, GefenMuon, contract_of
from gefen.muon import lr_scale
from gefen.newton_schulz import STANDARD, TUNED, orthogonalise, resolve_schedule
from gefen.quant import dequantise, quantise

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]


#: Singular-value band measured on Gaussian matrices with aspect ratio != 1 (3 seeds x 5 shapes):
#: standard 0.679..1.137, tuned3 0.885..1.147, tuned4 0.990..1.011; asserted with a small margin.
BANDS = {"standard": (0.67, 1.145), "tuned3": (0.875, 1.155), "tuned4": (0.985, 1.015)}
RECTANGULAR = [(64, 256), (256, 64), (96, 160), (128, 384), (200, 100)]


def _last_step_peak(schedule: str) -> float:
    """Max over [0, 1.25] of the schedule's last polynomial a x + b x^3 + c x^5."""
    a, b, c = resolve_schedule(schedule, 5)[-1]
    x = torch.linspace(0, 1.25, 100_001, dtype=torch.float64)
    return float((a * x + b * x**3 + c * x**5).max())


@pytest.mark.parametrize("schedule", sorted(BANDS))
def test_singular_values_land_in_the_schedules_band(schedule):
    lo, hi = BANDS[schedule]
    for seed, shape in enumerate(RECTANGULAR):
        u = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        o = orthogonalise(u, schedule)
        assert o.dtype == torch.bfloat16 and o.shape == u.shape
        sv = torch.linalg.svdvals(o.float())
        assert lo <= sv.min() and sv.max() <= hi, (shape, sv.min().item(), sv.max().item())


@pytest.mark.parametrize("schedule", sorted(BANDS))
def test_square_matrices_never_overshoot_the_last_polynomials_peak(schedule):
    """Square Gaussian matrices have singular values near 0 that no few-step schedule lifts into
    the band; but no singular value may exceed the peak of the final polynomial (+ bf16 slack)."""
    peak = _last_step_peak(schedule)
    for n in (64, 128):
        sv = torch.linalg.svdvals(orthogonalise(torch.randn(n, n), schedule).float())
        assert sv.max() <= peak + 0.01
        assert sv.median() >= BANDS[schedule][0]


def test_tall_matrices_are_iterated_transposed(monkeypatch):
    u = torch.randn(192, 48)
    shapes = []
    real = ns._baddbmm

    def spy(bias, x, y, **kw):
        shapes.append((tuple(x.shape[-2:]), tuple(y.shape[-2:])))
        return real(bias, x, y, **kw)

    monkeypatch.setattr(ns, "_baddbmm", spy)
    tall = orthogonalise(u)
    gram_shapes = shapes[::3]  # every step starts with X X^T
    assert all(x == (48, 192) and y == (192, 48) for x, y in gram_shapes)
    assert torch.equal(tall, orthogonalise(u.T.contiguous()).T)
    # and it shares u's singular vectors (it is the polar factor up to the band)
    U, _, Vh = torch.linalg.svd(u, full_matrices=False)
    core = U.T @ tall.float() @ Vh.T
    off_diagonal = core - torch.diag(core.diagonal())
    assert off_diagonal.norm() / core.norm() < 0.05
    assert core.diagonal().min() > BANDS["standard"][0]


def test_batched_orthogonalisation_matches_one_at_a_time():
    u = torch.randn(3, 32, 80)
    batched = orthogonalise(u)
    for i in range(3):
        torch.testing.assert_close(batched[i].float(), orthogonalise(u[i]).float(), atol=1e-2, rtol=0)


def test_zero_matrix_stays_zero():
    assert torch.equal(orthogonalise(torch.zeros(8, 16)).float(), torch.zeros(8, 16))


def test_schedules_resolve_to_the_spec_coefficients():
    assert resolve_schedule("standard", 3) == (STANDARD,) * 3
    assert resolve_schedule("tuned3", 5) == TUNED["tuned3"] and len(TUNED["tuned3"]) == 3
    assert resolve_schedule("tuned4", 5) == TUNED["tuned4"] and len(TUNED["tuned4"]) == 4
    custom = [[3.4445, -4.7750, 2.0315]] * 5
    u = torch.randn(16, 40)
    assert torch.equal(orthogonalise(u, custom), orthogonalise(u, "standard", 5))


@pytest.mark.parametrize(
    "schedule, ns_steps, pattern",
    [
        ("tuned5", 5, "unknown ns_coefficients 'tuned5'"),
        ([], 5, "non-empty list"),
        (7, 5, "schedule name or a non-empty list"),
        ([(1.0, 2.0)], 5, r"ns_coefficients\[0\] must be an \(a, b, c\) triple"),
        ([(3.0, -4.0, 2.0), (1.0, "x", 2.0)], 5, r"ns_coefficients\[1\] must hold three finite numbers"),
        ([(1.0, float("nan"), 2.0)], 5, "finite"),
        ([(True, 1.0, 2.0)], 5, "finite numbers"),
        ("standard", 0, "ns_steps must be a positive int"),
        ("standard", 2.0, "ns_steps must be a positive int"),
    ],
)
def test_malformed_schedules_raise_clear_errors(schedule, ns_steps, pattern):
    with pytest.raises(ValueError, match=pattern):
        resolve_schedule(schedule, ns_steps)
    with pytest.raises(ValueError, match=pattern):
        GefenMuon([torch.nn.Parameter(torch.randn(4, 4))], ns_coefficients=schedule, ns_steps=ns_steps)


# ----- one step against a dense reference -------------------------------------------------------
def _reference_ns(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's Newton-Schulz, written out in fp32 (no bf16)."""
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / (x.norm() + 1e-7)
    a, b, c = STANDARD
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if u.shape[0] > u.shape[1] else x


def _reference_muon(w, grads, lr, mu, nesterov, wd, adjust, normuon=False, beta2=0.95, eps=1e-8):
    """Dense fp32 Muon (docs/design.md 3.2) with an uncompressed momentum."""
    w, m, v = w.clone(), torch.zeros_like(w), torch.zeros(w.shape[0])
    rows, cols = w.shape
    scale = math.sqrt(max(1, rows / cols)) if adjust == "original" else 0.2 * math.sqrt(max(rows, cols))
    for t, g in enumerate(grads, 1):
        m = mu * m + (1 - mu) * g
        u = mu * m + (1 - mu) * g if nesterov else m
        o = _reference_ns(u)
        if normuon:
            v = beta2 * v + (1 - beta2) * (o * o).mean(1)
            on = o / ((v / (1 - beta2**t)).sqrt() + eps)[:, None]
            o = on * (o.norm() / on.norm())
        w = w * (1 - lr * wd) - lr * scale * o
    return w


CASES = [
    dict(shape=(48, 96), nesterov=True, wd=0.0, adjust="original"),
    dict(shape=(96, 48), nesterov=False, wd=0.1, adjust="original"),
    dict(shape=(64, 64), nesterov=True, wd=0.05, adjust="match_rms_adamw"),
    dict(shape=(32, 128), nesterov=True, wd=0.0, adjust="match_rms_adamw", normuon=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_steps_match_a_dense_reference_within_bf16_tolerance(case):
    gen = torch.Generator().manual_seed(0)
    shape = case["shape"]
    w0 = torch.randn(shape, generator=gen)
    # gradients with row/column scale structure, as real ones have
    grads = [torch.randn(shape, generator=gen) * torch.rand(shape[1], generator=gen) for _ in range(3)]
    lr, mu = 0.02, 0.95
    p = torch.nn.Parameter(w0.clone())
    opt = GefenMuon([("w", p)], lr=lr, momentum=mu, nesterov=case["nesterov"], weight_decay=case["wd"],
                    adjust_lr_fn=case["adjust"], normuon=case.get("normuon", False))
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = _reference_muon(w0, grads, lr, mu, case["nesterov"], case["wd"], case["adjust"], case.get("normuon", False))
    got_delta, ref_delta = p.detach() - w0, ref - w0
    assert ((got_delta - ref_delta).norm() / ref_delta.norm()) < 0.03


def test_step_composes_the_spec_formula_exactly():
    """With the optimizer's own re-quantised momentum and Newton-Schulz, the update is
    ``p * (1 - lr wd) - lr * scale * O`` to the bit."""
    gen = torch.Generator().manual_seed(1)
    w0, g = torch.randn(40, 24, generator=gen), torch.randn(40, 24, generator=gen)
    p = torch.nn.Parameter(w0.clone())
    opt = GefenMuon([("w", p)], lr=0.03, momentum=0.9, weight_decay=0.2)
    p.grad = g
    opt.step()
    st = opt.state[p]
    m_q = dequantise(st["m_code"], st["m_scale"], opt.codebook, int(st["period"]))
    o = orthogonalise(m_q * 0.9 + g * (1 - 0.9))
    expected = w0.clone().mul_(1 - 0.03 * 0.2).add_(o, alpha=-0.03 * math.sqrt(40 / 24))
    assert torch.equal(p.detach(), expected)


def test_lr_scale_rules():
    assert lr_scale((256, 64), "original") == 2.0 and lr_scale((64, 256), "original") == 1.0
    assert lr_scale((64, 256), "match_rms_adamw") == pytest.approx(3.2)


# ----- the compressed momentum is Gefen's ------------------------------------------------------
def test_momentum_state_is_gefens_encoder_bit_for_bit():
    gen = torch.Generator().manual_seed(2)
    shape = (32, 96)
    grads = [torch.randn(shape, generator=gen) * torch.linspace(0.1, 3, shape[1]) for _ in range(4)]
    a, b = torch.nn.Parameter(torch.randn(shape)), torch.nn.Parameter(torch.randn(shape))
    muon = GefenMuon([("w", a)], momentum=0.9)
    gef = Gefen([("w", b)], betas=(0.9, 0.999), moments="m8")  # GefenMuon keeps the m8 momentum
    m = torch.zeros(shape)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        muon.step()
        gef.step()
        st = muon.state[a]
        period = int(st["period"])
        m.lerp_(g, 1 - 0.9)
        codes, scales = quantise(m, muon.codebook, period)
        assert torch.equal(st["m_code"], codes) and torch.equal(st["m_scale"], scales)
        m = dequantise(codes, scales, muon.codebook, period)
        for field in ("step", "period", "m_code", "m_scale"):
            assert torch.equal(st[field], gef.state[b][field]), field
    assert st["m_code"].dtype == torch.uint8 and st["m_scale"].shape == (32, 96 // period)
    assert torch.equal(muon.codebook, gef.codebook)


# ----- options, parameters, state --------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(beta2=1.5), "beta2"),
        (dict(eps=-1.0), "eps"),
        (dict(nesterov=1), "nesterov"),
        (dict(normuon="yes"), "normuon"),
        (dict(adjust_lr_fn="rms"), "adjust_lr_fn"),
        (dict(normuon_eps=-1.0), "normuon_eps"),
        (dict(bf16_stochastic_round=1), "bf16_stochastic_round"),
        (dict(codebook_size=512), "codebook_size"),
    ],
)
def test_bad_options_raise_naming_the_option(kwargs, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        GefenMuon([torch.nn.Parameter(torch.randn(4, 4))], **kwargs)


@pytest.mark.parametrize("shape", [(8,), (2, 3, 4), ()])
def test_non_matrix_parameters_are_rejected_by_name(shape):
    with pytest.raises(ValueError, match=r"2-D parameters only; parameter 'blocks.0.bias' has shape"):
        GefenMuon([("w", torch.nn.Parameter(torch.randn(4, 4))), ("blocks.0.bias", torch.nn.Parameter(torch.randn(shape)))])
    opt = GefenMuon([("w", torch.nn.Parameter(torch.randn(4, 4)))])
    with pytest.raises(ValueError, match="'extra'"):
        opt.add_param_group({"params": [("extra", torch.nn.Parameter(torch.randn(shape)))]})
    assert len(opt.param_groups) == 1


def test_zero_gradient_and_bf16_parameters():
    p = torch.nn.Parameter(torch.randn(16, 32))
    before = p.detach().clone()
    opt = GefenMuon([p], weight_decay=0.0)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(p.detach(), before)
    q = torch.nn.Parameter(torch.randn(16, 32, dtype=torch.bfloat16))
    opt = GefenMuon([q])
    q.grad = torch.randn_like(q)
    opt.step()
    assert q.dtype == torch.bfloat16 and torch.isfinite(q).all()
    assert opt.state[q]["m_code"].dtype == torch.uint8


def test_equal_shapes_are_orthogonalised_together_and_match_separate_optimizers():
    gen = torch.Generator().manual_seed(3)
    ws = [torch.randn(24, 40, generator=gen) for _ in range(3)]
    gs = [torch.randn(24, 40, generator=gen) for _ in range(3)]
    together = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = GefenMuon(together, lr=0.02, weight_decay=0.0)
    for p, g in zip(together, gs):
        p.grad = g
    opt.step()
    for w, g, p in zip(ws, gs, together):
        alone = torch.nn.Parameter(w.clone())
        single = GefenMuon([alone], lr=0.02, weight_decay=0.0)
        single.codebook = opt.codebook  # the codebook is learned from all gradients together
        single.state[alone] = {k: torch.zeros_like(v) if k in ("step", "m_code", "m_scale") else v.clone()
                               for k, v in opt.state[p].items()}
        alone.grad = g
        single.step()
        torch.testing.assert_close(alone.detach(), p.detach(), atol=1e-3, rtol=0)


def test_contract_describes_the_state():
    p = torch.nn.Parameter(torch.randn(8, 16))
    opt = GefenMuon([("w", p)], normuon=True)
    p.grad = torch.randn_like(p)
    opt.step()
    contract = contract_of(opt)
    assert contract.implementation == "gefen.GefenMuon"
    # the optimizer-wide codebook too: one tensor, shared by every parameter's live state
    assert set(opt.state[p]) == {f.name for f in contract.fields + contract.global_fields}
    assert opt.state[p]["codebook"] is opt.codebook
    for f in contract.fields:
        assert str(opt.state[p][f.name].dtype).removeprefix("torch.") == f.dtype
    assert contract.field("v_row").geometry == "row" and contract.field("m_scale").geometry == "block"
    assert set(contract.hyperparameters) <= set(opt.param_groups[0])
    assert type(contract).from_dict(contract.to_dict()) == contract


@pytest.mark.parametrize("normuon", [False, True])
def test_state_dict_round_trip_resumes_bitwise(normuon):
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(32, 48, generator=gen)
    grads = [torch.randn(32, 48, generator=gen) for _ in range(6)]

    def run(steps, p, opt):
        for g in steps:
            p.grad = g.clone()
            opt.step()

    p = torch.nn.Parameter(w0.clone())
    opt = GefenMuon([("w", p)], normuon=normuon, ns_coefficients="tuned4")
    run(grads, p, opt)

    q = torch.nn.Parameter(w0.clone())
    first = GefenMuon([("w", q)], normuon=normuon, ns_coefficients="tuned4")
    run(grads[:3], q, first)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    r = torch.nn.Parameter(q.detach().clone())
    resumed = GefenMuon([("w", r)], normuon=normuon)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.param_groups[0]["ns_coefficients"] == "tuned4"
    run(grads[3:], r, resumed)
    assert torch.equal(r.detach(), p.detach())


def test_normuon_state_does_not_load_into_plain_muon():
    p = torch.nn.Parameter(torch.randn(8, 16))
    opt = GefenMuon([("w", p)], normuon=True)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["normuon"] = False
    plain = GefenMuon([("w", torch.nn.Parameter(torch.randn(8, 16)))])
    with pytest.raises(ValueError, match="v_row"):
        plain.load_state_dict(sd)
    assert not plain.state and plain.codebook is None


def test_state_dict_under_other_option_names_is_refused_untouched():
    """A saved group must carry today's names (torch.optim.Muon's): one lacking ``adjust_lr_fn`` is
    refused, naming it, before the optimizer changes."""
    p = torch.nn.Parameter(torch.randn(8, 16))
    opt = GefenMuon([("w", p)], adjust_lr_fn="match_rms_adamw")
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["adjust_lr"] = sd["param_groups"][0].pop("adjust_lr_fn")
    fresh = GefenMuon([("w", torch.nn.Parameter(torch.randn(8, 16)))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        fresh.load_state_dict(sd)
    assert not fresh.state and fresh.codebook is None and fresh.param_groups[0]["adjust_lr_fn"] is None


def test_checkpoint_under_other_option_names_is_refused_before_reading(tmp_path):
    """The same through gefen_ckpt: a checkpoint whose groups carry ``adjust_lr`` instead of
    ``adjust_lr_fn`` is refused naming the missing option, the optimizer untouched."""
    import gefen_ckpt
    from gefen_ckpt.errors import CheckpointMismatchError

    p = torch.nn.Parameter(torch.randn(8, 16))
    opt = GefenMuon([("w", p)], adjust_lr_fn="match_rms_adamw")
    p.grad = torch.randn_like(p)
    opt.step()
    state = gefen_ckpt.export_canonical(opt)
    state.param_groups[0]["adjust_lr"] = state.param_groups[0].pop("adjust_lr_fn")
    fresh = GefenMuon([("w", torch.nn.Parameter(torch.randn(8, 16)))])
    with pytest.raises(CheckpointMismatchError, match="adjust_lr_fn"):
        gefen_ckpt.import_canonical(fresh, state)
    assert not fresh.state and fresh.param_groups[0]["adjust_lr_fn"] is None

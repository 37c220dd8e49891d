"""Gefen as a drop-in for torch.optim.AdamW (and GefenMuon for torch.optim.Muon): the same
signatures, tensor hyperparameters, AdamW's keyword arguments, LR schedulers on a tensor lr,
and torch.compile of a training step that calls ``opt.step()``."""

from __future__ import annotations

import inspect

import pytest
import torch

import gefen_ckpt
from gefen import Gefen, GefenMuon


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(opt_factory, steps: int = 4, maximize_loss: bool = False, compiled: bool = False, seed: int = 0):
    model = _model(seed)
    opt = opt_factory(model)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)

    def train_step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        (-loss if maximize_loss else loss).backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = torch.compile(train_step) if compiled else train_step
    losses = [float(step()) for _ in range(steps)]
    return model, opt, losses


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _torch_part(ours, theirs) -> list[tuple]:
    """(name, kind, default) of ``ours``' first parameters, as many as ``theirs`` has, and the rest's kinds."""
    a = list(inspect.signature(ours).parameters.values())
    b = list(inspect.signature(theirs).parameters.values())
    return [(p.name, p.kind, p.default) for p in a[:len(b)]], [(p.name, p.kind, p.default) for p in b], a[len(b):]


@pytest.mark.parametrize("ours, theirs", [(Gefen, torch.optim.AdamW), (GefenMuon, torch.optim.Muon)],
                         ids=["Gefen-AdamW", "GefenMuon-Muon"])
def test_signature_is_torchs_then_keyword_only_options(ours, theirs):
    """Names, kinds, order and defaults of torch's parameters; ours only after them, keyword-only."""
    got, want, rest = _torch_part(ours, theirs)
    assert got == want
    assert rest and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in rest), [p.name for p in rest]
    assert {p.name for p in rest} >= {"seed", "bf16_stochastic_round", "codebook_size", "bins_per_code"}


def test_positional_adamw_arguments_mean_what_they_mean_for_adamw():
    model = _model()
    opt = Gefen(model.parameters(), 1e-3, (0.9, 0.999), 1e-8, 1e-2, False)
    assert opt.defaults["weight_decay"] == 1e-2 and opt.defaults["factored_v_2d"] is True
    with pytest.raises(ValueError, match="amsgrad=True"):
        Gefen(model.parameters(), 1e-3, (0.9, 0.999), 1e-8, 1e-2, True)
    with pytest.raises(TypeError):
        Gefen(model.parameters(), 1e-3, (0.9, 0.999), 1e-8, 1e-2, False, False)  # maximize is keyword-only


def test_gefen_muon_takes_torch_muons_arguments_with_their_meaning():
    """Positional torch.optim.Muon arguments; one (a, b, c) repeated ns_steps times is the schedule;
    adjust_lr_fn None is "original"; on the same dense momentum the step is torch's up to bf16."""
    torch.manual_seed(0)
    w0, g = torch.randn(24, 40), torch.randn(24, 40)
    ours_p, theirs_p = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    args = (0.02, 0.1, 0.9, False, (3.4445, -4.7750, 2.0315), 1e-7, 5, None)
    ours, theirs = GefenMuon([ours_p], *args), torch.optim.Muon([theirs_p], *args)
    ours_p.grad, theirs_p.grad = g.clone(), g.clone()
    ours.step()
    theirs.step()
    d_ours, d_theirs = ours_p.detach() - w0, theirs_p.detach() - w0
    # the first momentum is (1 - mu) g in both, ours 8-bit-coded; Newton-Schulz in bf16 in both
    assert float((d_ours - d_theirs).norm() / d_theirs.norm()) < 0.03
    assert GefenMuon([torch.nn.Parameter(torch.randn(4, 4))], ns_coefficients="tuned3").defaults["ns_steps"] == 5


def test_tensor_lr_and_betas_step_like_floats():
    floats, _, _ = _train(lambda m: Gefen(m.named_parameters(), lr=0.01, betas=(0.9, 0.99)))
    tensors, opt, _ = _train(lambda m: Gefen(m.named_parameters(), lr=torch.tensor(0.01, dtype=torch.float64),
                                             betas=(torch.tensor(0.9, dtype=torch.float64),
                                                    torch.tensor(0.99, dtype=torch.float64))))
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # kept as given, as torch does
    assert _same(_params(floats), _params(tensors))


def test_scheduler_on_a_tensor_lr_changes_the_step():
    """A scheduler fill_s a tensor lr in place; the step must read the new value each time."""
    lr = torch.tensor(0.01)
    model = _model()
    opt = Gefen(model.named_parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0 if epoch >= 1 else 1.0)
    x = torch.randn(8, 16)
    model(x).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and float(lr) == 0.0
    before = _params(model)
    model(x).sum().backward()
    opt.step()  # lr 0 (weight decay is scaled by lr): nothing moves
    assert _same(before, _params(model))


def test_tensor_lr_for_gefen_muon():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 16))
    opt = GefenMuon([("w", w)], lr=torch.tensor(0.02))
    w.grad = torch.randn(16, 16)
    before = w.detach().clone()
    opt.step()
    assert not torch.equal(before, w.detach())


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([0.1, 0.2]), "one-element tensor"),
    (torch.tensor(float("nan")), "finite"),
    (torch.tensor(-1.0), r"Invalid learning rate: -1.0 \(lr must be a finite number in \[0.0"),
])
def test_bad_tensor_lr_is_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        Gefen(_model().parameters(), lr=bad)


def test_tensor_lr_checkpoints_as_its_value(tmp_path):
    model, opt, _ = _train(lambda m: Gefen(m.named_parameters(), lr=torch.tensor(0.25)))
    gefen_ckpt.save(opt, str(tmp_path / "c"))
    fresh = Gefen(model.named_parameters(), lr=0.1)
    gefen_ckpt.load(fresh, str(tmp_path / "c"))
    assert fresh.param_groups[0]["lr"] == 0.25


def test_maximize_is_gradient_ascent_on_the_negated_loss():
    """maximize=True on -loss must give exactly the run of minimising loss (the sign flip is exact)."""
    minimised, _, losses_min = _train(lambda m: Gefen(m.named_parameters(), lr=0.01))
    maximised, _, losses_max = _train(lambda m: Gefen(m.named_parameters(), lr=0.01, maximize=True),
                                      maximize_loss=True)
    assert _same(_params(minimised), _params(maximised))
    assert losses_min == losses_max and losses_min[-1] < losses_min[0]


def test_adamw_implementation_hints_are_accepted():
    reference, _, _ = _train(lambda m: Gefen(m.named_parameters(), lr=0.01))
    for hints in ({"foreach": True}, {"foreach": False}, {"fused": True}, {"fused": None, "foreach": None},
                  {"amsgrad": False, "capturable": False, "differentiable": False}):
        hinted, _, _ = _train(lambda m, h=hints: Gefen(m.named_parameters(), lr=0.01, **h))
        assert _same(_params(reference), _params(hinted)), hints


@pytest.mark.parametrize("option, reason", [
    ("amsgrad", "uncompressed fp32 copy"), ("capturable", "CUDA graph"), ("differentiable", "no gradient"),
])
def test_adamw_options_that_do_not_carry_over_are_refused(option, reason):
    with pytest.raises(ValueError, match=f"{option}=True is not supported by Gefen: .*{reason}"):
        Gefen(_model().parameters(), **{option: True})


def test_maximize_must_be_a_bool():
    with pytest.raises(TypeError, match="maximize must be a bool"):
        Gefen(_model().parameters(), maximize="yes")


def test_maximize_survives_a_state_dict_round_trip():
    model, opt, _ = _train(lambda m: Gefen(m.named_parameters(), lr=0.01, maximize=True), steps=1)
    fresh = Gefen(model.named_parameters(), lr=0.01)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[0]["maximize"] is True


@pytest.mark.timeout(600)
def test_compiled_training_step_matches_eager():
    """torch.compile of a step that calls opt.step(): the optimizer step is a graph break (it is
    never traced), the model's forward/backward compile, and the numbers are the eager ones."""
    torch._dynamo.reset()
    eager, _, eager_losses = _train(lambda m: Gefen(m.named_parameters(), lr=0.01), steps=3)
    compiled, _, compiled_losses = _train(lambda m: Gefen(m.named_parameters(), lr=0.01), steps=3, compiled=True)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5, abs=1e-6)
    for a, b in zip(_params(eager), _params(compiled)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compiled_training_step_breaks_only_at_the_optimizer():
    """Dynamo never traces into step(): the one break it reports in a step that calls opt.step()
    names our reason (not a failure somewhere inside the kernel code)."""
    torch._dynamo.reset()
    model = _model()
    opt = Gefen(model.named_parameters(), lr=0.01)
    x = torch.randn(8, 16)
    model(x).sum().backward()

    def step_after_forward():
        loss = model(x).sum()
        opt.step()
        return loss * 2

    explanation = torch._dynamo.explain(step_after_forward)()
    reasons = " ".join(b.reason for b in explanation.break_reasons)
    assert explanation.graph_break_count == 1 and "disable" in reasons, reasons


def test_fullgraph_compile_of_step_is_refused_with_the_reason():
    from gefen.compile import REASON, eager_step

    model = _model()
    opt = Gefen(model.named_parameters(), lr=0.01)
    model(torch.randn(8, 16)).sum().backward()
    with pytest.raises(torch._dynamo.exc.Unsupported) as info:
        torch.compile(opt.step, fullgraph=True)()
    assert "torch.compiler.disable" in str(info.value)
    if "reason" in str(info.value):  # torch >= 2.8 carries eager_step's reason
        assert REASON.split(":")[0] in str(info.value)
    assert eager_step  # the decorator every optimizer's step uses

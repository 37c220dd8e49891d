"""Gefen and GefenMuon by torch's own rules: what torch's AdamW and Muon do with the inputs
torch ships for them (``torch.testing._internal.common_optimizers``), with hook-added state
keys, named and unnamed state dicts, a Python ``step``, a tensor listed twice, complex and meta
parameters, and one order of state fields whatever the process's string-hash seed.

Where a behaviour is torch's, the same check runs on torch's optimizer as the control.
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.testing._internal.common_optimizers as common  # needs expecttest (the test extra)
from torch import nn

from gefen import Gefen, GefenMuon

pytestmark = pytest.mark.usefixtures("one_thread")

#: the options Gefen refuses by design, and what its refusal points to instead
REFUSED = ("amsgrad", "capturable", "differentiable")


# ----- a small problem both optimizers train --------------------------------------------------
def _model(muon: bool, seed: int = 0) -> nn.Module:
    """Two layers: Muon gets the two matrices only (no biases), AdamW also biases."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 12, bias=not muon), nn.Tanh(), nn.Linear(12, 4, bias=not muon))


_GEN = torch.Generator().manual_seed(100)
#: one batch: every optimizer here must lower its loss
BATCH = (torch.randn(16, 8, generator=_GEN), torch.randn(16, 4, generator=_GEN))


def _loss(model: nn.Module) -> torch.Tensor:
    return nn.functional.mse_loss(model(BATCH[0]), BATCH[1])


def _train(model: nn.Module, opt, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = _loss(model)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _same_state(a: dict, b: dict) -> bool:
    """Two state_dicts' ``state`` equal, key for key and field for field (in order)."""
    if list(a["state"]) != list(b["state"]):
        return False
    for key, x in a["state"].items():
        y = b["state"][key]
        if not isinstance(x, dict):
            if x != y:
                return False
        elif list(x) != list(y) or not all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])) for k in x):
            return False
    return True


OURS = {"adamw": Gefen, "muon": GefenMuon}
THEIRS = {"adamw": torch.optim.AdamW, "muon": torch.optim.Muon}
PAIRS = [(kind, cls) for kind in OURS for cls in (OURS[kind], THEIRS[kind])]
PAIR_IDS = [f"{kind}-{cls.__name__}" for kind, cls in PAIRS]


def _trained(cls, kind: str, named: bool = True, steps: int = 2, **kwargs):
    model = _model(kind == "muon")
    opt = cls(model.named_parameters() if named else model.parameters(), lr=1e-2, **kwargs)
    _train(model, opt, steps)
    return model, opt


# ----- torch's inputs ---------------------------------------------------------------------------
def _inputs(kind: str) -> list:
    func = common.optim_inputs_func_adamw if kind == "adamw" else common.optim_inputs_func_muon
    return func("cpu", torch.float32)


ALL_INPUTS = [(kind, i) for kind in OURS for i in range(len(_inputs(kind)))]


@pytest.mark.parametrize("kind, index", ALL_INPUTS, ids=[f"{k}-{_inputs(k)[i].desc}" for k, i in ALL_INPUTS])
def test_torchs_inputs_train_resume_exactly_and_skip_parameters_without_gradients(kind, index):
    """Each of torch's AdamW / Muon inputs: refused by design (amsgrad) with what to use instead,
    or it trains (the loss falls; rises under maximize), a step without gradients changes nothing, and an optimizer
    loaded from the state_dict (through torch.save with weights_only) continues bit for bit."""
    kwargs = copy.deepcopy(_inputs(kind)[index].kwargs)
    model = _model(kind == "muon")
    if any(kwargs.get(name) for name in REFUSED):
        with pytest.raises(ValueError, match=r"=True is not supported by Gefen: .*use torch\.optim\.AdamW\("):
            OURS[kind](model.named_parameters(), **kwargs)
        return
    opt = OURS[kind](model.named_parameters(), **kwargs)
    before = _params(model)
    opt.step()  # no gradients yet: a no-op
    assert all(torch.equal(a, b) for a, b in zip(before, _params(model))) and not opt.state
    losses = _train(model, opt, 6)
    assert torch.isfinite(torch.tensor(losses)).all(), losses
    assert (losses[-1] > losses[0]) if kwargs.get("maximize") else (losses[-1] < losses[0]), losses

    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    twin = copy.deepcopy(model)
    resumed = OURS[kind](twin.named_parameters(), **copy.deepcopy(_inputs(kind)[index].kwargs))
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert _same_state(opt.state_dict(), resumed.state_dict())
    _train(model, opt, 2)
    _train(twin, resumed, 2)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(twin)))


def _error_inputs(kind: str) -> list:
    func = common.optim_error_inputs_func_adamw if kind == "adamw" else common.optim_error_inputs_func_muon
    return func("cpu", torch.float32)


ALL_ERRORS = [(kind, i) for kind in OURS for i in range(len(_error_inputs(kind)))]
#: what torch's foreach kernels alone refuse: Gefen has one implementation and takes them
FOREACH_ONLY = ("as a Tensor is not supported for capturable=False and foreach=True",)


@pytest.mark.parametrize("kind, index", ALL_ERRORS,
                         ids=[f"{k}-{_error_inputs(k)[i].optimizer_error_input.desc}" for k, i in ALL_ERRORS])
def test_torchs_error_inputs_raise_torchs_type_with_torchs_text_at_torchs_point(kind, index):
    error = _error_inputs(kind)[index]
    given = error.optimizer_error_input
    cls = OURS[kind]
    if any(text in error.error_regex.replace("\\", "") for text in FOREACH_ONLY):
        p = nn.Parameter(torch.randn(3, 3))
        opt = cls([p], **given.kwargs)
        p.grad = torch.randn(3, 3)
        opt.step()
        return
    if issubclass(error.error_type, Warning):  # warns, and the optimizer is built and steps
        with pytest.warns(error.error_type, match=error.error_regex):
            opt = cls(given.params, **given.kwargs)
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.randn_like(p)
        opt.step()
        return
    if error.error_on == common.OptimizerErrorEnum.CONSTRUCTION_ERROR:
        with pytest.raises(error.error_type) as raised:
            cls(given.params, **given.kwargs)
    else:
        opt = cls(given.params, **given.kwargs)  # torch refuses only at step(): so does ours
        with pytest.raises(error.error_type) as raised:
            opt.step()
    assert type(raised.value) is error.error_type
    assert re.search(error.error_regex, str(raised.value)), str(raised.value)


#: more inputs torch's optimizers refuse (beyond torch's error inputs), at construction or step()
MORE_ERRORS = [
    ("adamw", {"lr": -0.1}, False), ("adamw", {"lr": float("nan")}, False), ("adamw", {"eps": -1.0}, False),
    ("adamw", {"betas": (0.9, 1.0)}, False), ("adamw", {"betas": (-0.5, 0.9)}, False),
    ("adamw", {}, True),
    ("muon", {"lr": -1.0}, False), ("muon", {"momentum": -0.5}, False), ("muon", {"weight_decay": -1.0}, False),
    ("muon", {}, True),
]


@pytest.mark.parametrize("kind, kwargs, sparse", MORE_ERRORS, ids=[f"{k}-{a}-{'sparse' if s else ''}" for k, a, s
                                                                   in MORE_ERRORS])
def test_torchs_refusals_are_ours_with_torchs_type_point_and_text(kind, kwargs, sparse):
    """The control: what torch's optimizer raises (type, construction or step, message); ours
    raises the same type at the same point with torch's message at the start."""
    raised = []
    for cls in (THEIRS[kind], OURS[kind]):
        p = nn.Parameter(torch.randn(4, 4))
        p.grad = torch.randn(4, 4).to_sparse() if sparse else torch.randn(4, 4)
        point = "construction"
        try:
            opt = cls([p], **kwargs)
            point = "step"
            opt.step()
        except Exception as exc:  # noqa: BLE001 - the exception is what the test compares
            raised.append((point, type(exc), str(exc)))
    theirs, ours = raised
    assert ours[:2] == theirs[:2] and ours[2].startswith(theirs[2]), (theirs, ours)


# ----- state_dict behaviours, with torch's optimizer as the control ----------------------------
@pytest.mark.parametrize("kind, cls", PAIRS, ids=PAIR_IDS)
def test_named_state_dict_into_unnamed_optimizer_keeps_the_saved_names(kind, cls):
    _, named = _trained(cls, kind)
    sd = named.state_dict()
    model = _model(kind == "muon")
    unnamed = cls(model.parameters(), lr=1e-2)
    unnamed.load_state_dict(sd)
    assert unnamed.param_groups[0]["param_names"] == sd["param_groups"][0]["param_names"]
    assert _same_state(unnamed.state_dict(), sd)
    # and the other way: the live names stay
    _, plain = _trained(cls, kind, named=False)
    renamed = cls(_model(kind == "muon").named_parameters(), lr=1e-2)
    names = list(renamed.param_groups[0]["param_names"])
    renamed.load_state_dict(plain.state_dict())
    assert renamed.param_groups[0]["param_names"] == names


@pytest.mark.parametrize("kind, cls", PAIRS, ids=PAIR_IDS)
def test_keys_a_hook_adds_to_state_pass_through_state_dict_and_load(kind, cls):
    model, opt = _trained(cls, kind)
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
    sd = opt.state_dict()
    assert sd["state"]["test"] == 1
    assert sorted(k for k in sd["state"] if k != "test") == list(range(len(list(model.parameters()))))
    fresh = cls(copy.deepcopy(model).named_parameters(), lr=1e-2)
    fresh.load_state_dict(sd)
    assert fresh.state["test"] == 1
    again = fresh.state_dict()
    assert _same_state(again, sd)
    _train(model, fresh, 1)  # the step ignores the hook's key


@pytest.mark.parametrize("kind, cls", [pair for pair in PAIRS if pair[1] is not torch.optim.Muon],
                         ids=[i for i in PAIR_IDS if i != "muon-Muon"])  # torch's Muon keeps no step
def test_a_python_number_step_loads_as_the_tensor_step_does(kind, cls):
    model, opt = _trained(cls, kind)
    sd = opt.state_dict()
    older = copy.deepcopy(sd)
    for entry in older["state"].values():
        entry["step"] = entry["step"].item()
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    from_tensor, from_number = cls(a.named_parameters(), lr=1e-2), cls(b.named_parameters(), lr=1e-2)
    from_tensor.load_state_dict(sd)
    from_number.load_state_dict(older)
    assert _same_state(from_number.state_dict(), sd)
    _train(a, from_tensor, 2)
    _train(b, from_number, 2)
    assert all(torch.equal(x, y) for x, y in zip(_params(a), _params(b)))


def test_a_non_integral_python_step_is_refused_naming_the_parameter():
    _, opt = _trained(Gefen, "adamw")
    sd = opt.state_dict()
    sd["state"][0]["step"] = 2.5
    fresh = Gefen(_model(False).named_parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="'0.weight'.*step.*2.5"):
        fresh.load_state_dict(sd)
    assert not fresh.state


@pytest.mark.parametrize("kind, cls", PAIRS, ids=PAIR_IDS)
def test_a_tensor_listed_twice_warns_and_trains(kind, cls):
    """torch warns and goes on (its step then updates such a tensor twice)."""
    model = _model(kind == "muon")
    first, *rest = model.parameters()
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        opt = cls([first, *rest, first], lr=1e-2)
    losses = _train(model, opt, 4)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("cls", [Gefen, GefenMuon])
def test_a_tensor_listed_twice_is_stepped_once_and_round_trips(cls):
    """Gefen steps a tensor listed twice once per step, exactly as if listed once, and its
    state_dict loads back (docs/decisions.md, "torch's rules")."""
    model, once = _model(cls is GefenMuon), _model(cls is GefenMuon)
    first, *rest = model.parameters()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's duplicate warning (the test above)
        opt = cls([first, *rest, first], lr=1e-2)
        loaded = cls([first, *rest, first], lr=1e-2)
    _train(model, opt, 4)
    _train(once, cls(once.parameters(), lr=1e-2), 4)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(once)))
    loaded.load_state_dict(opt.state_dict())
    assert _same_state(loaded.state_dict(), opt.state_dict())


# ----- what Gefen refuses, where torch refuses it -----------------------------------------------
@pytest.mark.parametrize("option", REFUSED)
def test_options_refused_by_design_say_so_and_what_to_use(option):
    with pytest.raises(ValueError, match=rf"{option}=True is not supported by Gefen: .*torch\.optim\.AdamW\({option}=True\)"):
        Gefen(_model(False).parameters(), **{option: True})


@pytest.mark.parametrize("cls, said", [(Gefen, "Gefen does not support complex parameters"),
                                       (GefenMuon, "Muon does not support complex parameters")])
def test_complex_parameters_are_refused_at_step_before_any_state(cls, said):
    """Muon refuses complex parameters with a RuntimeError at step(), as torch's fused AdamW
    does; Gefen too (docs/decisions.md, "Complex parameters"). A real one beside it is untouched."""
    real, cplx = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    opt = cls([("real", real), ("cplx", cplx)], lr=1e-2)
    opt.step()  # no gradients: nothing to refuse
    real.grad, cplx.grad = torch.randn(4, 4), torch.randn(4, 4, dtype=torch.complex64)
    before = real.detach().clone()
    with pytest.raises(RuntimeError, match=f"^{said} \\(parameter 'cplx'"):
        opt.step()
    assert torch.equal(before, real) and not opt.state


def test_meta_parameters_fail_at_step_in_one_line_and_step_after_to_empty():
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    opt = Gefen(model.parameters(), fused=True)
    model(torch.randn(2, 4, device="meta")).sum().backward()
    with pytest.raises(RuntimeError, match="^Gefen cannot step meta tensors: parameter #0") as raised:
        opt.step()
    assert "\n" not in str(raised.value) and not opt.state
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # to_empty keeps the parameter objects
    try:
        model.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        model.weight.normal_()
        model.bias.zero_()
    model.zero_grad()
    model(torch.randn(2, 4)).square().sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.weight) and torch.isfinite(model.weight).all()


# ----- one field order, whatever the hash seed ---------------------------------------------------
_ORDERS = textwrap.dedent("""
    import json, sys, torch
    from torch import nn
    from gefen import Gefen, GefenMuon, GefenMuonHybrid

    def orders(opt):
        return [list(entry) for entry in opt.state.values()]

    def run(make):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 4))
        opt = make(model)
        model(torch.randn(5, 8)).square().mean().backward()
        opt.step()
        sd = opt.state_dict()
        fresh = make(model)
        fresh.load_state_dict(sd)
        return {"step": orders(opt), "load": orders(fresh),
                "saved": [list(e) for e in fresh.state_dict()["state"].values()]}

    print(json.dumps({
        "set": list({"step", "mv_code", "m_row_scale", "v_row", "v_col", "period", "m_code", "m_scale"}),
        "m4v4": run(lambda m: Gefen(m.named_parameters())),
        "m8": run(lambda m: Gefen(m.named_parameters(), moments="m8")),
        "muon": run(lambda m: GefenMuon([(n, p) for n, p in m.named_parameters() if p.dim() == 2], normuon=True)),
        "hybrid": run(lambda m: GefenMuonHybrid(m)),
    }))
""")


def test_field_order_after_load_is_a_fresh_steps_whatever_the_hash_seed():
    """load_state_dict lists each parameter's fields as a fresh step does, under any
    PYTHONHASHSEED (a set's order would follow it): torch's full-state-dict paths issue one
    collective per field in that order on every rank (tests/dist/test_field_order.py)."""
    results = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", _ORDERS], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert results[0]["set"] != results[1]["set"]  # the two seeds do order sets differently
    for kind in ("m4v4", "m8", "muon", "hybrid"):
        first = results[0][kind]
        assert first["step"] and all(order[0] == "step" for order in first["step"]), kind
        for got in results:
            assert got[kind]["load"] == got[kind]["step"] == first["step"], kind
            assert got[kind]["saved"] == first["step"], kind

"""Gefen as a torch.optim.Optimizer: groups, names, closures, schedulers, GradScaler, hooks,
state_dict round trips, fail-before-mutation loads, input validation and contracts."""

from __future__ import annotations

import copy
import dataclasses
import io

import msgpack
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gefen
from gefen import Gefen
from gefen.contract import GLOBAL_STATE_KEY, OptimizerContract
from gefen.validation import check_step_param

pytestmark = pytest.mark.usefixtures("one_thread")


# ----- a small model with every kind of tensor ----------------------------------------------------
class Net(nn.Module):
    """Conv (3-D weight), norm (1-D), linear (2-D) and a 0-D scale."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 5)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8 * 12, 4)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        h = self.norm(self.conv(x).transpose(1, 2)).relu()
        return self.head(h.reshape(len(x), -1)) * self.scale


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return Net().to(dtype)


def batch(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 3, 16, generator=gen).to(dtype), torch.randn(16, 4, generator=gen).to(dtype)


def loss_of(model, step):
    x, y = batch(step, next(model.parameters()).dtype)
    return F.mse_loss(model(x).float(), y.float())


def train(model, opt, steps, start=0):
    for s in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, s).backward()
        opt.step()


def trained(steps=2, seed=0, **kwargs):
    model = make_model(seed)
    opt = Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.01, **kwargs)
    train(model, opt, steps)
    return model, opt


# ----- bitwise snapshots ------------------------------------------------------------------------
def bits(t: torch.Tensor) -> tuple:
    t = t.detach()
    return t.dtype, tuple(t.shape), t.device, t.contiguous().reshape(-1).view(torch.uint8).clone()


def same_bits(a, b) -> bool:
    return a[:3] == b[:3] and torch.equal(a[3], b[3])


def snapshot(opt):
    """Everything the optimizer holds, as copies: groups (params by identity), state, codebook, params."""
    return {
        "groups": [{k: [id(p) for p in v] if k == "params" else copy.deepcopy(v) for k, v in g.items()}
                   for g in opt.param_groups],
        "state": {id(p): {k: bits(v) for k, v in st.items()} for p, st in opt.state.items()},
        "codebook": None if opt.codebook is None else bits(opt.codebook),
        "v_codebook": None if opt.v_codebook is None else bits(opt.v_codebook),
        "params": [bits(p) for g in opt.param_groups for p in g["params"]],
    }


def assert_same(a, b):
    assert a["groups"] == b["groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid, fields in a["state"].items():
        assert fields.keys() == b["state"][pid].keys()
        for name, value in fields.items():
            assert same_bits(value, b["state"][pid][name]), name
    for book in ("codebook", "v_codebook"):
        assert (a[book] is None) == (b[book] is None)
        if a[book] is not None:
            assert same_bits(a[book], b[book])
    assert all(same_bits(x, y) for x, y in zip(a["params"], b["params"]))


def params_bits(model):
    return [bits(p) for p in model.parameters()]


def state_bits(opt):
    """Per parameter, in group order: {field: bits}; comparable across optimizers."""
    return [{k: bits(v) for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


def assert_same_state(a, b):
    assert len(a) == len(b) and all(x.keys() == y.keys() for x, y in zip(a, b))
    assert all(same_bits(x[k], y[k]) for x, y in zip(a, b) for k in x)


# ----- optimizer behaviour ------------------------------------------------------------------------
def test_param_groups_and_add_param_group():
    """Groups keep their own options, add_param_group fills defaults, later parameters reuse the
    codebook learned on the first step, and a rejected group is not added."""
    model = make_model()
    opt = Gefen([{"params": [model.conv.weight, model.conv.bias], "lr": 1e-2}], lr=1e-3, weight_decay=0.5)
    train(model, opt, 1)
    codebook = opt.codebook.clone()
    head_before = model.head.weight.detach().clone()
    opt.add_param_group({"params": [model.head.weight], "betas": (0.5, 0.9)})
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["betas"] == (0.9, 0.999)
    group = opt.param_groups[1]
    assert group["lr"] == 1e-3 and group["betas"] == (0.5, 0.9) and group["weight_decay"] == 0.5
    assert group["factored_v_2d"] is True
    train(model, opt, 1, start=1)
    assert not torch.equal(model.head.weight, head_before)
    assert torch.equal(opt.codebook, codebook)
    assert model.head.bias not in opt.state and model.head.bias.grad is not None
    before = snapshot(opt)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [model.head.bias], "lr": -1.0})
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model.conv.weight]})
    assert_same(before, snapshot(opt))


def test_named_parameters_and_named_groups():
    """model.named_parameters() and groups with "param_names" keep names in groups and state_dict,
    and errors name the parameter."""
    model = make_model()
    opt = Gefen(model.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert opt.param_groups[0]["param_names"] == names
    opt2 = Gefen([
        {"params": [model.conv.weight, model.conv.bias], "param_names": ["conv.weight", "conv.bias"]},
        {"params": [("head.weight", model.head.weight)], "lr": 1e-4},
    ])
    assert opt2.param_groups[1]["param_names"] == ["head.weight"]
    train(model, opt, 1)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == names
    model.head.weight.grad = model.head.weight.grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse.*'head.weight'"):
        opt.step()
    with pytest.raises(ValueError, match="with/without names"):
        opt2.add_param_group({"params": [model.scale]})


def test_step_closure_and_zero_grad():
    """step(closure) re-evaluates the loss with grad enabled and returns it; zero_grad clears."""
    model = make_model()
    opt = Gefen(model.parameters(), lr=1e-2)
    calls = []

    def closure():
        opt.zero_grad()
        loss = loss_of(model, 0)
        loss.backward()
        calls.append(loss.item())
        return loss

    with torch.no_grad():
        first = opt.step(closure)
    assert calls and first.item() == calls[0]
    second = opt.step(closure)
    assert second.item() < first.item()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    before = snapshot(opt)
    assert opt.step() is None  # no gradients: nothing happens
    assert_same(before, snapshot(opt))


def test_step_hooks_fire_and_params_without_grad_are_skipped():
    """Step pre/post hooks run; a parameter without a gradient keeps its state and value."""
    model, opt = trained(1)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    loss_of(model, 5).backward()
    model.scale.grad = None
    scale_state = {k: bits(v) for k, v in opt.state[model.scale].items()}
    scale_value = bits(model.scale)
    opt.step()
    assert seen == ["pre", "post"]
    assert all(same_bits(bits(v), scale_state[k]) for k, v in opt.state[model.scale].items())
    assert same_bits(bits(model.scale), scale_value)


def test_lr_scheduler_drives_the_step_size():
    """An LR scheduler changes group["lr"]; at lr = 0 (and no decay) parameters stop moving."""
    model = make_model()
    opt = Gefen(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch < 2 else 0.0)
    for s in range(2):
        train(model, opt, 1, start=s)
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.0 and opt.param_groups[0]["initial_lr"] == 1e-2
    frozen = params_bits(model)
    train(model, opt, 2, start=2)
    assert all(same_bits(a, b) for a, b in zip(frozen, params_bits(model)))
    assert int(opt.state[model.head.weight]["step"]) == 4


def test_grad_scaler_skips_inf_and_nan_steps():
    """torch.amp.GradScaler on CPU: finite steps apply; a step with inf or nan gradients changes
    nothing at all (parameters, state, codebook), including the very first step."""
    model = make_model()
    opt = Gefen(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)

    def scaled_step(step, poison=None):
        opt.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if poison is not None:
            model.head.weight.grad[0, 0] = poison
        scaler.step(opt)
        scaler.update()

    before = snapshot(opt)
    scaled_step(0, poison=float("inf"))
    assert_same(before, snapshot(opt))
    assert not opt.state and scaler.get_scale() == 2.0**7
    scaled_step(1)
    assert opt.state and not all(same_bits(a, b) for a, b in zip(before["params"], snapshot(opt)["params"]))
    for poison in (float("nan"), float("-inf")):
        before = snapshot(opt)
        scaled_step(2, poison=poison)
        assert_same(before, snapshot(opt))


def test_state_dict_and_load_hooks_fire():
    """state_dict pre/post hooks and load_state_dict pre/post hooks run; a load pre-hook's
    returned dict is the one loaded; the post hook sees the codebook."""
    model, opt = trained(1)
    events = []
    opt.register_state_dict_pre_hook(lambda o: events.append("sd-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: events.append(("sd-post", "codebook" in sd[GLOBAL_STATE_KEY])))

    def load_pre(o, sd):
        events.append("load-pre")
        sd = copy.copy(sd)
        sd["param_groups"] = [dict(g, lr=0.125) for g in sd["param_groups"]]
        return sd

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: events.append(("load-post", o.param_groups[0]["lr"])))
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert events == ["sd-pre", ("sd-post", True), "load-pre", ("load-post", 0.125)]


def test_state_dict_never_casts_codes_or_scales():
    """bf16 parameters: codes stay uint8 and scales/second moments fp32 in state_dict() and
    after loading (torch's default load would cast floating state to the parameter dtype)."""
    model = make_model(dtype=torch.bfloat16)
    opt = Gefen(model.named_parameters(), lr=1e-2, moments="m8")
    train(model, opt, 2)
    sd = opt.state_dict()
    for entry in sd["state"].values():
        assert entry["m_code"].dtype == torch.uint8 and entry["m_scale"].dtype == torch.float32
        assert entry["step"].dtype == entry["period"].dtype == torch.int64
    assert sd[GLOBAL_STATE_KEY]["codebook"].dtype == torch.float32
    fresh = Gefen(copy.deepcopy(model).named_parameters(), lr=1e-2, moments="m8")
    fresh.load_state_dict(copy.deepcopy(sd))
    for st in fresh.state.values():
        assert st["m_code"].dtype == torch.uint8
        assert all(v.dtype == torch.float32 for k, v in st.items() if k not in ("m_code", "step", "period"))


M4V4_DTYPES = {"step": torch.int64, "mv_code": torch.uint8, "m_row_scale": torch.bfloat16, "v_row": torch.float32,
               "v_col": torch.float32, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.float32}


def test_m4v4_state_dict_never_casts_codes_or_scales():
    """The default layout on bf16 parameters: uint8 codes, the bf16 row scale and fp32 statistics
    and exact moments (also of 1-D bf16 tensors) survive state_dict() and a load unchanged."""
    model = make_model(dtype=torch.bfloat16)
    opt = Gefen(model.named_parameters(), lr=1e-2)
    train(model, opt, 2)
    sd = opt.state_dict()
    for entry in sd["state"].values():
        assert {k: v.dtype for k, v in entry.items() if k in M4V4_DTYPES} == {k: M4V4_DTYPES[k] for k in entry
                                                                             if k in M4V4_DTYPES}
    assert {k: v.dtype for k, v in sd[GLOBAL_STATE_KEY].items()} == {"codebook": torch.float32,
                                                                     "v_codebook": torch.float32}
    fresh = Gefen(copy.deepcopy(model).named_parameters(), lr=1e-2)
    fresh.load_state_dict(copy.deepcopy(sd))
    for p, st in fresh.state.items():
        # the optimizer-wide codebooks too, the very tensors the optimizer holds (torch's unflatten reads live keys)
        assert st["codebook"] is fresh.codebook and st["v_codebook"] is fresh.v_codebook
        assert set(st) - {"codebook", "v_codebook"} == ({"step", "mv_code", "m_row_scale", "v_row", "v_col"}
                                                        if p.dim() >= 2 else {"step", "exp_avg", "exp_avg_sq"})
        assert all(v.dtype == M4V4_DTYPES[k] for k, v in st.items() if k in M4V4_DTYPES)
    assert_same_state(state_bits(opt), state_bits(fresh))


def save_load(sd, how):
    if how == "deepcopy":
        return copy.deepcopy(sd)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("moments", ["m4v4", "m8"])
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_resumes_bitwise(how, dtype, moments):
    """Save after 3 steps, load into a fresh optimizer on a copy of the model, run 5 more steps:
    parameters and state are bitwise equal to an uninterrupted run."""
    model = make_model(dtype=dtype)
    opt = Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.05, moments=moments, seed=7)
    train(model, opt, 3)
    sd = save_load(opt.state_dict(), how)
    resumed_model = copy.deepcopy(model)
    resumed = Gefen(resumed_model.named_parameters(), lr=0.5, moments=moments)  # hyperparameters come from the state_dict
    resumed.load_state_dict(sd)
    assert resumed.param_groups[0]["lr"] == 1e-2
    train(model, opt, 5, start=3)
    train(resumed_model, resumed, 5, start=3)
    assert all(same_bits(a, b) for a, b in zip(params_bits(model), params_bits(resumed_model)))
    assert_same_state(state_bits(opt), state_bits(resumed))
    assert same_bits(bits(opt.codebook), bits(resumed.codebook))
    assert resumed.param_groups[0]["seed"] == 7
    if moments == "m4v4":
        assert same_bits(bits(opt.v_codebook), bits(resumed.v_codebook))


@pytest.mark.parametrize("adopt", [False, True])
def test_staging_copies_unless_it_adopts(adopt):
    """``prepare_load_state_dict`` copies every parameter field, or with ``adopt`` keeps the very
    tensors it is handed (a checkpoint read's own memory); either way it resumes bitwise."""
    model, opt = trained(3)
    sd = copy.deepcopy(opt.state_dict())
    books = opt.global_books()  # one shared copy each, staged apart
    given = {(i, name): t for i, entry in sd["state"].items() for name, t in entry.items()
             if t.dim() and name not in books}
    resumed_model = copy.deepcopy(model)
    resumed = Gefen(resumed_model.named_parameters(), lr=1e-2)
    resumed.prepare_load_state_dict(sd, adopt=adopt)()
    params = list(resumed_model.parameters())
    kept = [resumed.state[params[i]][name] is t for (i, name), t in given.items()]
    assert all(kept) if adopt else not any(kept)
    train(model, opt, 2, start=3)
    train(resumed_model, resumed, 2, start=3)
    assert all(same_bits(a, b) for a, b in zip(params_bits(model), params_bits(resumed_model)))


def test_loading_an_empty_state_dict_resets_the_optimizer():
    """A fresh optimizer's state_dict (no state, no codebook) loads and clears state and codebook."""
    model, opt = trained(2)
    opt.load_state_dict(Gefen(make_model().named_parameters(), lr=1e-2).state_dict())
    assert not opt.state and opt.codebook is None
    train(model, opt, 1)
    assert opt.codebook is not None and len(opt.state) == len(list(model.parameters()))


def test_zero_size_parameters_step_and_round_trip():
    """Empty parameters (no rows, or rows without elements) step like AdamW's do and survive a
    state_dict round trip, next to an ordinary parameter."""
    params = [nn.Parameter(torch.zeros(shape)) for shape in ((0, 5), (5, 0), (3, 0, 2), (0,))]
    dense = nn.Parameter(torch.randn(4, 8))
    opt = Gefen(params + [dense], lr=1e-2)
    for _ in range(2):
        for p in params + [dense]:
            p.grad = torch.randn(p.shape)
        opt.step()
    assert all(int(opt.state[p]["step"]) == 2 for p in params)
    fresh = Gefen(params + [dense], lr=1e-2)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert_same_state(state_bits(opt), state_bits(fresh))


# ----- rejected loads: clear error, optimizer bitwise untouched -------------------------------------
def _set(path, value):
    def corrupt(sd):
        *head, last = path
        target = sd
        for key in head:
            target = target[key]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value(target[last]) if callable(value) else value
    return corrupt


def _codebooks(value):
    """Apply ``_set``'s change to every copy of the codebook: the optimizer-wide one and the one
    each parameter's state carries for torch's checkpoint API."""
    def corrupt(sd):
        _set((GLOBAL_STATE_KEY, "codebook"), value)(sd)
        for index in sd["state"]:
            _set(("state", index, "codebook"), value)(sd)
    return corrupt


NAMES = [n for n, _ in Net().named_parameters()]
SCALE, CONV_W, HEAD_W = (NAMES.index(n) for n in ("scale", "conv.weight", "head.weight"))  # 0-D, 3-D, 2-D

REJECTS = {
    "foreign keys": (lambda sd: sd.clear() or sd.update(bad=1), ValueError, "missing"),
    "missing state": (_set(("state",), KeyError), ValueError, "state"),
    "wrong scale shape": (_set(("state", HEAD_W, "m_scale"), lambda t: t[:-1].clone()), ValueError, "'head.weight'.*m_scale.*shape"),
    "float codes": (_set(("state", CONV_W, "m_code"), lambda t: t.float()), TypeError, "'conv.weight'.*m_code.*dtype"),
    "int64 codes": (_set(("state", CONV_W, "m_code"), lambda t: t.long()), TypeError, "'conv.weight'.*m_code"),
    "code beyond codebook": (_set(("state", HEAD_W, "m_code"), lambda t: t.fill_(200)), ValueError, "'head.weight'.*code 200"),
    "fp64 second moment": (_set(("state", HEAD_W, "v_col"), lambda t: t.double()), TypeError, "'head.weight'.*v_col"),
    "wrong v_col shape": (_set(("state", HEAD_W, "v_col"), lambda t: t[:-1].clone()), ValueError, "'head.weight'.*v_col"),
    "wrong code shape": (_set(("state", SCALE, "m_code"), lambda t: t.reshape(1)), ValueError, "'scale'.*m_code"),
    "missing field": (_set(("state", SCALE, "m_scale"), KeyError), ValueError, "'scale'.*fields"),
    "unknown field": (_set(("state", SCALE, "exp_avg"), torch.zeros(())), ValueError, "'scale'.*exp_avg"),
    "block v on a factored tensor": (
        lambda sd: sd["state"][HEAD_W].update(v=torch.zeros(4, 1)) or sd["state"][HEAD_W].pop("v_row"),
        ValueError, "'head.weight'"),
    "invalid period": (_set(("state", HEAD_W, "period"), torch.tensor(7)), ValueError, "'head.weight'.*period 7"),
    "period as int": (_set(("state", HEAD_W, "period"), 96), ValueError, "'head.weight'.*period"),
    "field not a tensor": (_set(("state", HEAD_W, "m_scale"), lambda t: t.tolist()), TypeError, "'head.weight'.*m_scale"),
    "unknown parameter index": (lambda sd: sd["state"].update({99: sd["state"][0]}), ValueError, "99"),
    "unsorted codebook": (_codebooks(lambda c: c[[0, 2, 1, *range(3, 64)]]),
                          ValueError, "sorted"),
    "codebook ends": (_codebooks(lambda c: c * 0.5), ValueError, "codebook"),
    "codebook size": (_codebooks(lambda c: c[:32].clone()), ValueError, "codebook"),
    "codebook dtype": (_codebooks(lambda c: c.double()), TypeError, "codebook"),
    "codebook nan": (_codebooks(lambda c: c.index_fill(0, torch.tensor([5]), float("nan"))),
                     ValueError, "codebook"),
    "missing codebook": (_codebooks(KeyError), ValueError, "codebook"),
    "codebooks disagree": (_set(("state", HEAD_W, "codebook"), lambda c: c.flip(0).neg()), ValueError,
                           "'head.weight'.*differs"),
    "extra group": (lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0])), ValueError, "groups"),
    "fewer params in group": (lambda sd: sd["param_groups"][0]["params"].pop(), ValueError, "group 0"),
    "renamed parameter": (_set(("param_groups", 0, "param_names", 2), "norm.gamma"), ValueError, NAMES[2]),
    "missing hyperparameter": (_set(("param_groups", 0, "betas"), KeyError), ValueError, "betas"),
    "bad hyperparameter": (_set(("param_groups", 0, "lr"), -1.0), ValueError, "lr"),
    "bad factored flag": (_set(("param_groups", 0, "factored_v_2d"), "yes"), TypeError, "factored_v_2d"),
}


def _v1_groups(sd):
    """What a version "1" (m8) state_dict's groups look like: no moments / seed."""
    for group in sd["param_groups"]:
        group.pop("moments")
        group.pop("seed")


M4V4_REJECTS = {
    "float codes": (_set(("state", CONV_W, "mv_code"), lambda t: t.float()), TypeError, "'conv.weight'.*mv_code.*dtype"),
    "fp32 row scale": (_set(("state", HEAD_W, "m_row_scale"), lambda t: t.float()), TypeError,
                       "'head.weight'.*m_row_scale.*bfloat16"),
    "wrong row scale shape": (_set(("state", HEAD_W, "m_row_scale"), lambda t: t[:-1].clone()), ValueError,
                              "'head.weight'.*m_row_scale.*shape"),
    "wrong v_col shape": (_set(("state", CONV_W, "v_col"), lambda t: t[:-1].clone()), ValueError, "'conv.weight'.*v_col"),
    "m8 fields on a matrix": (lambda sd: sd["state"][HEAD_W].update(m_code=sd["state"][HEAD_W].pop("mv_code")),
                              ValueError, "'head.weight'.*m_code"),
    "exact moments on a matrix": (lambda sd: sd["state"][HEAD_W].update(exp_avg=torch.zeros(4, 96)), ValueError,
                                  "'head.weight'.*fields"),
    "missing exp_avg_sq": (_set(("state", SCALE, "exp_avg_sq"), KeyError), ValueError, "'scale'.*fields"),
    "fp32 first moment": (_set(("state", SCALE, "exp_avg"), lambda t: t.float()), TypeError, "'scale'.*exp_avg"),
    "bf16 second moment": (_set(("state", SCALE, "exp_avg_sq"), lambda t: t.bfloat16()), TypeError,
                           "'scale'.*exp_avg_sq"),
    "v_codebook ends": (lambda sd: [e.update(v_codebook=e["v_codebook"] * 0.5) for e in sd["state"].values()]
                        and sd[GLOBAL_STATE_KEY].update(v_codebook=sd[GLOBAL_STATE_KEY]["v_codebook"] * 0.5),
                        ValueError, "v_codebook"),
    "v_codebooks disagree": (_set(("state", HEAD_W, "v_codebook"), lambda c: c.flip(0).neg() * 0.5), ValueError,
                             "v_codebook of parameter 'head.weight' differs"),
    "v_codebook missing": (lambda sd: [e.pop("v_codebook") for e in sd["state"].values()]
                           and sd[GLOBAL_STATE_KEY].pop("v_codebook"), ValueError, "no v_codebook"),
    "version 1 groups": (_v1_groups, ValueError, r"""version '1' \(moments='m8'\).*moments='m8'.*gefen-ckpt convert"""),
    "bad seed": (_set(("param_groups", 0, "seed"), -3), ValueError, "seed"),
}


@pytest.mark.parametrize("case", list(M4V4_REJECTS))
def test_m4v4_rejected_load_leaves_optimizer_untouched(case):
    """The default layout's malformed state_dicts: refused naming what is wrong, nothing changes."""
    corrupt, error, pattern = M4V4_REJECTS[case]
    model, opt = trained(2)
    _, other = trained(3, seed=1)
    sd = copy.deepcopy(other.state_dict())
    corrupt(sd)
    before = snapshot(opt)
    with pytest.raises(error, match=pattern):
        opt.load_state_dict(sd)
    assert_same(before, snapshot(opt))
    opt.load_state_dict(copy.deepcopy(other.state_dict()))
    assert_same_state(state_bits(other), state_bits(opt))


def test_layouts_refuse_each_other_in_one_line_naming_both_ways_out():
    _, m8 = trained(2, moments="m8")
    _, m4v4 = trained(2)
    with pytest.raises(ValueError) as info:
        Gefen(make_model().named_parameters()).load_state_dict(copy.deepcopy(m8.state_dict()))
    assert "\n" not in str(info.value)
    assert "version '1'" in str(info.value) and "Gefen(..., moments='m8')" in str(info.value)
    assert "gefen-ckpt convert SRC DST --into Gefen" in str(info.value)
    with pytest.raises(ValueError, match=r"version '2' \(moments='m4v4'\).*Gefen\(moments='m8'\)"):
        Gefen(make_model().named_parameters(), moments="m8").load_state_dict(copy.deepcopy(m4v4.state_dict()))
    old = copy.deepcopy(m8.state_dict())  # a version "1" state_dict
    _v1_groups(old)
    twin = Gefen(make_model().named_parameters(), moments="m8")
    twin.load_state_dict(old)
    assert_same_state(state_bits(m8), state_bits(twin))
    assert twin.param_groups[0]["moments"] == "m8"


@pytest.mark.parametrize("case", list(REJECTS))
def test_rejected_load_leaves_optimizer_untouched(case):
    """Every malformed state_dict raises a ValueError/TypeError naming what is wrong (the FQN for
    per-parameter problems) and the live optimizer is bitwise unchanged."""
    corrupt, error, pattern = REJECTS[case]
    model, opt = trained(2, codebook_size=64, moments="m8")
    _, other = trained(3, seed=1, codebook_size=64, moments="m8")  # a different trajectory: a partial load would show
    sd = copy.deepcopy(other.state_dict())
    corrupt(sd)
    before = snapshot(opt)
    with pytest.raises(error, match=pattern):
        opt.load_state_dict(sd)
    assert_same(before, snapshot(opt))
    opt.load_state_dict(copy.deepcopy(other.state_dict()))  # the intact one loads
    assert_same_state(state_bits(other), state_bits(opt))


def test_rejected_load_of_non_dict_and_adamw_state():
    """A non-dict and torch AdamW's state_dict (with or without Gefen's group options) are refused
    before anything changes."""
    model, opt = trained(2)
    adamw = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    loss_of(model, 0).backward()
    adamw.step()
    before = snapshot(opt)
    with pytest.raises(TypeError, match="dict"):
        opt.load_state_dict([("state", {})])
    with pytest.raises(ValueError, match=r"this is torch.optim.AdamW's .*--into Gefen"):  # not "lacks factored_v_2d"
        opt.load_state_dict(copy.deepcopy(adamw.state_dict()))
    sd = copy.deepcopy(adamw.state_dict())
    sd["param_groups"][0]["factored_v_2d"] = True
    with pytest.raises(ValueError, match=r"this is torch.optim.AdamW's .*convert_state"):
        opt.load_state_dict(sd)
    assert_same(before, snapshot(opt))


def test_loaded_state_is_a_copy():
    """Loading copies tensors: mutating the source state_dict afterwards does not touch the optimizer."""
    model, opt = trained(2)
    _, other = trained(2, seed=1)
    sd = other.state_dict()
    opt.load_state_dict(sd)
    before = snapshot(opt)
    for entry in sd["state"].values():
        for value in entry.values():
            value.mul_(2)
    sd[GLOBAL_STATE_KEY]["codebook"].mul_(2)
    sd[GLOBAL_STATE_KEY]["v_codebook"].mul_(2)
    assert_same(before, snapshot(opt))


# ----- bad input --------------------------------------------------------------------------------
BAD_OPTIONS = [
    (dict(lr=-1e-3), ValueError, "lr"),
    (dict(lr=float("nan")), ValueError, "lr"),
    (dict(lr="0.1"), ValueError, "lr"),
    (dict(betas=(1.0, 0.999)), ValueError, r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\]"),
    (dict(betas=(0.9,)), ValueError, "betas"),
    (dict(eps=-1e-8), ValueError, "eps"),
    (dict(eps=float("inf")), ValueError, "eps"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(codebook_size=257), ValueError, "codebook_size"),
    (dict(codebook_size=3), ValueError, "codebook_size"),
    (dict(codebook_size=16.0), ValueError, "codebook_size"),
    (dict(bins_per_code=0), ValueError, "bins_per_code"),
    (dict(factored_v_2d=1), TypeError, "factored_v_2d"),
]


@pytest.mark.parametrize("kwargs,error,pattern", BAD_OPTIONS, ids=[str(k) for k, _, _ in BAD_OPTIONS])
def test_bad_options_raise_naming_the_option(kwargs, error, pattern):
    """Out-of-range options are refused at construction, naming the option."""
    with pytest.raises(error, match=pattern):
        Gefen([nn.Parameter(torch.zeros(3))], **kwargs)


def test_bad_parameters_raise_naming_the_parameter():
    """Non-floating parameters, a parameter in two groups and duplicate names are refused at
    construction (complex parameters and a tensor listed twice: tests/optim/test_torch_conformance.py)."""
    p, q = nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))
    with pytest.raises(TypeError, match="'ids'.*int64"):
        Gefen([("w", p), ("ids", torch.zeros(3, dtype=torch.int64))])
    with pytest.raises(ValueError, match="more than one parameter group"):
        Gefen([{"params": [p]}, {"params": [q, p]}])
    with pytest.raises(ValueError, match="duplicate parameter names.*'w'"):
        Gefen([("w", p), ("w", q)])
    with pytest.raises(ValueError, match="already used.*'w'"):
        Gefen([{"params": [("w", p)]}, {"params": [("w", q)]}])
    with pytest.raises(ValueError, match="empty"):
        Gefen([])


def test_sparse_and_complex_gradients_raise_before_any_change():
    """A sparse gradient (nn.Embedding(sparse=True)) fails the step naming the parameter, with
    nothing changed; complex gradients are refused by the same check."""
    emb, lin = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)
    opt = Gefen([("lin.weight", lin.weight), ("emb.weight", emb.weight)])
    lin(emb(torch.tensor([1, 2, 3]))).sum().backward()
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match="Adam does not support sparse gradients.*'emb.weight'"):
        opt.step()
    assert_same(before, snapshot(opt))
    with pytest.raises(RuntimeError, match="complex parameters.*'x'"):
        check_step_param(torch.zeros(3), torch.zeros(3, dtype=torch.complex64), "'x'", "Adam", "Gefen")


# ----- contracts ----------------------------------------------------------------------------------
def make(kind):
    model = make_model()
    if kind.startswith("Gefen"):
        return Gefen(model.named_parameters(), factored_v_2d=True, moments="m8" if kind == "Gefen-m8" else "m4v4")
    cls = getattr(torch.optim, kind)
    return cls(model.parameters(), lr=0.1, momentum=0.9) if kind == "SGD" else cls(model.parameters())


@pytest.mark.parametrize("kind", ["Gefen", "Gefen-m8", "AdamW", "Adam", "SGD"])
def test_contract_is_frozen_and_round_trips(kind):
    """contract_of is frozen, names the implementation, and survives to_dict/from_dict and msgpack."""
    opt = make(kind)
    contract = gefen.contract_of(opt)
    assert isinstance(contract, OptimizerContract)
    assert contract.implementation.endswith(kind.removesuffix("-m8"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        contract.version = "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        contract.fields[0].geometry = "param"
    plain = contract.to_dict()
    assert OptimizerContract.from_dict(plain) == contract
    packed = msgpack.packb(plain)
    assert OptimizerContract.from_dict(msgpack.unpackb(packed)) == contract
    assert hash(contract) == hash(OptimizerContract.from_dict(plain))


@pytest.mark.parametrize("kind", ["Gefen", "Gefen-m8", "AdamW", "Adam", "SGD"])
def test_contract_describes_the_real_state(kind):
    """Every hyperparameter is a group option, and after a step every state field is declared
    with its dtype and the shape its geometry implies (docs/design.md 4)."""
    opt = make(kind)
    model_params = [p for g in opt.param_groups for p in g["params"]]
    contract = gefen.contract_of(opt)
    assert set(contract.hyperparameters) <= set(opt.param_groups[0])
    loss = sum(p.float().square().sum() for p in model_params)
    loss.backward()
    opt.step()
    for p in model_params:
        rows = p.shape[0] if p.dim() else 1
        for name, value in opt.state[p].items():
            spec = contract.field(name)
            if spec.geometry == "global":  # the optimizer-wide codebook, shared by every parameter's state
                assert value is getattr(opt, name), (kind, name)
                continue
            want_dtype = str(p.dtype if spec.dtype == "like_param" else getattr(torch, spec.dtype))
            assert str(value.dtype) == want_dtype, (kind, name)
            period = int(opt.state[p]["period"]) if "period" in opt.state[p] else 1
            want_shape = {
                "scalar": (), "param": tuple(p.shape), "row": (rows,),
                "block": (rows, (p.numel() // rows) // period), "col": (p.numel() // rows,),
            }[spec.geometry]
            assert tuple(value.shape) == want_shape, (kind, name)
        required = {f.name for f in contract.fields if not f.optional}
        assert required <= set(opt.state[p])
    if kind == "Gefen-m8":
        assert contract.version == "1"
        assert [f.name for f in contract.global_fields] == ["codebook"]
        assert contract.field("codebook").geometry == "global"
        assert {f.name: f.geometry for f in contract.fields} == {
            "step": "scalar", "period": "scalar", "m_code": "param", "m_scale": "block",
            "v": "block", "v_row": "row", "v_col": "col"}
    if kind == "Gefen":
        assert contract.version == "2"
        assert {f.name: f.geometry for f in contract.global_fields} == {"codebook": "global", "v_codebook": "global"}
        assert {f.name: (f.dtype, f.geometry) for f in contract.fields} == {
            "step": ("int64", "scalar"), "mv_code": ("uint8", "param"), "m_row_scale": ("bfloat16", "row"),
            "v_row": ("float32", "row"), "v_col": ("float32", "col"), "exp_avg": ("bfloat16", "param"),
            "exp_avg_sq": ("float32", "param")}
        assert {"moments", "seed"} <= set(contract.hyperparameters)


def test_contract_errors():
    """Unsupported optimizers and malformed contract dicts get clear errors."""
    with pytest.raises(TypeError, match="RMSprop"):
        gefen.contract_of(torch.optim.RMSprop([nn.Parameter(torch.zeros(2))]))
    plain = gefen.contract_of(make("Gefen")).to_dict()
    del plain["fields"]
    with pytest.raises(ValueError, match="malformed"):
        OptimizerContract.from_dict(plain)
    plain = gefen.contract_of(make("Gefen")).to_dict()
    plain["fields"][0]["geometry"] = "diagonal"
    with pytest.raises(ValueError, match="diagonal"):
        OptimizerContract.from_dict(plain)


def test_deepcopy_keeps_codebook_and_continues_identically():
    """copy.deepcopy (used by e.g. model-averaging code) carries the codebook and settings."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 16)
    opt = Gefen(model.named_parameters(), lr=1e-2, codebook_size=64, moments="m8")
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    twin_model = copy.deepcopy(model)
    twin = copy.deepcopy(opt)
    assert twin.codebook_size == 64 and torch.equal(twin.codebook, opt.codebook)
    twin = Gefen(twin_model.named_parameters(), lr=1e-2, codebook_size=64, moments="m8")
    twin.load_state_dict(opt.state_dict())
    for m, o in ((model, opt), (twin_model, twin)):
        torch.manual_seed(1)
        m(torch.randn(4, 8)).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))


def test_deepcopy_and_pickle_keep_both_codebooks():
    """The default layout's second codebook and ``moments`` travel with copy.deepcopy / pickle."""
    import pickle

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 16)
    opt = Gefen(model.named_parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    for twin in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert twin.moments == "m4v4" and twin.codebook_size == 16
        assert torch.equal(twin.codebook, opt.codebook) and torch.equal(twin.v_codebook, opt.v_codebook)

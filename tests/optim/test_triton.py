"""The Triton kernels (gefen/triton) against the eager references in gefen.functional.

On a machine without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set by conftest.py before Triton is imported) on CPU tensors; with a CUDA device the same
comparisons run on it. Codes, scales and moments must be identical; parameters may differ by
two ulps of the update where torch's CPU ``sqrt`` (MKL) is not correctly rounded (docs/decisions.md, "Triton
kernels: what is bit-exact").
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from gefen import c_kernels, parity
from gefen import functional as F
from gefen.functional import Hyper
from gefen.stochastic import ratio_table

triton = pytest.importorskip("triton")
from gefen import dispatch as step_dispatch  # noqa: E402
from gefen.triton import dispatch, launch  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)


@pytest.fixture(autouse=True)
def _kernels_on_this_device(monkeypatch):
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and Triton's interpreter is off (TRITON_INTERPRET=1)")
    monkeypatch.setattr(dispatch, "DEVICES", {"cuda", "cpu"})
    assert dispatch.available()  # imports the launch module the kernels' functions below call
    monkeypatch.setattr(step_dispatch, "enabled", True)  # off: the reference is the eager torch step
    monkeypatch.setattr(launch, "MAX_SINGLE", 64)  # rows longer than 64 take the two-pass kernels


def _grad(gen, shape, dtype, zero_row: bool):
    rows = torch.rand(shape[0] if shape else 1, *[1] * max(len(shape) - 1, 0), generator=gen) + 0.1
    g = torch.randn(shape, generator=gen) * (rows if shape else rows.reshape(()))
    if zero_row and len(shape) >= 2 and shape[0] > 1:
        g[1] = 0
    return g.to(device=DEVICE, dtype=dtype)


def _books(gen):
    cb = torch.sort(torch.rand(16, generator=gen) * 2 - 1).values
    cb[0], cb[-1] = -1.0, 1.0
    vcb = torch.sort(torch.rand(16, generator=gen) * 2 - 1).values
    return cb.to(DEVICE), ratio_table(vcb.to(DEVICE))


def _assert_states_equal(ref: dict, got: dict, label: str):
    for key, value in ref.items():
        assert torch.equal(value, got[key]), f"{label}: state {key!r} differs"


# ----- Gefen m4v4 ---------------------------------------------------------------------------
M4V4_CASES = [
    ((37, 33), torch.float32, torch.float32),  # odd shape, one tile
    ((5, 4, 10), torch.bfloat16, torch.bfloat16),  # 3-D, bf16 parameter and gradient
    ((3, 150), torch.float32, torch.bfloat16),  # rows longer than MAX_SINGLE: two passes
    ((0, 12), torch.float32, torch.float32),  # an empty row shard
    ((1, 1), torch.bfloat16, torch.float32),
]


def _m4v4_pair(shape, pdt, gen):
    p = (torch.randn(shape, generator=gen) * 0.1).to(device=DEVICE, dtype=pdt)
    state = F.init_m4v4_state(p, shape)
    return (p, state), (p.clone(), copy.deepcopy(state))


@pytest.mark.parametrize("shape,pdt,gdt", M4V4_CASES, ids=str)
def test_m4v4_matches_the_reference(shape, pdt, gdt):
    gen = torch.Generator().manual_seed(len(shape) * 100 + sum(shape))
    cb, R = _books(gen)
    (p_ref, s_ref), (p_tri, s_tri) = _m4v4_pair(shape, pdt, gen)
    global_rows, row0 = shape[0] + 7, 5  # a row shard of a larger parameter (hash uses global indices)
    before = p_ref.clone()
    for step in range(3):
        g = _grad(gen, shape, gdt, zero_row=step == 1)
        v_row, parts = F.m4v4_partials(g, s_ref, H.beta2)
        kw = dict(global_rows=global_rows, v_row=v_row, partials=parts, pidx=3, seed=1, row0=row0)
        F.m4v4_update_(p_ref, g, s_ref, cb, R, H, **kw)  # the pure reference
        assert dispatch.m4v4_update_(p_tri, g, s_tri, cb, R, H, **{**kw, "v_row": v_row.clone()})
        _assert_states_equal(s_ref, s_tri, f"step {step}")
        assert parity.params_close(before, p_ref, p_tri), f"step {step}: parameters differ beyond rounding"
        p_tri.copy_(p_ref)  # every step is compared from the same parameters
        before = p_ref.clone()


def test_partials_match_the_reference():
    """Phase 1 for a group (one launch per gradient dtype, then one for the column sums): the new
    v_row identical; the float64 sums equal up to summation order, so identical once divided and
    rounded to fp32 as the step uses them."""
    gen = torch.Generator().manual_seed(5)
    shapes = [((70, 33), torch.float32), ((5, 4, 10), torch.bfloat16), ((0, 12), torch.float32),
              ((1, 1), torch.float32), ((3, 150), torch.bfloat16)]
    items = []
    for shape, gdt in shapes:
        state = F.init_m4v4_state(torch.zeros(shape, device=DEVICE), shape)
        state["v_row"].uniform_(generator=gen) if DEVICE == "cpu" else state["v_row"].uniform_()
        items.append((_grad(gen, shape, gdt, zero_row=True), state, 0.95))
    got = launch.m4v4_partials(items)
    assert got is not None
    for (g, state, b2), (v_row, parts) in zip(items, got):
        ref_v_row, ref_parts = F.m4v4_partials(g, state, b2)
        assert torch.equal(v_row, ref_v_row)
        torch.testing.assert_close(parts, ref_parts, rtol=1e-13, atol=0)
        rows = max(g.shape[0], 1)
        assert torch.equal((parts / rows).float(), (ref_parts / rows).float())


@pytest.mark.parametrize("shape,pdt", [((7,), torch.float32), ((), torch.float32), ((130,), torch.bfloat16),
                                       ((0,), torch.float32)], ids=str)
def test_1d_path_matches_the_reference(shape, pdt):
    gen = torch.Generator().manual_seed(7)
    p_ref = (torch.randn(shape, generator=gen) * 0.1).to(device=DEVICE, dtype=pdt)
    s_ref = F.init_m4v4_state(p_ref, shape)
    p_tri, s_tri = p_ref.clone(), copy.deepcopy(s_ref)
    before = p_ref.clone()
    for step in range(3):
        g = _grad(gen, shape, pdt, zero_row=False)
        F.adamw_update_(p_ref, g, s_ref, H, pidx=3, seed=2, row0=9)
        assert dispatch.adamw_update_(p_tri, g, s_tri, H, pidx=3, seed=2, row0=9)
        _assert_states_equal(s_ref, s_tri, f"step {step}")
        assert parity.params_close(before, p_ref, p_tri)
        p_tri.copy_(p_ref)
        before = p_ref.clone()


def test_optimizer_step_uses_the_kernels_in_one_batch(monkeypatch):
    """Gefen.step through the hook: the same state as the eager step, and the whole group goes
    to the kernels in one call per codebook (not one per tensor)."""
    from gefen import Gefen

    if "moments" not in Gefen.__init__.__code__.co_varnames:
        pytest.skip("needs the m4v4 optimizer")
    shapes = {"w1": (9, 20), "w2": (20, 9), "b": (20,), "e": (3, 2, 5)}
    gen = torch.Generator().manual_seed(3)
    init = {n: torch.randn(s, generator=gen).to(DEVICE) for n, s in shapes.items()}
    grads = [{n: _grad(gen, s, torch.float32, zero_row=False) for n, s in shapes.items()} for _ in range(3)]
    calls = []
    real = launch.m4v4_update_
    monkeypatch.setattr(launch, "m4v4_update_", lambda items, *a, **k: (calls.append(len(items)), real(items, *a, **k)))

    def run(use_kernels: bool):
        step_dispatch.enabled = use_kernels
        params = [(n, torch.nn.Parameter(t.clone())) for n, t in init.items()]
        opt = Gefen(params, lr=1e-2, weight_decay=0.1)
        for g in grads:
            for n, p in params:
                p.grad = g[n].clone()
            opt.step()
        return params, opt

    (ref_params, ref_opt), (params, opt) = run(False), run(True)
    assert calls == [3, 1] * len(grads)  # the three coded tensors together, the 1-D one
    for (name, a), (_, b) in zip(ref_params, params):
        _assert_states_equal(ref_opt.state[a], opt.state[b], name)
        assert parity.params_close(init[name], a.detach(), b.detach(), steps=len(grads)), name


@pytest.mark.parametrize("moments", ["m4v4", "m8"])
def test_bf16_stochastic_round_write_back_launches_after_the_updates(moments, monkeypatch):
    """bf16_stochastic_round on the kernels: the updates write fp32 copies, queued; the write-back
    is one launch for the group after them, and gives the bits of the eager write-back of the
    same fp32 values (the kernel's write-back disabled: the queue is drained, then the reference)."""
    from gefen import Gefen

    shapes = {"w1": (9, 20), "b": (20,), "e": (3, 2, 5)}
    gen = torch.Generator().manual_seed(4)
    init = {n: torch.randn(s, generator=gen).to(DEVICE, torch.bfloat16) for n, s in shapes.items()}
    grads = [{n: _grad(gen, s, torch.bfloat16, zero_row=False) for n, s in shapes.items()} for _ in range(3)]
    calls = []
    real = launch.round_params_
    monkeypatch.setattr(launch, "round_params_", lambda items: (calls.append(len(items)), real(items)))

    def run():
        params = [(n, torch.nn.Parameter(t.clone())) for n, t in init.items()]
        opt = Gefen(params, lr=1e-2, moments=moments, bf16_stochastic_round=True, seed=2)
        for g in grads:
            for n, p in params:
                p.grad = g[n].clone()
            opt.step()
        return [p.detach().clone() for _, p in params]

    kernels = run()
    assert calls == [len(shapes)] * len(grads)
    monkeypatch.setattr(dispatch, "round_param_", lambda *a, **k: False)
    monkeypatch.setattr(c_kernels, "round_param_", lambda *a, **k: False)
    eager = run()
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(kernels, eager))


# ----- Gefen m8 (8-bit codes; block or factored second moment) ---------------------------------
M8_CASES = [  # shape, block length, factored, parameter dtype, gradient dtype, codebook size
    ((37, 33), 33, True, torch.float32, torch.float32, 256),  # odd shape, one tile
    ((3, 150), 150, True, torch.bfloat16, torch.float32, 100),  # rows longer than MAX_SINGLE: two passes
    ((6, 40), 8, True, torch.float32, torch.bfloat16, 2),  # blocks shorter than a row
    ((5, 4, 10), 40, False, torch.bfloat16, torch.bfloat16, 16),  # 3-D: the per-block second moment
    ((3, 150), 150, False, torch.float32, torch.float32, 256),  # per-block, two passes
    ((0, 12), 12, True, torch.float32, torch.float32, 16),  # empty row shards
    ((0, 3, 4), 12, False, torch.float32, torch.float32, 16),
    ((7,), 1, False, torch.float32, torch.float32, 4),  # 1-D and 0-D: one element per block
    ((), 1, False, torch.bfloat16, torch.bfloat16, 256),
]


@pytest.mark.parametrize("shape,period,factored,pdt,gdt,K", M8_CASES, ids=str)
def test_m8_matches_the_reference(shape, period, factored, pdt, gdt, K):
    """Both phases through the hooks over three steps: codes, scales, v_col and the step count
    identical; v / v_row within M8_V_RTOL and parameters within one rounding plus M8_V_RTOL of
    the update (the fp32 means of g^2 differ only in summation order; docs/decisions.md)."""
    gen = torch.Generator().manual_seed(K + len(shape) * 10 + period)
    cb = torch.sort(torch.rand(K, generator=gen) * 2 - 1).values
    cb[0], cb[-1] = -1.0, 1.0
    cb = cb.to(DEVICE)
    p_ref = (torch.randn(shape, generator=gen) * 0.1).to(device=DEVICE, dtype=pdt)
    s_ref = F.init_m8_state(p_ref, shape, period, factored)
    p_tri, s_tri = p_ref.clone(), copy.deepcopy(s_ref)
    global_rows = (shape[0] if shape else 1) + 7  # a row shard of a larger parameter
    for step in range(3):
        g = _grad(gen, shape, gdt, zero_row=step == 1)
        before = p_ref.clone()
        kw = kw_tri = {}
        if factored:
            v_row, parts = F.m8_partials(g, s_ref, H.beta2)
            ((v_row_tri, parts_tri),) = launch.m8_partials([(g, s_tri, H.beta2)])
            torch.testing.assert_close(v_row_tri, v_row, rtol=parity.M8_V_RTOL, atol=0)
            torch.testing.assert_close(parts_tri[:-1], parts[:-1], rtol=1e-13, atol=0)  # float64 column sums
            torch.testing.assert_close(parts_tri[-1:], parts[-1:], rtol=parity.M8_V_RTOL, atol=0)  # sum of v_row
            kw, kw_tri = dict(v_row=v_row, partials=parts), dict(v_row=v_row_tri, partials=parts_tri)
        F.m8_update_(p_ref, g, s_ref, cb, H, global_rows=global_rows, **kw)  # the pure reference
        assert dispatch.m8_update_(p_tri, g, s_tri, cb, H, global_rows=global_rows, **kw_tri)
        assert (why := parity.state_differences(s_ref, s_tri, parity.M8_APPROX)) is None, f"step {step}: {why}"
        assert parity.params_close(before, p_ref, p_tri, parity.M8_V_RTOL), \
            f"step {step}: parameters differ beyond the tolerance"
        p_tri.copy_(p_ref)  # every step is compared from the same parameters


def test_m8_tolerance_is_needed_and_holds():
    """The stated tolerance is not vacuous: torch's fp32 mean of g^2 and the kernels' (a float64
    sum rounded once) differ somewhere on these rows, and by no more than M8_V_RTOL."""
    gen = torch.Generator().manual_seed(11)
    shape = (64, 33)
    state = F.init_m8_state(torch.zeros(shape, device=DEVICE), shape, 33, True)
    g = _grad(gen, shape, torch.float32, zero_row=False)
    ((v_row, _),) = launch.m8_partials([(g, state, 0.0)])  # beta2 = 0: v_row is the mean itself
    ref = (g.cpu() * g.cpu()).mean(1)  # torch's CPU mean (its cascade sum) on every device
    rel = ((v_row.cpu() - ref).abs() / ref).max().item()
    assert 0 < rel <= parity.M8_V_RTOL, rel


def test_m8_optimizer_step_uses_the_kernels_in_one_batch(monkeypatch):
    """Gefen(moments="m8").step through the hooks, both second-moment forms in one optimizer: the
    same state as the eager step (up to the stated tolerance), one phase-1 call for the factored
    matrices and one phase-2 call for every tensor of the step."""
    from gefen import Gefen

    shapes = {"w1": (9, 20), "w2": (20, 9), "b": (20,), "e": (3, 2, 5)}
    gen = torch.Generator().manual_seed(8)
    init = {n: torch.randn(s, generator=gen).to(DEVICE) for n, s in shapes.items()}
    grads = [{n: _grad(gen, s, torch.float32, zero_row=False) for n, s in shapes.items()} for _ in range(3)]
    calls = []
    for name in ("m8_partials", "m8_update_"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda items, *a, _r=real, _n=name: (calls.append((_n, len(items))),
                                                                              _r(items, *a))[1])
    optimizers = []
    for _ in range(2):  # the eager step, the kernels
        params = [(n, torch.nn.Parameter(t.clone())) for n, t in init.items()]
        optimizers.append((params, Gefen(params, lr=1e-2, weight_decay=0.1, moments="m8", codebook_size=64)))
    for g in grads:
        for use_kernels, (params, opt) in zip((False, True), optimizers):
            for n, p in params:
                p.grad = g[n].clone()
            step_dispatch.enabled = use_kernels
            opt.step()
        (ref_params, ref_opt), (params, opt) = optimizers
        for (name, a), (_, b) in zip(ref_params, params):
            why = parity.state_differences(ref_opt.state[a], opt.state[b], parity.M8_APPROX)
            assert why is None, f"{name}: {why}"
            assert parity.params_close(init[name], a.detach(), b.detach(), parity.M8_V_RTOL), name
            b.data.copy_(a.data)
            init[name] = a.detach().clone()
    assert calls == [("m8_partials", 2), ("m8_update_", 4)] * len(grads)


def test_m8_unexpected_layout_takes_the_reference(caplog, monkeypatch):
    """State the kernels do not expect (here an fp64 block second moment) is no kernel's: the one
    layout check names why; the same state in fp32 is the kernels'."""
    shape = (4, 6)
    p, g, cb = torch.randn(shape).to(DEVICE), torch.randn(shape).to(DEVICE), torch.linspace(-1, 1, 16).to(DEVICE)
    state = F.init_m8_state(p, shape, 6, False)
    state["v"] = state["v"].double()
    select = lambda: step_dispatch.kernels("m8", [p, g], [state["m_code"], state["m_scale"], cb, state["v"]],  # noqa: E731
                                           lambda: step_dispatch._m8_layout(p, g, state, cb))
    monkeypatch.setattr(dispatch, "_logged", set())
    with caplog.at_level("WARNING", logger="gefen.triton"):
        assert select() is None
    assert "unexpected m8 state" in step_dispatch._m8_layout(p, g, state, cb)
    if DEVICE == "cuda":
        assert any("unexpected m8 state" in r.getMessage() for r in caplog.records)
    state["v"] = state["v"].float()
    assert select() is dispatch


def test_m8_factored_rows_of_more_dims_fall_back_untouched(caplog, monkeypatch):
    """A factored 3-D parameter passes the shared check but not the Triton kernels' own (2-D rows):
    nothing is modified and the reason is logged once."""
    shape = (4, 3, 6)
    p = torch.randn(shape).to(DEVICE)
    state = F.init_m8_state(p, shape, 18, True)
    saved = copy.deepcopy(state)
    monkeypatch.setattr(dispatch, "_logged", set())
    with caplog.at_level("WARNING", logger="gefen.triton"):
        assert not dispatch.m8_update_(p, torch.randn(shape).to(DEVICE), state, torch.linspace(-1, 1, 16).to(DEVICE),
                                          H, global_rows=4)
    _assert_states_equal(saved, state, "fallback")
    assert any("unexpected m8 state" in r.getMessage() for r in caplog.records)


# ----- GefenMuon's compressed momentum (m8 codes) ----------------------------------------------
@pytest.mark.parametrize("K", [4, 16, 100, 256])
@pytest.mark.parametrize("shape,period,gdt", [((37, 33), 33, torch.float32), ((6, 40), 8, torch.float32),
                                              ((3, 150), 150, torch.float32), ((0, 8), 8, torch.float32)],
                         ids=str)
def test_momentum_matches_the_reference(K, shape, period, gdt):
    gen = torch.Generator().manual_seed(K + shape[0])
    cb = torch.sort(torch.rand(K, generator=gen) * 2 - 1).values
    cb[0], cb[-1] = -1.0, 1.0
    cb = cb.to(DEVICE)
    s_ref = F.init_momentum_state(torch.zeros(shape, device=DEVICE), shape, period)
    s_tri = copy.deepcopy(s_ref)
    for step, beta in enumerate((0.95, 0.3, 0.95)):  # lerp weights on both sides of 0.5
        g = _grad(gen, shape, gdt, zero_row=step == 1)
        ref = F.update_momentum_(s_ref, g, beta, cb)
        got = dispatch.momentum_(s_tri, g, beta, cb)
        assert got is not None
        assert torch.equal(ref, got), f"step {step}: momentum differs"
        _assert_states_equal(s_ref, s_tri, f"step {step}")


def test_muon_step_uses_one_launch_for_every_momentum(monkeypatch):
    """GefenMuon.step through the hook: bf16 and fp32 parameters and gradients, identical state to the eager step
    (Newton-Schulz and the update are torch's in both), one kernel call for all momenta."""
    from gefen import GefenMuon

    gen = torch.Generator().manual_seed(4)
    shapes = {"a": (12, 20), "b": (20, 12), "c": (7, 9)}
    dtypes = {"a": torch.float32, "b": torch.float32, "c": torch.bfloat16}
    init = {n: torch.randn(s, generator=gen).to(device=DEVICE, dtype=dtypes[n]) for n, s in shapes.items()}
    grads = [{n: _grad(gen, s, dtypes[n], zero_row=False) for n, s in shapes.items()} for _ in range(3)]
    calls = []
    real = launch.momentum_
    monkeypatch.setattr(launch, "momentum_", lambda items, *a: (calls.append(len(items)), real(items, *a))[1])

    def run(use_kernels: bool):
        step_dispatch.enabled = use_kernels
        params = [(n, torch.nn.Parameter(t.clone())) for n, t in init.items()]
        opt = GefenMuon(params, lr=1e-2)
        for g in grads:
            for n, p in params:
                p.grad = g[n].clone()
            opt.step()
        return params, opt

    (ref_params, ref_opt), (params, opt) = run(False), run(True)
    assert calls == [3] * len(grads)
    for (name, a), (_, b) in zip(ref_params, params):
        _assert_states_equal(ref_opt.state[a], opt.state[b], name)
        assert torch.equal(a, b), name


_AOT = """
import re, sys
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from gefen.triton import kernels as K

tab = {"progs": "*i64", "ptrs": "*i64"}
cases = [
    (K.m4v4_kernel, {**tab, "ints": "*i64", "scal": "*fp32", "cb": "*fp32", "R": "*fp32"},
     {"BR": 2, "BC": 1024, "SINGLE": True, "PARAM_T": tl.float32, "GRAD_T": tl.float32}),
    (K.m4v4_kernel, {**tab, "ints": "*i64", "scal": "*fp32", "cb": "*fp32", "R": "*fp32"},
     {"BR": 1, "BC": 1024, "SINGLE": False, "PARAM_T": tl.bfloat16, "GRAD_T": tl.bfloat16}),
    (K.momentum_kernel, {**tab, "sizes": "*i64", "weights": "*fp32", "cb": "*fp32", "thr": "*fp32", "K": "i32"},
     {"LOG2K": 8, "BR": 4, "BC": 256, "SINGLE": True, "GRAD_T": tl.bfloat16}),
    (K.adamw_kernel, {**tab, "ints": "*i64", "scal": "*fp32"}, {"BLOCK": 1024, "PARAM_T": tl.bfloat16,
                                                              "GRAD_T": tl.float32}),
    (K.prologue_kernel, {**tab, "ints": "*i64", "scal": "*fp32"}, {"BC": 1024, "M8": False}),
    (K.partials_kernel, {**tab, "ints": "*i64", "betas": "*fp32"},
     {"BR": 32, "BC": 64, "GRAD_T": tl.float32, "M8": False}),
    (K.column_sum_kernel, {**tab, "ints": "*i64"}, {"BC": 256, "BR": 32}),
    (K.m8_kernel, {**tab, "ints": "*i64", "scal": "*fp32", "cb": "*fp32", "thr": "*fp32", "K": "i32"},
     {"LOG2K": 8, "BR": 2, "BC": 1024, "SINGLE": True, "FACTORED": True, "PARAM_T": tl.float32,
      "GRAD_T": tl.float32}),
    (K.m8_kernel, {**tab, "ints": "*i64", "scal": "*fp32", "cb": "*fp32", "thr": "*fp32", "K": "i32"},
     {"LOG2K": 4, "BR": 1, "BC": 1024, "SINGLE": False, "FACTORED": False, "PARAM_T": tl.bfloat16,
      "GRAD_T": tl.bfloat16}),
    (K.prologue_kernel, {**tab, "ints": "*i64", "scal": "*fp32"}, {"BC": 1024, "M8": True}),
    (K.partials_kernel, {**tab, "ints": "*i64", "betas": "*fp32"},
     {"BR": 32, "BC": 64, "GRAD_T": tl.bfloat16, "M8": True}),
]
for fn, sig, consts in cases:
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts)
    ptx = compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
    bad = sorted(set(re.findall(r"\\b(?:div\\.(?:full|approx)|sqrt\\.approx|rcp\\.approx|ex2|lg2)[.a-z0-9]*", ptx)))
    print(fn.__name__, "approximate:", bad)
    assert not bad, (fn.__name__, bad)
print("ok")
"""


def test_kernels_compile_for_a_gpu_with_ieee_arithmetic():
    """Compiled for an H100/H200 (sm_90) without one: every kernel lowers, and the PTX holds no
    approximate division, square root or transcendental (Triton's ``/`` and ``tl.sqrt`` would)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout + out.stderr)[-3000:]


# ----- dispatch ---------------------------------------------------------------------------------
def test_disabled_or_foreign_devices_fall_back(caplog):
    gen = torch.Generator().manual_seed(0)
    shape = (4, 8)
    s = F.init_momentum_state(torch.zeros(shape), shape, 8)
    cb = torch.linspace(-1, 1, 16)
    g = torch.randn(shape, generator=gen).to(DEVICE)
    states = [s["m_code"].to(DEVICE), s["m_scale"].to(DEVICE), cb.to(DEVICE)]
    assert step_dispatch.kernels("momentum", [g], states) is dispatch
    step_dispatch.enabled = False
    assert step_dispatch.kernels("momentum", [g], states) is None
    step_dispatch.enabled = True
    dispatch.DEVICES = {"cuda"}
    if DEVICE == "cpu":  # CPU tensors are the C kernel's or the eager step's: silently not ours
        assert step_dispatch.kernels("momentum", [g], states) is not dispatch
        assert not caplog.records


def test_first_use_check_of_the_write_back_passes_and_catches_a_wrong_kernel(monkeypatch):
    device = torch.device(DEVICE)
    assert dispatch.parity_check(device, "round") is None
    real = launch.round_params_

    def broken(items):
        real(items)
        items[0][0].view(-1)[-1] = items[0][0].view(-1)[-1].float() * 2  # one element off

    monkeypatch.setattr(launch, "round_params_", broken)
    assert "differs" in dispatch.parity_check(device, "round")


@pytest.mark.parametrize("family", ["m4v4", "m8", "momentum"])
def test_first_use_check_passes_and_catches_a_wrong_kernel(family, monkeypatch):
    """The check run at a device's first use (gefen.triton.dispatch.parity_check) passes with these kernels
    and reports a kernel whose output differs (here: an update that forgets the last element)."""
    device = torch.device(DEVICE)
    assert dispatch.parity_check(device, family) is None
    name = {"momentum": "momentum_", "m8": "m8_update_"}.get(family, "m4v4_update_")
    real = getattr(launch, name)

    def broken(items, *args):
        saved = [copy.deepcopy(it[0] if family == "momentum" else it.state) for it in items]
        out = real(items, *args)
        for it, old in zip(items, saved):  # undo the first parameter's codes
            state = it[0] if family == "momentum" else it.state
            key = "mv_code" if family == "m4v4" else "m_code"
            if key in state and state[key].numel():
                state[key].view(-1)[-1] = old[key].view(-1)[-1] ^ 1
            break
        return out

    monkeypatch.setattr(launch, name, broken)
    assert "differs" in dispatch.parity_check(device, family)


def test_cuda_fallback_logs_its_reason_once(monkeypatch, caplog):
    """A CUDA step that cannot use the kernels says why, once (checked with a fake reason)."""
    monkeypatch.setattr(dispatch, "_logged", set())
    with caplog.at_level("WARNING", logger="gefen.triton"):
        for _ in range(3):
            assert dispatch.fallback("a test reason") is False
    assert [r.getMessage() for r in caplog.records] == ["gefen: a CUDA step uses the eager torch path: a test reason"]


def test_without_triton_everything_imports_and_steps():
    """A machine without Triton: gefen imports and steps on CPU, the kernels' module is never
    imported (Triton is a lazy, optional import) and the dispatch reports why not; with
    GEFEN_DISABLE_NATIVE=1 every fused path (C and Triton) is off."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from gefen import Gefen, GefenMuon\n"
        "from gefen.triton import dispatch\n"
        "w = torch.nn.Parameter(torch.randn(8, 4)); b = torch.nn.Parameter(torch.randn(4))\n"
        "opt = Gefen([('w', w), ('b', b)]); w.grad = torch.randn(8, 4); b.grad = torch.randn(4); opt.step()\n"
        "m = GefenMuon([('w', w)]); m.step()\n"
        "assert 'gefen.triton.launch' not in sys.modules and 'gefen.triton.kernels' not in sys.modules\n"
        "assert dispatch._kernels() is None and 'not importable' in dispatch._import_error\n"
        "assert \"pip install 'gefen[gpu]'\" in dispatch._import_error\n"
        "from gefen import dispatch as step_dispatch\n"
        "assert not step_dispatch.enabled  # GEFEN_DISABLE_NATIVE=1: the eager step\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRITON_INTERPRET": "0", "GEFEN_DISABLE_NATIVE": "1"})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _m8_dtensor_worker(rank: int, world_size: int):
    """Gefen(moments="m8") on row-sharded DTensors (as FSDP2 leaves them) with and without the
    kernels: the m8 kernels get the local shards; the state agrees up to the stated tolerance."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gefen import Gefen

    dispatch.DEVICES = {"cuda", "cpu"}
    mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(2)
    shapes = {"emb": (9, 16), "tiny": (1, 8), "norm": (16,), "conv": (4, 2, 3)}  # "tiny": an empty shard
    init = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(2)]
    calls = []
    real = launch.m8_update_
    launch.m8_update_ = lambda items, *a: (calls.append(sorted(tuple(it.param.shape) for it in items)), real(items, *a))
    states = []
    for use_kernels in (False, True):
        step_dispatch.enabled = use_kernels
        params = {n: torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for n, t in init.items()}
        opt = Gefen(list(params.items()), lr=1e-2, moments="m8")
        for g in grads:
            for n, p in params.items():
                p.grad = distribute_tensor(g[n], mesh, [Shard(0)])
            opt.step()
        states.append({n: (opt.state[p], p.to_local()) for n, p in params.items()})
    diffs = [parity.state_differences(states[0][n][0], states[1][n][0], parity.M8_APPROX) for n in shapes]
    close = [torch.allclose(states[0][n][1], states[1][n][1], rtol=1e-5, atol=1e-7) for n in shapes]
    return {"calls": calls, "diffs": diffs, "close": close}


@pytest.mark.dist
def test_m8_kernels_take_dtensor_local_shards():
    """Two gloo ranks, parameters row-sharded as DTensors: each rank's step sends its local shards
    (an empty one included) to the m8 kernels in one call, and its state matches the eager step's."""
    from distributed import run

    for rank, r in enumerate(run(_m8_dtensor_worker, 2, timeout=120)):
        local = [(5 - rank, 16), (2, 2, 3), (8,), (1 - rank, 8)]
        assert r["calls"] == [sorted(local)] * 2, r["calls"]
        assert r["diffs"] == [None] * 4 and all(r["close"]), r

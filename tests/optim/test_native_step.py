"""The fused C step of the m8 layout (gefen/c_kernels.py, gefen/csrc/gefen_step.c) against the eager
reference (the m4v4 layout's kernels: tests/optim/test_native_m4v4.py).

Both paths run on identical inputs; after several steps, on the block and factored paths, for
0-D/1-D/2-D/3-D and empty shards, odd sizes, fp32 and bf16, with and without weight decay, at
several thread counts, the kernels meet their bound (``parity.M8_RULE``: codes, scales, v_col and
step counts the reference's, the second-moment means within ``M8_V_RTOL``, parameters within
rounding), GefenMuon's momentum the reference's values; and every ISA, at 1 and 2 threads,
leaves identical bits (fp32 compared as integers, so even the sign of a zero counts).
These test the "m8" layout's kernel (``moments="m8"``); the m4v4 step's fused path has its own tests.
CUDA has no fused path yet; its tests would skip without a GPU (there are none here).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import gefen.c_kernels as c_kernels
from gefen import Gefen, dispatch, parity
from gefen.codebook import code_thresholds, learn_codebook, nearest_code
from gefen.dispatch import m8_partials, m8_update_
from gefen.functional import Hyper, init_m8_state
from gefen.geometry import as_blocks, rows_and_row_numel

from op_count import CountOps

HYPER = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _restore():
    threads, enabled = torch.get_num_threads(), dispatch.enabled
    yield
    torch.set_num_threads(threads)
    dispatch.enabled = enabled


def test_native_library_is_built_and_verified():
    assert c_kernels._lib is not None, "gefen._gefen_step is not built: run `pip install -e .`"
    assert c_kernels.available(), "the fused step does not reproduce the eager step on this machine"


# ----- helpers ----------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def assert_identical(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = (bits(a) != bits(b)).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


def make_codebook(kind: str, gen: torch.Generator, grads=None) -> torch.Tensor:
    if kind == "learned":
        return learn_codebook([as_blocks(g.float(), rows_and_row_numel(g.shape)[1]) for g in grads], 256)
    if kind == "uniform":  # the all-zero-histogram fallback
        return torch.linspace(-1.0, 1.0, 256)
    if kind == "small":
        return torch.cat([torch.tensor([-1.0]), torch.sort(torch.rand(14, generator=gen) * 2 - 1).values, torch.tensor([1.0])])
    if kind == "crowded":  # centres closer than any LUT bucket: forces the binary-search quantiser
        mid = 0.3 + torch.arange(200, dtype=torch.float32) * 1e-7
        rest = torch.sort(torch.rand(54, generator=gen) * 2 - 1).values
        return torch.sort(torch.cat([torch.tensor([-1.0, 1.0]), mid, rest])).values
    if kind == "padded":  # few active bins: the tail is padded with +1
        return torch.cat([torch.tensor([-1.0]), torch.linspace(-0.5, 0.5, 20), torch.ones(235)])
    raise ValueError(kind)


def grads_for(shape, dtype, gen, steps):
    out = []
    for _ in range(steps):
        g = torch.randn(shape, generator=gen) * torch.rand(shape[:1] + (1,) * (len(shape) - 1), generator=gen) \
            if shape else torch.randn((), generator=gen)
        if len(shape) >= 1 and shape[0] > 2:
            g[1] = 0.0  # an all-zero row: zero scales, zero second moments
        out.append(g.to(dtype))
    return out


def one_step(param, g, state, codebook, h, rows, factored, use_native):
    v_row = partials = None
    if factored:
        if use_native:
            out = c_kernels.m8_partials(g, state, h.beta2)
            assert out is not None, "m8_partials did not apply"
            v_row, partials = out
        else:
            v_row, partials = m8_partials(g, state, h.beta2)
    if use_native:
        assert c_kernels.m8_update_(param, g, state, codebook, h, global_rows=rows, v_row=v_row, partials=partials)
    else:
        m8_update_(param, g, state, codebook, h, global_rows=rows, v_row=v_row, partials=partials)


def run(shape, period, factored, *, use_native, dtype=torch.float32, grad_dtype=None, steps=3, h=HYPER,
        codebook_kind="learned", global_rows=None, seed=0, lockstep=False):
    """``steps`` steps of one tensor; ``lockstep``: the reference's, each also taken by the kernels
    from the reference's parameter and state and checked against it (``parity.M8_RULE``)."""
    gen = torch.Generator().manual_seed(seed)
    param = (torch.randn(shape, generator=gen)).to(dtype)
    grads = grads_for(shape, grad_dtype or dtype, gen, steps)
    codebook = make_codebook(codebook_kind, gen, grads)
    rows = global_rows if global_rows is not None else (shape[0] if shape else 1)
    state = init_m8_state(param, (rows,) + tuple(shape[1:]) if shape else (), period, factored)
    dispatch.enabled = use_native
    for i, g in enumerate(grads):
        before, p_nat, s_nat = param.clone(), param.clone(), {k: v.clone() for k, v in state.items()}
        if lockstep:
            one_step(p_nat, g, s_nat, codebook, h, rows, factored, True)
        one_step(param, g, state, codebook, h, rows, factored, use_native)
        if lockstep:
            assert_within_bound(p_nat, s_nat, param, state, before, what=f"step {i + 1}")
    return param, state


def assert_within_bound(p_nat, s_nat, p_ref, s_ref, before, what=""):
    """``parity.M8_RULE`` for one step from the same parameter ``before`` and state."""
    assert parity.M8_RULE((p_nat, s_nat, before), (p_ref, s_ref, before)) is None, what


#: Several steps, each path from its own state: the parameters drift apart by each step's rounding
#: (the steps' updates, ~lr, within M8_V_RTOL, and a unit of the parameter's last place)
MULTI_STEP_ATOL = 1e-6


def check_parity(*args, **kwargs):
    return run(*args, use_native=False, lockstep=True, **kwargs)


# ----- parity ------------------------------------------------------------------------------------
FACTORED = [((64, 48), 48), ((33, 40), 8), ((300, 130), 13), ((1, 40000), 40000), ((45, 29), 29),
            ((40000, 2), 1), ((7, 3), 1), ((130, 300), 300),
            # one-pass phase 1 (whole 256-row chunks per thread): partial last chunk, B-order columns,
            # a 4096-row level, more rows than 16^4
            ((600, 48), 48), ((600, 130), 130), ((4396, 20), 20), ((70000, 3), 1)]
BLOCK = [((4, 6, 10), 60), ((64, 24, 25), 600), ((8, 3, 5), 5), ((777,), 1), ((40000,), 1), ((), 1),
         ((70, 1000), 500), ((1, 40000), 40000), ((9, 16), 16), ((3, 2, 2, 7), 28)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape,period", FACTORED)
def test_factored_parity(shape, period, threads):
    torch.set_num_threads(threads)
    check_parity(shape, period, True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape,period", BLOCK)
def test_block_parity(shape, period, threads):
    torch.set_num_threads(threads)
    check_parity(shape, period, False)


@pytest.mark.parametrize("shape,period,factored", [((64, 48), 48, True), ((300, 130), 130, True),
                                                   ((4, 6, 10), 60, False), ((777,), 1, False)])
def test_three_threads(shape, period, factored):
    torch.set_num_threads(3)
    check_parity(shape, period, factored)


@pytest.mark.parametrize("weight_decay", [0.0, 0.3])
@pytest.mark.parametrize("beta1", [0.8, 0.5, 0.2])  # 1 - beta1 >= 0.5 switches ATen's lerp formula
@pytest.mark.parametrize("shape,period,factored", [((48, 64), 16, True), ((5, 4, 12), 12, False), ((33,), 1, False)])
def test_weight_decay_and_hyperparameters(shape, period, factored, weight_decay, beta1):
    h = Hyper(lr=3e-3, beta1=beta1, beta2=0.95, eps=1e-6, weight_decay=weight_decay)
    check_parity(shape, period, factored, h=h, steps=4)


@pytest.mark.parametrize("kind", ["learned", "uniform", "small", "crowded", "padded"])
def test_codebooks(kind):
    check_parity((40, 96), 32, True, codebook_kind=kind)
    check_parity((6, 5, 16), 16, False, codebook_kind=kind)
    check_parity((8, 260), 130, True, codebook_kind=kind)  # >= 128: AVX-512 takes values from registers


@pytest.mark.parametrize("shape,period,factored", [((64, 48), 48, True), ((300, 130), 13, True),
                                                   ((4, 6, 10), 60, False), ((777,), 1, False),
                                                   ((70, 1000), 500, False)])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)])
def test_bf16(shape, period, factored, dtypes):
    check_parity(shape, period, factored, dtype=dtypes[0], grad_dtype=dtypes[1])


@pytest.mark.parametrize("shape,period,factored", [((0, 32), 8, True), ((0, 4, 8), 32, False), ((0,), 1, False)])
def test_empty_local_shard(shape, period, factored):
    """A rank can hold 0 rows; the factored column EMA still advances with the global sums."""
    p, st = check_parity(shape, period, factored, global_rows=10)
    assert int(st["step"]) == 3
    if factored:
        assert st["v_col"].shape == (32,)


def test_row_sharded_matches_between_paths():
    """Two row shards with summed partials (what the optimizer's all-reduce does), both paths."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(50, 64, generator=gen)
    grads = [torch.randn(50, 64, generator=gen) for _ in range(3)]
    codebook = make_codebook("learned", gen, grads)
    results = {}
    for use_native in (False, True):
        dispatch.enabled = use_native
        shards = [full[:23].clone(), full[23:].clone()]
        states = [init_m8_state(s, (50, 64), 16, True) for s in shards]
        for g in grads:
            parts = [m8_partials(gs, st, HYPER.beta2) for gs, st in zip(g.split([23, 27]), states)]
            total = parts[0][1] + parts[1][1]
            for s, gs, st, (v_row, _) in zip(shards, g.split([23, 27]), states, parts):
                m8_update_(s, gs, st, codebook, HYPER, global_rows=50, v_row=v_row, partials=total)
        results[use_native] = (shards, states)
    for i in range(2):  # codes and scales exact, the rest within the rounding of three steps
        assert parity.state_differences(results[False][1][i], results[True][1][i], parity.M8_APPROX) is None
        assert torch.allclose(results[True][0][i], results[False][0][i], rtol=0, atol=MULTI_STEP_ATOL)


def portable(monkeypatch):
    """Every later fused call runs the portable kernels (a calibration that allows no SIMD)."""
    monkeypatch.setattr(c_kernels, "_calibration", dataclasses.replace(c_kernels._calibrated(), isa=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa_and_thread_count_agree(monkeypatch, dtype):
    """The kernels' own contract: AVX-512, AVX2 and portable, at 1 and 2 threads, the same bits
    ((300, 130) and (70, 1000) are split over threads; odd periods have vector tails: 24 and 29 an
    8-lane step past the per-block sum's 16 lanes, 29, 130 and 500 a 16-lane kernel's scalar tail;
    130 and 500 the codebook in registers)."""
    cases = [((64, 48), 48, True), ((300, 130), 13, True), ((33, 40), 8, True), ((70, 1000), 500, False),
             ((9, 16), 16, False), ((8, 3, 5), 5, False), ((777,), 1, False), ((), 1, False),
             ((6, 4, 6), 24, False), ((4, 58), 29, False), ((45, 29), 29, True), ((20, 130), 130, True)]
    for shape, period, factored in cases:
        results = []
        for isa in c_kernels.ISAS.values():
            for threads in (1, 2):
                torch.set_num_threads(threads)
                with monkeypatch.context() as m:
                    m.setattr(c_kernels, "_calibration", dataclasses.replace(c_kernels._calibrated(), isa=isa))
                    results.append(run(shape, period, factored, use_native=True, dtype=dtype))
        for p, st in results[1:]:
            assert_identical(p, results[0][0], f"{shape}: param")
            for key in st:
                assert_identical(st[key], results[0][1][key], f"{shape}: {key}")


def test_special_values():
    """inf/NaN gradients: both paths agree on codes and second moments, and on where NaNs are."""
    gen = torch.Generator().manual_seed(5)
    shape = (16, 32)
    grads = [torch.randn(shape, generator=gen) for _ in range(2)]
    grads[1][3, 5] = float("nan")
    grads[1][7, 0] = float("inf")
    codebook = make_codebook("small", gen)
    out = {}
    for use_native in (False, True):
        dispatch.enabled = use_native
        p = torch.randn(shape, generator=torch.Generator().manual_seed(9))
        st = init_m8_state(p, shape, 8, False)
        for g in grads:
            m8_update_(p, g, st, codebook, HYPER, global_rows=16)
        out[use_native] = (p, st)
    (p0, s0), (p1, s1) = out[False], out[True]
    assert torch.equal(s0["m_code"], s1["m_code"])
    assert torch.allclose(s1["v"], s0["v"], rtol=parity.M8_V_RTOL, atol=0, equal_nan=True)
    assert torch.equal(s0["m_scale"].isnan(), s1["m_scale"].isnan())
    assert torch.equal(s0["m_scale"].nan_to_num(), s1["m_scale"].nan_to_num())
    assert torch.equal(p0.isnan(), p1.isnan())
    assert torch.allclose(p0.nan_to_num(), p1.nan_to_num(), rtol=0, atol=MULTI_STEP_ATOL)


# ----- the quantiser LUT -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["learned", "uniform", "small", "padded"])
def test_lut_is_exact_at_every_threshold(kind):
    gen = torch.Generator().manual_seed(1)
    codebook = make_codebook(kind, gen, [torch.randn(64, 64, generator=gen)])
    q = c_kernels._Quantiser(codebook)
    assert q.M > 0
    thr = code_thresholds(codebook)
    inside = thr[(thr > -1) & (thr < 1)]
    down = torch.nextafter(inside, torch.full_like(inside, -2.0))
    up = torch.nextafter(inside, torch.full_like(inside, 2.0))
    x = torch.cat([inside, down, up, torch.linspace(-1, 1, 100001), torch.tensor([-1.0, 1.0, 0.0, -0.0])])
    x = x.clamp(-1, 1)
    b = ((x + 1.0) * (q.M // 2)).to(torch.int32).clamp(0, q.M - 1).long()
    lo = q.lo[b]
    got = lo + (q.thr[lo] < x).long() + (q.thr[lo + 1] < x).long()
    assert torch.equal(got, nearest_code(x, codebook).long())


def test_crowded_codebook_uses_binary_search():
    q = c_kernels._Quantiser(make_codebook("crowded", torch.Generator().manual_seed(0)))
    assert q.M == 0


# ----- the optimizer ------------------------------------------------------------------------------
def _model_params(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"emb": (100, 32), "q": (32, 32), "up": (32, 128), "down": (128, 32), "norm": (32,),
              "bias": (128,), "conv": (8, 4, 3, 3), "scalar": ()}
    return [(name, torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1)) for name, s in shapes.items()]


@pytest.mark.parametrize("factored_v_2d", [True, False])
def test_optimizer_uses_fused_path_and_matches_eager(factored_v_2d):
    runs = {}
    for use_native in (False, True):
        dispatch.enabled = use_native
        params = _model_params(0)
        opt = Gefen(params, lr=1e-2, weight_decay=0.05, factored_v_2d=factored_v_2d, moments="m8")
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            for _, p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        runs[use_native] = (params, opt.state_dict())
    (pa, sa), (pb, sb) = runs[False], runs[True]
    for (name, a), (_, b), key in zip(pa, pb, sa["state"]):  # codes and scales exact, the rest within rounding
        assert parity.state_differences(sa["state"][key], sb["state"][key], parity.M8_APPROX) is None, name
        assert torch.allclose(b.detach(), a.detach(), rtol=0, atol=MULTI_STEP_ATOL), name



def test_per_parameter_overhead_is_one_call():
    """Many small tensors: the fused step must not pay ~15-25 torch op launches per tensor."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(16, 16), (16,), (4, 4, 4)] * 40]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    counts = {}
    for use_native in (False, True):
        dispatch.enabled = use_native
        opt = Gefen([p.detach().clone().requires_grad_() for p in params], lr=1e-3, moments="m8")
        for q, p in zip(opt.param_groups[0]["params"], params):
            q.grad = p.grad.clone()
        opt.step()  # first step: periods and codebook
        with CountOps() as mode:
            opt.step()
        counts[use_native] = mode.total / len(params)
    assert counts[True] <= 6, counts  # int(step), int(period), 2 small allocations (factored), cat/split
    assert counts[True] * 3 < counts[False], counts


def test_disable_environment_variable():
    code = "import gefen.dispatch as d; print(d.enabled)"
    env = dict(os.environ, GEFEN_DISABLE_NATIVE="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_unsupported_inputs_fall_back_without_touching_state():
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(8, 16, generator=gen).t()  # not contiguous
    g = torch.randn(16, 8, generator=gen)
    st = init_m8_state(p, (16, 8), 8, False)
    before = {k: v.clone() for k, v in st.items()}
    codebook = torch.linspace(-1, 1, 256)
    assert dispatch.kernels("m8", [p, g], [st["m_code"], st["m_scale"], codebook, st["v"]]) is None
    assert dispatch.kernels("m8", [p.double().contiguous(), g.double()], [st["m_code"]]) is None
    assert dispatch.kernels("m8", [p.contiguous(), g], [st["m_code"], st["m_scale"], codebook, st["v"]]) is c_kernels
    assert not c_kernels.m8_update_(p.contiguous(), g, st, codebook[:1], HYPER, global_rows=16)  # one code
    for k in st:
        assert torch.equal(st[k], before[k])
    m8_update_(p, g, st, codebook, HYPER, global_rows=16)  # eager still works
    assert int(st["step"]) == 1


def test_the_m8_and_momentum_layout_rules():
    """The one check both kernel families rely on: each broken field is named, the valid state passes."""
    p, g, cb = torch.zeros(6, 16), torch.zeros(6, 16), torch.linspace(-1, 1, 16)
    block, factored = init_m8_state(p, (6, 16), 8, False), init_m8_state(p, (6, 16), 16, True)
    v_row, partials = torch.zeros(6), torch.zeros(17, dtype=torch.float64)
    assert dispatch._m8_layout(p, g, block, cb) is None
    assert dispatch._m8_layout(p, g, factored, cb, v_row, partials) is None
    assert dispatch._m8_layout(p, g, factored, cb, v_row, partials[:-1]) is not None
    assert dispatch._m8_layout(p, g, factored, cb, v_row.double(), partials) is not None
    assert dispatch._m8_layout(p, g, factored, cb) is not None  # phase 1's results missing
    assert dispatch._m8_layout(p, g, {**block, "v": block["v"][:-1]}, cb) is not None
    assert dispatch._m8_layout(p, g[:, :8], block, cb) is not None
    assert dispatch._momentum_layout(g, block, cb) is None
    assert dispatch._momentum_layout(g, block, cb, torch.zeros(12)) is None  # a column split's reduced scales
    for bad_cb in (cb[:1], cb.double(), torch.linspace(-1, 1, 257)):
        assert dispatch._momentum_layout(g, block, bad_cb) is not None
    for key, bad in (("m_code", block["m_code"].short()), ("m_scale", block["m_scale"].half()),
                     ("m_scale", block["m_scale"][:3])):
        assert dispatch._momentum_layout(g, {**block, key: bad}, cb) is not None, key
    assert dispatch._momentum_layout(g, block, cb, torch.zeros(11)) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_uses_the_eager_path():
    p = torch.randn(8, 16, device="cuda")
    st = init_m8_state(p, (8, 16), 16, False)
    assert not c_kernels.m8_update_(p, torch.randn_like(p), st, torch.linspace(-1, 1, 256, device="cuda"), HYPER,
                                    global_rows=8)


# ----- the momentum alone (GefenMuon; Gefen's eager fallback) -------------------------------------
def _momentum_run(shape, period, *, use_native, grad_dtype=torch.float32, beta=0.95, steps=3, codebook_kind="learned"):
    from gefen.functional import init_momentum_state, update_momentum_

    gen = torch.Generator().manual_seed(7)
    grads = grads_for(shape, grad_dtype, gen, steps)
    codebook = make_codebook(codebook_kind, gen, grads)
    state = init_momentum_state(torch.zeros(shape), tuple(shape), period)
    dispatch.enabled = use_native
    outs = []
    for g in grads:
        if use_native:
            out = c_kernels.momentum_(state, g, beta, codebook)
            assert out is not None, "momentum_ did not apply"
        else:  # the eager lerp needs an fp32 end point; the C path widens bf16 itself
            out = update_momentum_(state, g.float(), beta, codebook)
        outs.append(out.clone())
    return outs, state


MOMENTUM = [((64, 48), 48), ((33, 40), 8), ((300, 130), 13), ((1, 40000), 40000), ((7, 3), 1),
            ((600, 130), 130), ((4396, 20), 20), ((70, 1000), 500), ((40000, 2), 2)]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape,period", MOMENTUM)
def test_momentum_parity(shape, period, threads):
    torch.set_num_threads(threads)
    (ref, s_ref), (nat, s_nat) = (_momentum_run(shape, period, use_native=u) for u in (False, True))
    assert parity.equal((nat, s_nat["m_code"], s_nat["m_scale"]), (ref, s_ref["m_code"], s_ref["m_scale"])) is None


@pytest.mark.parametrize("kind", ["uniform", "crowded", "padded"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_momentum_parity_codebooks_and_bf16(kind, grad_dtype):
    (ref, s_ref), (nat, s_nat) = (_momentum_run((50, 96), 32, use_native=u, grad_dtype=grad_dtype, codebook_kind=kind)
                                  for u in (False, True))
    assert parity.equal(nat, ref) is None
    assert_identical(s_nat["m_code"], s_ref["m_code"], "m_code")


def test_momentum_portable_kernel_agrees(monkeypatch):
    portable(monkeypatch)
    (ref, _), (nat, _) = (_momentum_run((40, 64), 16, use_native=u) for u in (False, True))
    assert parity.equal(nat, ref) is None, "momentum (portable kernel)"


def test_gefen_muon_native_matches_eager():
    from gefen import GefenMuon

    runs = {}
    for use_native in (False, True):
        dispatch.enabled = use_native
        gen = torch.Generator().manual_seed(3)
        params = [(n, torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1)) for n, s in
                  (("a", (96, 64)), ("b", (64, 160)), ("c", (40, 40)))]
        opt = GefenMuon(params, lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            for _, p in params:
                p.grad = torch.randn(p.shape, generator=gen) * torch.rand(p.shape[0], 1, generator=gen)
            opt.step()
        runs[use_native] = (params, opt)
    (pa, oa), (pb, ob) = runs[False], runs[True]
    for (name, a), (_, b) in zip(pa, pb):
        assert_identical(b.detach(), a.detach(), name)
        for key in ("m_code", "m_scale"):
            assert_identical(ob.state[b][key], oa.state[a][key], f"{name}.{key}")

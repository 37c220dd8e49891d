"""The fused m4v4 step (gefen/csrc/m4v4_step.c) against the torch reference
(gefen.functional.m4v4_partials / m4v4_update_ / adamw_update_), and the kernels against each other.

Both paths run on identical inputs. Coded (>= 2-D) tensors: the kernels stay within their stated
bound of the reference (``parity.m4v4_disagreement``: at most 1e-3 of the elements one code step
or a rounding tolerance away, the fp32 statistics within 1e-6) after several steps; the 1-D AdamW
step is bit-for-bit identical (compared as integers, so even the sign of a zero counts). Odd
shapes, 3-D/4-D tensors, empty row shards, shards that start at row0 != 0, fp32 and bf16, weight
decay on and off, all-zero rows, stand-in and tied tables, 1-3 threads. The AVX-512, AVX2 and
portable kernels, at 1 and 2 threads, leave identical bits (the kernels' own contract).
"""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys

import pytest
import torch

import gefen.c_kernels as c_kernels
from gefen import Gefen, dispatch, parity
from gefen.functional import Hyper, adamw_update_, init_m4v4_state, m4v4_partials, m4v4_update_
from gefen.stochastic import ratio_table, standin_codebook

from op_count import CountOps

HYPER = Hyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def _restore():
    threads, enabled = torch.get_num_threads(), dispatch.enabled
    yield
    torch.set_num_threads(threads)
    dispatch.enabled = enabled


def test_m4v4_kernels_are_verified():
    assert c_kernels.available(), "the fused m8 step does not reproduce the eager step on this machine"
    assert c_kernels._calibrated().m4v4, "the m4v4 kernels are not within their bound of the reference on this machine"


# ----- helpers ----------------------------------------------------------------------------------
_INTS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INTS[t.dtype]) if t.dtype in _INTS else t


def assert_identical(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    diff = (bits(a) != bits(b)).sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


def tables(kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(first-moment codebook, second-moment ratio table) of 16 sorted entries each."""
    if kind == "standin":  # before the codebooks are learned
        return standin_codebook(), ratio_table(standin_codebook())
    if kind == "tied":  # repeated entries: zero gaps, the GUARD divisor
        cb = torch.tensor([-1.0, -0.5, -0.5, -0.2, 0.0, 0.0, 0.0, 0.1, 0.3, 0.3, 0.5, 0.7, 1.0, 1.0, 1.0, 1.0])
        return cb, ratio_table(torch.tensor([-1.0] * 3 + torch.linspace(-0.5, 0.5, 10).tolist() + [1.0] * 3))
    inner = torch.sort(torch.rand(14, generator=gen) * 2 - 1).values
    cb = torch.cat([torch.tensor([-1.0]), inner, torch.tensor([1.0])])
    vcb = torch.sort(torch.rand(16, generator=gen) * 1.2 - 0.6).values  # ratios e^-4.8 .. e^4.8
    return cb, ratio_table(vcb)


def grads_for(shape, dtype, gen, steps, special=False):
    """``special``: a huge and a tiny row (rows 5 and 6 of a >= 8-row shape), so ratios and
    moments fall outside both tables and below fp32's normal range."""
    out = []
    for _ in range(steps):
        if shape:
            g = torch.randn(shape, generator=gen) * torch.rand(shape[:1] + (1,) * (len(shape) - 1), generator=gen)
        else:
            g = torch.randn((), generator=gen)
        if len(shape) >= 1 and shape[0] > 2:
            g[1] = 0.0  # an all-zero row: zero row scale, zero row statistics
        if special:
            g[5] *= 1e15
            g[6] *= 1e-30
        out.append(g.to(dtype))
    return out


def run(shape, *, use_native, dtype=torch.float32, grad_dtype=None, steps=3, h=HYPER, kind="random",
        global_rows=None, row0=0, pidx=0, seed=0, gen_seed=0, special=False):
    gen = torch.Generator().manual_seed(gen_seed)
    param = torch.randn(shape, generator=gen).to(dtype)
    grads = grads_for(shape, grad_dtype or dtype, gen, steps, special)
    codebook, ratio = tables(kind, gen)
    rows = global_rows if global_rows is not None else (shape[0] if shape else 1)
    state = init_m4v4_state(param, (rows,) + tuple(shape[1:]) if shape else ())
    dispatch.enabled = use_native
    for g in grads:
        if len(shape) < 2:
            if use_native:
                assert c_kernels.adamw_update_(param, g, state, h, pidx=pidx, seed=seed, row0=row0), \
                    "the fused AdamW step did not apply"
            else:
                adamw_update_(param, g, state, h, pidx=pidx, seed=seed, row0=row0)
            continue
        if use_native:
            out = c_kernels.m4v4_partials(g, state, h.beta2)
            assert out is not None, "m4v4_partials did not apply"
        else:
            out = m4v4_partials(g, state, h.beta2)
        kw = dict(global_rows=rows, v_row=out[0], partials=out[1], pidx=pidx, seed=seed, row0=row0)
        if use_native:
            assert c_kernels.m4v4_update_(param, g, state, codebook, ratio, h, **kw), "the fused step did not apply"
        else:
            m4v4_update_(param, g, state, codebook, ratio, h, **kw)
    return param, state


def initial_param(shape, dtype=torch.float32, gen_seed=0, **_):
    """The parameter ``run`` starts from."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(gen_seed)).to(dtype)


def assert_within_bound(p_nat, s_nat, p_ref, s_ref, before, what="param"):
    """Coded tensors: the kernels' stated bound; 1-D/0-D (AdamW, no codes): bit for bit."""
    if "mv_code" not in s_ref:
        assert set(s_ref) == set(s_nat)
        for key in s_ref:
            assert_identical(s_nat[key], s_ref[key], key)
        assert_identical(p_nat, p_ref, what)
        return
    problem = parity.m4v4_disagreement(p_nat, s_nat, p_ref, s_ref, before)
    assert problem is None, f"{what}: {problem}"


def check_parity(shape, **kwargs):
    """The kernels against the reference, within the bound (``assert_within_bound``)."""
    p_ref, s_ref = run(shape, use_native=False, **kwargs)
    p_nat, s_nat = run(shape, use_native=True, **kwargs)
    assert_within_bound(p_nat, s_nat, p_ref, s_ref, initial_param(shape, **kwargs))
    return p_nat, s_nat


def test_the_bound_is_not_vacuous():
    """A parameter off by more than the tolerance, or a code two steps away, is caught."""
    p_ref, s_ref = run((64, 48), use_native=False)
    before = initial_param((64, 48))
    assert parity.m4v4_disagreement(p_ref.clone(), dict(s_ref), p_ref, s_ref, before) is None
    worse = p_ref + (p_ref - before) * 1e-3
    assert parity.m4v4_disagreement(worse, dict(s_ref), p_ref, s_ref, before) is not None
    codes = s_ref["mv_code"].clone()
    codes.view(-1)[0] = (codes.view(-1)[0] & 0xF0) | (((codes.view(-1)[0] & 15) + 2) % 16)
    assert parity.m4v4_disagreement(p_ref, {**s_ref, "mv_code": codes}, p_ref, s_ref, before) is not None
    v_col = s_ref["v_col"] * (1 + 1e-5)
    assert parity.m4v4_disagreement(p_ref, {**s_ref, "v_col": v_col}, p_ref, s_ref, before) is not None


# ----- parity ------------------------------------------------------------------------------------
MATRICES = [(64, 48), (33, 40), (300, 130), (1, 40000), (45, 29), (40000, 2), (7, 3), (130, 300), (5, 1),
            # one-pass phase 1 (whole 256-row chunks per thread): partial last chunk, short rows, many rows
            (600, 48), (600, 130), (4396, 20), (70000, 3),
            (4, 6, 10), (8, 3, 5), (3, 2, 2, 7)]
VECTORS = [(777,), (40000,), (), (1,), (9,)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", MATRICES + VECTORS)
def test_parity(shape, threads):
    torch.set_num_threads(threads)
    check_parity(shape)


@pytest.mark.parametrize("shape", [(64, 48), (300, 130), (1, 40000), (777,)])
def test_three_threads(shape):
    """torch splits its float64 sums by its thread count; the kernels' fixed order must not care."""
    torch.set_num_threads(3)
    check_parity(shape)


@pytest.mark.parametrize("weight_decay", [0.0, 0.3])
@pytest.mark.parametrize("betas", [(0.8, 0.95), (0.5, 0.999), (0.0, 0.9)])
@pytest.mark.parametrize("shape", [(48, 64), (5, 4, 12), (33,)])
def test_hyperparameters(shape, betas, weight_decay):
    h = Hyper(lr=3e-3, beta1=betas[0], beta2=betas[1], eps=1e-6, weight_decay=weight_decay)
    check_parity(shape, h=h, steps=5)


@pytest.mark.parametrize("kind", ["standin", "tied"])
def test_tables(kind):
    check_parity((40, 96), kind=kind)
    check_parity((6, 5, 16), kind=kind)


@pytest.mark.parametrize("shape", [(64, 48), (300, 130), (7, 3), (777,), ()])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)])
def test_bf16(shape, dtypes):
    check_parity(shape, dtype=dtypes[0], grad_dtype=dtypes[1])


def test_many_steps_and_salts():
    """Ten steps (the codes feed back into themselves), another parameter index and seed."""
    check_parity((96, 80), steps=10, pidx=7, seed=3)
    check_parity((96, 80), steps=10, pidx=7, seed=3, dtype=torch.bfloat16)


@pytest.mark.parametrize("shape", [(0, 32), (0, 4, 8)])
def test_empty_local_shard(shape):
    """A rank can hold 0 rows; the column EMA and the step still advance."""
    p, st = check_parity(shape, global_rows=10, row0=10)
    assert int(st["step"]) == 3 and st["v_col"].abs().sum() == 0


@pytest.mark.parametrize("row0", [1, 37, 2**31 // 48 + 5, 2**32 // 48 - 30])  # past 2^31; across 2^32 (wraps)
def test_row_offset(row0):
    """A shard that starts at a later global row: the noise follows the global index."""
    check_parity((64, 48), global_rows=row0 + 64 + 3, row0=row0)
    check_parity((5000,), row0=row0 * 48, pidx=2, seed=5)  # a 1-D shard: its first moment's rounding noise


def test_row_sharded_matches_between_paths():
    """Two row shards with summed partials (what the optimizer's all-reduce does), both paths:
    within the bound of each other, and the sharded kernels give the unsharded kernels' bits."""
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(50, 64, generator=gen)
    grads = [torch.randn(50, 64, generator=gen) for _ in range(3)]
    codebook, ratio = tables("random", gen)
    results = {}
    for use_native in (False, True):
        dispatch.enabled = use_native
        shards = [full[:23].clone(), full[23:].clone()]
        states = [init_m4v4_state(s, (50, 64)) for s in shards]
        for g in grads:
            gs = g.split([23, 27])
            parts = [(c_kernels.m4v4_partials if use_native else m4v4_partials)(x, st, HYPER.beta2)
                     for x, st in zip(gs, states)]
            total = parts[0][1] + parts[1][1]
            for s, x, st, (v_row, _), row0 in zip(shards, gs, states, parts, (0, 23)):
                kw = dict(global_rows=50, v_row=v_row, partials=total, pidx=2, seed=0, row0=row0)
                if use_native:
                    assert c_kernels.m4v4_update_(s, x, st, codebook, ratio, HYPER, **kw)
                else:
                    m4v4_update_(s, x, st, codebook, ratio, HYPER, **kw)
        results[use_native] = (shards, states)
    for i, before in enumerate((full[:23], full[23:])):
        assert_within_bound(results[True][0][i], results[True][1][i], results[False][0][i], results[False][1][i],
                            before, f"shard {i}")
    whole, st = full.clone(), init_m4v4_state(full, (50, 64))
    dispatch.enabled = True
    for g in grads:
        v_row, partials = c_kernels.m4v4_partials(g, st, HYPER.beta2)
        assert c_kernels.m4v4_update_(whole, g, st, codebook, ratio, HYPER, global_rows=50, v_row=v_row,
                                         partials=partials, pidx=2, seed=0)
    assert_identical(torch.cat(results[True][0]), whole, "sharded vs whole param")
    for key in ("mv_code", "m_row_scale", "v_row"):
        assert_identical(torch.cat([x[key] for x in results[True][1]]), st[key], f"sharded vs whole {key}")
    for x in results[True][1]:
        assert_identical(x["v_col"], st["v_col"], "sharded vs whole v_col")


@pytest.mark.parametrize("shape", [(64, 48), (9, 21), (300, 130), (3, 40), (257, 200), (5, 3, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_instruction_sets_and_threads_agree(shape, dtype, monkeypatch):
    """The AVX-512, AVX2 and portable kernels (those this CPU has), at 1 and 2 threads, leave
    identical bits (the kernels' contract; (300, 130) and (257, 200) are split over threads)."""
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for cap in range(c_kernels._lib.gefen_cpu_isa(), -1, -1):
            monkeypatch.setattr(c_kernels, "_calibration", dataclasses.replace(c_kernels._calibrated(), isa=cap))
            results.append(run(shape, use_native=True, dtype=dtype, steps=4))
    for p, st in results[1:]:
        assert_identical(p, results[0][0], "param")
        for key in st:
            assert_identical(st[key], results[0][1][key], key)


@pytest.mark.parametrize("kind", ["tied", "standin"])
def test_instruction_sets_agree_on_edge_inputs(kind, monkeypatch):
    """Tied table entries (the GUARD divisor), huge and tiny gradient rows, a 37-column tail:
    every instruction set leaves the portable kernel's bits."""
    results = []
    for cap in range(c_kernels._lib.gefen_cpu_isa(), -1, -1):
        monkeypatch.setattr(c_kernels, "_calibration", dataclasses.replace(c_kernels._calibrated(), isa=cap))
        results.append(run((40, 37), use_native=True, kind=kind, steps=3, special=True))
    assert results[0][0].isfinite().all()
    for p, st in results[1:]:
        assert_identical(p, results[0][0], "param")
        for key in st:
            assert_identical(st[key], results[0][1][key], key)


def test_first_step_moments_are_zero_whatever_the_codes():
    """v_row_old = 0 at the first step: the old codes decode to exactly zero in both paths."""
    gen = torch.Generator().manual_seed(11)
    codebook, ratio = tables("random", gen)
    g = torch.randn(20, 30, generator=gen)
    out = []
    for use_native in (False, True):
        dispatch.enabled = use_native
        p = torch.zeros(20, 30)
        st = init_m4v4_state(p, (20, 30))
        st["mv_code"].random_(0, 256, generator=torch.Generator().manual_seed(1))  # garbage codes
        v_row, partials = (c_kernels.m4v4_partials if use_native else m4v4_partials)(g, st, HYPER.beta2)
        kw = dict(global_rows=20, v_row=v_row, partials=partials, pidx=0, seed=0)
        if use_native:
            assert c_kernels.m4v4_update_(p, g, st, codebook, ratio, HYPER, **kw)
        else:
            m4v4_update_(p, g, st, codebook, ratio, HYPER, **kw)
        out.append((p, st))
    assert_within_bound(out[1][0], out[1][1], out[0][0], out[0][1], torch.zeros(20, 30))


# ----- the optimizer ------------------------------------------------------------------------------
def _model_params(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"emb": (100, 32), "q": (32, 32), "up": (32, 128), "down": (128, 32), "norm": (32,),
              "bias": (128,), "conv": (8, 4, 3, 3), "scalar": ()}
    return [(name, torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1)) for name, s in shapes.items()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_matches_the_reference(dtype):
    """Gefen's default (m4v4) with and without the kernels: identical parameters and state
    (codebooks learned at the first step included), over several steps."""
    runs = {}
    for use_native in (False, True):
        dispatch.enabled = use_native
        params = [(n, torch.nn.Parameter(p.detach().to(dtype))) for n, p in _model_params(0)]
        opt = Gefen(params, lr=1e-2, weight_decay=0.05, seed=5)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            for _, p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            opt.step()
        runs[use_native] = (params, opt.state_dict())
    (pa, sa), (pb, sb) = runs[False], runs[True]
    assert sa["state"].keys() == sb["state"].keys()
    for key, ((name, a), (_, b), (_, p0)) in enumerate(zip(pa, pb, _model_params(0))):
        ref_st = {f: v for f, v in sa["state"][key].items() if isinstance(v, torch.Tensor)}
        st = {f: v for f, v in sb["state"][key].items() if isinstance(v, torch.Tensor)}
        assert_within_bound(b.detach(), st, a.detach(), ref_st, p0.detach().to(dtype), name)



def test_per_parameter_overhead_is_a_few_ops():
    """Many small tensors: the kernels replace the reference's ~60 torch ops per matrix."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(16, 16), (16,), (4, 4, 4)] * 40]
    counts = {}
    for use_native in (False, True):
        dispatch.enabled = use_native
        opt = Gefen([p.detach().clone().requires_grad_() for p in params], lr=1e-3)
        for q in opt.param_groups[0]["params"]:
            q.grad = torch.randn(q.shape, generator=gen)
        opt.step()  # first step: the codebooks
        with CountOps() as mode:
            opt.step()
        counts[use_native] = mode.total / len(params)
    assert counts[True] <= 4 and counts[True] * 10 < counts[False], counts  # measured: 2.4 vs 108


# ----- refusals: nothing touched, the reference runs --------------------------------------------
def test_refuses_what_it_cannot_do():
    gen = torch.Generator().manual_seed(0)
    codebook, ratio = tables("random", gen)
    p = torch.randn(8, 6)
    st = init_m4v4_state(p, (8, 6))
    g = torch.randn(8, 6)
    v_row, partials = m4v4_partials(g, st, HYPER.beta2)
    fields = [st[k] for k in ("mv_code", "m_row_scale", "v_row", "v_col")]
    assert dispatch.kernels("m4v4", [p, g], fields) is c_kernels
    assert dispatch.kernels("m4v4", [p.double(), g.double()], fields) is None
    assert dispatch.kernels("m4v4", [p.t(), g.t()], fields) is None  # not contiguous
    assert dispatch.kernels("m4v4", [p, g], fields + [torch.zeros(6, 2).t()]) is None  # a state not contiguous
    assert dispatch.kernels("m4v4", [p, g], fields[:2] + [None]) is None  # a state field missing
    args = (p, ratio, v_row, partials)
    assert dispatch._m4v4_layout(g, st, codebook, *args) is None
    assert dispatch._m4v4_layout(g, st, codebook[:8], *args) is not None  # not 16 entries
    assert dispatch._m4v4_layout(g, st, codebook, p, ratio, v_row, partials[:-1]) is not None
    assert dispatch._m4v4_layout(g, st, codebook, *args, row_max=torch.zeros(3)) is not None  # one per row
    dispatch.enabled = False
    assert dispatch.kernels("m4v4", [p, g], fields) is None


# ----- checkpoints: the state layout did not change -----------------------------------------------
def _continue(params, saved, use_native, steps, seed):
    """Load ``saved`` (a torch-serialised state dict, or None) into a fresh Gefen and train on."""
    dispatch.enabled = use_native
    opt = Gefen(params, lr=1e-2, weight_decay=0.05, seed=5)
    if saved is not None:
        saved.seek(0)
        opt.load_state_dict(torch.load(saved, weights_only=True))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for _, p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    out = io.BytesIO()
    torch.save(opt.state_dict(), out)
    return opt, out


@pytest.mark.parametrize("first,then", [(False, True), (True, False)], ids=["reference-then-kernels",
                                                                            "kernels-then-reference"])
def test_checkpoints_cross_between_the_reference_and_the_kernels(first, then):
    """A state saved by one path loads into the other and trains on (the eager reference writes what
    the earlier, bit-exact kernels wrote): the continuation stays within the kernels' bound of the
    reference continuing the same checkpoint."""
    params = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in _model_params(0)]
    _, saved = _continue(params, None, first, 3, seed=1)
    at_save = [p.detach().clone() for _, p in params]
    runs = {}
    for use_native in (then, not then):
        mine = [(n, torch.nn.Parameter(p.clone())) for (n, _), p in zip(params, at_save)]
        opt, _ = _continue(mine, saved, use_native, 3, seed=2)
        runs[use_native] = (mine, opt)
        assert all(int(opt.state[p]["step"]) == 6 for _, p in mine)
    (got, opt), (want, ref) = runs[True], runs[False]
    for (name, a), (_, b), before in zip(got, want, at_save):
        st = {k: v for k, v in opt.state[a].items() if isinstance(v, torch.Tensor)}
        ref_st = {k: v for k, v in ref.state[b].items() if isinstance(v, torch.Tensor)}
        assert torch.isfinite(a).all(), name
        assert_within_bound(a.detach(), st, b.detach(), ref_st, before, name)


@pytest.mark.parametrize("name,isa", [("scalar", 0), ("avx2", 1), ("avx512", 2), ("bogus", 2)])
def test_the_isa_can_be_forced_from_the_environment(name, isa):
    """``GEFEN_CPU_ISA`` (read at import) caps the kernels every call runs; an unknown name warns."""
    code = "from gefen import c_kernels\nprint(c_kernels._ISA, c_kernels._calibrated().isa)\n"
    env = {**os.environ, "GEFEN_CPU_ISA": name}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(isa), str(isa)]
    if name == "bogus":
        warn = subprocess.run([sys.executable, "-W", "error", "-c", "import gefen.c_kernels"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert warn.returncode != 0 and "GEFEN_CPU_ISA" in warn.stderr

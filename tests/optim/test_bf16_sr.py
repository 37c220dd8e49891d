"""bf16_stochastic_round: the update added in fp32 and written back into bf16 parameters by
unbiased stochastic rounding whose noise hashes (global element index, step, seed). The C
write-back is the reference bit for bit; the rounding is unbiased; small updates survive it where
round-to-nearest drops them; shards round like the slices of the whole tensor."""

from __future__ import annotations

import pytest
import torch

from gefen import Gefen, GefenMuon, GefenMuonHybrid, c_kernels, dispatch
from gefen import functional as F
from gefen.stochastic import element_index, hash_bits, round_bf16


def _values(shape, seed: int = 0) -> torch.Tensor:
    """fp32 values over many magnitudes (both signs, subnormals) with +-inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 10)
    flat = x.view(-1)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e-40, -0.0])
    flat[:5] = special[:flat.numel()]
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bf16 bits, every NaN as one pattern (torch's own bf16 cast of a NaN gives 0x7FC0 or
    0xFFFF depending on its vector path; NaN staying NaN is the contract)."""
    return torch.where(t.isnan(), torch.tensor(0x7FC0, dtype=torch.int16), t.view(torch.int16))


@pytest.mark.parametrize("shape, kw", [((13, 70), dict(row0=5, col0=9, row_len=100)), ((37, 64), {}),
                                       ((1000,), dict(row0=123)), ((), {}), ((4, 3, 5), dict(row0=2))])
def test_c_write_back_is_the_reference_bit_for_bit(shape, kw):
    if not c_kernels.available():
        pytest.skip("the C extension is not built")
    work = _values(shape)
    ref, got = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16)
    F.round_param_(ref, work, step=9, salt=0xDEADBEEF, **kw)
    assert c_kernels.round_param_(got, work, step=9, salt=0xDEADBEEF, **kw)
    assert torch.equal(_bits(ref), _bits(got))
    # and the reference is round_bf16 of the hash of each element's global index
    rows, cols, r0, row_len, c0 = F.param_rows(ref, **kw)
    gidx = element_index(rows, cols, row0=r0, row_len=row_len, col0=c0)
    assert torch.equal(_bits(ref).reshape(rows, cols),
                       _bits(round_bf16(work.reshape(rows, cols), hash_bits(gidx, 9, 0xDEADBEEF))))


def test_a_shard_rounds_like_its_slice_of_the_whole_tensor():
    """Global indices, not local ones: rows 4..9 and columns 8..20 of a [12, 32] tensor."""
    work = _values((12, 32), seed=1)
    whole = torch.empty(12, 32, dtype=torch.bfloat16)
    F.round_param_(whole, work, step=3, salt=77)
    shard = torch.empty(6, 12, dtype=torch.bfloat16)
    F.round_param_(shard, work[4:10, 8:20].contiguous(), step=3, salt=77, row0=4, col0=8, row_len=32)
    assert torch.equal(_bits(shard), _bits(whole[4:10, 8:20]))
    vec = torch.empty(7, dtype=torch.bfloat16)
    full = torch.empty(20, dtype=torch.bfloat16)
    v = _values((20,), seed=2)
    F.round_param_(full, v, step=3, salt=77)
    F.round_param_(vec, v[9:16].contiguous(), step=3, salt=77, row0=9)
    assert torch.equal(_bits(vec), _bits(full[9:16]))


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    """The mean of 2^17 roundings of one value between two bf16 neighbours is the value."""
    n = 1 << 17
    for x in (1.0 + 2.0**-10, -3.0 - 0.3 * 2.0**-6, 1e-3 * (1 + 2.0**-9)):
        work = torch.full((n,), x)
        out = torch.empty(n, dtype=torch.bfloat16)
        F.round_param_(out, work, step=1, salt=5)
        lo, hi = sorted({float(v) for v in out.unique()})
        assert lo < x < hi  # only the two neighbours occur
        sem = (hi - lo) / 2 / n**0.5
        assert abs(float(out.double().mean()) - x) < 5 * sem
        assert abs(float(work.bfloat16().double().mean()) - x) > 20 * sem  # nearest: biased


#: each step moves an element by ~3e-5, ~65x below half a bf16 step at 1.0 (Muon's orthogonalised
#: update of these near rank-1 gradients has elements ~100x below its lr)
LR, STEPS = {Gefen: 3e-5, GefenMuon: 3e-3}, 60


def _train(opt_cls, shape, dtype, sr: bool = False) -> torch.Tensor:
    p = torch.nn.Parameter(torch.ones(shape, dtype=dtype))
    opt = opt_cls([("w", p)], lr=LR[opt_cls], weight_decay=0.0, bf16_stochastic_round=sr)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):  # the same gradients in every run (they do not depend on the parameter)
        p.grad = (1 + 0.3 * torch.randn(shape, generator=g)).bfloat16().to(dtype)  # bf16-exact in every run
        opt.step()
    return p.detach().float()


@pytest.mark.parametrize("opt_cls, shape", [(Gefen, (64, 96)), (Gefen, (4096,)), (GefenMuon, (64, 96))],
                         ids=["gefen-matrix", "gefen-vector", "muon"])
def test_nearest_loses_small_updates_and_stochastic_rounding_keeps_them(opt_cls, shape):
    nearest = _train(opt_cls, shape, torch.bfloat16)
    assert torch.equal(nearest, torch.ones(shape))  # every update rounded away
    fp32 = _train(opt_cls, shape, torch.float32)
    moved = 1.0 - float(fp32.mean())
    assert moved > 5e-4
    error = _train(opt_cls, shape, torch.bfloat16, sr=True) - fp32  # the same updates, rounded stochastically
    sem = float(error.std()) / error.numel() ** 0.5
    assert abs(float(error.mean())) < 5 * sem  # unbiased: the fp32 run's drift, on average
    assert moved > 10 * sem  # while nearest's bias is the whole drift


def test_sr_is_the_same_with_and_without_the_c_kernels(monkeypatch):
    """The fused C step writing fp32 plus the C write-back == the eager reference, bit for bit."""
    if not c_kernels.available():
        pytest.skip("the C extension is not built")
    shapes = {"a": (24, 40), "b": (40,), "c": (6, 5, 4)}

    def run():
        g = torch.Generator().manual_seed(3)
        params = {n: torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for n, s in shapes.items()}
        opt = Gefen(list(params.items()), lr=1e-2, bf16_stochastic_round=True, seed=4)
        for _ in range(3):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=g).bfloat16()
            opt.step()
        return [p.detach().clone() for p in params.values()]

    fused = run()
    monkeypatch.setattr(dispatch, "enabled", False)
    eager = run()
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(fused, eager))


def test_the_option_is_a_bool_saved_in_the_groups_and_the_hybrid_forwards_it():
    with pytest.raises(TypeError, match="bf16_stochastic_round must be a bool"):
        Gefen([torch.nn.Parameter(torch.ones(3))], bf16_stochastic_round=1)
    p = torch.nn.Parameter(torch.ones(8, 8, dtype=torch.bfloat16))
    opt = Gefen([("w", p)], bf16_stochastic_round=True)
    p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["bf16_stochastic_round"] is True
    del sd["param_groups"][0]["bf16_stochastic_round"]  # a state_dict saved without the option
    for live in (True, False):
        fresh = Gefen([("w", torch.nn.Parameter(p.detach().clone()))], bf16_stochastic_round=live)
        fresh.load_state_dict(sd)
        assert fresh.param_groups[0]["bf16_stochastic_round"] is live  # the live choice
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10)).bfloat16()
    hybrid = GefenMuonHybrid(model, bf16_stochastic_round=True)
    assert [g["bf16_stochastic_round"] for g in hybrid.param_groups] == [True, True]


def test_fp32_parameters_ignore_the_option():
    """Nothing to round: an fp32 parameter steps exactly as without the option."""
    g = torch.Generator().manual_seed(0)
    w0, grad = torch.randn(16, 24, generator=g), torch.randn(16, 24, generator=g)
    out = []
    for sr in (False, True):
        p = torch.nn.Parameter(w0.clone())
        opt = Gefen([("w", p)], lr=1e-2, bf16_stochastic_round=sr)
        p.grad = grad.clone()
        opt.step()
        out.append(p.detach())
    assert torch.equal(*out)

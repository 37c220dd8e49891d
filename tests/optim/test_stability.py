"""Gefen as a drop-in for AdamW: what AdamW guarantees must hold on every layout and path.

* Zero history, no step: an element whose gradient has been exactly 0 on every step so far keeps
  its bits (weight decay 0), as under AdamW. GefenMuon's Newton-Schulz mixes a matrix's rows and
  columns, so there the unit is a whole row or column of zero history.
* Bounded steps: no element moves more than ``MAX_STEP`` x lr in one step (AdamW: about 1-1.5),
  from the first step on, when a feature switches from dead to alive, and for gradients of
  1e-12 and 1e6 scale.
* Trains where AdamW trains: ``benchmarks/bench_stability.py``'s small cases and targets, fewer
  steps (its module docstring has the cases and the targets).

The paths: ``kernels`` (the C step on CPU, the default) and ``reference`` (``gefen.dispatch.enabled
= False``, the torch reference); one small case on the Triton kernels, in Triton's interpreter.
"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import bench_stability as bench
from gefen import Gefen, GefenMuon, GefenMuonHybrid, c_kernels, dispatch, split_params_for_muon

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

MAX_STEP = bench.MAX_STEP
LR = 1e-2
DTYPES = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False), "bf16-sr": (torch.bfloat16, True)}
#: (moments, factored_v_2d): m4v4 codes v against the factored estimate, so only m8 has per-block v
GEFEN_LAYOUTS = [("m4v4", True), ("m8", True), ("m8", False)]


@pytest.fixture(params=["kernels", "reference"])
def path(request, monkeypatch):
    """The step's implementation: the C kernels (the default on CPU) or the torch reference."""
    if request.param == "kernels" and c_kernels._lib is None:
        pytest.skip("the C library is not built")
    monkeypatch.setattr(dispatch, "enabled", request.param == "kernels")
    return request.param


class DeadNet(nn.Module):
    """A small net with elements whose gradient is exactly 0 on every step, of each kind a user
    meets: input features that always read 0 (``fc1`` columns 0-3), ReLU units that never fire
    (``fc1``/``fc2`` rows 0-3: weights 0, bias -1), so the next layer's columns 0-3 (the head's
    too) see only zeros, embedding rows never looked up, and masked-out weights of ``fc2``."""

    DEAD = 4
    SEEN_TOKENS = 40

    def __init__(self, dtype=torch.float32):
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the same weights every run, the global generator untouched
            torch.manual_seed(7)
            self.embed = nn.Embedding(100, 8)
            self.fc1, self.fc2, self.classifier = nn.Linear(16 + 8, 32), nn.Linear(32, 32), nn.Linear(32, 5)
            self.register_buffer("mask", (torch.rand(32, 32) > 0.25).float())
        with torch.no_grad():
            for layer in (self.fc1, self.fc2):
                layer.weight[: self.DEAD] = 0
                layer.bias[: self.DEAD] = -1
        self.to(dtype)

    def forward(self, x, tokens):
        h = F.relu(self.fc1(torch.cat([x, self.embed(tokens)], 1)))
        h = F.relu(F.linear(h, self.fc2.weight * self.mask, self.fc2.bias))
        return self.classifier(h)


def batches(steps: int, seed: int = 0, alive_from: int | None = None, dtype=torch.float32):
    """``(x, tokens, labels)`` per step: features 0-3 read 0 and only the first ``SEEN_TOKENS`` rows
    are looked up, until step ``alive_from`` (None: never), from which both come alive."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        alive = alive_from is not None and t >= alive_from
        x = torch.randn(16, 16, generator=gen)
        if not alive:
            x[:, : DeadNet.DEAD] = 0
        tokens = torch.randint(0, 100 if alive else DeadNet.SEEN_TOKENS, (16,), generator=gen)
        out.append((x.to(dtype), tokens, torch.randint(0, 5, (16,), generator=gen)))
    return out


def make(kind: str, model: nn.Module, lr: float = LR, sr: bool = False, moments="m4v4", factored=True):
    """``kind``'s optimizer over ``model``, weight decay 0; and the ids of the parameters it steps
    with Newton-Schulz (their zero-history unit is a whole row or column)."""
    if kind == "Gefen":
        return Gefen(model.named_parameters(), lr=lr, weight_decay=0.0, moments=moments, factored_v_2d=factored,
                     bf16_stochastic_round=sr), set()
    if kind == "GefenMuon":
        mats = [p for p in model.parameters() if p.dim() == 2 and p is not model.embed.weight]
        return GefenMuon(mats, lr=lr, weight_decay=0.0, bf16_stochastic_round=sr), {id(p) for p in mats}
    muon, _ = split_params_for_muon(model)
    return (GefenMuonHybrid(model, lr=lr, weight_decay=0.0, bf16_stochastic_round=sr),
            {id(p) for _, p in muon})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _bf16_spacing(t: torch.Tensor) -> torch.Tensor:
    """The gap between adjacent bf16 values at ``|t|`` (what one rounding of a bf16 parameter may add)."""
    exp = torch.frexp(t.detach().float().abs().clamp_min(2.0**-126)).exponent
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32), exp - 8)


def train_and_check(model, opt, muon: set, data, lr: float, scale: float = 1.0, max_step: float | None = MAX_STEP):
    """Step through ``data``; after every step assert that no zero-history element changed a bit
    and (``max_step``) that no element moved more than ``max_step`` x lr (bf16: plus one bf16
    spacing, what rounding the parameter may add). Returns ``(protected, moved)``: elements of
    zero history at the end, elements that moved at least once (the test is not vacuous)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    seen = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in named}
    moved = 0
    for t, (x, tokens, labels) in enumerate(data):
        loss = F.cross_entropy(model(x, tokens).float(), labels) * scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        before = {n: p.detach().clone() for n, p in named}
        for n, p in named:
            if p.grad is not None:
                seen[n] |= p.grad != 0
        opt.step()
        for n, p in named:
            keep = bench.still_zero(seen[n], id(p) in muon)
            changed = _bits(p) != _bits(before[n])
            wrong = int((changed & keep).sum())
            assert wrong == 0, f"step {t}: {wrong} of {int(keep.sum())} zero-history elements of {n} moved"
            assert bool(torch.isfinite(p).all()), f"step {t}: {n} is not finite"
            if max_step is not None:
                delta = (p.detach().float() - before[n].float()).abs()
                bound = max_step * lr + (_bf16_spacing(p) if p.dtype == torch.bfloat16 else 0.0)
                worst = int((delta - bound).flatten().argmax())
                over = delta.flatten()[worst].item() / lr
                assert bool((delta <= bound).all()), f"step {t}: {n} element {worst} moved {over:.4g} x lr (bound {max_step})"
            moved += int(changed.sum())
    protected = sum(int(bench.still_zero(seen[n], id(p) in muon).sum()) for n, p in named)
    return protected, moved


def _assert_not_vacuous(protected: int, moved: int) -> None:
    assert protected >= 4 * 32 and moved > 0, (protected, moved)


# ----- zero history: bit-for-bit unchanged --------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("moments,factored", GEFEN_LAYOUTS, ids=[f"{m}-{'factored' if f else 'block'}"
                                                                  for m, f in GEFEN_LAYOUTS])
def test_gefen_zero_history_elements_never_move(path, moments, factored, dtype):
    torch_dtype, sr = DTYPES[dtype]
    model = DeadNet(torch_dtype)
    opt, muon = make("Gefen", model, sr=sr, moments=moments, factored=factored)
    _assert_not_vacuous(*train_and_check(model, opt, muon, batches(8, dtype=torch_dtype), LR, max_step=None))


@pytest.mark.parametrize("dtype", ["fp32", "bf16-sr"])
@pytest.mark.parametrize("kind", ["GefenMuon", "GefenMuonHybrid"])
def test_muon_zero_rows_and_columns_never_move(path, kind, dtype):
    """Whole zero rows/columns of GefenMuon's momentum stay zero through Newton-Schulz, so they never
    move; the hybrid's backup (embedding, head, biases) keeps Gefen's per-element rule."""
    torch_dtype, sr = DTYPES[dtype]
    model = DeadNet(torch_dtype)
    opt, muon = make(kind, model, sr=sr)
    _assert_not_vacuous(*train_and_check(model, opt, muon, batches(8, dtype=torch_dtype), LR, max_step=None))


# ----- bounded steps ------------------------------------------------------------------------------
SCENARIOS = {  # name: (steps, step from which the dead features come alive, loss scale)
    "dead-features": (10, None, 1.0),
    "dead-then-alive": (10, 4, 1.0),
    "grad-1e-12": (10, 4, 1e-12),
    "grad-1e6": (10, 4, 1e6),
}
KINDS = {f"Gefen-{m}-{'factored' if f else 'block'}": ("Gefen", m, f) for m, f in GEFEN_LAYOUTS}
KINDS |= {"GefenMuon": ("GefenMuon", "m4v4", True), "GefenMuonHybrid": ("GefenMuonHybrid", "m4v4", True)}


@pytest.mark.parametrize("lr", [1e-3, 3e-2])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_step_is_bounded(path, kind, scenario, lr):
    """Every step, the first included, moves no element more than MAX_STEP x lr (and zero-history
    elements not at all), in fp32."""
    steps, alive_from, scale = SCENARIOS[scenario]
    name, moments, factored = KINDS[kind]
    model = DeadNet()
    opt, muon = make(name, model, lr=lr, moments=moments, factored=factored)
    train_and_check(model, opt, muon, batches(steps, seed=1, alive_from=alive_from), lr, scale=scale)


@pytest.mark.parametrize("dtype", ["bf16", "bf16-sr"])
def test_bf16_steps_are_bounded(path, dtype):
    """bf16 parameters: the same bound, plus the one bf16 spacing that rounding may add."""
    torch_dtype, sr = DTYPES[dtype]
    model = DeadNet(torch_dtype)
    opt, muon = make("Gefen", model, sr=sr)
    train_and_check(model, opt, muon, batches(10, seed=2, alive_from=4, dtype=torch_dtype), LR)


def test_first_step_on_a_relu_mlp_is_bounded(path):
    """The first step a new user takes: a fresh ReLU MLP on non-negative, mostly-zero inputs (dead
    input pixels and dead hidden units give the head all-zero columns)."""
    gen = torch.Generator().manual_seed(3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        mlp = nn.Sequential(nn.Linear(196, 64), nn.ReLU(), nn.Linear(64, 10))
    x = torch.rand(32, 196, generator=gen)
    x = torch.where(x > 0.7, x, torch.zeros(()))
    x[:, :40] = 0
    y = torch.randint(0, 10, (32,), generator=gen)
    for moments in ("m4v4", "m8"):
        model = copy.deepcopy(mlp)
        opt = Gefen(model.parameters(), lr=LR, weight_decay=0.0, moments=moments)
        before = [p.detach().clone() for p in model.parameters()]
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        for (name, p), b, g in zip(model.named_parameters(), before, grads):
            step = (p.detach() - b).abs()
            assert step.max().item() <= MAX_STEP * LR, f"{moments} {name}: {step.max().item() / LR:.4g} x lr"
            assert torch.equal(_bits(p)[g == 0], _bits(b)[g == 0]), f"{moments} {name}: zero-gradient elements moved"


# ----- trains where AdamW trains -----------------------------------------------------------------
TRAIN_STEPS = 30
TRAIN_CASES = ("mlp16", "deep6", "embed", "masked", "late")
TRAIN_OPTIMIZERS = ("Gefen m4v4", "Gefen m8", "GefenMuonHybrid")


#: whose losses are held against what: GefenMuonHybrid against torch's own Muon + AdamW, the
#: algorithm it compresses (Muon's loss curve is not AdamW's: on mlp16 at lr 1e-2, 30 steps, the
#: 3-seed final loss is AdamW 0.758, torch Muon+AdamW 1.17, GefenMuonHybrid 1.17)
LOSS_BASELINE = {"GefenMuonHybrid": bench.TORCH_MUON}


@functools.cache
def _runs(case: str, optimizer: str, lr: float) -> tuple[dict, ...]:
    with torch.random.fork_rng(devices=[]):  # train() seeds the global generator
        return tuple(bench.train(case, optimizer, lr, seed, TRAIN_STEPS) for seed in bench.SEEDS)


@pytest.mark.parametrize("lr", [1e-3, 1e-2])
@pytest.mark.parametrize("optimizer", TRAIN_OPTIMIZERS)
@pytest.mark.parametrize("case", TRAIN_CASES)
def test_trains_where_adamw_trains(case, optimizer, lr):
    """bench_stability's targets on 3-seed means: finite, max step and zero-history elements as
    AdamW; worst and final loss against AdamW's (the hybrid: torch Muon + AdamW's) on the same
    case and rate."""
    ref = LOSS_BASELINE.get(optimizer, bench.BASELINE)
    if optimizer == "GefenMuonHybrid" and not split_params_for_muon(bench.CASES[case](torch.Generator(), 1).model)[0]:
        pytest.skip("no hidden matrix for Muon")
    if ref == bench.TORCH_MUON and not hasattr(torch.optim, "Muon"):
        pytest.skip(f"torch {torch.__version__} has no torch.optim.Muon")
    runs = [run for name in dict.fromkeys((bench.BASELINE, optimizer, ref)) for run in _runs(case, name, lr)]
    rows = {r["optimizer"]: r for r in bench.summarise(runs)}
    row, base = rows[optimizer], rows[ref]
    met = row["checks"] | {k: ok for k, ok in bench.targets_met(row, base).items() if k in ("worst", "final")}
    missed = [k for k, ok in met.items() if not ok]
    assert met and not missed, (
        f"{case} lr {lr:g} {optimizer} misses {missed}: final {row['final']:.4g} worst {row['worst']:.4g} max step "
        f"{row['max_step']:.4g} NaN steps {row['nan_steps']} moved {row['zero_history_moved']}; {ref} final "
        f"{base['final']:.4g} worst {base['worst']:.4g}")


# ----- the Triton kernels ----------------------------------------------------------------------------
@pytest.mark.triton
@pytest.mark.parametrize("moments", ["m4v4", "m8"])
def test_triton_kernels_keep_zero_history_and_bound(moments, monkeypatch):
    """The same invariants on the Triton kernels (CPU: Triton's interpreter)."""
    pytest.importorskip("triton")
    from gefen.triton import dispatch as triton_dispatch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and Triton's interpreter is off (TRITON_INTERPRET=1)")
    monkeypatch.setattr(triton_dispatch, "DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(dispatch, "enabled", True)
    assert triton_dispatch.available()  # imports the launch module
    from gefen.triton import launch

    calls, real = [], getattr(launch, f"{moments}_update_")
    monkeypatch.setattr(launch, f"{moments}_update_", lambda items, *a: (calls.append(len(items)), real(items, *a))[1])
    model = DeadNet()
    opt, muon = make("Gefen", model, moments=moments)
    _assert_not_vacuous(*train_and_check(model, opt, muon, batches(4, seed=4, alive_from=2), LR))
    assert calls, "the steps never reached the Triton kernels"

"""Bounded steps on sharded and tensor-parallel layouts (docs/design.md, "Bounded steps"): the
same global gradients, with dead columns and rows, on a (dp, tp) = (1, 2) mesh (rows and columns
split by tensor parallelism, the column split's statistics reduced over tp) and under FSDP2 on 2
ranks leave every zero-history element bit for bit unchanged, keep every step within
``step_bound``, and equal one process bit for bit."""

from __future__ import annotations

import pytest
import torch
from test_tp import COLWISE, STYLES, full, mesh_of, parallel_model

from gefen import Gefen, GefenMuonHybrid
from gefen.functional import step_bound

from distributed import run

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEPS, LR = 4, 1e-2
KINDS = ("m4v4", "m8", "hybrid")


def dead_grads(shapes: dict[str, tuple[int, ...]], step: int) -> dict[str, torch.Tensor]:
    """The same global gradients on every layout: random, with the first quarter of every matrix's
    columns and its last two rows exactly zero (dead input features, a dead output unit), and the
    first elements of every vector zero."""
    g = torch.Generator().manual_seed(2000 + step)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], generator=g)).view(-1, *[1] * (len(shape) - 1))
        if len(shape) == 2:
            t[:, : max(shape[1] // 4, 1)] = 0
            t[-2:] = 0
        else:
            t[:3] = 0
        out[name] = t
    return out


def make(kind: str, m):
    if kind == "hybrid":
        return GefenMuonHybrid(m, lr=LR, weight_decay=0.0)
    return Gefen(list(m.named_parameters()), lr=LR, weight_decay=0.0, moments=kind)


def train_and_watch(m, opt) -> dict:
    """STEPS steps; returns the whole parameters after each step (a collective per DTensor, the
    same order on every rank)."""
    from torch.distributed.tensor import distribute_tensor

    named = dict(m.named_parameters())
    history = [{n: full(p) for n, p in named.items()}]
    for step in range(STEPS):
        grads = dead_grads({n: tuple(p.shape) for n, p in named.items()}, step)
        for name, p in named.items():
            p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements, src_data_rank=None) \
                if hasattr(p, "device_mesh") else grads[name]
        opt.step()
        opt.zero_grad()
        history.append({n: full(p) for n, p in named.items()})
    return history


def styles_of(kind: str) -> dict:
    """Every tensor-parallel style; m8 (which refuses column splits) on row splits only."""
    return COLWISE if kind == "m8" else STYLES


def _world(rank: int, world: int, dp: int) -> dict:
    mesh = mesh_of(dp, world // dp)
    out = {}
    for kind in KINDS:
        m = parallel_model(0, mesh, styles_of(kind) if world // dp > 1 else {})  # dp = world: FSDP2 alone
        out[kind] = train_and_watch(m, make(kind, m))
    return out


def check(history: list[dict], what: str, muon: set[str] = frozenset()) -> None:
    """Zero-history elements unchanged (Muon matrices: their dead rows and columns), every step
    within the bound, something moved."""
    shapes = {n: tuple(t.shape) for n, t in history[0].items()}
    for t in range(1, len(history)):
        grads = [dead_grads(shapes, step) for step in range(t)]
        for name, shape in shapes.items():
            alive = torch.zeros(shape, dtype=torch.bool)
            for g in grads:
                alive |= g[name] != 0
            moved = history[t][name] - history[t - 1][name]
            assert ((moved == 0) | alive).all(), f"{what} {name} step {t}: a zero-history element moved"
            if name not in muon:
                limit = LR * step_bound(t, 0.9, 0.999) * (1 + 1e-6) + torch.finfo(torch.float32).eps * 4
                assert (moved.abs() <= limit).all(), f"{what} {name} step {t}: {moved.abs().max() / LR} x lr"
    assert any((history[-1][n] != history[0][n]).any() for n in shapes), what


@pytest.mark.parametrize("dp", [1, 2], ids=["tp2", "fsdp2"])
def test_sharded_steps_are_bounded_and_keep_zero_history(dp):
    results = run(_world, 2, dp, timeout=300)
    for kind in KINDS:
        m = parallel_model(0, None, styles_of(kind))
        want = train_and_watch(m, make(kind, m))
        muon = {"up.weight", "down.weight"} if kind == "hybrid" else set()
        check(want, f"one process, {kind}", muon)
        for rank, got in enumerate(results):
            for t, (a, b) in enumerate(zip(want, got[kind])):
                for name in a:
                    assert torch.equal(a[name], b[name]), f"{kind} rank {rank} step {t}: {name} differs from one process"

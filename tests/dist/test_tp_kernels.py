"""Tensor-parallel steps on the C kernels: on a 2 x 2 ``(dp, tp)`` mesh (``ColwiseParallel`` and
``RowwiseParallel`` under FSDP2, as tests/dist/test_tp.py) no parameter's step, first step
included, runs the torch reference, and a step issues the same small number of collectives
whatever the number of parameters.

The references are counted where ``gefen.dispatch`` calls them (``gefen.functional``'s step
functions and the codebook histogram), as the op-count tests count torch ops.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from distributed import run

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

#: what a step may fall back to (the eager references gefen.dispatch runs when no kernel applies)
REFERENCES = ("m4v4_update_", "m4v4_partials", "adamw_update_", "m8_update_", "m8_partials",
              "update_momentum_", "store_momentum_", "momentum_ema", "m4v4_momentum", "row_square_sums")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 16), nn.LayerNorm(16))
                           for _ in range(layers)])


def _counting(monkeypatch_targets: list[tuple[object, str]], counter: collections.Counter) -> None:
    for owner, name in monkeypatch_targets:
        real = getattr(owner, name)

        def counted(*args, _real=real, _name=name, **kw):
            counter[_name] += 1
            return _real(*args, **kw)

        setattr(owner, name, counted)


def _world(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import gefen.dispatch
    import gefen.functional
    from gefen import Gefen, GefenMuon, GefenMuonHybrid, c_kernels

    assert c_kernels.available() and c_kernels._calibrated().m4v4
    references, collectives = collections.Counter(), collections.Counter()
    _counting([(gefen.functional, n) for n in REFERENCES] + [(gefen.dispatch, "histogram_normalised_blocks")],
              references)
    _counting([(dist, n) for n in COLLECTIVES], collectives)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for kind in ("m4v4", "muon", "hybrid"):
        for layers in (1, 3):
            model = _model(layers)
            for block in model:
                parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            named = list(model.named_parameters())
            if kind == "m4v4":
                opt = Gefen(named, lr=1e-2, weight_decay=0.1)
            elif kind == "muon":
                opt = GefenMuon([(n, p) for n, p in named if p.dim() == 2], lr=1e-2, normuon=True)
            else:
                opt = GefenMuonHybrid(model, lr=1e-2)
            counts = []
            for step in range(3):
                g = torch.Generator().manual_seed(step)
                for p in model.parameters():
                    full = torch.randn(p.shape, generator=g)
                    p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                references.clear()
                collectives.clear()
                opt.step()
                counts.append((dict(references), sum(collectives.values())))
            out[kind, layers] = counts
    return out


def test_tensor_parallel_steps_run_on_the_kernels_with_few_collectives():
    """Gefen m4v4, GefenMuon (NorMuon) and GefenMuonHybrid on (dp, tp) = (2, 2): no reference call at
    any step (the first, which learns the codebooks, included), and from the second step on the
    same number of collectives for 1 and 3 transformer-like blocks: Gefen's two (one all_gather of
    the column-split rows' statistics over tp, one all-reduce of the column statistics)."""
    for r in run(_world, 4, timeout=400):
        for (kind, layers), steps in r.items():
            for step, (refs, _) in enumerate(steps):
                assert not refs, f"{kind}, {layers} blocks, step {step}: the reference ran {refs}"
            for later in range(1, len(steps)):
                assert steps[later][1] == r[kind, 1][later][1], f"{kind}: collectives grow with the parameters"
        assert [n for _, n in r["m4v4", 3][1:]] == [2, 2], r["m4v4", 3]

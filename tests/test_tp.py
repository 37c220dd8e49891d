"""Tensor parallelism on a 2-D ``(dp, tp)`` mesh: torch's ``ColwiseParallel`` (``Shard(0)``) and
``RowwiseParallel`` (``Shard(1)``) under FSDP2 ``fully_shard`` on ``dp`` (which puts a
``_StridedShard(0)`` over a tensor-parallel ``Shard(0)``), on real gloo ranks.

The same global gradients give the same state and parameters bit for bit on every ``(dp, tp)``
layout and in one process, and torch's own checkpoint API reshards the state between meshes.
Every field is compared as the DTensor ``state_dict()`` presents it (``full_tensor()``), so the
field placements are checked too.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from gefen import Gefen, GefenMuon, GefenMuonHybrid

from distributed import row_scaled_grads, run

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

STEPS, MORE = 3, 2
#: every TP style on uneven splits: an embedding split by columns (ColwiseParallel on an
#: Embedding is Shard(1)), a Linear split by rows (14 rows: 7+7 / 5+5+4), one split by columns
#: (14 columns), and a LayerNorm tensor parallelism leaves whole (on the dp slice of the mesh)
STYLES = {"emb": "colwise", "up": "colwise", "down": "rowwise"}


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(OrderedDict(emb=nn.Embedding(20, 24), up=nn.Linear(24, 14), act=nn.GELU(),
                                     down=nn.Linear(14, 10), norm=nn.LayerNorm(10)))


def mesh_of(dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def parallel_model(seed: int, mesh, styles: dict[str, str] = STYLES) -> nn.Module:
    """``model(seed)`` tensor-parallel on ``mesh["tp"]``, then fully_shard-ed on ``mesh["dp"]``
    (None: the plain model)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    m = model(seed)
    if mesh is None:
        return m
    kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(m, mesh["tp"], {name: kinds[style]() for name, style in styles.items()})
    for layer in m:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(m, mesh=mesh["dp"])


def train(m: nn.Module, opt, start: int, steps: int) -> None:
    """``steps`` optimizer steps with the same global gradients on every layout."""
    from torch.distributed.tensor import distribute_tensor

    named = dict(m.named_parameters())
    for step in range(start, start + steps):
        grads = row_scaled_grads({n: tuple(p.shape) for n, p in named.items()}, step)
        for name, p in named.items():
            g = grads[name]
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) \
                if hasattr(p, "device_mesh") else g
        opt.step()
        opt.zero_grad()


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def snapshot(m: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Every parameter and state field as a whole tensor (DTensor fields through ``full_tensor``:
    a collective every rank runs in the same order)."""
    out = {f"param/{n}": full(p) for n, p in m.named_parameters()}
    sd = opt.state_dict()
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    for index, entry in sorted(sd["state"].items()):
        for field, value in sorted(entry.items()):
            out[f"{names[index]}/{field}"] = full(value)
    return out


def assert_same(want: dict, got: dict, what: str) -> None:
    assert sorted(want) == sorted(got), what
    for key, value in want.items():
        assert value.dtype == got[key].dtype and torch.equal(value, got[key]), f"{what}: {key}"


# ----- rows split over both mesh dimensions (ColwiseParallel under FSDP2): any second moment ------
COLWISE = {"emb": "rowwise", "up": "colwise"}  # RowwiseParallel on an Embedding is Shard(0)


def _rows_world(rank: int, world: int, dp: int, kinds: tuple[str, ...]) -> dict:
    mesh = mesh_of(dp, world // dp)
    out = {}
    for kind in kinds:
        m = parallel_model(0, mesh, COLWISE)
        opt = make_opt(kind, m)
        train(m, opt, 0, STEPS)
        out[kind] = snapshot(m, opt)
    return out


def make_opt(kind: str, m: nn.Module):
    named = list(m.named_parameters())
    if kind == "m8":
        return Gefen(named, lr=1e-2, weight_decay=0.1)
    if kind == "m8_block":
        return Gefen(named, lr=1e-2, factored_v_2d=False)
    raise ValueError(kind)


def test_rows_split_over_both_dims_match_one_process():
    """ColwiseParallel under FSDP2 splits rows over dp (_StridedShard) and tp: state and parameters
    after three steps on 2x2 equal one process bit for bit (every field compared whole)."""
    kinds = ("m8", "m8_block")
    want = {}
    for kind in kinds:
        m = parallel_model(0, None)
        opt = make_opt(kind, m)
        train(m, opt, 0, STEPS)
        want[kind] = snapshot(m, opt)
    for r in run(_rows_world, 4, 2, kinds, timeout=300):
        for kind in kinds:
            assert_same(want[kind], r[kind], f"{kind} 2x2")


# ----- refusals: a clear one-line error before any state exists ---------------------------------
def _refusal_world(rank: int, world: int) -> dict:
    mesh = mesh_of(2, 2)
    out = {}
    makers = {
        "m8": lambda m: Gefen(m.named_parameters(), lr=1e-2),
        "muon": lambda m: GefenMuon([(n, p) for n, p in m.named_parameters() if p.dim() == 2], lr=1e-2),
        "hybrid": lambda m: GefenMuonHybrid(m, lr=1e-2),
    }
    for kind, make in makers.items():
        m = parallel_model(0, mesh)
        opt = make(m)
        try:
            train(m, opt, 0, 1)
            out[kind] = ("stepped", None)
        except ValueError as exc:
            out[kind] = (str(exc), all(not s for s in opt.state.values()))
    return out


@pytest.mark.timeout(300)
def test_unsupported_tensor_parallel_layouts_are_refused():
    """m8 with columns split, and GefenMuon / GefenMuonHybrid on any tensor-parallel matrix: one
    line naming the parameter, its placements and the alternative; no state allocated."""
    for r in run(_refusal_world, 4, timeout=300):
        for kind, (message, untouched) in r.items():
            assert untouched, kind
            assert "\n" not in message and "unsupported layout" in message, (kind, message)
            assert "Shard(dim=1)" in message or "Shard(dim=0)" in message, (kind, message)
        assert "moments='m4v4'" in r["m8"][0]
        for kind in ("muon", "hybrid"):
            assert "GefenMuon" in r[kind][0] and "Gefen" in r[kind][0] and "backup" in r[kind][0], r[kind]

"""Tensor parallelism on a 2-D ``(dp, tp)`` mesh: torch's ``ColwiseParallel`` (``Shard(0)``) and
``RowwiseParallel`` (``Shard(1)``) under FSDP2 ``fully_shard`` on ``dp`` (which puts a
``_StridedShard(0)`` over a tensor-parallel ``Shard(0)``), on real gloo ranks.

The same global gradients give the same state and parameters bit for bit on every ``(dp, tp)``
layout and in one process, and torch's own checkpoint API reshards the state between meshes.
Every field is compared as the DTensor ``state_dict()`` presents it (``full_tensor()``), so the
field placements are checked too.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gefen import Gefen, GefenMuon, GefenMuonHybrid
from gefen_ckpt import export_canonical
from gefen_ckpt.dcp import GefenDCPState, GefenLoadPlanner, GefenSavePlanner
from gefen_ckpt.errors import UnsupportedLayoutError

from distributed import row_scaled_grads, run

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

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


def parallel_model(seed: int, mesh, styles: dict[str, str] = STYLES, dp: tuple[str, ...] = ("dp",)) -> nn.Module:
    """``model(seed)`` tensor-parallel on ``mesh["tp"]``, then fully_shard-ed on ``mesh[dp]`` (two
    names: HSDP, replicate x shard) (None: the plain model)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    m = model(seed)
    if mesh is None:
        return m
    kinds = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(m, mesh["tp"], {name: kinds[style]() for name, style in styles.items()})
    for layer in m:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh[dp])
    return fully_shard(m, mesh=mesh[dp])


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


def make_opt(kind: str, m: nn.Module):
    named = list(m.named_parameters())
    if kind == "m4v4":
        return Gefen(named, lr=1e-2, weight_decay=0.1)
    if kind == "m8":
        return Gefen(named, lr=1e-2, weight_decay=0.1, moments="m8")
    if kind == "m8_block":
        return Gefen(named, lr=1e-2, factored_v_2d=False, moments="m8")
    if kind == "muon":  # every matrix: the column-split embedding and down, up's rows over both dims
        return GefenMuon([(n, p) for n, p in named if p.dim() == 2], lr=1e-2, weight_decay=0.1, normuon=True)
    if kind == "hybrid":  # up and down to Muon; the embedding, biases and norm to Gefen m4v4
        return GefenMuonHybrid(m, lr=1e-2, weight_decay=0.1)
    if kind == "hybrid_adamw":  # the same with torch's AdamW (DTensor state) as the backup
        return GefenMuonHybrid(m, lr=1e-2, weight_decay=0.1, backup="adamw")
    raise ValueError(kind)


#: what a 2x2 run saves and the resumed runs continue (every TP style); ASYNC saves with dcp.async_save
STOCK_KINDS = ("m4v4", "muon", "hybrid")
ASYNC = "muon"


#: rows split over both mesh dimensions only (ColwiseParallel under FSDP2; RowwiseParallel on an
#: Embedding is Shard(0)): every second-moment layout works there, m8 included
COLWISE = {"emb": "rowwise", "up": "colwise"}
M8_KINDS = ("m8", "m8_block")


def uninterrupted(kind: str, styles: dict, steps: int) -> dict[str, torch.Tensor]:
    m = parallel_model(0, None, styles)
    opt = make_opt(kind, m)
    train(m, opt, 0, steps)
    return snapshot(m, opt)


def save(m, opt, path: str, use_async: bool = False) -> None:
    msd, osd = get_state_dict(m, opt)
    if use_async:
        dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path).result()
    else:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def resume(path: str, mesh, kind: str) -> tuple[nn.Module, object]:
    """A fresh model (other initial weights) and optimizer (no state), filled the stock way."""
    m = parallel_model(1, mesh)
    opt = make_opt(kind, m)
    msd, osd = get_state_dict(m, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(m, opt, model_state_dict=msd, optim_state_dict=osd)
    return m, opt


def _refusals(mesh) -> dict[str, tuple[str, bool]]:
    """What m8 says at its first step on a column split, and whether it left its state empty; what
    GefenMuon says when state with blocks shorter than a row (not the one block length) is loaded
    onto a column split, and whether its state stayed as it was."""
    out = {}
    m = parallel_model(0, mesh)
    opt = Gefen(m.named_parameters(), lr=1e-2, moments="m8")
    try:
        train(m, opt, 0, 1)
        out["m8"] = ("stepped", False)
    except ValueError as exc:
        out["m8"] = (str(exc), all(not s for s in opt.state.values()))
    m = parallel_model(0, mesh)
    opt = make_opt("muon", m)
    train(m, opt, 0, 1)
    before = snapshot(m, opt)
    sd = opt.state_dict()
    down = sd["param_groups"][0]["param_names"].index("down.weight")  # 10 x 14, columns split over tp
    sd["state"][down]["period"] = torch.tensor(7)  # two blocks per row: the split cuts neither, but a scale per block
    try:
        opt.load_state_dict(sd)
        out["muon"] = ("loaded", False)
    except ValueError as exc:
        out["muon"] = (str(exc), all(torch.equal(v, before[k]) for k, v in snapshot(m, opt).items()))
    return out


def _world_2x2(rank: int, world: int, path: str) -> dict:
    """On a (dp, tp) = (2, 2) mesh: m4v4, GefenMuon and GefenMuonHybrid with every TP style (each
    saved the stock way under ``path``), every m8 layout on row splits only, and the refusals."""
    mesh = mesh_of(2, 2)
    out = {}
    for kind in STOCK_KINDS:
        m = parallel_model(0, mesh)
        opt = make_opt(kind, m)
        train(m, opt, 0, STEPS)
        out[kind] = snapshot(m, opt)
        save(m, opt, f"{path}/{kind}", use_async=kind == ASYNC)
        if kind == "m4v4":  # GefenDCPState is the stock layout with a record: it takes every TP style
            dcp.save({"model": m.state_dict(), "optim": GefenDCPState(opt, m)}, checkpoint_id=f"{path}/planned",
                     planner=GefenSavePlanner())
            try:  # gefen_ckpt's own formats hand each rank whole rows: they refuse a column split
                export_canonical(opt, model=m)
                out["gefen_ckpt"] = "exported"
            except UnsupportedLayoutError as exc:
                out["gefen_ckpt"] = str(exc)
    m = parallel_model(0, mesh)
    opt = make_opt("hybrid_adamw", m)
    train(m, opt, 0, STEPS)
    out["hybrid_adamw"] = snapshot(m, opt)
    for kind in M8_KINDS:
        m = parallel_model(0, mesh, COLWISE)
        opt = make_opt(kind, m)
        train(m, opt, 0, STEPS)
        out[kind] = snapshot(m, opt)
    out["refusals"] = _refusals(mesh)
    return out


def resume_planned(path: str, mesh) -> tuple[nn.Module, object]:
    """A fresh model and m4v4 optimizer filled by GefenDCPState + GefenLoadPlanner (no step)."""
    m = parallel_model(1, mesh)
    opt = make_opt("m4v4", m)
    msd = m.state_dict()
    dcp.load({"model": msd, "optim": GefenDCPState(opt, m)}, checkpoint_id=f"{path}/planned",
             planner=GefenLoadPlanner())
    m.load_state_dict(msd)
    return m, opt


def _resume_world(rank: int, world: int, dp: int, path: str) -> dict:
    out = {}
    for kind in STOCK_KINDS:
        m, opt = resume(f"{path}/{kind}", mesh_of(dp, world // dp), kind)
        train(m, opt, STEPS, MORE)
        out[kind] = snapshot(m, opt)
    m, opt = resume_planned(path, mesh_of(dp, world // dp))
    train(m, opt, STEPS, MORE)
    out["planned"] = snapshot(m, opt)
    return out


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp") / "2x2")
    return path, run(_world_2x2, 4, path, timeout=400)


def test_2x2_matches_one_process(two_by_two):
    """The same global gradients on a (dp, tp) = (2, 2) mesh and in one process: every state field
    (compared whole through the DTensors state_dict() presents) and parameter is bit for bit equal;
    ColwiseParallel (rows split over dp and tp) and RowwiseParallel (columns split over tp) on
    uneven splits, for m4v4, GefenMuon (NorMuon) and GefenMuonHybrid (Gefen and AdamW backups)
    and, on row splits only, for m8."""
    _, results = two_by_two
    want = {k: uninterrupted(k, STYLES, STEPS) for k in (*STOCK_KINDS, "hybrid_adamw")}
    want |= {k: uninterrupted(k, COLWISE, STEPS) for k in M8_KINDS}
    assert any(k.endswith("/mv_code") for k in want["m4v4"]) and any(k.endswith("/v_col") for k in want["m4v4"])
    assert {"down.weight/m_scale", "emb.weight/v_row"} <= set(want["muon"])
    assert {"down.weight/m_code", "emb.weight/mv_code"} <= set(want["hybrid"])
    assert {"down.weight/m_code", "emb.weight/exp_avg"} <= set(want["hybrid_adamw"])
    for r in results:
        for kind, value in want.items():
            assert_same(value, r[kind], f"{kind} on 2x2")


def test_stock_checkpoint_of_2x2_resumes_on_other_meshes(two_by_two):
    """get_state_dict + dcp.save (dcp.async_save for GefenMuon) on 2x2, then a fresh model and
    optimizer on 1x3, 3x1 and one process: get_state_dict, dcp.load, set_state_dict, continue; each
    equals the uninterrupted run bit for bit (m4v4, GefenMuon, GefenMuonHybrid); and so does m4v4
    saved through GefenDCPState and loaded by GefenLoadPlanner into a fresh optimizer."""
    path, _ = two_by_two
    want = {kind: uninterrupted(kind, STYLES, STEPS + MORE) for kind in STOCK_KINDS}
    for dp in (1, 3):
        for r in run(_resume_world, 3, dp, path, timeout=300):
            for kind in STOCK_KINDS:
                assert_same(want[kind], r[kind], f"{kind}: 2x2 -> {dp}x{3 // dp}")
            assert_same(want["m4v4"], r["planned"], f"GefenDCPState: 2x2 -> {dp}x{3 // dp}")
    for kind in STOCK_KINDS:
        m, opt = resume(f"{path}/{kind}", None, kind)
        train(m, opt, STEPS, MORE)
        assert_same(want[kind], snapshot(m, opt), f"{kind}: 2x2 -> one process")
    m, opt = resume_planned(path, None)
    train(m, opt, STEPS, MORE)
    assert_same(want["m4v4"], snapshot(m, opt), "GefenDCPState: 2x2 -> one process")


def test_unsupported_tensor_parallel_layouts_are_refused(two_by_two):
    """m8 with columns split (no state allocated): one line naming the parameter, its placements
    and what works; GefenMuon state whose blocks are shorter than a row, loaded onto a column
    split: refused like anywhere else, the live state unchanged. gefen_ckpt's canonical export
    (whole rows per rank) refuses a column split, naming the parameter."""
    _, results = two_by_two
    for r in results:
        refusals = r["refusals"]
        for kind, (message, untouched) in refusals.items():
            assert untouched and "\n" not in message and "parameter '" in message, (kind, message)
        message = refusals["m8"][0]
        assert "unsupported layout" in message and "Shard(dim=" in message and "moments='m4v4'" in message, message
        assert "emb.weight" in r["gefen_ckpt"] and "Shard(dim=1)" in r["gefen_ckpt"], r["gefen_ckpt"]
        message = refusals["muon"][0]
        assert "'down.weight'" in message and "period 7 is not the block length" in message, message


def test_offline_tools_read_a_tensor_parallel_stock_checkpoint(two_by_two, tmp_path):
    """The stock 2x2 checkpoints (model + optimizer, columns and rows split): torch's own
    dcp_to_torch_save gives a file that a one-process model and optimizer resume from exactly, and
    ``gefen-ckpt inspect / verify / convert / reshard`` read them into the same state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from typer.testing import CliRunner

    import gefen_ckpt
    from gefen import contract_of
    from gefen_cli.app import app

    from test_dcp import canonical_tensors

    path, _ = two_by_two
    cli = CliRunner()
    for kind in STOCK_KINDS:
        src = f"{path}/{kind}"
        dcp_to_torch_save(src, tmp_path / f"{kind}.pt")
        saved = torch.load(tmp_path / f"{kind}.pt", weights_only=False)
        m = parallel_model(1, None)
        opt = make_opt(kind, m)
        set_state_dict(m, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
        want = canonical_tensors(opt)
        train(m, opt, STEPS, MORE)
        assert_same(uninterrupted(kind, STYLES, STEPS + MORE), snapshot(m, opt), f"{kind}: dcp_to_torch_save")

        shown = cli.invoke(app, ["inspect", src, "--json"])
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.output)["optimizer"]["implementation"] == contract_of(opt).implementation
        verified = cli.invoke(app, ["verify", src])
        assert verified.exit_code == 0, verified.output
        for command in (["reshard", src, str(tmp_path / f"{kind}-r3"), "--world-size", "3"],
                        ["convert", src, str(tmp_path / f"{kind}-portable"), "--to", "portable"]):
            result = cli.invoke(app, command)
            assert result.exit_code == 0, result.output
            fresh = make_opt(kind, parallel_model(1, None))
            gefen_ckpt.load(fresh, command[2])
            assert_same(want, canonical_tensors(fresh), f"{kind}: gefen-ckpt {command[0]}")


#: HSDP x TP on 4 ranks: (replicate, shard, tp) meshes
HSDP_TP = ((2, 1, 2), (1, 2, 2))


def _world_hsdp_tp(rank: int, world: int) -> dict:
    """Every stock kind on each 3-D (replicate, shard, tp) mesh of ``HSDP_TP``."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for shape in HSDP_TP:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
        for kind in STOCK_KINDS:
            m = parallel_model(0, mesh, dp=("replicate", "shard"))
            opt = make_opt(kind, m)
            train(m, opt, 0, STEPS)
            out[shape, kind] = snapshot(m, opt)
    return out


def test_hsdp_by_tp_matches_one_process():
    """A 3-D mesh, HSDP (replicate x shard) over tensor parallelism, (2, 1, 2) and (1, 2, 2): the
    same global gradients give every state field and parameter of one process bit for bit."""
    results = run(_world_hsdp_tp, 4, timeout=300)
    want = {kind: uninterrupted(kind, STYLES, STEPS) for kind in STOCK_KINDS}
    for r in results:
        for (shape, kind), got in r.items():
            assert_same(want[kind], got, f"{kind} on (replicate, shard, tp) = {shape}")

"""torch's own checkpoint API on Gefen optimizers, unchanged: ``get_state_dict`` / ``set_state_dict``
with ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``, as training frameworks call them.

A checkpoint written on N ranks of FSDP2 resumes on M ranks (and in one process) into a *fresh*
model and optimizer, and the resumed run equals the uninterrupted one bit for bit. Gradients are
set from one generator per step (the same global gradients on every world size), so the
comparison isolates checkpointing from data-parallel summation order.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict, set_state_dict
from typer.testing import CliRunner

from gefen import Gefen, GefenMuon, GefenMuonHybrid, contract_of

from distributed import row_scaled_grads, run
from test_dcp import _fsdp_model as model_on  # the mlp, fully_shard-ed on a mesh (None: plain)
from test_dcp import assemble, assert_same, canonical_tensors, param_pieces, pieces

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEPS, MORE = 3, 2
KINDS = ("gefen", "gefen_block", "muon", "adamw", "hybrid", "hybrid_adamw")
#: the kind each world saves with dcp.async_save instead of dcp.save
ASYNC = "gefen_block"


def make_opt(kind: str, model: torch.nn.Module):
    named = list(model.named_parameters())
    if kind == "gefen":
        return Gefen(named, lr=1e-2, weight_decay=0.1)
    if kind == "gefen_block":
        return Gefen(named, lr=1e-2, factored_v_2d=False, moments="m8")
    if kind == "gefen_m8":
        return Gefen(named, lr=1e-2, weight_decay=0.1, moments="m8")
    if kind == "muon":
        return GefenMuon([(n, p) for n, p in named if p.dim() == 2], lr=1e-2, normuon=True)
    if kind == "adamw":
        return torch.optim.AdamW(named, lr=1e-2, weight_decay=0.1)
    if kind == "hybrid":  # routes by itself: the weights to Muon, biases and the norm to Gefen
        return GefenMuonHybrid(model, lr=1e-2)
    if kind == "hybrid_adamw":
        return GefenMuonHybrid(model, lr=1e-2, backup="adamw", weight_decay=0.1)
    raise ValueError(kind)


def train(model: torch.nn.Module, opt, start: int, steps: int) -> None:
    """``steps`` optimizer steps with the same global gradients on every layout."""
    from torch.distributed.tensor import distribute_tensor

    named = dict(model.named_parameters())
    for step in range(start, start + steps):
        grads = row_scaled_grads({n: tuple(p.shape) for n, p in named.items()}, step)
        for name, p in named.items():
            g = grads[name]
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else g
        opt.step()
        opt.zero_grad()


def save(model, opt, path: str, use_async: bool = False) -> None:
    msd, osd = get_state_dict(model, opt)
    if use_async:
        dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path).result()
    else:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def resume(kind: str, path: str, mesh) -> tuple[torch.nn.Module, object]:
    """A fresh model and optimizer (other initial weights, no state), filled the stock way."""
    model = model_on(1, mesh)
    opt = make_opt(kind, model)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return model, opt


def snapshot(model, opt) -> dict:
    params = dict(model.named_parameters())
    return {"state": pieces(opt, params), "params": param_pieces(params)}


def _world(rank: int, world: int, load_from: str | None, save_to: str, hsdp: bool = False) -> dict:
    """Every kind: resume ``load_from``'s checkpoint (if any) and continue; then train a new run
    from scratch and save it under ``save_to``. ``hsdp``: a (replicate, shard) = (2, world / 2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp \
        else init_device_mesh("cpu", (world,))
    out = {}
    for kind in KINDS:
        if load_from is not None:
            model, opt = resume(kind, f"{load_from}-{kind}", mesh)
            train(model, opt, STEPS, MORE)
            out[kind] = snapshot(model, opt)
        model = model_on(0, mesh)
        opt = make_opt(kind, model)
        train(model, opt, 0, STEPS)
        save(model, opt, f"{save_to}-{kind}", use_async=kind == ASYNC)
    return out


def uninterrupted(kind: str) -> dict[str, torch.Tensor]:
    model = model_on(0, None)
    opt = make_opt(kind, model)
    train(model, opt, 0, STEPS + MORE)
    return flat(model, opt)


def flat(model, opt) -> dict[str, torch.Tensor]:
    out = canonical_tensors(opt)
    out.update({f"param/{n}": p.detach().clone() for n, p in model.named_parameters()})
    return out


def assembled(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    return {**assemble([r["state"] for r in per_rank]), **assemble([r["params"] for r in per_rank])}


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_stock_api_resumes_bitwise_across_world_sizes(tmp_path):
    """1 process -> 2 ranks -> 3 ranks -> HSDP 2x2 -> 1 process, each hop through get_state_dict +
    dcp.save (async_save for one kind) and a fresh model + optimizer filled by get_state_dict +
    dcp.load + set_state_dict; every resumed run equals the uninterrupted one bit for bit."""
    want = {kind: uninterrupted(kind) for kind in KINDS}
    for kind in KINDS:  # the one-process checkpoint the 2-rank world resumes
        model = model_on(0, None)
        opt = make_opt(kind, model)
        train(model, opt, 0, STEPS)
        save(model, opt, str(tmp_path / f"w1-{kind}"))

    two = run(_world, 2, str(tmp_path / "w1"), str(tmp_path / "w2"), timeout=400)
    three = run(_world, 3, str(tmp_path / "w2"), str(tmp_path / "w3"), timeout=400)
    hsdp = run(_world, 4, str(tmp_path / "w3"), str(tmp_path / "hsdp"), True, timeout=400)
    for kind in KINDS:
        assert_same(want[kind], assembled([r[kind] for r in two]), f"{kind}: 1 -> 2 ranks")
        assert_same(want[kind], assembled([r[kind] for r in three]), f"{kind}: 2 -> 3 ranks")
        assert_same(want[kind], assembled([r[kind] for r in hsdp]), f"{kind}: 3 ranks -> HSDP 2x2")
        model, opt = resume(kind, str(tmp_path / f"hsdp-{kind}"), None)
        train(model, opt, STEPS, MORE)
        assert_same(want[kind], flat(model, opt), f"{kind}: HSDP 2x2 -> 1 process")


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_offline_tools_read_a_stock_checkpoint(tmp_path):
    """A model + optimizer checkpoint of the stock flow on 2 ranks: torch's own offline converter
    (dcp_to_torch_save) gives a file a single-process model and optimizer resume from exactly, and
    ``gefen-ckpt inspect / verify / convert / reshard`` read it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import gefen_ckpt
    from gefen_cli.app import app

    run(_world, 2, None, str(tmp_path / "w2"), timeout=200)
    for kind in ("gefen", "muon", "hybrid", "hybrid_adamw"):
        src = tmp_path / f"w2-{kind}"
        dcp_to_torch_save(src, tmp_path / f"{kind}.pt")
        saved = torch.load(tmp_path / f"{kind}.pt", weights_only=False)
        model = model_on(1, None)
        opt = make_opt(kind, model)
        set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
        want = canonical_tensors(opt)
        train(model, opt, STEPS, MORE)
        assert_same(uninterrupted(kind), flat(model, opt), f"{kind}: dcp_to_torch_save")

        cli = CliRunner()
        shown = cli.invoke(app, ["inspect", str(src), "--json"])
        assert shown.exit_code == 0, shown.output
        info = json.loads(shown.output)
        assert info["optimizer"]["implementation"] == contract_of(opt).implementation, info["optimizer"]
        assert cli.invoke(app, ["verify", str(src)]).exit_code == 0
        for command in (["reshard", str(src), str(tmp_path / f"{kind}-r3"), "--world-size", "3"],
                        ["convert", str(src), str(tmp_path / f"{kind}-portable"), "--to", "portable"]):
            result = cli.invoke(app, command)
            assert result.exit_code == 0, result.output
            fresh_model = model_on(1, None)
            fresh = make_opt(kind, fresh_model)
            gefen_ckpt.load(fresh, command[2])
            assert_same(want, canonical_tensors(fresh), f"{kind}: gefen-ckpt {command[0]}")

    # an AdamW run checkpointed the stock way starts Gefen warm (issue: conversions)
    warm = tmp_path / "adamw-into-gefen"
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "w2-adamw"), str(warm), "--into", "Gefen",
                                      "--to", "portable"])
    assert result.exit_code == 0, result.output
    gefen = make_opt("gefen", model_on(1, None))
    gefen_ckpt.load(gefen, str(warm))
    assert gefen.codebook is not None and all(int(s["step"]) == STEPS for s in gefen.state.values())


@pytest.mark.parametrize("kind", ["gefen_m8", "gefen"])
def test_stock_state_dict_is_filled_without_learning_from_zeros(kind):
    """get_state_dict initialises an empty optimizer by a step with zero gradients and lr 0: the
    state gets the checkpoint's shapes (the codebooks among it, all zero = not learned) and the
    codebooks are learned later from the first real gradients, exactly as without that step."""
    model = model_on(0, None)
    opt = make_opt(kind, model)
    _, osd = get_state_dict(model, opt)
    assert opt.codebook is None
    entry = osd["state"]["0.weight"]
    if kind == "gefen_m8":
        assert entry["m_code"].shape == (24, 16) and entry["m_scale"].shape == (24, 1)
        assert entry["codebook"].shape == (256,) and not entry["codebook"].any()
    else:  # the default layout: both codebooks, 16 entries each
        assert entry["mv_code"].shape == (24, 16) and entry["m_row_scale"].shape == (24,)
        assert entry["codebook"].shape == entry["v_codebook"].shape == (16,)
        assert not entry["codebook"].any() and not entry["v_codebook"].any() and opt.v_codebook is None
    # every moment is zero (m4v4's codes of a zero row are stochastic 0-neighbours: scale 0 decodes them to 0)
    assert not any(v.any() for e in osd["state"].values() for k, v in e.items() if k not in ("step", "period", "mv_code"))
    train(model, opt, 0, 1)

    plain = model_on(0, None)
    plain_opt = make_opt(kind, plain)
    train(plain, plain_opt, 0, 1)
    assert torch.equal(opt.codebook, plain_opt.codebook)
    # learned from real gradients, not collapsed by zeros
    assert len(opt.codebook.unique()) > (100 if kind == "gefen_m8" else 12)
    if kind == "gefen":
        assert torch.equal(opt.v_codebook, plain_opt.v_codebook) and len(opt.v_codebook.unique()) > 12


def test_a_state_dict_whose_parameters_disagree_about_the_codebook_is_refused():
    model = model_on(0, None)
    opt = make_opt("gefen", model)
    train(model, opt, 0, 2)
    _, osd = get_state_dict(model, opt)
    osd["state"]["2.weight"]["codebook"] = osd["state"]["2.weight"]["codebook"].flip(0).neg()
    before = flat(model, opt)
    with pytest.raises(ValueError, match="'2.weight'.*differs"):
        set_optimizer_state_dict(model, opt, osd)
    assert_same(before, flat(model, opt), "after the refused load")

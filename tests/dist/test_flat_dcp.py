"""torch's flattened optimizer state dicts (``StateDictOptions(flatten_optimizer_state_dict=True)``,
the layout torchtitan writes) with Gefen optimizers, through the frameworks' own code.

torch's ``_unflatten_optim_state_dict`` (and torchtitan's copy of it) rebuild the state_dict from
the keys of the *live* ``optimizer.state[p]`` and ``param_groups``, so every key ``state_dict()``
emits must be live: the codebooks in every parameter's state, the hybrid's ``child`` in its groups.
A checkpoint written on 2 FSDP2 ranks resumes on 2, 3 and 1 ranks into a fresh model and optimizer
bit for bit (AdamW is the control), and ``gefen-ckpt`` reads, converts and reshards it in the same
layout, which the same API loads back.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from typer.testing import CliRunner

from gefen import GefenMuonHybrid

from distributed import run
from test_dcp import _fsdp_model as model_on
from test_dcp import assert_same
from test_stock_dcp import MORE, STEPS, assembled, flat, snapshot, train, uninterrupted
from test_stock_dcp import make_opt as stock_opt

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
KEY = "optimizer"  # torchtitan's key
KINDS = ("adamw", "gefen", "muon", "hybrid", "hybrid_adamw", "hybrid_groups")


def make_opt(kind: str, model: torch.nn.Module):
    if kind == "hybrid_groups":  # HF-style weight-decay groups, named: routed by name and shape
        named = list(model.named_parameters())
        decay = [(n, p) for n, p in named if p.dim() == 2]
        return GefenMuonHybrid([{"params": [p for _, p in decay], "param_names": [n for n, _ in decay],
                                 "weight_decay": 0.1},
                                {"params": [(n, p) for n, p in named if p.dim() != 2], "weight_decay": 0.0}],
                               lr=1e-2)
    return stock_opt(kind, model)


def save_flat(model, opt, path: str) -> None:
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.save({"model": msd, KEY: osd}, checkpoint_id=path)


def resume_flat(kind: str, path: str, mesh):
    """A fresh model and optimizer (other initial weights, no state), filled through the flat API."""
    model = model_on(1, mesh)
    opt = make_opt(kind, model)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    dcp.load({"model": msd, KEY: osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=FLAT)
    return model, opt


def _save_and_resume(rank: int, world: int, root: str) -> dict:
    """Train every kind on ``world`` ranks and save it flat; then resume each into a fresh model
    and optimizer on the same ranks and continue."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind in KINDS:
        model = model_on(0, mesh)
        opt = make_opt(kind, model)
        train(model, opt, 0, STEPS)
        save_flat(model, opt, f"{root}/w{world}-{kind}")
    for kind in KINDS:
        model, opt = resume_flat(kind, f"{root}/w{world}-{kind}", mesh)
        train(model, opt, STEPS, MORE)
        out[kind] = snapshot(model, opt)
    return out


def _resume(rank: int, world: int, paths: dict[str, str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, (kind, path) in paths.items():
        model, opt = resume_flat(kind, path, mesh)
        loaded = snapshot(model, opt)
        train(model, opt, STEPS, MORE)
        out[name] = {"loaded": loaded, "continued": snapshot(model, opt)}
    return out


@pytest.fixture(scope="module")
def flat_checkpoints(tmp_path_factory):
    """Every kind saved flat on 2 FSDP2 ranks, and what resuming each on 2 ranks gave."""
    root = tmp_path_factory.mktemp("flat")
    two = run(_save_and_resume, 2, str(root), timeout=500)
    return root, two


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_flattened_state_dicts_resume_bitwise_on_2_3_and_1_ranks(flat_checkpoints):
    root, two = flat_checkpoints
    paths = {kind: (kind, str(root / f"w2-{kind}")) for kind in KINDS}
    three = run(_resume, 3, paths, timeout=500)
    one = run(_resume, 1, paths, timeout=300)
    for kind in KINDS:
        want = uninterrupted(kind) if kind != "hybrid_groups" else _uninterrupted_groups()
        assert_same(want, assembled([r[kind] for r in two]), f"{kind}: 2 -> 2 ranks")
        assert_same(want, assembled([r[kind]["continued"] for r in three]), f"{kind}: 2 -> 3 ranks")
        assert_same(want, assembled([r[kind]["continued"] for r in one]), f"{kind}: 2 -> 1 rank")


def _uninterrupted_groups() -> dict:
    model = model_on(0, None)
    opt = make_opt("hybrid_groups", model)
    train(model, opt, 0, STEPS + MORE)
    return flat(model, opt)


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_offline_tools_read_and_write_the_flattened_layout(flat_checkpoints, tmp_path):
    """``gefen-ckpt`` on the 2-rank flat checkpoints: inspect, verify and diff read them; ``convert
    --into Gefen`` of the AdamW one and ``reshard -n 3 --to dcp`` of each Gefen kind write the same
    layout (with the model), which torch's flat API loads on 3 ranks: the resharded state equals the
    source's bit for bit and its run continues as the uninterrupted one; the converted state equals
    what ``convert`` reported."""
    from gefen_ckpt.dcp import read_dcp
    from gefen_cli.app import app

    root, _ = flat_checkpoints
    cli = CliRunner()
    implementations = {"adamw": "torch.optim.AdamW", "gefen": "gefen.Gefen", "muon": "gefen.GefenMuon",
                       "hybrid": "gefen.GefenMuonHybrid", "hybrid_adamw": "gefen.GefenMuonHybrid",
                       "hybrid_groups": "gefen.GefenMuonHybrid"}
    paths = {}
    for kind in KINDS:
        src = str(root / f"w2-{kind}")
        shown = cli.invoke(app, ["inspect", src, "--json"])
        assert shown.exit_code == 0, shown.output
        info = json.loads(shown.output)
        assert info["optimizer"]["implementation"] == implementations[kind], info["optimizer"]
        assert {p["fqn"] for p in info["params"]} == {n for n, p in model_on(0, None).named_parameters()
                                                      if kind != "muon" or p.dim() == 2}
        checked = cli.invoke(app, ["verify", src, "--key", KEY])
        assert checked.exit_code == 0, checked.output
        same = cli.invoke(app, ["diff", src, src])
        assert same.exit_code == 0, same.output
        if kind != "adamw":
            dst = str(tmp_path / f"{kind}-r3")
            result = cli.invoke(app, ["reshard", src, dst, "--world-size", "3", "--to", "dcp"])
            assert result.exit_code == 0, result.output
            again = cli.invoke(app, ["diff", src, dst])
            assert again.exit_code == 0, again.output
            paths[f"{kind}-r3"] = (kind, dst)
    warm = str(tmp_path / "adamw-into-gefen")
    result = cli.invoke(app, ["convert", str(root / "w2-adamw"), warm, "--into", "Gefen", "--to", "dcp"])
    assert result.exit_code == 0, result.output
    assert read_dcp(warm).contract.implementation == "gefen.Gefen"
    paths["warm"] = ("gefen", warm)
    differs = cli.invoke(app, ["diff", str(root / "w2-adamw"), warm])
    assert differs.exit_code == 1, differs.output

    three = run(_resume, 3, paths, timeout=500)
    for name, (kind, path) in paths.items():
        loaded = assembled([r[name]["loaded"] for r in three])
        stored = {f"{fqn}/{k}": s.read() for fqn, e in read_dcp(path).params.items() for k, s in e.fields.items()}
        stored.update({f"__global__/{k}": s.read() for k, s in read_dcp(path).global_fields.items()})
        assert_same(stored, {k: v for k, v in loaded.items() if not k.startswith("param/")}, f"{name}: as stored")
        if name != "warm":
            assert_same(uninterrupted(kind) if kind != "hybrid_groups" else _uninterrupted_groups(),
                        assembled([r[name]["continued"] for r in three]), f"{name}: continued on 3 ranks")


def test_several_optimizers_in_one_checkpoint_are_named_and_picked_with_key(tmp_path):
    """Two flattened optimizers under two keys: the tools say which keys and take ``--key``."""
    from gefen_cli.app import app

    model = model_on(0, None)
    gefen, adamw = make_opt("gefen", model), make_opt("adamw", model)
    train(model, gefen, 0, 1)
    train(model, adamw, 0, 1)
    dcp.save({"model": model.state_dict(), "opt_a": get_optimizer_state_dict(model, gefen, options=FLAT),
              "opt_b": get_optimizer_state_dict(model, adamw, options=FLAT)}, checkpoint_id=tmp_path)
    cli = CliRunner()
    refused = cli.invoke(app, ["inspect", str(tmp_path)])
    assert refused.exit_code == 1 and "'opt_a'" in refused.output and "'opt_b'" in refused.output, refused.output
    assert "--key" in refused.output
    for key, impl in (("opt_a", "gefen.Gefen"), ("opt_b", "torch.optim.AdamW")):
        shown = cli.invoke(app, ["inspect", str(tmp_path), "--key", key, "--json"])
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.output)["optimizer"]["implementation"] == impl


def test_a_flat_state_dict_whose_parameters_disagree_about_the_codebook_is_refused():
    model = model_on(0, None)
    opt = make_opt("gefen", model)
    train(model, opt, 0, 2)
    osd = get_optimizer_state_dict(model, opt, options=FLAT)
    osd = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in osd.items()}
    osd["state.2.weight.codebook"] = osd["state.2.weight.codebook"].flip(0).neg()
    before = flat(model, opt)
    with pytest.raises(ValueError, match="'2.weight'.*differs"):
        set_optimizer_state_dict(model, opt, osd, options=FLAT)
    assert_same(before, flat(model, opt), "after the refused load")


# ----- torchtitan's own checkpointing (runs where torchtitan is installed) ----------------------
# Not in the test extra: torchtitan 0.3.0 needs datasets<4.8, which caps fsspec at 2026.2.0 below
# the s3fs the test extra resolves (pip backtracks through s3fs releases), and brings ~40 packages
# (pyarrow, pandas, wandb, tensorboard). `pip install torchtitan==0.3.0` beside torch 2.13 runs it.
TITAN = ("adamw", "gefen", "muon", "hybrid")


def _titan_container(kind: str, model: torch.nn.Module):
    """torchtitan's ``OptimizersContainer`` as a user adds Gefen to it: the factory knows our
    optimizers and passes no fused/foreach flags. Groups come from regex patterns, with
    ``param_names``; GefenMuon takes the matrices and AdamW the rest, as torchtitan mixes types."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    from gefen import Gefen, GefenMuon

    class Container(OptimizersContainer):
        @staticmethod
        def _resolve_optimizer_factory(name: str):
            return {"AdamW": torch.optim.AdamW, "Gefen": Gefen, "GefenMuon": GefenMuon,
                    "GefenMuonHybrid": GefenMuonHybrid}[name]

        @staticmethod
        def _build_impl_kwargs(config) -> dict:
            return {}

    def group(pattern: str, name: str, **kwargs) -> ParamGroupConfig:
        return ParamGroupConfig(pattern=pattern, optimizer_name=name, optimizer_kwargs={"lr": 1e-2, **kwargs})

    groups = {"adamw": [group(".*", "AdamW", weight_decay=0.1)],
              "gefen": [group(".*", "Gefen", weight_decay=0.1)],
              "muon": [group(r"^[024]\.weight$", "GefenMuon", normuon=True), group(".*", "AdamW")],
              "hybrid": [group(r"\.bias$", "GefenMuonHybrid", weight_decay=0.0),
                         group(".*", "GefenMuonHybrid", weight_decay=0.1)]}[kind]
    # "hybrid": torchtitan hands both groups to one GefenMuonHybrid (it batches groups by optimizer name)
    return Container(Container.Config(param_groups=groups), model_parts=[model])


def _titan_manager(folder: str, model, container):
    from torchtitan.components.checkpoint import CheckpointManager

    config = CheckpointManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0,
                                      last_save_model_only=False)
    return CheckpointManager(config, dataloader=None, model_parts=[model], optimizers=container,
                             lr_schedulers=None, states={}, sd_adapter=None)


def _titan_world(rank: int, world: int, root: str, save: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind in TITAN:
        if save:
            model = model_on(0, mesh)
            container = _titan_container(kind, model)
            train(model, container, 0, STEPS)
            manager = _titan_manager(f"{root}/{kind}", model, container)
            assert manager.save(curr_step=STEPS)
            manager.close()
        model = model_on(1, mesh)
        container = _titan_container(kind, model)
        manager = _titan_manager(f"{root}/{kind}", model, container)
        assert manager.load(step=STEPS)
        manager.close()
        train(model, container, STEPS, MORE)
        out[kind] = {"params": snapshot_params(model)}
    return out


def snapshot_params(model) -> dict:
    from test_dcp import param_pieces

    return dict(param_pieces(dict(model.named_parameters())))


def _titan_uninterrupted(kind: str) -> dict:
    model = model_on(0, None)
    container = _titan_container(kind, model)
    train(model, container, 0, STEPS + MORE)
    return {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_torchtitan_checkpoint_manager_resumes_bitwise_on_2_3_and_1_ranks(tmp_path):
    """torchtitan's ``OptimizersContainer`` + ``CheckpointManager.save/load``, as a torchtitan
    trainer calls them, on 2 FSDP2 ranks; resumed on 2, 3 and 1 ranks into fresh models and
    optimizers, every run's parameters equal the uninterrupted run's bit for bit; and gefen-ckpt
    reads what torchtitan wrote."""
    pytest.importorskip("torchtitan", reason="torchtitan is not installed")
    from gefen_cli.app import app

    from test_dcp import assemble

    two = run(_titan_world, 2, str(tmp_path), True, timeout=500)
    three = run(_titan_world, 3, str(tmp_path), False, timeout=500)
    one = run(_titan_world, 1, str(tmp_path), False, timeout=300)
    for kind in TITAN:
        want = _titan_uninterrupted(kind)
        for world, results in ((2, two), (3, three), (1, one)):
            assert_same(want, assemble([r[kind]["params"] for r in results]), f"torchtitan {kind}: 2 -> {world}")
        src = str(tmp_path / kind / f"step-{STEPS}")
        shown = CliRunner().invoke(app, ["inspect", src, "--json"])
        if kind == "muon":  # two optimizers of different types flattened under one key: not one optimizer's state
            assert shown.exit_code == 1 and "cannot tell which optimizer" in shown.output, shown.output
            continue
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.output)["optimizer"]["implementation"] == {
            "adamw": "torch.optim.AdamW", "gefen": "gefen.Gefen", "hybrid": "gefen.GefenMuonHybrid"}[kind]


def test_groups_without_param_names_are_rebuilt_from_equal_hyperparameters(tmp_path):
    """An optimizer built from bare tensors saves no ``param_names`` (torchtitan drops them too):
    the tools rebuild its two weight-decay groups from equal hyperparameters, and what ``reshard
    --to dcp`` writes loads back through the flat API bit for bit, model included."""
    from gefen import Gefen
    from gefen_ckpt.dcp import read_dcp
    from gefen_cli.app import app

    model = model_on(0, None)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() != 2]
    opt = Gefen([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}], lr=1e-2)
    train(model, opt, 0, STEPS)
    save_flat(model, opt, str(tmp_path / "src"))
    groups = read_dcp(tmp_path / "src").param_groups
    names = dict((id(p), n) for n, p in model.named_parameters())
    assert [(g["weight_decay"], sorted(g["params"])) for g in groups] == \
        [(0.1, sorted(names[id(p)] for p in matrices)), (0.0, sorted(names[id(p)] for p in vectors))]
    result = CliRunner().invoke(app, ["reshard", str(tmp_path / "src"), str(tmp_path / "r2"), "-n", "2",
                                      "--to", "dcp"])
    assert result.exit_code == 0, result.output

    fresh_model = model_on(1, None)
    fresh = Gefen([{"params": [p for p in fresh_model.parameters() if p.dim() == 2], "weight_decay": 0.1},
                   {"params": [p for p in fresh_model.parameters() if p.dim() != 2], "weight_decay": 0.0}], lr=1e-2)
    msd, osd = get_state_dict(fresh_model, fresh, options=FLAT)
    dcp.load({"model": msd, KEY: osd}, checkpoint_id=str(tmp_path / "r2"))
    set_state_dict(fresh_model, fresh, model_state_dict=msd, optim_state_dict=osd, options=FLAT)
    from test_dcp import canonical_tensors_of

    def both(m, o):
        return {**canonical_tensors_of(o, m), **{f"param/{n}": p.detach() for n, p in m.named_parameters()}}

    assert_same(both(model, opt), both(fresh_model, fresh), "resharded without param_names")

"""One order of state fields on every rank, whatever each rank's string-hash seed.

torch's full-state-dict paths (``get_optimizer_state_dict(full_state_dict=True)``, with or
without ``cpu_offload``, and ``set_optimizer_state_dict(broadcast_from_rank0=True)``) walk each
parameter's state in its dict order and issue one collective per tensor: ranks that list the
fields in different orders mismatch their collectives (gloo aborts; NCCL hangs or swaps two
fields of one size). The ranks here run with different ``PYTHONHASHSEED`` values, so anything
ordered by a set of field names differs between them.
"""

from __future__ import annotations

import pytest
import torch

from gefen import Gefen, GefenMuon

from distributed import row_scaled_grads, run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: per rank: seeds under which sets of these field names iterate in different orders (checked below)
HASH_SEEDS = ("1", "2")
FIELDS = ("step", "mv_code", "m_row_scale", "v_row", "v_col", "exp_avg", "exp_avg_sq", "period", "m_code", "m_scale")


def _model(seed: int, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 6))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _optimizer(kind: str, model: torch.nn.Module):
    named = list(model.named_parameters())
    if kind == "muon":
        return GefenMuon([(n, p) for n, p in named if p.dim() == 2], lr=1e-2, normuon=True)
    return Gefen(named, lr=1e-2, weight_decay=0.1)


def _train(model, opt, start: int, steps: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    named = dict(model.named_parameters())
    for step in range(start, start + steps):
        grads = row_scaled_grads({n: tuple(p.shape) for n, p in named.items()}, step)
        for name, p in named.items():
            p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements)
        opt.step()
        opt.zero_grad()


def _orders(opt) -> list[list[str]]:
    return [list(entry) for entry in opt.state.values()]


def _differences(a: dict, b: dict) -> list[str]:
    """The keys of two full optimizer state_dicts whose per-parameter tensors differ."""
    bad = [fqn for fqn in a["state"].keys() ^ b["state"].keys()] + ([] if a["state"] else ["(no state)"])
    for fqn in a["state"].keys() & b["state"].keys():
        x, y = a["state"][fqn], b["state"][fqn]
        if list(x) != list(y) or any(not torch.equal(x[k].cpu(), y[k].cpu()) for k in x):
            bad.append(fqn)
    return sorted(bad)


def _resume_gather_broadcast(rank: int, world: int) -> dict:
    """FSDP2 and HSDP (replicate x shard = 2 x 1): train, resume a fresh optimizer through
    ``set_optimizer_state_dict``, gather full state dicts (with and without cpu_offload), load one
    back with ``broadcast_from_rank0``, and train on: orders, full states and parameters reported."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    full, offload = StateDictOptions(full_state_dict=True), StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {"set_order": list(set(FIELDS))}
    meshes = {"fsdp2": init_device_mesh("cpu", (world,)),
              "hsdp": init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))}
    for layout, mesh in meshes.items():
        for kind in ("gefen", "muon") if layout == "fsdp2" else ("gefen",):
            model = _model(0, mesh)
            opt = _optimizer(kind, model)
            _train(model, opt, 0, 2)
            fresh, reference = _orders(opt), get_optimizer_state_dict(model, opt, options=full)
            model2 = _model(1, mesh)
            with torch.no_grad():
                for p2, p in zip(model2.parameters(), model.parameters()):
                    p2.copy_(p)
            opt2 = _optimizer(kind, model2)
            set_optimizer_state_dict(model2, opt2, get_optimizer_state_dict(model, opt))
            resumed = _orders(opt2)
            gathered = get_optimizer_state_dict(model2, opt2, options=full)
            offloaded = get_optimizer_state_dict(model2, opt2, options=offload)  # rank 0 only
            set_optimizer_state_dict(model2, opt2, offloaded if rank == 0 else {},
                                     options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
            broadcast = _orders(opt2)
            # before training on: a full state_dict shares the live tensors of unsharded fields
            case = {"fresh": fresh, "resumed": resumed, "broadcast": broadcast,
                    "gathered": _differences(reference, gathered),
                    "offloaded": _differences(reference, offloaded) if rank == 0 else []}
            _train(model, opt, 2, 1)
            _train(model2, opt2, 2, 1)
            case["params"] = [n for (n, p), p2 in zip(model.named_parameters(), model2.parameters())
                              if not torch.equal(p.to_local(), p2.to_local())]
            out[f"{layout}-{kind}"] = case
    return out


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_ranks_with_different_hash_seeds_agree_on_every_full_state_dict_path():
    ranks = run(_resume_gather_broadcast, 2, timeout=240,
                rank_env=[{"PYTHONHASHSEED": seed} for seed in HASH_SEEDS])
    assert ranks[0]["set_order"] != ranks[1]["set_order"]  # the seeds do order sets differently
    cases = [key for key in ranks[0] if key != "set_order"]
    assert cases == ["fsdp2-gefen", "fsdp2-muon", "hsdp-gefen"]
    for case in cases:
        fresh = ranks[0][case]["fresh"]
        assert fresh and all(order[0] == "step" for order in fresh), case
        for rank in ranks:
            got = rank[case]
            assert got["fresh"] == got["resumed"] == got["broadcast"] == fresh, case
            assert got["gathered"] == [] and got["offloaded"] == [], (case, got["gathered"], got["offloaded"])
            assert got["params"] == [], (case, got["params"])

"""gefen_ckpt.dcp: stock dcp.save / dcp.async_save / dcp.load reshard compressed state bit-exactly.

Single-process tests run in this process; distributed ones spawn real gloo worlds (DTensor
``Shard(0)`` parameters on a 1-D mesh, FSDP2 ``fully_shard`` models, HSDP 2x2 under ``slow``).
Each spawned world runs a list of tasks, because spawning costs more than the work.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from gefen import Gefen, GefenMuon, GefenMuonHybrid, contract_of
from gefen_ckpt import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    EagerSource,
    export_canonical,
)
from gefen_ckpt.dcp import GefenDCPState, GefenLoadPlanner, GefenSavePlanner, read_dcp, write_dcp
from gefen_ckpt.dist.placement import local_rows
from gefen_ckpt.state.canonical import LocalPart

from distributed import row_scaled_grads, run

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# uneven rows (7 on 2/3/4 ranks), an empty shard (3 rows on 4 ranks), 1-D, 3-D
SHAPES = {"emb": (24, 16), "proj": (7, 32), "tiny": (3, 8), "norm": (16,), "conv": (8, 4, 3)}
STEPS = 3
MORE = 2
KINDS = ("gefen", "gefen_block", "adamw", "hybrid")
#: kinds whose trajectory does not depend on the world size (so a continued run is comparable)
CONTINUABLE = ("gefen", "gefen_block", "adamw")
#: kinds whose N-rank checkpoints here are re-saved one-process state (their trajectory on sharded
#: parameters is tested in test_dist_optim and test_tp)
NO_SHARDED_STEP = ("hybrid",)


# ----- shared helpers (run in the test process and in spawned ranks) --------------------------
def make_opt(kind: str, named):
    named = list(named)
    if kind == "gefen":
        return Gefen(named, lr=1e-2, weight_decay=0.1)
    if kind == "gefen_block":
        return Gefen(named, lr=1e-2, factored_v_2d=False, moments="m8")
    if kind == "adamw":
        return torch.optim.AdamW(named, lr=1e-2, weight_decay=0.1)
    if kind == "hybrid":
        return GefenMuonHybrid(named, lr=1e-2)
    if kind == "muon":
        return GefenMuon(named, lr=1e-2)
    raise ValueError(kind)


def global_grads(step: int) -> dict[str, torch.Tensor]:
    return row_scaled_grads(SHAPES, step)


def initial_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def train(params: dict, opt, steps: int, start: int, to_grad=lambda g: g) -> None:
    for step in range(start, start + steps):
        for name, grad in global_grads(step).items():
            params[name].grad = to_grad(grad)
        opt.step()


def pieces(opt, params: dict[str, torch.Tensor]) -> dict[str, tuple[bool, int, torch.Tensor]]:
    """This rank's part of the exported canonical state: key -> (row-sharded, first row, tensor).

    Under a process group ``export_canonical`` gives each rank its rows (``LocalPart``)."""
    contract = contract_of(opt)
    state = export_canonical(opt)
    out = {}
    for fqn, entry in state.params.items():
        leaf = contract.child(entry.child) if entry.child else contract
        p = params[fqn]
        start, _ = local_rows(p)
        for name, src in entry.fields.items():
            sharded = leaf.field(name).row_sharded and len(src.shape) > 0
            t = src.tensor if isinstance(src, (LocalPart, EagerSource)) else src.read()
            if hasattr(t, "to_local"):
                t = t.to_local()  # torch optimizers keep DTensor state for DTensor parameters
            out[f"{fqn}/{name}"] = (sharded, start, t.detach().clone())
    for key, src in state.global_fields.items():
        out["__global__/" + key] = (False, 0, src.read().detach().clone())
    return out


def param_pieces(params: dict[str, torch.Tensor]) -> dict[str, tuple[bool, int, torch.Tensor]]:
    out = {}
    for name, p in params.items():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[f"param/{name}"] = (local.dim() > 0, local_rows(p)[0], local.detach().clone())
    return out


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Global tensors from every rank's pieces (replicas deduplicated, replicated fields checked)."""
    keys = set(per_rank[0])
    assert all(set(r) == keys for r in per_rank), "ranks disagree on which fields exist"
    out = {}
    for key in sorted(keys):
        sharded = per_rank[0][key][0]
        if not sharded:
            value = per_rank[0][key][2]
            for r in per_rank[1:]:
                assert torch.equal(r[key][2], value), f"{key}: replicated value differs between ranks"
            out[key] = value
            continue
        parts = {}
        for r in per_rank:
            _, start, t = r[key]
            if t.shape[0]:
                if (start, t.shape[0]) in parts:
                    assert torch.equal(parts[(start, t.shape[0])], t), f"{key}: replicas differ"
                parts[(start, t.shape[0])] = t
        ordered = sorted(parts.items())
        row = 0
        for (start, n), _ in ordered:
            assert start == row, f"{key}: rows {row}..{start} missing"
            row += n
        out[key] = torch.cat([t for _, t in ordered])
    return out


def canonical_tensors(opt) -> dict[str, torch.Tensor]:
    """Single process: export_canonical as {key: tensor}."""
    state = export_canonical(opt)
    out = {f"{fqn}/{k}": s.read().clone() for fqn, e in state.params.items() for k, s in e.fields.items()}
    out.update({"__global__/" + k: s.read().clone() for k, s in state.global_fields.items()})
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str = "") -> None:
    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:6]}"
    for key in a:
        assert a[key].dtype == b[key].dtype, f"{what} {key}: {a[key].dtype} vs {b[key].dtype}"
        assert a[key].shape == b[key].shape, f"{what} {key}: {tuple(a[key].shape)} vs {tuple(b[key].shape)}"
        assert torch.equal(a[key], b[key]), f"{what} {key}: values differ"


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 7),
                               torch.nn.LayerNorm(7), torch.nn.Linear(7, 3))


def mlp_step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(8, 16, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def mlp_params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


# ----- what one process (or one rank) does for a task -------------------------------------------
def _mesh(world: int, layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    if layout == "ddp":  # plain replicated parameters under a process group
        return None, None
    if layout == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")), [Replicate(), Shard(0)]
    return init_device_mesh("cpu", (world,)), [Shard(0)]


def _dtensor_params(seed: int, mesh, placements) -> tuple[dict, callable]:
    from torch.distributed.tensor import distribute_tensor

    if mesh is None:
        return {n: torch.nn.Parameter(t) for n, t in initial_params(seed).items()}, (lambda g: g)
    params = {n: torch.nn.Parameter(distribute_tensor(t, mesh, placements)) for n, t in initial_params(seed).items()}
    return params, (lambda g: distribute_tensor(g, mesh, placements))


def _fsdp_model(seed: int, mesh):
    model = mlp(seed)
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def do_task(task: dict, mesh=None, placements=None) -> dict:
    """save: train and save; load: fresh optimizer, dcp.load, (continue). Returns pieces."""
    kind, op, path = task["kind"], task["op"], task["path"]
    if kind == "fsdp":
        model = _fsdp_model(0 if op == "save" else 1, mesh)
        opt = Gefen(model.named_parameters(), lr=1e-2, weight_decay=0.1)
        params = mlp_params(model)
        if op == "save":
            for step in range(STEPS):
                mlp_step(model, opt, step)
            dcp.save({"model": model.state_dict(), "optim": GefenDCPState(opt)}, checkpoint_id=path,
                     planner=GefenSavePlanner())
            return {"state": pieces(opt, params), "params": param_pieces(params)}
        msd = model.state_dict()
        dcp.load({"model": msd, "optim": GefenDCPState(opt)}, checkpoint_id=path, planner=GefenLoadPlanner())
        model.load_state_dict(msd)
        out = {"state": pieces(opt, params), "params": param_pieces(params)}
        mlp_step(model, opt, STEPS)  # the loaded state trains
        return out

    params, to_grad = _dtensor_params(0 if op == "save" else 1, mesh, placements)
    opt = make_opt(kind, params.items())
    if op == "save":
        if task.get("from"):  # state made in one process (this kind cannot step sharded yet)
            dcp.load({"params": params, "optim": GefenDCPState(opt)}, checkpoint_id=task["from"],
                     planner=GefenLoadPlanner())
        else:
            train(params, opt, STEPS, 0, to_grad)
        sd = {"params": params, "optim": GefenDCPState(opt)}
        if task.get("async"):
            dcp.async_save(sd, checkpoint_id=path, planner=GefenSavePlanner()).result()
        else:
            dcp.save(sd, checkpoint_id=path, planner=GefenSavePlanner())
        return {"state": pieces(opt, params), "params": param_pieces(params)}
    dcp.load({"params": params, "optim": GefenDCPState(opt)}, checkpoint_id=path, planner=GefenLoadPlanner())
    out = {"state": pieces(opt, params), "params": param_pieces(params)}
    if task.get("continue"):
        train(params, opt, MORE, STEPS, to_grad)
        out["continued"] = {**pieces(opt, params), **param_pieces(params)}
    return out


def _worker(rank: int, world: int, tasks: list[dict]) -> list:
    import faulthandler

    faulthandler.enable()
    results = []
    meshes = {}
    for task in tasks:
        layout = task.get("layout", "fsdp")
        if layout not in meshes:
            meshes[layout] = _mesh(world, layout)
        mesh, placements = meshes[layout]
        if task["op"] == "mismatch":
            results.append(_mismatch_task(rank, task, mesh, placements))
        elif task["op"] == "agree":
            results.append(_agree_task(rank, task, mesh, placements))
        else:
            results.append(do_task(task, mesh, placements))
    return results


def _mismatch_task(rank: int, task: dict, mesh, placements) -> dict:
    """A Gefen checkpoint loaded into AdamW: every rank raises before anything is read."""
    params, _ = _dtensor_params(1, mesh, placements)
    opt = make_opt("adamw", params.items())
    before = param_pieces(params)
    try:
        dcp.load({"params": params, "optim": GefenDCPState(opt)}, checkpoint_id=task["path"],
                 planner=GefenLoadPlanner())
    except CheckpointException as exc:
        inner = {r: type(e).__name__ + ": " + str(e) for r, (e, _) in exc.failures.items()}
        untouched = all(torch.equal(before[k][2], v[2]) for k, v in param_pieces(params).items())
        return {"raised": inner, "untouched": untouched and not opt.state}
    return {"raised": None}


def _agree_task(rank: int, task: dict, mesh, placements) -> dict:
    """Rank 1 fails while staging: every rank raises and no optimizer changes."""
    params, _ = _dtensor_params(1, mesh, placements)
    opt = make_opt("gefen", params.items())
    if rank == 1:
        def refuse(sd, **options):
            raise ValueError("injected staging failure")
        opt.prepare_load_state_dict = refuse
    try:
        dcp.load({"optim": GefenDCPState(opt)}, checkpoint_id=task["path"], planner=GefenLoadPlanner())
    except CheckpointError as exc:
        return {"raised": type(exc).__name__ + ": " + str(exc), "untouched": not opt.state and opt.codebook is None}
    return {"raised": None}


# ----- single-process building blocks of the distributed tests ----------------------------------
def single(task: dict) -> dict:
    out = do_task(task)
    return {"state": {k: v[2] for k, v in out["state"].items()},
            "params": {k: v[2] for k, v in out["params"].items()},
            **({"continued": {k: v[2] for k, v in out["continued"].items()}} if "continued" in out else {})}


def continued_reference(kind: str, path: str) -> dict[str, torch.Tensor]:
    """Load ``path`` in one process and train MORE steps: what every world size must reproduce."""
    return single({"kind": kind, "op": "load", "path": path, "continue": True})["continued"]


def check_loaded(source: dict, loaded: dict, where: str) -> None:
    assert_same(source["state"], loaded["state"], f"optimizer state {where}")
    assert_same(source["params"], loaded["params"], f"parameters {where}")


def check_read_dcp(source_state: dict[str, torch.Tensor], path: str) -> None:
    state = read_dcp(path)
    got = {f"{fqn}/{k}": s.read() for fqn, e in state.params.items() for k, s in e.fields.items()}
    got.update({"__global__/" + k: s.read() for k, s in state.global_fields.items()})
    assert_same(source_state, got, f"read_dcp({os.path.basename(path)})")


def assembled(results: list, index: int) -> dict:
    per = [r[index] for r in results]
    out = {"state": assemble([p["state"] for p in per]), "params": assemble([p["params"] for p in per])}
    if "continued" in per[0]:
        out["continued"] = assemble([p["continued"] for p in per])
    return out


ALL_KINDS = KINDS + ("fsdp",)


def _save_tasks(root, world: int, kinds=ALL_KINDS, layout: str = "fsdp", async_kind: str | None = None) -> list[dict]:
    return [{"kind": k, "op": "save", "path": str(root / f"{layout}{world}-{k}"), "layout": layout,
             "async": k == async_kind, "from": str(root / f"fsdp1-{k}") if k in NO_SHARDED_STEP and world > 1 else None}
            for k in kinds]


def _load_tasks(root, src: str, kinds=ALL_KINDS, layout: str = "fsdp") -> list[dict]:
    return [{"kind": k, "op": "load", "path": str(root / f"{src}-{k}"), "layout": layout,
             "continue": k in CONTINUABLE} for k in kinds]


# ----- single process ---------------------------------------------------------------------------
def _model_for(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "muon":
        return torch.nn.Sequential(torch.nn.Linear(12, 16, bias=False), torch.nn.GELU(),
                                   torch.nn.Linear(16, 4, bias=False))
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def _step(model, opt, i: int) -> None:
    g = torch.Generator().manual_seed(2000 + i)
    model(torch.randn(32, 12, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("kind", ["gefen", "gefen_block", "adamw", "muon", "hybrid"])
def test_save_load_fresh_then_continue_is_bitwise_uninterrupted(kind, tmp_path):
    """model + optimizer in one dcp.save; load into a fresh model and optimizer; 5 more steps."""
    model = _model_for(kind)
    opt = make_opt(kind, model.named_parameters())
    for i in range(3):
        _step(model, opt, i)
    dcp.save({"model": model.state_dict(), "optim": GefenDCPState(opt)}, checkpoint_id=tmp_path,
             planner=GefenSavePlanner())
    for i in range(3, 8):
        _step(model, opt, i)

    fresh = _model_for(kind)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh_opt = make_opt(kind, fresh.named_parameters())
    msd = fresh.state_dict()
    dcp.load({"model": msd, "optim": GefenDCPState(fresh_opt)}, checkpoint_id=tmp_path, planner=GefenLoadPlanner())
    fresh.load_state_dict(msd)
    for i in range(3, 8):
        _step(fresh, fresh_opt, i)
    assert_same(canonical_tensors(opt), canonical_tensors(fresh_opt), kind)
    assert_same(dict(model.state_dict()), dict(fresh.state_dict()), "model")


def _trained(kind: str = "gefen", steps: int = 3):
    model = _model_for(kind)
    opt = make_opt(kind, model.named_parameters())
    for i in range(steps):
        _step(model, opt, i)
    return model, opt


def test_compressed_on_disk_and_read_dcp_equals_export(tmp_path):
    model, opt = _trained()
    dcp.save({"optim": GefenDCPState(opt)}, checkpoint_id=tmp_path, planner=GefenSavePlanner())
    state = read_dcp(tmp_path)
    assert state.contract == contract_of(opt)
    assert state.metadata["source_topology"] == {"world_size": 1}
    ref = canonical_tensors(opt)
    got = {f"{fqn}/{k}": s.read() for fqn, e in state.params.items() for k, s in e.fields.items()}
    got.update({"__global__/" + k: s.read() for k, s in state.global_fields.items()})
    assert_same(ref, got, "read_dcp")
    # lazy row reads
    src = state.params["0.weight"].fields["mv_code"]
    assert src.dtype == torch.uint8
    assert torch.equal(src.read(3, 9), ref["0.weight/mv_code"][3:9])
    assert src.read(5, 5).shape == (0, 12)


def test_codes_stay_uint8_on_disk(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    opt = make_opt("gefen", model.named_parameters())
    _ = model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    dcp.save({"optim": GefenDCPState(opt)}, checkpoint_id=tmp_path, planner=GefenSavePlanner())
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    assert metadata.state_dict_metadata["optim.state.0.weight.mv_code"].properties.dtype == torch.uint8
    assert tuple(metadata.state_dict_metadata["optim.state.0.weight.mv_code"].size) == (512, 256)
    assert metadata.state_dict_metadata["optim.state.0.weight.m_row_scale"].properties.dtype == torch.bfloat16
    data = sum(f.stat().st_size for f in tmp_path.iterdir() if f.suffix == ".distcp")
    compressed = sum(t.numel() * t.element_size() for t in canonical_tensors(opt).values())
    params = sum(p.numel() for p in model.parameters())
    assert compressed < 1.1 * params  # ~1 byte per parameter in memory ...
    entries = len(metadata.state_dict_metadata)  # DCP adds ~1 KiB per entry (tensor or group value)
    assert data < 1.05 * compressed + 1536 * entries  # ... and on disk


def test_write_dcp_then_load_into_fresh_optimizer(tmp_path):
    model, opt = _trained("gefen")
    source = export_canonical(opt)
    write_dcp(source, tmp_path / "w", chunk_bytes=40)  # several row chunks per tensor
    fresh = make_opt("gefen", model.named_parameters())
    dcp.load({"optim": GefenDCPState(fresh)}, checkpoint_id=tmp_path / "w", planner=GefenLoadPlanner())
    assert_same(canonical_tensors(opt), canonical_tensors(fresh), "write_dcp -> load")
    # and the written layout reads back, and round-trips through read_dcp -> write_dcp
    write_dcp(read_dcp(tmp_path / "w"), tmp_path / "w2", key="opt")
    again = make_opt("gefen", model.named_parameters())
    dcp.load({"opt": GefenDCPState(again)}, checkpoint_id=tmp_path / "w2", planner=GefenLoadPlanner())
    assert_same(canonical_tensors(opt), canonical_tensors(again), "read_dcp -> write_dcp -> load")


def test_foreign_checkpoint_is_refused_before_anything_is_read(tmp_path):
    adam_model, adam = _trained("adamw")
    dcp.save({"model": adam_model.state_dict(), "optim": GefenDCPState(adam)}, checkpoint_id=tmp_path,
             planner=GefenSavePlanner())
    model, opt = _trained("gefen", steps=2)
    before, model_before = canonical_tensors(opt), {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointException) as info:
        dcp.load({"model": model.state_dict(), "optim": GefenDCPState(opt)}, checkpoint_id=tmp_path,
                 planner=GefenLoadPlanner())
    (inner, _), = info.value.failures.values()
    assert isinstance(inner, CheckpointMismatchError)
    assert "torch.optim.AdamW" in str(inner) and "gefen.Gefen" in str(inner)
    assert_same(before, canonical_tensors(opt), "optimizer after a refused load")
    assert_same(model_before, dict(model.state_dict()), "model after a refused load")


@pytest.mark.parametrize("kind,names", [("gefen_block", "exp_avg"), ("gefen", "0.weight/step: checkpoint dtype")])
def test_foreign_checkpoint_saved_without_our_planner_is_refused(tmp_path, kind, names):
    """m8 knows no exp_avg; the default layout keeps exp_avg (bf16) for 1-D tensors only, and
    refuses AdamW's fp32 step of a matrix before it reads anything."""
    _, adam = _trained("adamw")
    dcp.save({"optim": GefenDCPState(adam)}, checkpoint_id=tmp_path)  # stock planner: no record
    _, opt = _trained(kind, steps=2)
    before = canonical_tensors(opt)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"optim": GefenDCPState(opt)}, checkpoint_id=tmp_path, planner=GefenLoadPlanner())
    (inner, _), = info.value.failures.values()
    assert isinstance(inner, CheckpointMismatchError) and names in str(inner)
    assert_same(before, canonical_tensors(opt), "optimizer")


def test_shape_mismatch_is_refused(tmp_path):
    _, opt = _trained("gefen")
    dcp.save({"optim": GefenDCPState(opt)}, checkpoint_id=tmp_path, planner=GefenSavePlanner())
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(12, 17), torch.nn.GELU(), torch.nn.LayerNorm(17),
                                torch.nn.Linear(17, 4))
    fresh = make_opt("gefen", other.named_parameters())
    with pytest.raises(CheckpointException) as info:
        dcp.load({"optim": GefenDCPState(fresh)}, checkpoint_id=tmp_path, planner=GefenLoadPlanner())
    (inner, _), = info.value.failures.values()
    assert isinstance(inner, CheckpointMismatchError) and "0.weight" in str(inner)
    assert not fresh.state


def test_plain_dcp_load_needs_state_of_the_same_geometry(tmp_path):
    model, opt = _trained("gefen")
    dcp.save({"optim": GefenDCPState(opt)}, checkpoint_id=tmp_path)  # stock save planner works too
    # into an optimizer that already has state of the same geometry: plain dcp.load works
    _, other = _trained("gefen", steps=1)
    dcp.load({"optim": GefenDCPState(other)}, checkpoint_id=tmp_path)
    assert_same(canonical_tensors(opt), canonical_tensors(other), "plain dcp.load")
    # into a fresh optimizer: a clear error, nothing changed
    fresh = make_opt("gefen", model.named_parameters())
    with pytest.raises(CheckpointMismatchError, match="GefenLoadPlanner"):
        dcp.load({"optim": GefenDCPState(fresh)}, checkpoint_id=tmp_path)
    assert not fresh.state and fresh.codebook is None


def test_missing_key_and_corrupt_description(tmp_path):
    _, opt = _trained("gefen")
    dcp.save({"optim": GefenDCPState(opt)}, checkpoint_id=tmp_path / "a", planner=GefenSavePlanner())
    fresh = make_opt("gefen", _model_for("gefen").named_parameters())
    with pytest.raises(CheckpointException) as info:
        dcp.load({"other": GefenDCPState(fresh)}, checkpoint_id=tmp_path / "a", planner=GefenLoadPlanner())
    (inner, _), = info.value.failures.values()
    assert isinstance(inner, CheckpointMismatchError) and "'optim'" in str(inner)
    with pytest.raises(CheckpointMismatchError, match="no optimizer state under .other"):
        read_dcp(tmp_path / "a", key="other")
    # a record whose bytes were damaged: a format error before anything is read, never a crash
    write_dcp(export_canonical(opt), tmp_path / "b")
    data = tmp_path / "b" / ".metadata"  # the record's copy in DCP's metadata is read first
    raw = bytearray(data.read_bytes())
    at = raw.find(b"gefen.Gefen")
    raw[at:at + 11] = b"\xc1" * 11  # a byte msgpack never uses
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointFormatError):
        read_dcp(tmp_path / "b")


def test_optimizer_built_from_bare_tensors_takes_names_from_the_model(tmp_path):
    model = _model_for("gefen")
    opt = Gefen(model.parameters(), lr=1e-2)
    for i in range(2):
        _step(model, opt, i)
    with pytest.raises(CheckpointMismatchError, match="model="):
        GefenDCPState(opt).state_dict()
    dcp.save({"optim": GefenDCPState(opt, model)}, checkpoint_id=tmp_path, planner=GefenSavePlanner())
    assert set(read_dcp(tmp_path).params) == {n for n, _ in model.named_parameters()}
    fresh = Gefen(model.parameters(), lr=1e-2)
    dcp.load({"optim": GefenDCPState(fresh, model)}, checkpoint_id=tmp_path, planner=GefenLoadPlanner())
    assert_same(canonical_tensors_of(opt, model), canonical_tensors_of(fresh, model), "bare tensors")


def test_one_layout_for_gefen_dcp_state_and_torchs_api(tmp_path):
    """What GefenDCPState saves, torch's set_state_dict resumes from, and the reverse."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _trained("gefen")
    dcp.save({"model": model.state_dict(), "optim": GefenDCPState(opt)}, checkpoint_id=tmp_path / "a",
             planner=GefenSavePlanner())
    fresh_model = _model_for("gefen")
    fresh = make_opt("gefen", fresh_model.named_parameters())
    msd, osd = get_state_dict(fresh_model, fresh)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "a")
    set_state_dict(fresh_model, fresh, model_state_dict=msd, optim_state_dict=osd)
    assert_same(canonical_tensors(opt), canonical_tensors(fresh), "GefenDCPState -> set_state_dict")

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "b")
    again = make_opt("gefen", _model_for("gefen").named_parameters())
    dcp.load({"optim": GefenDCPState(again)}, checkpoint_id=tmp_path / "b", planner=GefenLoadPlanner())
    assert_same(canonical_tensors(opt), canonical_tensors(again), "get_state_dict -> GefenDCPState")
    assert read_dcp(tmp_path / "b").contract.implementation == "gefen.Gefen"


def canonical_tensors_of(opt, model) -> dict[str, torch.Tensor]:
    state = export_canonical(opt, model=model)
    return {f"{fqn}/{k}": s.read().clone() for fqn, e in state.params.items() for k, s in e.fields.items()}


def test_dcp_metadata_is_unpickled_with_an_allowlist(tmp_path):
    _, opt = _trained("gefen")
    dcp.save({"optim": GefenDCPState(opt)}, checkpoint_id=tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointFormatError, match="refuses"):
        read_dcp(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_a_garbage_record_is_a_format_error(tmp_path):
    """The record (msgpack in DCP's planner data) is untrusted bytes: garbage is a format error."""
    from gefen_ckpt.dcp import PLANNER_DATA_KEY

    _, opt = _trained("gefen")
    dcp.save({"optim": GefenDCPState(opt)}, checkpoint_id=tmp_path, planner=GefenSavePlanner())
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    metadata.planner_data[PLANNER_DATA_KEY]["optim"] = b"\xc1 not msgpack"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointFormatError, match="planner record of 'optim' is not valid msgpack"):
        read_dcp(tmp_path)


# ----- distributed ------------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_reshard_chain_1_4_3_2_1(tmp_path):
    """Save on N ranks, load into fresh optimizers on M ranks (1->4->3->2->1, FSDP-style DTensor
    params and FSDP2 models; 3 -> DDP-style replicas on 2 -> 1), export: bitwise equal to the
    source; continued on M ranks == continued in one process; async_save once; model +
    optimizer in one dcp.save; foreign and failing loads raise on every rank."""
    sources = {}
    for task in _save_tasks(tmp_path, 1):
        sources[("fsdp1", task["kind"])] = single(task)
    refs = {}

    def check(results, loads: list[dict], world: int):
        for i, task in enumerate(loads):
            got = assembled(results, i) if world > 1 else results[i]
            src = os.path.basename(task["path"]).rsplit("-", 1)[0]
            where = f"{src} -> {task['layout']}{world} ({task['kind']})"
            check_loaded(sources[(src, task["kind"])], got, where)
            if task["continue"]:
                key = (src, task["kind"])
                refs.setdefault(key, continued_reference(task["kind"], task["path"]))
                assert_same(refs[key], got["continued"], f"continued after {where}")

    previous = "fsdp1"
    for world in (4, 3, 2):
        loads = _load_tasks(tmp_path, previous)
        saves = _save_tasks(tmp_path, world, async_kind="gefen" if world == 3 else None)
        extra = []
        if world == 2:
            loads += _load_tasks(tmp_path, previous, kinds=("gefen",), layout="ddp")
            saves += _save_tasks(tmp_path, world, kinds=("gefen",), layout="ddp")
            extra = [{"op": "mismatch", "kind": "-", "path": str(tmp_path / "fsdp3-gefen")},
                     {"op": "agree", "kind": "-", "path": str(tmp_path / "fsdp3-gefen")}]
        results = run(_worker, world, loads + saves + extra, timeout=300)
        check(results, loads, world)
        for i, task in enumerate(saves):
            name = f"{task['layout']}{world}"
            sources[(name, task["kind"])] = assembled(results, len(loads) + i)
            check_read_dcp(sources[(name, task["kind"])]["state"], task["path"])
        if world == 2:
            mismatch, agree = (r[-2] for r in results), (r[-1] for r in results)
            for res in mismatch:
                assert res["raised"] and res["untouched"], res
                assert all("CheckpointMismatchError" in v and "gefen.Gefen" in v for v in res["raised"].values())
            for rank, res in enumerate(agree):
                assert res["raised"] and res["untouched"], res
                assert "injected staging failure" in res["raised"], res  # rank 1's own, or quoted naming it
                assert (rank == 1) != ("failed on rank(s) [1]" in res["raised"]), res
        previous = f"fsdp{world}"
    loads = _load_tasks(tmp_path, previous) + _load_tasks(tmp_path, "ddp2", kinds=("gefen",))
    check([single(t) for t in loads], loads, 1)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(1800)
def test_reshard_matrix_all_world_sizes_and_hsdp(tmp_path):
    """Every N -> M for N, M in {1, 2, 3, 4}, plus HSDP 2x2 -> {1, 2, 3, 4, 2x2} and {1..4} -> 2x2."""
    sources = {}
    for task in _save_tasks(tmp_path, 1):
        sources[("fsdp1", task["kind"])] = single(task)
    hsdp_kinds = ("gefen", "adamw")
    for world in (2, 3, 4):
        saves = _save_tasks(tmp_path, world)
        if world == 4:
            saves += _save_tasks(tmp_path, 4, kinds=hsdp_kinds, layout="hsdp")
        results = run(_worker, world, saves, timeout=600)
        for i, task in enumerate(saves):
            name = f"{task['layout']}{world}"
            sources[(name, task["kind"])] = assembled(results, i)
            check_read_dcp(sources[(name, task["kind"])]["state"], task["path"])
    names = sorted({name for name, _ in sources})
    refs = {}
    for world in (1, 2, 3, 4):
        loads = [t for name in names for t in _load_tasks(tmp_path, name, kinds=[k for n, k in sources if n == name])]
        if world == 4:
            loads += [dict(t, layout="hsdp") for name in names
                      for t in _load_tasks(tmp_path, name, kinds=hsdp_kinds)]
        results = [[single(t) for t in loads]] if world == 1 else run(_worker, world, loads, timeout=900)
        for i, task in enumerate(loads):
            got = results[0][i] if world == 1 else assembled(results, i)
            src = os.path.basename(task["path"]).rsplit("-", 1)[0]
            check_loaded(sources[(src, task["kind"])], got, f"{src} -> {task['layout']}{world} ({task['kind']})")
            if task["continue"]:
                key = (src, task["kind"])
                refs.setdefault(key, continued_reference(task["kind"], task["path"]))
                assert_same(refs[key], got["continued"], f"continued {src} -> {world} ({task['kind']})")

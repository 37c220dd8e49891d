"""Collective save/load on real gloo ranks: save on N, load on M, continue == never stopped.

Gefen's state does not depend on the world size (test_dist_optim.py), and neither does
torch AdamW's, so a run saved on N ranks, loaded on M and continued must be *bitwise* equal
to an uninterrupted single-process run with the same per-parameter gradients.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import gefen_ckpt
from gefen import Gefen

from distributed import row_scaled_grads, run

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

SHAPES = {"emb": (24, 16), "proj": (7, 32), "tiny": (3, 8), "norm": (16,), "conv": (8, 4, 3)}
KINDS = ("gefen-factored", "gefen-block", "adamw")


def _grads(step: int) -> dict[str, torch.Tensor]:
    return row_scaled_grads(SHAPES, step)


def _optimizer(kind: str, params: dict[str, torch.Tensor]):
    named = list(params.items())
    if kind == "adamw":
        return torch.optim.AdamW(named, lr=1e-2, weight_decay=0.1)
    factored = kind == "gefen-factored"  # the default layout; "gefen-block" is m8's per-block v
    return Gefen(named, lr=1e-2, weight_decay=0.1, factored_v_2d=factored, moments="m4v4" if factored else "m8")


def _session(kind: str, steps: range, load_from: str | None, save_to: str | None, mesh=None):
    """Fresh params + optimizer (on ``mesh`` if given), optionally load, step, optionally save."""
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    init = {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}
    if load_from:  # the model's weights travel beside the optimizer checkpoint
        init = torch.load(load_from + ".params.pt", weights_only=True)
    shard = (lambda t: distribute_tensor(t, mesh, [Shard(0)])) if mesh is not None else (lambda t: t.clone())
    params = {name: torch.nn.Parameter(shard(t)) for name, t in init.items()}
    opt = _optimizer(kind, params)
    if load_from:
        gefen_ckpt.load(opt, load_from)
    for step in steps:
        for name, grad in _grads(step).items():
            params[name].grad = shard(grad)
        opt.step()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in params.items()}
    if save_to:
        gefen_ckpt.save(opt, save_to)
        if mesh is None or mesh.get_rank() == 0:
            torch.save(full, save_to + ".params.pt")
    return opt, full


def _world(rank: int, world_size: int, jobs: list[tuple]):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    return [_session(kind, range(a, b), src, dst, mesh)[1] for kind, a, b, src, dst in jobs]


def _reference(kind: str, steps: int) -> dict[str, torch.Tensor]:
    return _session(kind, range(steps), None, None)[1]


def _assert_params(got: dict, want: dict, what: str) -> None:
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{what}: {name}"


def test_save_n_load_m_continue_is_bitwise(tmp_path):
    """1 -> 2 -> 3 (and 2 -> offline reshard to 3) -> 1, three steps in each, for every kind."""
    ck = {n: {k: str(tmp_path / f"ws{n}-{k}") for k in KINDS} for n in (1, 2, 3)}
    resharded = {k: str(tmp_path / f"ws2-to-3-{k}") for k in KINDS}
    for kind in KINDS:
        _session(kind, range(3), None, ck[1][kind])

    on_two = run(_world, 2, [(k, 3, 6, ck[1][k], ck[2][k]) for k in KINDS])
    for kind in KINDS:
        gefen_ckpt.write(gefen_ckpt.read(ck[2][kind]), resharded[kind], world_size=3)  # what `reshard` does
        shutil.copy(ck[2][kind] + ".params.pt", resharded[kind] + ".params.pt")
    jobs = [(k, 6, 9, ck[2][k], ck[3][k]) for k in KINDS] + [(k, 6, 9, resharded[k], None) for k in KINDS]
    on_three = run(_world, 3, jobs)

    for i, kind in enumerate(KINDS):
        for r in on_two:
            _assert_params(r[i], _reference(kind, 6), f"{kind} 1->2")
        for r in on_three:
            _assert_params(r[i], _reference(kind, 9), f"{kind} 2->3")
            _assert_params(r[i + len(KINDS)], _reference(kind, 9), f"{kind} 2->reshard 3")
        _, back_on_one = _session(kind, range(9, 12), ck[3][kind], None)
        _assert_params(back_on_one, _reference(kind, 12), f"{kind} 3->1")
        on_one = gefen_ckpt.read(ck[3][kind])
        assert gefen_ckpt.read_manifest(ck[3][kind])["world_size"] == 3
        assert set(on_one.params) == set(SHAPES)


# ----- failure injection -----------------------------------------------------------------------
def _failing_world(rank: int, world_size: int, good: str, target: str, corrupt: str):
    from torch.distributed.device_mesh import init_device_mesh

    import gefen_ckpt.dist.sharded as sharded_io

    mesh = init_device_mesh("cpu", (world_size,))
    opt, _ = _session("gefen-factored", range(2), None, None, mesh)
    before = {k: v.clone() for s in opt.state.values() for k, v in s.items()}
    outcomes = {}

    real = sharded_io.write_pieces
    if rank == 1:
        def broken(*args, **kwargs):
            raise OSError("disk full (injected on rank 1)")
        sharded_io.write_pieces = broken
    try:
        gefen_ckpt.save(opt, target)
        outcomes["save"] = "no error"
    except Exception as exc:
        outcomes["save"] = f"{type(exc).__name__}: {exc}"
    sharded_io.write_pieces = real

    for what, url in (("load-corrupt", corrupt), ("load-missing", target + "-nothing-here")):
        try:
            gefen_ckpt.load(opt, url)
            outcomes[what] = "no error"
        except Exception as exc:
            outcomes[what] = f"{type(exc).__name__}: {exc}"
    after = {k: v for s in opt.state.values() for k, v in s.items()}
    outcomes["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    return outcomes


def test_failure_on_one_rank_raises_everywhere_and_changes_nothing(tmp_path):
    good, corrupt = str(tmp_path / "good"), str(tmp_path / "corrupt")
    _session("gefen-factored", range(2), None, good)
    gefen_ckpt.write(gefen_ckpt.read(good), corrupt, world_size=2)
    victim = sorted(f for f in os.listdir(corrupt) if "-r00001-" in f)[0]  # only rank 1's rows
    with open(os.path.join(corrupt, victim), "r+b") as fh:
        fh.seek(-3, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-3, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0xFF]))
    good_manifest = gefen_ckpt.read_manifest(good)

    results = run(_failing_world, 2, good, good, corrupt)
    for rank, out in enumerate(results):
        assert out["save"] != "no error", rank
        assert out["load-corrupt"] != "no error" and out["load-missing"] != "no error", rank
        assert out["untouched"], rank
    assert "disk full" in results[1]["save"] and "rank(s) [1]" in results[0]["save"]
    assert "CheckpointCorruptError" in results[1]["load-corrupt"]
    # the checkpoint that was being overwritten is still the committed, loadable one
    assert gefen_ckpt.read_manifest(good) == good_manifest
    assert gefen_ckpt.verify(good).ok


# ----- GefenMuon and the hybrid through the collective save/load ---------------------------------
def _muon_like(kind: str, params: dict[str, torch.Tensor]):
    from gefen import GefenMuon, GefenMuonHybrid

    if kind == "muon":
        return GefenMuon([(n, p) for n, p in params.items() if p.dim() == 2], lr=0.02)
    backup = kind.removeprefix("hybrid-")
    named = list(params.items())
    return GefenMuonHybrid(([(n, p) for n, p in named if n == "proj"], [(n, p) for n, p in named if n != "proj"]),
                           lr=1e-2, backup=backup)


def _gathered_state(opt) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's canonical state, assembled on every rank."""
    from gefen_ckpt.transport import gather

    state = gather(opt, dst=0)
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return {}
    return {k: src.read().clone() for k, src in state.tensors()}


def _muon_world(rank: int, world_size: int, jobs: list[tuple]):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    out = []
    for kind, load_from, save_to in jobs:
        g = torch.Generator().manual_seed(0)
        params = {n: torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g), mesh, [Shard(0)]))
                  for n, s in SHAPES.items()}
        opt = _muon_like(kind, params)
        if load_from:
            gefen_ckpt.load(opt, load_from)
        else:
            for step in range(2):
                for name, grad in _grads(step).items():
                    params[name].grad = distribute_tensor(grad, mesh, [Shard(0)])
                opt.step()
        if save_to:
            gefen_ckpt.save(opt, save_to)
        out.append(_gathered_state(opt))
    return out


def test_muon_and_hybrid_state_survive_n_to_m(tmp_path):
    """GefenMuon and the hybrid (both backups), trained sharded on 3 ranks, saved, loaded on 2:
    every canonical tensor bitwise equal to what was saved."""
    kinds = ("muon", "hybrid-gefen", "hybrid-adamw")
    paths = {k: str(tmp_path / k) for k in kinds}
    saved = run(_muon_world, 3, [(k, None, paths[k]) for k in kinds])[0]
    loaded = run(_muon_world, 2, [(k, paths[k], None) for k in kinds])[0]
    for i, kind in enumerate(kinds):
        assert saved[i].keys() == loaded[i].keys() and saved[i], kind
        for key, value in saved[i].items():
            assert torch.equal(loaded[i][key], value), f"{kind}: {key}"
        assert gefen_ckpt.verify(paths[kind]).ok

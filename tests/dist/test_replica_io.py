"""Replicas share the I/O, on real gloo ranks: a save spreads the replicated bytes over every rank
holding them (each row written once), a read-once load reads each byte from storage about once
and shares it over the process group, bit-exact across layouts and world sizes; a failed read,
a corrupted transfer or a stalled sender raises on every rank and changes nothing.
"""

from __future__ import annotations

import os

import pytest
import torch

import gefen_ckpt

from distributed import row_scaled_grads, run

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

#: ``big`` holds more than half of the state's bytes
SHAPES = {"big": (1024, 768), "emb": (48, 64), "proj": (24, 64), "tiny": (3, 8), "norm": (64,), "conv": (16, 4, 3)}
KINDS = ("m4v4", "hybrid", "adamw")


def _optimizer(kind: str, params: dict):
    from gefen import Gefen, GefenMuonHybrid

    named = list(params.items())
    if kind == "adamw":
        return torch.optim.AdamW(named, lr=1e-2)
    if kind == "hybrid":
        return GefenMuonHybrid(([(n, p) for n, p in named if n in ("big", "proj")],
                                [(n, p) for n, p in named if n not in ("big", "proj")]), lr=1e-2)
    return Gefen(named, lr=1e-2, moments=kind)


def _params(layout: str, world: int) -> dict:
    """``ddp``: plain tensors on every rank; ``hsdp``: (2 replicas, world/2 shards); ``fsdp``: Shard(0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    if layout == "ddp":
        return {n: torch.nn.Parameter(t) for n, t in init.items()}
    mesh, placements = ((init_device_mesh("cpu", (2, world // 2)), [Replicate(), Shard(0)]) if layout == "hsdp"
                        else (init_device_mesh("cpu", (world,)), [Shard(0)]))
    return {n: torch.nn.Parameter(distribute_tensor(t, mesh, placements)) for n, t in init.items()}


def _grad(p, full):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements) if hasattr(p, "placements") else full


def _gathered(opt) -> dict:
    """Every canonical tensor, assembled on rank 0 ({} elsewhere)."""
    import torch.distributed as dist

    from gefen_ckpt.transport import gather

    state = gather(opt, dst=0)
    return {k: s.read().clone() for k, s in state.tensors()} if dist.get_rank() == 0 else {}


def _first_replica_rules(parts: dict) -> dict:
    """How 2.0 files written before the replica rule split rows: every row by the first replica."""
    from gefen_ckpt.wire.index import Rule

    return {k: Rule(p.holders.shards, tuple(p.holders.grid[0].tolist())) for k, p in parts.items()}


def _session(world: int, kind: str, layout: str, load_from=None, save_to=None, read_once=None, old_rule=False):
    import gefen_ckpt.dist.sharded as sharded_io

    if old_rule:
        sharded_io.rules_for = _first_replica_rules
    params = _params(layout, world)
    opt = _optimizer(kind, params)
    out = {}
    if load_from:
        gefen_ckpt.load(opt, load_from, read_once=read_once)
        out["load"] = gefen_ckpt.last_io_stats().as_dict()
    else:
        for step in range(2):
            for name, full in row_scaled_grads(SHAPES, step).items():
                params[name].grad = _grad(params[name], full)
            opt.step()
    if save_to:
        gefen_ckpt.save(opt, save_to)
        out["save"] = gefen_ckpt.last_io_stats().as_dict()
    out["state"] = _gathered(opt)
    return out


def _world(rank: int, world: int, jobs: list[tuple]):
    return [_session(world, *job) for job in jobs]


def _bytes_on_disk(url: str) -> int:
    return sum(os.path.getsize(os.path.join(url, f)) for f in os.listdir(url))


def _ratio(values) -> float:
    return max(values) / (sum(values) / len(values))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each kind trained and saved on 4 ranks as DDP and as HSDP (2 x 2), then loaded on 4 ranks
    into the other layout and into its own, read once and not; and an m4v4 HSDP checkpoint
    written the way 2.0 files were before the replica rule (every row by the first replica)."""
    root = tmp_path_factory.mktemp("replicas")
    ck = {(k, lay): str(root / f"{k}-{lay}") for k in KINDS for lay in ("ddp", "hsdp")}
    old = str(root / "m4v4-first-replica")
    saves = [(k, lay, None, ck[k, lay]) for k in KINDS for lay in ("ddp", "hsdp")]
    saves.append(("m4v4", "hsdp", None, old, None, True))  # the old rule stays patched: only loads follow
    loads = [(k, "hsdp", ck[k, "ddp"], None, True) for k in KINDS]
    loads += [(k, "ddp", ck[k, "hsdp"], None, True) for k in KINDS]
    loads += [(k, "ddp", ck[k, "ddp"], None, ro) for k in KINDS for ro in (True, False)]
    loads.append(("m4v4", "ddp", old, None, True))
    results = run(_world, 4, saves + loads, timeout=600)
    by_job = {(job[:3] + job[4:5]) if job[2] else job[:3] + job[3:4]: [r[i] for r in results]
              for i, job in enumerate(saves + loads)}
    return ck, old, by_job


@pytest.mark.parametrize("layout", ["ddp", "hsdp"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_rank_writes_its_share_once(saved, kind, layout):
    ck, _, by_job = saved
    writes = [r["save"]["bytes_written"] for r in by_job[kind, layout, None, ck[kind, layout]]]
    on_disk = _bytes_on_disk(ck[kind, layout])
    assert sum(writes) / on_disk <= 1.01, writes  # each row once (plus a lock file of a few bytes)
    assert _ratio(writes) <= 1.10, writes
    assert gefen_ckpt.verify(ck[kind, layout]).ok


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("source,target", [("ddp", "hsdp"), ("hsdp", "ddp"), ("ddp", "ddp")])
def test_read_once_loads_read_each_byte_about_once_and_are_bitexact(saved, kind, source, target):
    ck, _, by_job = saved
    results = by_job[kind, target, ck[kind, source], True]
    reads = [r["load"]["bytes_read"] for r in results]
    assert sum(reads) / _bytes_on_disk(ck[kind, source]) <= 1.05, reads
    assert _ratio(reads) <= 1.10, reads
    assert sum(r["load"]["bytes_received"] for r in results) > 0  # the rest arrived over the group
    want = by_job[kind, source, None, ck[kind, source]][0]["state"]
    got = results[0]["state"]
    assert want.keys() == got.keys() and want
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{kind} {source} -> {target}: {key}"


def test_without_read_once_every_replica_reads_its_rows_itself(saved):
    ck, _, by_job = saved
    results = by_job["m4v4", "ddp", ck["m4v4", "ddp"], False]
    reads = [r["load"]["bytes_read"] for r in results]
    assert sum(reads) / _bytes_on_disk(ck["m4v4", "ddp"]) > 3.5  # four replicas, four reads of everything
    assert all(r["load"]["bytes_received"] == 0 for r in results)
    want = by_job["m4v4", "ddp", None, ck["m4v4", "ddp"]][0]["state"]
    assert all(torch.equal(results[0]["state"][k], v) for k, v in want.items())


def test_read_once_on_another_world_size(saved):
    """The 4-rank checkpoints loaded on 3 ranks (DDP, and FSDP which has no replicas) read once."""
    ck, _, by_job = saved
    jobs = [("m4v4", "ddp", ck["m4v4", "hsdp"], None, True), ("adamw", "ddp", ck["adamw", "ddp"], None, True),
            ("hybrid", "fsdp", ck["hybrid", "ddp"], None, True)]
    results = run(_world, 3, jobs, timeout=300)
    for i, (kind, _, url, _, _) in enumerate(jobs):
        reads = [r[i]["load"]["bytes_read"] for r in results]
        assert sum(reads) / _bytes_on_disk(url) <= 1.05, (kind, reads)
        want = by_job[kind, "hsdp" if url.endswith("hsdp") else "ddp", None, url][0]["state"]
        for key, value in want.items():
            assert torch.equal(results[0][i]["state"][key], value), f"{kind}: {key}"


# ----- faults ---------------------------------------------------------------------------------
def _faulty(rank: int, world: int, url: str, fault: str):
    """Load ``url`` read-once on DDP with ``fault`` injected on rank 1; what each rank raised, and
    whether its optimizer is untouched."""
    import time

    import torch.distributed as dist

    params = _params("ddp", world)
    opt = _optimizer("m4v4", params)
    for name, full in row_scaled_grads(SHAPES, 0).items():
        params[name].grad = full
    opt.step()
    before = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    real = dist.isend
    if rank == 1 and fault == "transit":
        def isend(tensor, dst, *args, **kwargs):  # flips a bit after the CRC was computed
            tensor = tensor.clone()
            tensor[0] ^= 1
            return real(tensor, dst, *args, **kwargs)
        dist.isend = isend
    if rank == 1 and fault == "stall":
        def isend(*args, **kwargs):
            time.sleep(8)
            return real(*args, **kwargs)
        dist.isend = isend
    try:
        gefen_ckpt.load(opt, url, read_once=True, timeout=4)
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        dist.isend = real
    after = {i: dict(s) for i, s in enumerate(opt.state.values())}
    untouched = all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])
    return outcome, untouched


def test_a_checkpoint_written_by_the_first_replica_loads_read_once(saved):
    """2.0 files written before the replica rule (one writer per shard, no ``sub``) still load,
    read once, bit-exact."""
    _, old, by_job = saved

    raw = gefen_ckpt.read_manifest(old)
    assert all("sub" not in r for r in raw["rules"]) and {tuple(r["writers"]) for r in raw["rules"]} <= {(0,), (0, 1),
                                                                                                        (0, 1, 2, 3)}
    results = by_job["m4v4", "ddp", old, True]
    want = by_job["m4v4", "hsdp", None, old][0]["state"]
    for key, value in want.items():
        assert torch.equal(results[0]["state"][key], value), key
    reads = [r["load"]["bytes_read"] for r in results]
    assert sum(reads) / _bytes_on_disk(old) <= 1.05, reads


@pytest.fixture(scope="module")
def ddp_checkpoint(saved, tmp_path_factory):
    return saved[0]["m4v4", "ddp"]


def _copy(url: str, tmp_path) -> str:
    import shutil

    dst = str(tmp_path / "copy")
    shutil.copytree(url, dst)
    return dst


def test_a_corrupt_piece_raises_on_every_rank_naming_the_reader_and_file(ddp_checkpoint, tmp_path):
    url = _copy(ddp_checkpoint, tmp_path)
    data = sorted(f for f in os.listdir(url) if f.startswith("data-"))[2]  # written by rank 2
    with open(os.path.join(url, data), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(url, data)) - 9)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    results = run(_faulty, 4, url, "none", timeout=300)
    for outcome, untouched in results:
        assert untouched
        assert outcome.startswith("CheckpointCorruptError") and data in outcome, outcome
    assert sum("failed on rank(s)" in o for o, _ in results) >= 1  # the other ranks name the reader


def test_a_corrupted_transfer_is_refused_everywhere(ddp_checkpoint):
    results = run(_faulty, 4, ddp_checkpoint, "transit", timeout=300)
    for rank, (outcome, untouched) in enumerate(results):
        assert untouched
        assert outcome.startswith("CheckpointCorruptError"), outcome
        if rank != 1:
            assert "from rank 1" in outcome and "CRC-32" in outcome, outcome


def test_a_stalled_sender_is_named_by_the_timeout(ddp_checkpoint):
    results = run(_faulty, 4, ddp_checkpoint, "stall", timeout=300)
    for rank, (outcome, untouched) in enumerate(results):
        assert untouched
        assert outcome.startswith("CheckpointTimeoutError"), outcome
        if rank != 1:
            assert "rank 1" in outcome or "rank(s) [1]" in outcome, outcome

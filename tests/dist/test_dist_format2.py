"""Format 2.0 sharded saves on real gloo ranks: a constant number of collectives whatever the
world size, O(1) bytes per rank to the commit, a rule (not piece lists) in the manifest, and
``async_save`` under a process group (same files as ``save``; an error raised on every rank)."""

from __future__ import annotations

import os

import pytest
import torch

import gefen_ckpt

from distributed import run

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

SHAPES = {"emb": (24, 16), "proj": (7, 32), "norm": (16,)}


def _trained(mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    from gefen import Gefen

    g = torch.Generator().manual_seed(0)
    params = {n: torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g), mesh, [Shard(0)]))
              for n, s in SHAPES.items()}
    opt = Gefen(list(params.items()), lr=1e-2)
    for n, p in params.items():
        p.grad = distribute_tensor(torch.randn(SHAPES[n], generator=g), mesh, [Shard(0)])
    opt.step()
    return opt


def _counting(rank: int, world_size: int, url: str) -> dict:
    """The save's tensor collectives (by kind) and the bytes this rank sent the commit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import gefen_ckpt.dist.collective as collective

    opt = _trained(init_device_mesh("cpu", (world_size,)))
    counts: dict[str, int] = {}
    sent = []
    real = {name: getattr(dist, name) for name in ("all_gather", "all_reduce", "broadcast", "gather")}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return real[name](*args, **kwargs)
        return call

    real_gather = collective.gather_bytes

    def gather_bytes(payload, *args, **kwargs):
        sent.append(len(payload))
        return real_gather(payload, *args, **kwargs)

    for name in real:
        setattr(dist, name, counted(name))
    collective.gather_bytes = gather_bytes
    import gefen_ckpt.dist.sharded as sharded_io

    sharded_io.gather_bytes = gather_bytes
    try:
        gefen_ckpt.save(opt, url)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"counts": counts, "sent": sent}


def test_collectives_per_save_do_not_grow_with_ranks(tmp_path):
    results = {n: run(_counting, n, str(tmp_path / f"ws{n}")) for n in (2, 4)}
    assert results[2][0]["counts"] == results[4][0]["counts"], results
    for n, per_rank in results.items():
        assert all(r["counts"] == per_rank[0]["counts"] for r in per_rank)
        assert all(len(r["sent"]) == 1 and r["sent"][0] <= 1024 for r in per_rank), per_rank
        raw = gefen_ckpt.read_manifest(str(tmp_path / f"ws{n}"))
        assert raw["version"] == [2, 0] and len(raw["writers"]) == n
        assert {r["parts"] for r in raw["rules"]} == {1, n}  # every row-sharded field follows the rule
        assert all(isinstance(f["split"], int) for e in raw["params"].values() for f in e["fields"].values())
        assert gefen_ckpt.verify(str(tmp_path / f"ws{n}")).ok


def _async(rank: int, world_size: int, sync_url: str, async_url: str, broken_url: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import gefen_ckpt.dist.sharded as sharded_io

    opt = _trained(init_device_mesh("cpu", (world_size,)))
    gefen_ckpt.save(opt, sync_url)
    future = gefen_ckpt.async_save(opt, async_url)
    out = {"result": future.result(timeout=300)}
    real = sharded_io.write_pieces
    if rank == 1:
        def broken(*args, **kwargs):
            raise OSError("disk full (injected on rank 1)")
        sharded_io.write_pieces = broken
    for key, url in (("broken", broken_url), ("over_committed", sync_url)):  # a fresh URL, a committed one
        try:
            gefen_ckpt.async_save(opt, url).result(timeout=300)
            out[key] = "no error"
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    sharded_io.write_pieces = real
    return out


def _stripped(url: str) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(url):
        if name.startswith(("data-", "index-")):
            kind, _, rest = name.split("-", 2)
            out[f"{kind}-{rest}"] = open(os.path.join(url, name), "rb").read()
    return out


def test_async_save_under_a_process_group(tmp_path):
    sync, asyn, broken = (str(tmp_path / d) for d in ("sync", "async", "broken"))
    results = run(_async, 2, sync, asyn, broken)
    assert all(r["result"] is None for r in results)
    assert _stripped(sync) == _stripped(asyn)
    for key in ("broken", "over_committed"):  # raised from the future on every rank
        assert all(r[key] != "no error" for r in results), results
        assert "disk full" in results[1][key] and "rank(s) [1]" in results[0][key]
    # the failed save over the committed checkpoint left it committed, byte for byte (no stray files)
    assert _stripped(sync) == _stripped(asyn) and gefen_ckpt.verify(sync).ok
    assert not os.path.exists(os.path.join(broken, "manifest.msgpack"))
    assert not [n for n in os.listdir(broken) if n.startswith(("data-", "index-"))]


# ----- every rank raises the same, truthful error type ------------------------------------------
def _damaged_copies(good: str, root: str) -> dict[str, str]:
    """Copies of ``good``: a damaged manifest (a format error), rank 1's data damaged (corruption),
    a data file replaced by a link to its copy (refused by every reader)."""
    import shutil

    out = {k: os.path.join(root, k) for k in ("format", "corrupt", "symlink")}
    for path in out.values():
        shutil.copytree(good, path)
    with open(os.path.join(out["format"], "manifest.msgpack"), "r+b") as f:
        f.seek(20)
        byte = f.read(1)
        f.seek(20)
        f.write(bytes([byte[0] ^ 0x01]))
    victim = sorted(n for n in os.listdir(out["corrupt"]) if n.startswith("data-") and "-r00001-" in n)[0]
    with open(os.path.join(out["corrupt"], victim), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    link = sorted(n for n in os.listdir(out["symlink"]) if n.startswith("data-"))[0]
    os.rename(os.path.join(out["symlink"], link), os.path.join(root, link))
    os.symlink(os.path.join(root, link), os.path.join(out["symlink"], link))
    return out


def _same_types(rank: int, world_size: int, root: str, locked: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    opt = _trained(init_device_mesh("cpu", (world_size,)))
    good = os.path.join(root, "good")
    gefen_ckpt.save(opt, good)
    dist.barrier()
    if rank == 0:
        _damaged_copies(good, root)
    dist.barrier()
    def state() -> dict:
        return {(i, k): v.clone() for i, s in enumerate(opt.state.values()) for k, v in s.items()}

    before = state()
    out = {}
    for what in ("format", "corrupt", "symlink"):
        try:
            gefen_ckpt.load(opt, os.path.join(root, what))
            out[what] = ("no error", "")
        except Exception as exc:
            out[what] = (type(exc).__name__, str(exc))
    try:
        gefen_ckpt.save(opt, locked)
        out["locked"] = ("no error", "")
    except Exception as exc:
        out["locked"] = (type(exc).__name__, str(exc))
    after = state()
    out["untouched"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return out


def test_every_rank_raises_the_type_of_the_failure(tmp_path):
    """A corrupt file reads as corruption (never "wrong model") on every rank, a damaged manifest
    as a format error, a linked data file is refused as by one process, and a save refused by the
    lock is ``CheckpointLockedError`` on every rank, not only on the rank that holds it."""
    from gefen_ckpt.io.storage import Store
    from gefen_ckpt.wire.writelock import acquire

    locked = str(tmp_path / "locked")
    with acquire(Store(locked), "0123456789abcdef"):  # another job's save, in progress
        results = run(_same_types, 2, str(tmp_path), locked)
    want = {"format": "CheckpointFormatError", "corrupt": "CheckpointCorruptError",
            "symlink": "CheckpointFormatError", "locked": "CheckpointLockedError"}
    for rank, out in enumerate(results):
        for what, kind in want.items():
            assert out[what][0] == kind, (rank, what, out[what])
        assert out["untouched"], rank
    assert "symbolic link" in str(results) and "another save to this location is in progress" in str(results)

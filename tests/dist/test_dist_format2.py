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

    import gefen_ckpt.collective as collective

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
    import gefen_ckpt.sharded_io as sharded_io

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

    import gefen_ckpt.sharded_io as sharded_io

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

"""The replica rule (``gefen.replicas.assign``): every row of every tensor to exactly one of its
holders, spread evenly, the same on every rank; and how a manifest records it (a chunk rule with
``sub`` parts per shard)."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gefen.replicas import Holders, assign, chunk_rows, nested_chunk
from gefen_ckpt.errors import CheckpointFormatError
from gefen_ckpt.wire.index import Rule, parse_rules

pytestmark = pytest.mark.timeout(120)


def loads(tensors, plan) -> np.ndarray:
    """Bytes each rank acts for under ``plan``."""
    world = 1 + max(int(h.grid.max()) for _, _, h in tensors)
    out = np.zeros(world)
    for (rows, row_bytes, _), a in zip(tensors, plan):
        for k, rank in enumerate(a.writers):
            start, stop = nested_chunk(rows, a.parts, a.sub, k)
            out[rank] += (stop - start) * row_bytes
    return out


@st.composite
def layouts(draw):
    replicas, shards = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    perm = draw(st.permutations(range(replicas * shards)))
    grid = Holders(np.asarray(perm).reshape(replicas, shards))
    everyone = Holders.replicated(list(range(replicas * shards)))
    n = draw(st.integers(1, 12))
    tensors = [(draw(st.integers(0, 60)), draw(st.integers(1, 4096)), draw(st.sampled_from([grid, everyone])))
               for _ in range(n)]
    return tensors


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_row_has_exactly_one_rank_among_its_holders(tensors):
    plan = assign(tensors)
    assert plan == assign(list(tensors))  # deterministic
    for (rows, _, holders), a in zip(tensors, plan):
        spans = []
        for rank in set(a.writers):
            replica, shard = (int(x) for x in np.argwhere(holders.grid == rank)[0])
            lo, hi = chunk_rows(rows, holders.shards, shard)
            for start, stop in a.parts_of(rows, rank):
                assert lo <= start < stop <= hi, "a rank acts only for rows it holds"
                spans.append((start, stop))
        spans.sort()
        covered = 0
        for start, stop in spans:  # tiling [0, rows): no gap, no overlap
            assert start == covered
            covered = stop
        assert covered == rows


def _ddp(world):
    return Holders.replicated(range(world))


def _hsdp(replicas, shards):
    return Holders(np.arange(replicas * shards).reshape(replicas, shards))


@pytest.mark.parametrize("holders", [_ddp(4), _hsdp(2, 2), _ddp(3), _hsdp(4, 2)], ids=["ddp4", "hsdp2x2", "ddp3",
                                                                                      "hsdp4x2"])
def test_balanced_even_when_one_tensor_is_most_of_the_bytes(holders):
    """A 1024 x 1024 fp32 matrix (~60% of the bytes), mid-sized and tiny tensors, scalars."""
    tensors = [(1024, 4096, holders)] + [(64 * (i % 7 + 1), 256, holders) for i in range(40)]
    tensors += [(1, 4, holders) for _ in range(30)]
    load = loads(tensors, assign(tensors))
    assert load.sum() == sum(r * b for r, b, _ in tensors)
    assert load.max() / load.mean() <= 1.10


def test_single_replica_is_the_fsdp_split_itself():
    grid = _hsdp(1, 4)
    (a,) = assign([(10, 8, grid)])
    assert (a.parts, a.sub, a.writers) == (4, 1, (0, 1, 2, 3))


def test_llama_405b_on_8_by_2048_plans_in_a_second():
    """The rule alone at scale: ~3,800 tensors of a Llama-3-405B-shaped Gefen state on HSDP 8 x 2,048."""
    grid, everyone = _hsdp(8, 2048), Holders.replicated(range(8 * 2048))
    tensors = []
    for _ in range(126):
        for rows, cols in [(16384, 16384), (1024, 16384), (1024, 16384), (16384, 16384), (53248, 16384),
                           (16384, 53248), (53248, 16384)]:
            tensors += [(rows, cols // 2, grid), (rows, cols // 16, grid), (rows, 4, grid), (1, 4, everyone)]
        tensors += [(16384, 8, grid), (16384, 8, grid)]
    start = time.perf_counter()
    plan = assign(tensors)
    seconds = time.perf_counter() - start
    load = loads(tensors, plan)
    assert load.max() / load.mean() <= 1.10
    assert seconds <= 3.0  # 1 s target on an idle core (benchmarks/bench_replicas.py measures it)


def test_nested_chunk_is_torch_chunk_of_torch_chunk():
    torch = pytest.importorskip("torch")
    for rows in (0, 1, 7, 10, 33):
        for parts in (1, 2, 3, 5):
            for sub in (1, 2, 4):
                got = [nested_chunk(rows, parts, sub, k) for k in range(parts * sub)]
                want = []
                for i, outer in enumerate(torch.arange(rows).tensor_split([min(rows, -(-rows // parts) * j)
                                                                            for j in range(1, parts)])):
                    base = chunk_rows(rows, parts, i)[0]
                    for j in range(sub):
                        a, b = chunk_rows(len(outer), sub, j)
                        want.append((base + a, base + b))
                assert got == want


# ----- the rule in a manifest ---------------------------------------------------------------
def test_a_rule_with_sub_parts_parses_and_places_writers():
    (rule,) = parse_rules([{"kind": "chunk", "parts": 2, "sub": 2, "writers": [0, 2, 1, 3]}], 4)
    assert rule == Rule(2, (0, 2, 1, 3), 2)
    assert [rule.parts_of(10, w) for w in range(4)] == [[(0, 3)], [(5, 8)], [(3, 5)], [(8, 10)]]
    assert rule.writers_in(10, 4, 6) == {2, 1}
    assert rule.writers_in(10, 0, 10) == {0, 1, 2, 3}
    assert rule.writers_in(10, 9, 10) == {3}


def test_a_rule_without_sub_is_one_part_per_writer():
    (rule,) = parse_rules(msgpack.unpackb(msgpack.packb([{"kind": "chunk", "parts": 3, "writers": [2, 1, 0]}])), 3)
    assert rule.sub == 1 and rule.parts_of(9, 2) == [(0, 3)]


@pytest.mark.parametrize("rule", [
    {"kind": "chunk", "parts": 2, "sub": 2, "writers": [0, 1, 2]},
    {"kind": "chunk", "parts": 2, "sub": 0, "writers": []},
    {"kind": "chunk", "parts": 2, "sub": "2", "writers": [0, 1, 2, 3]},
])
def test_a_bad_sub_is_refused_by_name(rule):
    with pytest.raises(CheckpointFormatError, match=r"rules\[0\]"):
        parse_rules([rule], 4)


def test_network_file_systems_are_told_from_local_ones(tmp_path):
    """``load(read_once=None)`` reads once where reads cross a network: object stores and locally
    mounted network file systems (the mount table's type of the longest mount point above)."""
    from gefen_ckpt.io.storage import Store, filesystem_type

    table = tmp_path / "mountinfo"
    table.write_text("22 1 0:21 / / rw - ext4 /dev/sda1 rw\n"
                     "40 22 0:50 / /mnt/shared rw,relatime - nfs4 server:/export rw\n"
                     "41 22 0:51 / /mnt/my\\040lustre rw - lustre 10.0.0.1@tcp:/fs rw\n"
                     "42 40 0:52 / /mnt/shared/local rw - xfs /dev/sdb1 rw\n"
                     "43 22 0:53 / /mnt/bucket rw - fuse.s3fs s3fs rw\n")
    kinds = {p: filesystem_type(p, str(table)) for p in ("/mnt/shared/ck", "/mnt/my lustre/ck", "/mnt/shared/local/ck",
                                                           "/mnt/bucket/ck", "/home/ck", "/mnt/sharedx")}
    assert kinds == {"/mnt/shared/ck": "nfs4", "/mnt/my lustre/ck": "lustre", "/mnt/shared/local/ck": "xfs",
                     "/mnt/bucket/ck": "fuse.s3fs", "/home/ck": "ext4", "/mnt/sharedx": "ext4"}
    assert filesystem_type("/x", str(tmp_path / "absent")) == ""
    assert not Store(str(tmp_path / "ck")).networked or filesystem_type(str(tmp_path)) not in ("ext4", "xfs", "tmpfs")
    assert Store("memory://bucket/ck").networked

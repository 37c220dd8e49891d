"""Fuzzing the manifest and index readers: whatever the manifest or a writer's index holds
(random msgpack, mutated valid manifests and indexes with their checksums recomputed, damaged
bytes), reading, loading and verifying raise nothing but ``CheckpointError``, and nothing is
allocated beyond what the files on disk justify."""

from __future__ import annotations

import copy
import math
import re
import tracemalloc
import uuid

import fsspec
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gefen_ckpt
from gefen_ckpt.errors import CheckpointError, CheckpointFormatError
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire import checksum
from gefen_ckpt.wire import manifest as manifest_module
from gefen_ckpt.wire.dtypes import itemsize

from ckpt_util import fresh_like, trained

pytestmark = pytest.mark.timeout(300)
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

SCALARS = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=12)
           | st.binary(max_size=12) | st.sampled_from([0, 1, -1, 2**31, 2**62, 2**63 - 1, "float32", "uint8", ""]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@pytest.fixture(scope="module")
def base():
    """A valid checkpoint in memory:// (two writers, several data files each), its manifest, the
    bytes of its data files, an optimizer, and writer 0's index (name and decoded map)."""
    model, opt = trained("gefen_factored", steps=2)
    url = f"memory://fuzz-{uuid.uuid4().hex}/ck"
    gefen_ckpt.write(gefen_ckpt.export_canonical(opt, model=model), url, world_size=2, max_file_bytes=4096)
    manifest = gefen_ckpt.read_manifest(url)
    fs, root = fsspec.core.url_to_fs(url)
    file_bytes = sum(info["size"] for info in fs.ls(root, detail=True) if info["name"].endswith(".safetensors"))
    target_model, target = fresh_like(model, "gefen_factored")
    index = manifest["writers"][0][0]
    return url, manifest, file_bytes, target_model, target, (index, msgpack.unpackb(fs.cat_file(f"{root}/{index}")))


def _described_bytes(manifest: dict) -> int:
    tensors = list(manifest["globals"].values()) + [t for e in manifest["params"].values() for t in e["fields"].values()]
    return sum(math.prod(t["shape"]) * itemsize(t["dtype"]) for t in tensors)


def _exercise(base, data: bytes, index: bytes | None = None) -> None:
    """Commit ``data`` as the manifest (and ``index`` as writer 0's index), then read, load and verify."""
    url, _, file_bytes, model, opt, (index_name, _) = base
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/manifest.msgpack", data)
    if index is not None:
        fs.pipe_file(f"{root}/{index_name}", index)
    tracemalloc.start()
    try:
        try:
            manifest = gefen_ckpt.read_manifest(url)
            gefen_ckpt.read(url)
            for t in manifest_module.open_checkpoint(Store(url)).tensors.values():
                t.pieces  # every index read and checked against the manifest  # noqa: B018
        except CheckpointError:
            manifest = None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * (len(data) + len(index or b"")) + 2**20, f"reading a {len(data)}-byte manifest took {peak} bytes"
    if manifest is not None:  # accepted, indexes too: what it describes must fit in the files
        assert _described_bytes(manifest) <= file_bytes
    try:
        gefen_ckpt.load(opt, url, model=model)
    except CheckpointError:
        pass
    report = gefen_ckpt.verify(url)
    assert report.ok or report.problems


@FUZZ
@given(VALUES)
def test_random_msgpack(base, value):
    _exercise(base, msgpack.packb(value, use_bin_type=True))


@st.composite
def mutated(draw, manifest: dict) -> dict:
    m = copy.deepcopy(manifest)
    for _ in range(draw(st.integers(1, 3))):
        parent, key = None, None
        node = m
        while isinstance(node, (dict, list)) and node and (parent is None or draw(st.integers(0, 3)) > 0):
            keys = sorted(node, key=str) if isinstance(node, dict) else range(len(node))
            parent, key = node, draw(st.sampled_from(list(keys)))
            node = node[key]
        if parent is None:
            continue
        action = draw(st.sampled_from(["replace", "delete", "nudge"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[key]
        elif action == "nudge" and type(node) is int:
            parent[key] = draw(st.sampled_from([node + 1, node - 1, -node - 1, node * 4096, 2**62, 2**63 - 1, 0]))
        else:
            parent[key] = draw(VALUES)
    return m


@FUZZ
@given(st.data())
def test_mutated_valid_manifest(base, data):
    """Mutations behind the manifest's checksum (recomputed), so that the validation sees them."""
    _exercise(base, manifest_module.encode(data.draw(mutated(base[1]))))


@FUZZ
@given(st.data())
def test_mutated_valid_index(base, data):
    """Writer 0's index mutated and re-pinned in the manifest (size and CRC): what its checks see."""
    index = msgpack.packb(data.draw(mutated(base[5][1])), use_bin_type=True)
    manifest = copy.deepcopy(base[1])
    manifest["writers"][0][1:3] = [len(index), checksum.update(0, index)]
    try:
        _exercise(base, manifest_module.encode(manifest), index)
    finally:  # the other examples see the valid index
        _exercise(base, manifest_module.encode(base[1]), msgpack.packb(base[5][1], use_bin_type=True))


@FUZZ
@given(st.data())
def test_damaged_manifest_bytes(base, data):
    raw = bytearray(msgpack.packb(base[1], use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    _exercise(base, bytes(raw[:cut]))


def test_hostile_sizes_are_refused_before_allocation(base):
    m = copy.deepcopy(base[1])
    field = m["params"]["up.weight"]["fields"]["mv_code"]
    field["shape"] = [2**40, 16]  # a terabyte of codes, but the files hold kilobytes
    with pytest.raises(CheckpointError):
        _exercise_raising(base, m)
    for deep in (b"\x91" * 100_000 + b"\xc0", b"\x81\xa1x" * 100_000 + b"\xc0"):  # nested 100k deep
        _exercise(base, deep)
    m = copy.deepcopy(base[1])
    nested = 1
    for _ in range(40):  # deeper than the informational fields may nest
        nested = [nested]
    m["metadata"] = {"x": nested}
    _exercise(base, msgpack.packb(m, use_bin_type=True))


def _exercise_raising(base, manifest: dict) -> None:
    url = base[0]
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/manifest.msgpack", manifest_module.encode(manifest))
    gefen_ckpt.read(url)


def _entry_by_entry(writers: list) -> bool:
    """The ``writers`` rules (docs/format.md), one entry at a time: the oracle of the reader's check."""
    seen = set()
    for w in writers:
        if type(w) is not list or len(w) < 3 or len(w) % 2 == 0:
            return False
        for name, size in zip([w[0], *w[3::2]], [w[1], *w[4::2]]):
            if (type(name) is not str or name in seen or name == manifest_module.MANIFEST_NAME
                    or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}", name)
                    or type(size) is not int or not 0 <= size <= 2**62):
                return False
            seen.add(name)
        if type(w[2]) is not int or not 0 <= w[2] < 2**32 or w[1] > manifest_module.MAX_INDEX_BYTES:
            return False
    return bool(writers)


@FUZZ
@given(st.data())
def test_fast_writers_check_accepts_nothing_the_checked_one_refuses(base, data):
    """The manifest reader's check of the ``writers`` (a few C-speed passes over all entries,
    then entry by entry only on failure) accepts exactly what the rules checked entry by entry do."""
    writers = base[1]["writers"]
    assert _entry_by_entry(writers)
    manifest_module._writers(writers)
    x = data.draw(mutated(writers))
    try:
        manifest_module._writers(x)
        accepted = True
    except CheckpointFormatError:
        accepted = False
    assert accepted == _entry_by_entry(x), x

"""Fuzzing the manifest reader: whatever the manifest holds (random msgpack, mutated valid
manifests, damaged bytes), reading, loading and verifying raise nothing but ``CheckpointError``,
and nothing is allocated beyond what the files on disk justify."""

from __future__ import annotations

import copy
import math
import tracemalloc
import uuid
from collections import defaultdict

import fsspec
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gefen_ckpt
from gefen_ckpt.errors import CheckpointError, CheckpointFormatError
from gefen_ckpt.wire import manifest as manifest_module
from gefen_ckpt.wire.dtypes import itemsize

from ckpt_util import fresh_like, trained

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("format_1x")]  # 1.x internals; 2.0: test_format2.py
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

SCALARS = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=12)
           | st.binary(max_size=12) | st.sampled_from([0, 1, -1, 2**31, 2**62, 2**63 - 1, "float32", "uint8", ""]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@pytest.fixture(scope="module")
def base():
    """A valid checkpoint in memory:// (several data files), its manifest, and an optimizer."""
    model, opt = trained("gefen_factored", steps=2)
    url = f"memory://fuzz-{uuid.uuid4().hex}/ck"
    gefen_ckpt.save(opt, url, model=model, max_file_bytes=4096)
    manifest = gefen_ckpt.read_manifest(url)
    fs, root = fsspec.core.url_to_fs(url)
    file_bytes = sum(info["size"] for info in fs.ls(root, detail=True) if info["name"].endswith(".safetensors"))
    target_model, target = fresh_like(model, "gefen_factored")
    return url, manifest, file_bytes, target_model, target


def _described_bytes(manifest: dict) -> int:
    tensors = list(manifest["globals"].values()) + [t for e in manifest["params"].values() for t in e["fields"].values()]
    return sum(math.prod(t["shape"]) * itemsize(t["dtype"]) for t in tensors)


def _exercise(base, data: bytes) -> None:
    url, _, file_bytes, model, opt = base
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/manifest.msgpack", data)
    tracemalloc.start()
    try:
        try:
            manifest = gefen_ckpt.read_manifest(url)
            gefen_ckpt.read(url)
        except CheckpointError:
            manifest = None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(data) + 2**20, f"reading a {len(data)}-byte manifest took {peak} bytes"
    if manifest is not None:  # accepted: what it describes must fit in the files
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
    _exercise(base, msgpack.packb(data.draw(mutated(base[1])), use_bin_type=True))


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
    fs.pipe_file(f"{root}/manifest.msgpack", msgpack.packb(manifest, use_bin_type=True))
    gefen_ckpt.read(url)


@FUZZ
@given(st.data())
def test_fast_tensor_check_accepts_nothing_the_checked_one_refuses(base, data):
    """The manifest reader's fast path (no error messages) is never more lenient than the
    checked path, and returns the same record when it accepts."""
    m = base[1]
    files = manifest_module._files(m["files"])
    entries = [t for e in m["params"].values() for t in e["fields"].values()]
    entry = data.draw(st.sampled_from(entries))
    assert manifest_module._fast_tensor(entry, "f", "x", files) is not None
    x = data.draw(mutated(entry))
    fast = manifest_module._fast_tensor(x, "f", "x", files)
    try:
        checked = manifest_module._checked_tensor(x, "where", "f", "x", files, defaultdict(list))
    except CheckpointFormatError:
        checked = None
    if fast is not None:
        assert checked == fast[0]

"""Staged loads: verified views of a private mapping (what a Gefen optimizer's load stages) and
reads into fresh memory (what a torch optimizer keeps) give the same bits; mapped tensors are
never changed by the files afterwards in the ways gefen_ckpt changes files; the optimizer never
aliases a checkpoint file; the prefetch that overlaps the disk with validation never hangs."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch

import gefen_ckpt
from gefen_ckpt.errors import CheckpointCorruptError
from gefen_ckpt.io import storage
from gefen_ckpt.io.storage import Prefetch, Store
from gefen_ckpt.wire.manifest import open_checkpoint
from gefen_ckpt.wire.reader import lazy_state, stage_checkpoint, stage_state

from ckpt_util import bits_equal, canonical_equal, fresh_like, same, snapshot, trained

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=["gefen_factored", "hybrid_adamw"])
def source(request):
    return request.param, trained(request.param, steps=3, seed=0)


def saved(tmp_path, source, max_file_bytes=1024) -> str:
    _, (model, opt) = source
    url = str(tmp_path / "ck")
    gefen_ckpt.write(gefen_ckpt.export_canonical(opt, model=model), url, max_file_bytes=max_file_bytes,
                     memory_budget=1024)
    return url


def test_mapped_and_read_staging_agree_bitwise(tmp_path, source):
    url = saved(tmp_path, source)  # small files: tensors split over several files and pieces
    store = Store(url)
    manifest = open_checkpoint(store)
    assert any(len(t.pieces) > 1 for t in manifest.tensors.values())
    read = stage_state(store, manifest)
    mapped = stage_checkpoint(store, map_files=True)
    assert canonical_equal(read, mapped)
    assert canonical_equal(gefen_ckpt.read(url), mapped)


def test_mapped_lazy_reads_agree_with_reads_and_verify_pieces(tmp_path, source):
    """What a Gefen optimizer's collective load reads: row ranges across piece and file boundaries."""
    url = saved(tmp_path, source)
    manifest = open_checkpoint(Store(url))
    mapped, read = lazy_state(Store(url), manifest, map_files=True), lazy_state(Store(url), manifest)
    assert canonical_equal(read, mapped)
    for key, src in read.tensors():
        rows = src.shape[0] if src.shape else 1
        for start, stop in [(0, 1), (1, rows), (rows // 3, rows - rows // 3), (rows, rows)]:
            if src.shape and start <= stop:
                got = dict(mapped.tensors())[key].read(start, stop)
                assert bits_equal(got, src.read(start, stop)), (key, start, stop)
    for _, src in mapped.tensors():  # every read is memory of its own (a load keeps it)
        first = src.read()
        if first.numel():
            first.view(-1).view(torch.uint8)[0] ^= 0xFF
            assert not bits_equal(first, src.read())
    t = next(t for t in manifest.tensors.values() if len(t.pieces) > 1)
    piece = t.pieces[1]
    with open(os.path.join(url, piece.file), "r+b") as f:  # damage one piece
        f.seek(piece.offset)
        b = f.read(1)
        f.seek(piece.offset)
        f.write(bytes([b[0] ^ 1]))
    fresh = dict(lazy_state(Store(url), manifest, map_files=True).tensors())
    key = next(k for k, src in fresh.items() if src.tensor is t)
    if piece.rows[0]:  # the undamaged piece before it still reads
        assert bits_equal(fresh[key].read(0, piece.rows[0]), dict(read.tensors())[key].read(0, piece.rows[0]))
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        fresh[key].read(piece.rows[0], piece.rows[0] + 1)


def test_mapped_tensors_survive_overwrite_and_delete_and_never_write_back(tmp_path, source):
    url = saved(tmp_path, source, max_file_bytes=2**30)
    mapped = stage_checkpoint(Store(url), map_files=True)
    expected = {key: src.read().clone() for key, src in mapped.tensors()}
    for _, src in mapped.tensors():  # copy-on-write: a write changes this process's copy only
        t = src.read()
        if t.numel():
            t.view(-1).view(torch.uint8)[0] ^= 0xFF
            t.view(-1).view(torch.uint8)[0] ^= 0xFF
    assert gefen_ckpt.verify(url).ok
    kind, (model, opt) = source
    other_model, other = fresh_like(model, kind)
    gefen_ckpt.save(other, url, model=other_model)  # a new save replaces the files at the URL
    shutil.rmtree(url)
    for key, src in mapped.tensors():
        assert bits_equal(src.read(), expected[key]), key


@pytest.mark.parametrize("kind", ["gefen_factored", "adamw", "hybrid_adamw"])
def test_a_loaded_optimizer_does_not_alias_the_files(tmp_path, kind):
    """Rewriting a data file in place after a load must not reach the optimizer's state (a
    private mapping shows such writes until a page is copied)."""
    model, opt = trained(kind, steps=3, seed=0)
    url = str(tmp_path / "ck")
    gefen_ckpt.save(opt, url, model=model)
    target_model, target = fresh_like(model, kind)
    gefen_ckpt.load(target, url, model=target_model)
    before = snapshot(target, target_model)
    for name in os.listdir(url):
        if name.endswith(".safetensors"):
            path = os.path.join(url, name)
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                f.seek(min(4096, size // 2))
                f.write(b"\xa5" * (size - f.tell()))
    assert same(before, snapshot(target, target_model))


# ----- the prefetch ---------------------------------------------------------------------------
@pytest.fixture(params=[True, False], ids=["C", "python"])
def prefetch_kind(request, monkeypatch):
    """Both prefetch loops: the C thread (``gefen_prefetch_start``) and the Python fallback."""
    from gefen_ckpt.io import native

    if request.param and not native.io:
        pytest.skip("no C library on this machine/build")
    monkeypatch.setattr(native, "io", request.param)


def write(path, nbytes: int) -> str:
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
    return str(path)


def test_prefetch_reads_in_order_and_waits_return(tmp_path, prefetch_kind):
    a, b = write(tmp_path / "a", 3 << 20), write(tmp_path / "b", 1 << 20)
    warming = Prefetch([(a, 3 << 20), (b, 1 << 20)])
    warming.wait(b, 1 << 20)
    assert warming.cached == 4 << 20
    warming.wait(a, 1)  # already passed
    warming.wait(str(tmp_path / "not-prefetched"), 10)  # not its file: returns at once
    warming.stop()


def test_prefetch_stays_within_its_lead(tmp_path, monkeypatch, prefetch_kind):
    monkeypatch.setattr(storage, "PREFETCH_CHUNK", 256 << 10)
    path = write(tmp_path / "a", 4 << 20)
    warming = Prefetch([(path, 4 << 20)], lead=1 << 20)
    time.sleep(0.3)
    assert warming.cached <= 1 << 20  # nobody asked for anything yet
    warming.wait(path, 2 << 20)
    time.sleep(0.3)
    assert 2 << 20 <= warming.cached <= 3 << 20
    warming.wait(path, 4 << 20)
    assert warming.cached == 4 << 20


@pytest.mark.parametrize("damage", ["missing", "short"])
def test_prefetch_of_a_bad_file_never_blocks_its_reader(tmp_path, damage, prefetch_kind):
    path = str(tmp_path / "a")
    if damage == "short":
        write(path, 1000)
    warming = Prefetch([(path, 5 << 20), (write(tmp_path / "b", 100), 100)])
    done = threading.Event()
    threading.Thread(target=lambda: (warming.wait(path, 5 << 20), done.set()), daemon=True).start()
    assert done.wait(10)


def test_stop_releases_waiters(tmp_path, monkeypatch, prefetch_kind):
    monkeypatch.setattr(storage, "PREFETCH_CHUNK", 4096)
    path = write(tmp_path / "a", 1 << 20)
    warming = Prefetch([(path, 1 << 20)], lead=0)  # runs only as far as asked
    warming.stop()
    warming.wait(path, 1 << 20)  # returns: the prefetch gave up
    time.sleep(0.1)  # and its thread, if still running, never counts what it did not read
    assert warming.cached < 1 << 20


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_drops_a_native_prefetch_without_joining_it(tmp_path, prefetch_kind):
    """A child forked during a load inherits the object, not the C thread: freeing it there
    must not join a thread that does not exist (it would hang or crash)."""
    import gc

    path = write(tmp_path / "a", 1 << 20)
    warming = Prefetch([(path, 1 << 20)], lead=0)
    pid = os.fork()
    if pid == 0:  # child: drop it and exit at once
        try:
            del warming
            gc.collect()
        finally:
            os._exit(0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, 9)
        pytest.fail("the child hung freeing the prefetch")
    assert os.waitstatus_to_exitcode(status) == 0
    warming.stop()

"""The reliability failures of an adversarial pass (concurrent writers, a listing race, an
unchecksummed manifest, half-applied torch loads, unbounded decoding, leaks), each reproduced
with an injected hook or a crafted file and shown fixed. Soak variants are marked ``slow``."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
import tracemalloc

import msgpack
import pytest
from ckpt_edits import data_files, index_entry, rewrite_index, rewrite_manifest, stored_files

import gefen_ckpt
import gefen_ckpt.io.storage as storage
from gefen_ckpt.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointStorageError,
)
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire import manifest as mf
from gefen_ckpt.wire import writelock, writer

from ckpt_util import OPTIMIZERS, Tiny, fresh_like, same, snapshot, train, trained


def _files(url) -> set[str]:
    return set(os.listdir(url))


# ----- 1. concurrent writers ------------------------------------------------------------------
def _held_save(opt, model, url, inside: threading.Event, go_on: threading.Event, monkeypatch):
    """Start a save in a thread that stops just before publishing its manifest (the moment
    the adversarial run slowed writer Y at) until ``go_on`` is set."""
    real = writer.commit

    def slow_commit(*args, **kwargs):
        if threading.current_thread().name == "writer-y":
            inside.set()
            go_on.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "commit", slow_commit)
    errors: list[BaseException] = []

    def run():
        try:
            gefen_ckpt.save(opt, url, model=model)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run, name="writer-y")
    thread.start()
    assert inside.wait(30)
    return thread, errors


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_a_second_writer_is_refused_and_the_first_commits_intact(tmp_path, monkeypatch, backend):
    url = str(tmp_path / "ck") if backend == "local" else f"memory://reliability-{os.getpid()}-{time.time_ns()}/ck"
    model, opt = trained("gefen_factored", steps=2)
    gefen_ckpt.save(opt, url, model=model)
    train(model, opt, 1)
    inside, go_on = threading.Event(), threading.Event()
    thread, errors = _held_save(opt, model, url, inside, go_on, monkeypatch)
    try:
        with pytest.raises(CheckpointLockedError, match="another save to this location is in progress"):
            gefen_ckpt.save(opt, url, model=model)  # writer X, while Y is about to publish
    finally:
        go_on.set()
        thread.join(30)
    assert not errors
    clone, fresh = fresh_like(model, "gefen_factored")
    gefen_ckpt.load(fresh, url, model=clone)  # Y's checkpoint is complete: nothing of it was deleted
    assert same(snapshot(fresh, clone), snapshot(opt, model))
    assert gefen_ckpt.verify(url).ok
    gefen_ckpt.save(opt, url, model=model)  # and the lock was released


def test_a_save_deletes_only_what_its_own_commit_made_unreferenced(tmp_path):
    url = tmp_path / "ck"
    model, opt = trained("adamw", steps=1)
    gefen_ckpt.save(opt, str(url), model=model)
    old = stored_files(url)
    foreign = "data-00000000000000aa-r00000-00000.safetensors"  # another writer's, not yet committed
    (url / foreign).write_bytes(b"x" * 100)
    gefen_ckpt.save(opt, str(url), model=model)
    assert foreign in _files(url)
    assert not old & _files(url)  # the replaced checkpoint's files went


def test_the_files_of_a_save_that_died_holding_the_lock_are_removed(tmp_path):
    """A lock file left non-empty and unlocked names a save that died (kill -9): the next save
    takes the lock and removes that save's files, and nothing else."""
    url = tmp_path / "ck"
    model, opt = trained("adamw", steps=1)
    gefen_ckpt.save(opt, str(url), model=model)
    dead = "00000000000000dd"
    (url / writelock.LOCK_NAME).write_text(f'{{"host": "h", "pid": 1, "token": "{dead}", "time": 0}}')
    (url / f"data-{dead}-r00000-00000.safetensors").write_bytes(b"partial")
    (url / f"manifest.msgpack.{dead}.tmp").write_bytes(b"partial")
    gefen_ckpt.save(opt, str(url), model=model)
    assert not any(dead in name for name in _files(url))
    assert gefen_ckpt.verify(str(url)).ok


def test_a_stale_object_store_lock_is_broken_and_a_live_one_refuses():
    url = f"memory://reliability-stale-{time.time_ns()}/ck"
    store = storage.Store(url)
    store.makedirs()
    store.create_exclusive(writelock.LOCK_NAME, b'{"host": "elsewhere", "pid": 7, "token": "ab", "time": 0}')
    model, opt = trained("adamw", steps=1)
    gefen_ckpt.save(opt, url, model=model)  # older than STALE_AFTER: broken
    assert writelock.LOCK_NAME not in store.listing()  # released after the save
    store.create_exclusive(writelock.LOCK_NAME, writelock._me("cd"))  # a live holder on this host
    with pytest.raises(CheckpointLockedError, match=f"pid {os.getpid()}"):
        gefen_ckpt.save(opt, url, model=model)


def _racer(url: str, wanted: int, seed: int, start, out) -> None:
    """Save until ``wanted`` saves succeeded (a refused attempt returns at once, so counting
    attempts would let one process spend all of them during the other's save); ``start``: a
    barrier, so both race from the same moment."""
    model, opt = trained("adamw", steps=1, seed=seed)
    start.wait()
    outcome = {"ok": 0, "refused": 0, "other": []}
    while outcome["ok"] < wanted and outcome["refused"] < 1_000_000 and not outcome["other"]:
        try:
            gefen_ckpt.save(opt, url, model=model)
            outcome["ok"] += 1
        except CheckpointLockedError:
            outcome["refused"] += 1
        except Exception as exc:  # noqa: BLE001 - counted as a failure
            outcome["other"].append(repr(exc))
    out.put(outcome)


@pytest.mark.slow
def test_racing_processes_never_fail_other_than_refused_and_leave_a_loadable_checkpoint(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    url, out, start = str(tmp_path / "ck"), ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_racer, args=(url, 50, seed, start, out)) for seed in (0, 1)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    assert not [r["other"] for r in results if r["other"]]
    assert [r["ok"] for r in results] == [50, 50], results  # both made progress: neither was locked out
    assert sum(r["refused"] for r in results) > 0, results  # they did race
    assert gefen_ckpt.verify(url).ok


# ----- 2. a listing race ----------------------------------------------------------------------
def test_a_file_vanishing_while_listed_does_not_hide_the_checkpoint(tmp_path, monkeypatch):
    url = tmp_path / "ck"
    model, opt = trained("adamw", steps=1)
    gefen_ckpt.save(opt, str(url), model=model)
    real_scandir = os.scandir

    class Vanishing:
        """``os.scandir`` whose entries are read, then one unrelated file is deleted before
        its ``stat()`` (what another process's clean-up does mid-listing)."""

        def __init__(self, path):
            (url / "junk.tmp").write_bytes(b"x")
            self.it = real_scandir(path)
            self.entries = list(self.it)
            (url / "junk.tmp").unlink()

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            self.it.close()

    monkeypatch.setattr(storage.os, "scandir", Vanishing)
    listing = storage.Store(str(url)).listing()
    assert mf.MANIFEST_NAME in listing and "junk.tmp" not in listing
    assert gefen_ckpt.read_manifest(str(url))["format"] == "gefen-ckpt"


# ----- 3. the manifest's own checksum ---------------------------------------------------------
def test_every_single_byte_flip_of_the_manifest_is_refused(tmp_path):
    url = tmp_path / "ck"
    model, opt = trained("adamw", steps=1)
    gefen_ckpt.save(opt, str(url), model=model)
    data = (url / mf.MANIFEST_NAME).read_bytes()
    assert mf.has_checksum(data)
    accepted = []
    for i in range(len(data)):
        for bit in (0x01, 0x80):
            flipped = bytearray(data)
            flipped[i] ^= bit
            try:
                mf.validate(mf.decode(bytes(flipped)))
            except CheckpointFormatError:
                continue
            accepted.append((i, bit))
    assert not accepted


def test_a_flipped_hyperparameter_is_refused_by_load_and_verify(tmp_path):
    url = tmp_path / "ck"
    model, opt = trained("adamw", steps=1)
    gefen_ckpt.save(opt, str(url), model=model)
    path = url / mf.MANIFEST_NAME
    data = bytearray(path.read_bytes())
    at = data.index(msgpack.packb(0.01)) + 3  # lr = 0.01, a float64: damage its mantissa
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    report = gefen_ckpt.verify(str(url))
    assert not report.ok and "checksum" in report.problems[0]
    clone, fresh = fresh_like(model, "adamw")
    with pytest.raises(CheckpointFormatError, match="checksum"):
        gefen_ckpt.load(fresh, str(url), model=clone)


def test_a_manifest_without_its_checksum_is_refused(tmp_path):
    url = tmp_path / "ck"
    model, opt = trained("adamw", steps=1)
    gefen_ckpt.save(opt, str(url), model=model)
    path = url / mf.MANIFEST_NAME
    m = msgpack.unpackb(path.read_bytes())
    del m[mf.MANIFEST_CHECKSUM]
    path.write_bytes(msgpack.packb(m))  # otherwise intact: damaged all the same
    with pytest.raises(CheckpointFormatError, match="must end with its checksum"):
        gefen_ckpt.read_manifest(str(url))
    clone, fresh = fresh_like(model, "adamw")
    before = snapshot(fresh, clone)
    with pytest.raises(CheckpointFormatError, match="checksum"):
        gefen_ckpt.load(fresh, str(url), model=clone)
    assert same(snapshot(fresh, clone), before)
    report = gefen_ckpt.verify(str(url))
    assert not report.ok and "checksum" in report.problems[0]


# ----- 4. no half-applied torch loads; verify refuses what load refuses -----------------------
@pytest.mark.parametrize("field", ["step", "exp_avg"])
def test_a_torch_checkpoint_missing_a_required_field_is_refused_before_mutation(tmp_path, field):
    url = tmp_path / "ck"
    model, opt = trained("adamw", steps=2)
    gefen_ckpt.save(opt, str(url), model=model)
    rewrite_manifest(url, lambda m: m["params"]["up.weight"]["fields"].pop(field))
    clone, target = trained("adamw", steps=1, seed=3)
    before = snapshot(target, clone)
    with pytest.raises(CheckpointError, match=f"'{field}'"):
        gefen_ckpt.load(target, str(url), model=clone)
    assert same(snapshot(target, clone), before)
    train(clone, target, 1)  # the optimizer still steps
    report = gefen_ckpt.verify(str(url))
    assert not report.ok and field in report.problems[0]


@pytest.mark.parametrize("change, words", [
    (lambda m: m["contract"].__setitem__("schema_version", 99), "schema"),
    (lambda m: m["globals"].pop("codebook"), "codebook"),
])
def test_verify_refuses_what_load_refuses(tmp_path, change, words):
    url = tmp_path / "ck"
    model, opt = trained("gefen_factored", steps=1)
    gefen_ckpt.save(opt, str(url), model=model)
    rewrite_manifest(url, change)
    clone, fresh = fresh_like(model, "gefen_factored")
    with pytest.raises(CheckpointError) as refused:
        gefen_ckpt.load(fresh, str(url), model=clone)
    report = gefen_ckpt.verify(str(url))
    assert not report.ok and words in str(refused.value) and words in report.problems[0]


def test_verify_checks_that_padding_is_zero(tmp_path):
    url = tmp_path / "ck"
    model = Tiny(dim=64)  # pieces of 4 KiB and more start on 64-byte boundaries: padding before them
    opt = OPTIMIZERS["adamw"](model)
    train(model, opt, 1)
    gefen_ckpt.save(opt, str(url), model=model)
    name = data_files(url)[0]
    pieces = sorted((p.offset, p.nbytes) for t in mf.open_checkpoint(Store(str(url))).tensors.values()
                    for p in t.pieces if p.file == name)
    gap = next(a + n for (a, n), (b, _) in zip(pieces, pieces[1:]) if b > a + n)
    path = url / name
    data = bytearray(path.read_bytes())
    data[gap] = 0x55
    path.write_bytes(bytes(data))
    report = gefen_ckpt.verify(str(url))
    assert not report.ok and "padding" in report.problems[0]


# ----- 5. bounded decoding; the live model checked before any data is read --------------------
def _hostile(kind: str, size: int) -> bytes:
    """About ``size`` bytes of msgpack that costs the most decoded memory per byte."""
    if kind == "empty maps":
        body = [{} for _ in range(size)]
    elif kind == "nils":
        body = [None] * size
    elif kind == "short strings":
        body = ["ab"] * (size // 3)
    elif kind == "small maps":
        body = [{"ab": "cd"} for _ in range(size // 7)]
    else:  # nested pairs of lists
        body = [[[], []] for _ in range(size // 3)]
    return mf.encode({"format": "gefen-ckpt", "version": [2, 0], "metadata": {"x": body}})


@pytest.mark.parametrize("kind", ["empty maps", "nils", "short strings", "small maps", "pairs"])
def test_decoding_any_manifest_is_bounded_in_memory_and_time(kind):
    data = _hostile(kind, 2**20)  # the cost per byte does not depend on the size
    tracemalloc.start()
    started = time.perf_counter()
    try:
        try:
            mf.validate(mf.decode(data))
        except CheckpointFormatError:
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= mf.DECODE_MEMORY_FACTOR * len(data), (kind, peak / len(data))
    assert time.perf_counter() - started < 20


def _reshaped(url) -> None:
    """up.weight (48 x 16) and its param-shaped fields declared 24 x 32 (the same bytes), their
    pieces in the index re-cut to match: a valid checkpoint; only the live model can tell."""
    def manifest(m):
        entry = m["params"]["up.weight"]
        entry["shape"] = [24, 32]
        for field in ("exp_avg", "exp_avg_sq"):
            entry["fields"][field]["shape"] = [24, 32]

    def index(raw):
        for field in ("exp_avg", "exp_avg_sq"):
            (piece,) = index_entry(raw, url, "up.weight", field)
            piece[1] = 24

    rewrite_index(url, 0, index)
    rewrite_manifest(url, manifest)


def test_a_shape_mismatch_is_refused_before_any_data_is_read(tmp_path, monkeypatch):
    from gefen_ckpt.wire import reader

    url = tmp_path / "ck"
    model, opt = trained("adamw", steps=1)
    gefen_ckpt.save(opt, str(url), model=model)
    _reshaped(url)  # a valid checkpoint of another model: up.weight is 24 x 32, not 48 x 16
    assert gefen_ckpt.verify(str(url)).ok

    def no_reads(*args, **kwargs):
        raise AssertionError("tensor data was read before the shape check")

    monkeypatch.setattr(reader, "stage_state", no_reads)
    clone, fresh = fresh_like(model, "adamw")
    with pytest.raises(CheckpointMismatchError, match="up.weight"):
        gefen_ckpt.load(fresh, str(url), model=clone)


# ----- 7. storage errors name the path --------------------------------------------------------
def test_an_unreachable_object_store_is_one_storage_error_naming_the_path():
    pytest.importorskip("s3fs")
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = "s3://bucket/run/ck"
    options = {"key": "k", "secret": "s", "endpoint_url": f"http://127.0.0.1:{port}", "skip_instance_cache": True,
               "config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}}
    started = time.perf_counter()
    with pytest.raises(CheckpointStorageError, match="bucket/run/ck"):
        gefen_ckpt.read_manifest(url, storage_options=options)
    assert time.perf_counter() - started < 30


# ----- 8. no leaks when the commit fails ------------------------------------------------------
@pytest.mark.parametrize("where", ["manifest write", "rename"])
def test_a_failed_commit_leaves_only_the_previous_checkpoint(tmp_path, monkeypatch, where):
    url = tmp_path / "ck"
    model, opt = trained("adamw", steps=1)
    gefen_ckpt.save(opt, str(url), model=model)
    before = _files(url)
    train(model, opt, 1)
    if where == "rename":
        def fail(*args):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(storage.os, "replace", fail)
    else:
        real_create = storage.Store.create

        def create(self, name, durable=True):
            if name.startswith(mf.MANIFEST_NAME):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_create(self, name, durable)

        monkeypatch.setattr(storage.Store, "create", create)
    for _ in range(3):  # no retry on a full disk may leak another save
        with pytest.raises(OSError):
            gefen_ckpt.save(opt, str(url), model=model)
        assert _files(url) == before
    monkeypatch.undo()
    assert gefen_ckpt.verify(str(url)).ok


# ----- non-regular files and links inside a checkpoint ---------------------------------------
_OPEN = {  # what opens the checkpoint at sys.argv[1], in a child process (a FIFO would block it)
    "load": "import gefen_ckpt, ckpt_util as u; m, o = u.fresh_like(u.make_model(0), 'adamw'); "
            "gefen_ckpt.load(o, sys.argv[1], model=m)",
    "read": "import gefen_ckpt; [s.read() for _, s in gefen_ckpt.read(sys.argv[1]).tensors()]",
    "verify": "import gefen_ckpt; r = gefen_ckpt.verify(sys.argv[1]); print(r.problems); sys.exit(0 if r.ok else 3)",
    "save": "import gefen_ckpt, ckpt_util as u; m, o = u.trained('adamw', steps=1); "
            "gefen_ckpt.save(o, sys.argv[1], model=m)",
}


def _in_child(code: str, *args: str) -> subprocess.CompletedProcess:
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {tests!r}); {code}", *args],
                          capture_output=True, text=True, timeout=120)


def _saved(tmp_path):
    url = tmp_path / "ck"
    model, opt = trained("adamw", steps=1)
    gefen_ckpt.save(opt, str(url), model=model)
    return url


def _one_of(url, prefix: str) -> str:
    return next(n for n in sorted(_files(url)) if n.startswith(prefix))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["manifest.msgpack", "index-", "data-"])
def test_a_fifo_inside_a_checkpoint_is_refused_on_every_path_never_waited_on(tmp_path, where):
    """``inspect`` and a lazy read hung forever on a FIFO where the manifest should be: every open
    inside a checkpoint is non-blocking and refuses what is not a regular file."""
    url = _saved(tmp_path)
    name = _one_of(url, where)
    os.unlink(url / name)
    os.mkfifo(url / name)
    for how in ("load", "read", "verify"):
        done = _in_child(_OPEN[how], str(url))
        assert done.returncode != 0, (how, done.stdout, done.stderr)
        assert "CheckpointError" in done.stderr or "Checkpoint" in done.stderr or how == "verify", (how, done.stderr)
        text = done.stdout + done.stderr
        assert "not a regular file" in text, (how, text[-2000:])
    cli = subprocess.run([sys.executable, "-m", "gefen_cli", "inspect", str(url)], capture_output=True, text=True,
                         timeout=120)
    if where == "manifest.msgpack":  # inspect reads only the manifest (and the codebook)
        assert cli.returncode == 1 and "not a regular file (a FIFO)" in cli.stderr, cli.stderr


@pytest.mark.timeout(300)
def test_a_fifo_lock_or_names_file_is_refused(tmp_path):
    url = _saved(tmp_path)
    os.unlink(url / writelock.LOCK_NAME)
    os.mkfifo(url / writelock.LOCK_NAME)
    done = _in_child(_OPEN["save"], str(url))
    assert done.returncode != 0 and "not a regular file" in done.stderr, done.stderr
    names = tmp_path / "names.txt"
    os.mkfifo(names)
    model, opt = trained("adamw", steps=1)
    import torch

    torch.save(opt.state_dict(), tmp_path / "opt.pt")  # saved without names: --param-names gives them
    cli = subprocess.run([sys.executable, "-m", "gefen_cli", "inspect", str(tmp_path / "opt.pt"), "--param-names",
                          str(names)], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 1 and "not a regular file (a FIFO)" in cli.stderr, cli.stderr
    from gefen_ckpt.checkpoints import write

    dcp = tmp_path / "dcp"  # torch's reader opens a DCP directory's files: they are checked first
    write(gefen_ckpt.read(str(url)), str(dcp), "dcp")
    os.unlink(dcp / ".metadata")
    os.mkfifo(dcp / ".metadata")
    cli = subprocess.run([sys.executable, "-m", "gefen_cli", "inspect", str(dcp)], capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 1 and "not a regular file (a FIFO)" in cli.stderr, cli.stderr


def test_a_save_never_writes_through_a_symlinked_lock_file(tmp_path):
    """The lock file is opened with O_NOFOLLOW: a link planted there cannot make a save empty (or
    write its JSON into) the file it points at."""
    url = _saved(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.unlink(url / writelock.LOCK_NAME)
    os.symlink(victim, url / writelock.LOCK_NAME)
    before = _files(url)
    model, opt = trained("adamw", steps=2)
    with pytest.raises(CheckpointFormatError, match="symbolic link"):
        gefen_ckpt.save(opt, str(url), model=model)
    assert victim.read_text() == "precious" and _files(url) == before


@pytest.mark.parametrize("how", ["load", "read"])
def test_a_symlinked_data_file_is_refused_by_every_reader(tmp_path, how):
    """One policy for links inside a checkpoint (every reader refuses them; a collective load too:
    tests/dist/test_dist_format2.py), also for a lazy read, which lists nothing."""
    url = _saved(tmp_path)
    name = _one_of(url, "data-")
    os.rename(url / name, tmp_path / name)
    os.symlink(tmp_path / name, url / name)
    model, _ = trained("adamw", steps=1)
    clone, fresh = fresh_like(model, "adamw")
    before = snapshot(fresh, clone)
    with pytest.raises(CheckpointError, match="symbolic link|not a regular file"):
        if how == "load":
            gefen_ckpt.load(fresh, str(url), model=clone)
        else:
            [src.read() for _, src in gefen_ckpt.read(str(url)).tensors()]
    assert same(snapshot(fresh, clone), before)


def test_a_world_size_beyond_the_maximum_is_refused_before_anything_is_written(tmp_path):
    """``write(..., world_size=2**31)`` allocated per rank until the machine's memory was gone."""
    from gefen_ckpt.wire.index import MAX_WORLD_SIZE

    model, opt = trained("adamw", steps=1)
    state = gefen_ckpt.export_canonical(opt, model=model)
    started = time.monotonic()
    with pytest.raises(ValueError, match="1,048,576"):
        gefen_ckpt.write(state, str(tmp_path / "ck"), world_size=MAX_WORLD_SIZE + 1)
    assert time.monotonic() - started < 5 and not (tmp_path / "ck").exists()

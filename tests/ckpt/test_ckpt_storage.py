"""Every fsspec backend we promise: local paths, file://, memory://, and S3 over real HTTP
(moto's server mode on loopback, with s3fs as the client)."""

from __future__ import annotations

import uuid

import fsspec
import pytest

import gefen_ckpt
from gefen_ckpt.errors import CheckpointCorruptError, CheckpointIncompleteError
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire.manifest import open_checkpoint

from ckpt_util import fresh_like, same, snapshot, trained

pytestmark = pytest.mark.timeout(180)


def _stored(url) -> list[str]:
    """Every data file and index the committed manifest names."""
    return [name for w in gefen_ckpt.read_manifest(url)["writers"] for name in (w[0], *w[3::2])]


@pytest.fixture(scope="module")
def s3_endpoint():
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed: S3 tests need it")
    pytest.importorskip("s3fs", reason="s3fs is not installed: S3 tests need it")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("gefen-test-bucket")
    try:
        yield endpoint
    finally:
        if saved is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved
        fsspec.filesystem("s3").clear_instance_cache()
        server.stop()


def _urls(tmp_path, request):
    return {
        "path": str(tmp_path / "ck"),
        "file": f"file://{tmp_path}/ck",
        "memory": f"memory://gefen-{uuid.uuid4().hex}/ck",
        "s3": f"s3://gefen-test-bucket/{uuid.uuid4().hex}/ck",
    }


@pytest.mark.parametrize("backend", ["path", "file", "memory", "s3"])
def test_backends_round_trip_verify_and_overwrite(tmp_path, request, backend):
    if backend == "s3":
        request.getfixturevalue("s3_endpoint")
    url = _urls(tmp_path, request)[backend]
    with pytest.raises(CheckpointIncompleteError):
        gefen_ckpt.read(url)
    model, opt = trained("gefen_factored")
    small = 16384 if backend == "s3" else 4096  # several files and split pieces (fewer HTTP calls on S3)
    gefen_ckpt.save(opt, url, model=model, max_file_bytes=small)
    first = set(_stored(url))
    assert len(first) > 2  # an index and several data files
    report = gefen_ckpt.verify(url)
    assert report.ok and report.pieces_checked > 0 and not report.warnings, report

    resumed, opt2 = fresh_like(model, "gefen_factored")
    gefen_ckpt.load(opt2, url, model=resumed)
    assert same(snapshot(opt, model), snapshot(opt2, resumed))
    src = gefen_ckpt.read(url).params["embed.weight"].fields["mv_code"]  # ranged read
    assert src.read(5, 9).equal(opt.state[model.embed.weight]["mv_code"][5:9])

    gefen_ckpt.save(opt2, url, model=resumed)  # overwrite: old data collected after commit
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    assert not names & first and "manifest.msgpack" in names
    assert gefen_ckpt.verify(url).ok


def test_s3_missing_object_is_reported(s3_endpoint):
    url = f"s3://gefen-test-bucket/{uuid.uuid4().hex}/ck"
    model, opt = trained("adamw")
    gefen_ckpt.save(opt, url, model=model)
    name = _stored(url)[1]  # the first data file (after its index)
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm_file(f"{root}/{name}")
    with pytest.raises(CheckpointCorruptError, match=name):
        gefen_ckpt.load(fresh_like(model, "adamw")[1], url, model=model)
    assert not gefen_ckpt.verify(url).ok


# ----- local writes ---------------------------------------------------------------------------
def _spans(chunks):
    import ctypes

    owners = [(ctypes.c_ubyte * len(c)).from_buffer_copy(c) for c in chunks]
    return owners, [(ctypes.addressof(o), len(c)) for o, c in zip(owners, chunks)]


@pytest.mark.parametrize("native", [True, False], ids=["C", "python"])
def test_local_writer_keeps_order_across_writes_and_hashed_spans(tmp_path, native, monkeypatch):
    """``write`` (coalesced when small) and ``write_hashed`` (one C call, or the Python fallback)
    interleave in order, and ``write_hashed`` returns zlib's CRC-32 of every span."""
    import os
    import zlib

    import gefen_ckpt.io.native
    import gefen_ckpt.io.storage as storage

    if native and not gefen_ckpt.io.native.io:
        pytest.skip("no C write path on this machine/build")
    monkeypatch.setattr(gefen_ckpt.io.native, "io", native)
    monkeypatch.setattr(storage, "WRITEBACK_EVERY", 3 * storage.WRITE_BUFFER + 11)
    small, large = [os.urandom(n) for n in (10, 100, 5)], [os.urandom(n) for n in (storage.WRITE_BUFFER + 7, 0, 1, 999_999)]
    hashed = [os.urandom(n) for n in (3 * storage.WRITE_BUFFER, 0, 4097, 2)]
    owners, spans = _spans(hashed)
    store = storage.Store(str(tmp_path))
    with store.create("f.bin") as out:
        for c in small:
            out.write(c)
        crcs = out.write_hashed(spans)
        for c in large:
            out.write(c)
    assert crcs == [zlib.crc32(c) for c in hashed]
    assert (tmp_path / "f.bin").read_bytes() == b"".join(small + hashed + large)


@pytest.mark.parametrize("native", [True, False], ids=["C", "python"])
def test_a_failed_write_surfaces_and_removes_the_file(tmp_path, native, monkeypatch):
    """A disk that fills up mid-file (the descriptor swapped for /dev/full): ``OSError`` from the
    ``with`` block, and no partial file left behind."""
    import os

    import gefen_ckpt.io.native
    import gefen_ckpt.io.storage as storage

    if not os.path.exists("/dev/full") or (native and not gefen_ckpt.io.native.io):
        pytest.skip("needs /dev/full (and the C write path for the C case)")
    monkeypatch.setattr(gefen_ckpt.io.native, "io", native)
    owners, spans = _spans([b"x" * (2 * storage.WRITE_BUFFER)] * 3)
    store = storage.Store(str(tmp_path))
    with pytest.raises(OSError) as failure:
        with store.create("f.bin") as out:
            out.write(b"header")
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, out.fd)
            os.close(full)
            out.write_hashed(spans)
    assert failure.value.errno == 28  # ENOSPC
    assert str(tmp_path / "f.bin") in str(failure.value)  # the message names the file
    assert not (tmp_path / "f.bin").exists()


def test_saves_with_and_without_the_c_library_write_the_same_bytes(tmp_path, monkeypatch):
    """The C write path (one call per batch, fsync on a C thread) and the Python fallback
    produce byte-identical data files and the same checksums."""
    from gefen_ckpt.io import native

    if not native.io:
        pytest.skip("no C library on this machine/build")
    model, opt = trained("gefen_factored")

    def saved(name: str) -> tuple[list[bytes], list]:
        url = str(tmp_path / name)
        gefen_ckpt.save(opt, url, model=model, max_file_bytes=4096)  # several files, padding between pieces
        files = [(tmp_path / name / f).read_bytes() for f in _stored(url)]  # indexes included
        pieces = [(key, p.checksum, p.offset) for key, t in open_checkpoint(Store(url)).tensors.items()
                  for p in t.pieces]
        return files, pieces

    with_c = saved("c")
    monkeypatch.setattr(native, "io", False)
    without = saved("python")
    assert len(with_c[0]) > 1 and with_c == without


def test_local_create_exclusive_refuses_an_existing_file(tmp_path):
    """The writer lock's primitive on a local directory: the first create writes the data, a
    second one raises ``FileExistsError`` and leaves the first file as it was."""
    store = Store(str(tmp_path))
    store.create_exclusive("lock", b"first")
    with pytest.raises(FileExistsError):
        store.create_exclusive("lock", b"second")
    assert (tmp_path / "lock").read_bytes() == b"first"

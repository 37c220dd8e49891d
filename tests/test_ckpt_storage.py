"""Every fsspec backend we promise: local paths, file://, memory://, and S3 over real HTTP
(moto's server mode on loopback, with s3fs as the client)."""

from __future__ import annotations

import uuid

import fsspec
import pytest

import gefen_ckpt
from gefen_ckpt.errors import CheckpointCorruptError, CheckpointIncompleteError

from ckpt_util import fresh_like, same, snapshot, trained

pytestmark = pytest.mark.timeout(180)


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
    first = {f["name"] for f in gefen_ckpt.read_manifest(url)["files"]}
    report = gefen_ckpt.verify(url)
    assert report.ok and report.pieces_checked > 0 and not report.warnings, report

    resumed, opt2 = fresh_like(model, "gefen_factored")
    gefen_ckpt.load(opt2, url, model=resumed)
    assert same(snapshot(opt, model), snapshot(opt2, resumed))
    src = gefen_ckpt.read(url).params["embed.weight"].fields["m_code"]  # ranged read
    assert src.read(5, 9).equal(opt.state[model.embed.weight]["m_code"][5:9])

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
    name = gefen_ckpt.read_manifest(url)["files"][0]["name"]
    fs, root = fsspec.core.url_to_fs(url)
    fs.rm_file(f"{root}/{name}")
    with pytest.raises(CheckpointCorruptError, match=name):
        gefen_ckpt.load(fresh_like(model, "adamw")[1], url, model=model)
    assert not gefen_ckpt.verify(url).ok


# ----- local write-behind ---------------------------------------------------------------------
@pytest.mark.parametrize("write_behind", [False, True])
def test_local_writer_keeps_order_across_small_and_large_writes(tmp_path, write_behind, monkeypatch):
    import os

    import gefen_ckpt.storage as storage

    monkeypatch.setattr(storage, "WRITE_BEHIND_BYTES", 3 * storage.WRITE_BUFFER)  # queue and wait
    chunks = [os.urandom(n) for n in (10, storage.WRITE_BUFFER + 7, 100, 5, 3 * storage.WRITE_BUFFER, 1, 999_999, 2)]
    store = storage.Store(str(tmp_path))
    with store.create("f.bin", write_behind=write_behind) as out:
        for c in chunks:
            out.write(c)
    assert (tmp_path / "f.bin").read_bytes() == b"".join(chunks)


def test_write_behind_error_surfaces_and_removes_the_file(tmp_path, monkeypatch):
    import os

    import gefen_ckpt.storage as storage

    calls = {"n": 0}
    real = os.write

    def failing(fd, data):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device (injected)")
        return real(fd, data)

    monkeypatch.setattr(storage.os, "write", failing)
    store = storage.Store(str(tmp_path))
    with pytest.raises(OSError, match="injected"):
        with store.create("f.bin", write_behind=True) as out:
            for _ in range(6):
                out.write(b"x" * (2 * storage.WRITE_BUFFER))
    assert not (tmp_path / "f.bin").exists()

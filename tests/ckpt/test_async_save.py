"""``gefen_ckpt.async_save``: the bytes of a synchronous save, written while training steps; one
save at a time; an error comes from the future and leaves the previous checkpoint committed."""

from __future__ import annotations

import os
import threading

import pytest

import gefen_ckpt
from gefen_ckpt.wire import writer

from ckpt_util import fresh_like, same, snapshot, train, trained

pytestmark = pytest.mark.timeout(300)


def _files(url) -> dict[str, bytes]:
    """Every data file and index by (kind, writer, n), token stripped: the names hold the token."""
    out = {}
    for name in os.listdir(url):
        if name.startswith(("data-", "index-")):
            kind, _, rest = name.split("-", 2)
            out[f"{kind}-{rest}"] = open(os.path.join(url, name), "rb").read()
    return out


def test_async_save_writes_what_save_writes_while_training_steps(tmp_path):
    model, opt = trained("gefen_factored", steps=2)
    want = snapshot(opt, model)
    gefen_ckpt.save(opt, str(tmp_path / "sync"), model=model)
    future = gefen_ckpt.async_save(opt, str(tmp_path / "async"), model=model)
    train(model, opt, 2, seed=5)  # the write proceeds from the staged copy
    assert future.result(timeout=120) is None
    assert _files(tmp_path / "sync") == _files(tmp_path / "async")
    a, b = (gefen_ckpt.read_manifest(str(tmp_path / d)) for d in ("sync", "async"))
    for m in (a, b):
        m.pop("created"), m.pop("writers"), m.pop("manifest_checksum")  # times and tokens differ
    assert a == b
    back_model, back = fresh_like(model, "gefen_factored")
    gefen_ckpt.load(back, str(tmp_path / "async"), model=back_model)
    assert same(snapshot(back, back_model), want)
    # steady state: the buffers are reused
    from gefen_ckpt import async_io

    buffers = {k: v.data_ptr() for k, v in async_io._buffers.items()}
    gefen_ckpt.async_save(opt, str(tmp_path / "async"), model=model).result(timeout=120)
    assert {k: v.data_ptr() for k, v in async_io._buffers.items()} == buffers


def test_a_second_async_save_waits_for_the_first(tmp_path, monkeypatch):
    model, opt = trained("gefen_factored", steps=1)
    release, started = threading.Event(), threading.Event()
    real = writer.write_state

    def slow(*args, **kwargs):
        started.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "write_state", slow)
    first = gefen_ckpt.async_save(opt, str(tmp_path / "a"), model=model)
    assert started.wait(60)
    seen = {}

    def second():
        f = gefen_ckpt.async_save(opt, str(tmp_path / "b"), model=model)
        seen["first_done_when_second_returned"] = first.done()
        seen["future"] = f

    t = threading.Thread(target=second)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # blocked behind the first
    release.set()
    t.join(60)
    assert seen["first_done_when_second_returned"]
    first.result(timeout=60)
    seen["future"].result(timeout=60)


def test_an_error_comes_from_the_future_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    model, opt = trained("gefen_factored", steps=1)
    url = str(tmp_path / "ck")
    gefen_ckpt.save(opt, url, model=model)
    before, names = gefen_ckpt.read_manifest(url), sorted(os.listdir(url))

    def broken(*args, **kwargs):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(writer, "write_pieces", broken)
    train(model, opt, 1)
    future = gefen_ckpt.async_save(opt, url, model=model)
    with pytest.raises(OSError, match="disk full"):
        future.result(timeout=120)
    assert gefen_ckpt.read_manifest(url) == before and sorted(os.listdir(url)) == names
    assert gefen_ckpt.verify(url).ok

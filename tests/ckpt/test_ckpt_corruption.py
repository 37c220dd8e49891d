"""Damaged, foreign or mismatched checkpoints: a documented ``CheckpointError`` that names the
file or FQN, and the live optimizer bit-for-bit untouched."""

from __future__ import annotations

import os

import pytest
from ckpt_edits import index_entry, piece, rewrite_index, rewrite_manifest

import gefen
import gefen_ckpt
from gefen_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
)
from gefen_ckpt.io import native
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire import reader
from gefen_ckpt.wire.manifest import open_checkpoint

from ckpt_util import Tiny, fresh_like, same, snapshot, train, trained

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def source():
    return trained("gefen_factored", steps=3, seed=0)


@pytest.fixture
def ck(tmp_path, source):
    model, opt = source
    url = str(tmp_path / "ck")
    gefen_ckpt.save(opt, url, model=model, max_file_bytes=4096)
    return url


@pytest.fixture
def target(source):
    """A live optimizer with state of its own (different data), to prove it stays untouched."""
    model, opt = fresh_like(source[0], "gefen_factored")
    train(model, opt, 2, seed=99)
    return model, opt


def refused(target, url, error, *names):
    model, opt = target
    before = snapshot(opt, model)
    with pytest.raises(error) as info:
        gefen_ckpt.load(opt, url, model=model)
    for name in names:
        assert name in str(info.value), (name, str(info.value))
    assert same(before, snapshot(opt, model)), "the optimizer changed"
    return str(info.value)


@pytest.fixture(params=["mapped", "fused", "python"])
def read_path(request, monkeypatch):
    """Damaged data is found the same way by a Gefen load's mapped staging and by the reads into
    fresh memory (the fused C read+checksum, the Python reads) that torch optimizers' loads use."""
    if request.param != "mapped":
        monkeypatch.setattr(reader, "_stage_mapped", reader._stage_read)
    if request.param == "python":
        monkeypatch.setattr(native, "io", False)
    elif not native.io:
        pytest.skip("no fused read+checksum on this machine/build")


@pytest.mark.usefixtures("read_path")
def test_truncated_data_file(ck, target):
    path, _ = piece(ck)
    os.truncate(path, os.path.getsize(path) - 7)
    refused(target, ck, CheckpointCorruptError, os.path.basename(path), "up.weight/mv_code", "truncated")
    assert not gefen_ckpt.verify(ck).ok


@pytest.mark.usefixtures("read_path")
def test_flipped_byte_names_file_and_fqn(ck, target, monkeypatch):
    path, p = piece(ck)
    with open(path, "r+b") as f:
        f.seek(p.offset + p.nbytes // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    refused(target, ck, CheckpointCorruptError, os.path.basename(path), "up.weight/mv_code", "checksum")
    report = gefen_ckpt.verify(ck)
    assert not report.ok and any("up.weight/mv_code" in m and "checksum" in m for m in report.problems)
    with pytest.raises(CheckpointCorruptError, match="up.weight/mv_code"):  # lazy partial reads verify too
        gefen_ckpt.read(ck).params["up.weight"].fields["mv_code"].read(0, 1)
    monkeypatch.setattr(reader._PARTIAL, "budget", 0)  # a piece too large to keep is streamed, and verified
    with pytest.raises(CheckpointCorruptError, match="up.weight/mv_code"):
        gefen_ckpt.read(ck).params["up.weight"].fields["mv_code"].read(0, 1)


def test_flipped_byte_in_safetensors_header_is_found_by_verify(ck):
    path, _ = piece(ck)
    with open(path, "r+b") as f:
        f.seek(9)
        f.write(b"\x00")
    report = gefen_ckpt.verify(ck)
    assert not report.ok and any(os.path.basename(path) in m for m in report.problems)


def test_missing_data_file(ck, target):
    path, _ = piece(ck)
    os.remove(path)
    refused(target, ck, CheckpointCorruptError, os.path.basename(path), "missing", "up.weight/mv_code")
    assert any("missing" in m for m in gefen_ckpt.verify(ck).problems)


def test_extra_file_is_ignored_by_load_and_reported_by_verify(ck, target, source):
    """Files no manifest references are what an interrupted save leaves: they must not stop
    the committed checkpoint from loading (docs/decisions.md), but verify names them."""
    stray = os.path.join(ck, "data-0123456789abcdef-r00000-00000.safetensors")
    with open(stray, "wb") as f:
        f.write(b"garbage")
    model, opt = target
    gefen_ckpt.load(opt, ck, model=model)
    assert same(snapshot(opt, model), snapshot(source[1], source[0]))
    report = gefen_ckpt.verify(ck)
    assert report.ok and any(os.path.basename(stray) in w for w in report.warnings)


def test_no_manifest_is_incomplete(ck, target):
    os.remove(os.path.join(ck, "manifest.msgpack"))
    refused(target, ck, CheckpointIncompleteError, "manifest.msgpack", "never committed")
    assert not gefen_ckpt.verify(ck).ok
    with pytest.raises(CheckpointIncompleteError):
        gefen_ckpt.read_manifest(str(ck) + "-nonexistent")


@pytest.mark.parametrize("cut", [1, 100, -1])
def test_truncated_or_garbage_manifest(ck, target, cut):
    path = os.path.join(ck, "manifest.msgpack")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:cut] if cut > 0 else b"\xc1garbage")
    refused(target, ck, CheckpointFormatError, "manifest.msgpack")


@pytest.mark.parametrize("version, words", [([3, 0], "newer"), ([2, 7], None), ([1, 1], "version 1.1 is not supported"),
                                            ([0, 9], "not supported"), ("1.0", "[major, minor]")])
def test_format_versions(ck, target, source, version, words):
    rewrite_manifest(ck, lambda m: m.update(version=version))
    if words is None:  # same major, newer minor: readable (minor versions only add optional keys)
        model, opt = target
        gefen_ckpt.load(opt, ck, model=model)
        assert same(snapshot(opt, model), snapshot(source[1], source[0]))
    else:
        refused(target, ck, CheckpointFormatError, words)


def test_not_our_format(ck, target):
    rewrite_manifest(ck, lambda m: m.update(format="someone-else"))
    refused(target, ck, CheckpointFormatError, "not a gefen-ckpt manifest")


@pytest.mark.parametrize("change, words", [(lambda p: p[0].__setitem__(0, 1), "do not match the manifest's split"),
                                           (lambda p: p.append(list(p[-1])), "overlap")])
def test_coverage_gap_and_overlap_are_format_errors(ck, target, change, words):
    rewrite_index(ck, 0, lambda raw: change(index_entry(raw, ck, "embed.weight", "mv_code")))
    refused(target, ck, CheckpointFormatError, "embed.weight/mv_code", words)


def test_pieces_sharing_bytes_are_a_format_error_naming_both(ck, target):
    path, a = piece(ck)
    tensors = open_checkpoint(Store(ck)).tensors
    (key, i), b = next(((key, i), p) for key, t in tensors.items() for i, p in enumerate(t.pieces)
                       if p.file == a.file and p.offset != a.offset and a.offset + p.nbytes <= os.path.getsize(path))

    def alias(raw):
        index_entry(raw, ck, *key)[i][3] = a.offset

    rewrite_index(ck, 0, alias)
    message = refused(target, ck, CheckpointFormatError, "overlaps", "{} rows [{}, {})".format(tensors[key].label, *b.rows),
                      "up.weight/mv_code rows [{}, {})".format(*a.rows), a.file)
    assert message.count(" rows [") == 2, message


def test_fqn_mismatch(ck, source):
    model = Tiny()
    opt = gefen.Gefen([("model." + n, p) for n, p in model.named_parameters()], lr=1e-2)
    train(model, opt, 1)
    refused((model, opt), ck, CheckpointMismatchError, "model.down.weight", "embed.weight")


def test_shape_mismatch(ck):
    model = Tiny(hidden=32)
    opt = gefen.Gefen(model.named_parameters(), lr=1e-2)
    train(model, opt, 1)
    refused((model, opt), ck, CheckpointMismatchError, "up.weight", "(48, 16)")


def test_foreign_optimizer_checkpoint(tmp_path, target):
    model, opt = trained("adamw")
    gefen_ckpt.save(opt, str(tmp_path / "adamw"), model=model)
    refused(target, str(tmp_path / "adamw"), CheckpointMismatchError, "torch.optim.AdamW", "gefen.Gefen")


def test_state_the_optimizer_refuses_is_a_mismatch(ck, target):
    rewrite_manifest(ck, lambda m: m["param_groups"][0].update(lr=-1.0))
    refused(target, ck, CheckpointMismatchError, "lr")


def test_every_refusal_is_a_checkpoint_error(ck):
    with pytest.raises(CheckpointError):
        gefen_ckpt.read(ck + "/nothing-here")

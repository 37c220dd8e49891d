"""Format 2.0: row-split rules in the manifest, piece records in per-writer indexes.

Round trips, reads that touch only the indexes they need, the offline reshard's data size, and
every bad index, rule or part (or a manifest of another format version) refused by name before
any tensor data is read and with the optimizer untouched."""

from __future__ import annotations

import os
import shutil

import msgpack
import pytest
import torch
from ckpt_edits import rewrite_index as _rewrite_index
from ckpt_edits import rewrite_manifest as _rewrite

import gefen_ckpt
from gefen.replicas import chunk_rows
from gefen_ckpt.errors import CheckpointCorruptError, CheckpointFormatError
from gefen_ckpt.io.storage import LocalStore, Store
from gefen_ckpt.wire import manifest as mf
from gefen_ckpt.wire.manifest import open_checkpoint

from ckpt_util import fresh_like, same, snapshot, trained

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def source():
    return trained("gefen_factored", steps=3)


@pytest.fixture(scope="module")
def sharded(source, tmp_path_factory):
    """The source's state written as 3 writers (format 2.0, the default)."""
    model, opt = source
    url = str(tmp_path_factory.mktemp("f2") / "ws3")
    gefen_ckpt.write(gefen_ckpt.export_canonical(opt, model=model), url, world_size=3)
    return url


def _copy(url, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(url, dst)
    return dst


def _tensors(state) -> dict:
    return {k: s.read().clone() for k, s in state.tensors()}


def test_2_0_is_the_default_and_round_trips_bitwise(source, sharded, tmp_path):
    model, opt = source
    raw = gefen_ckpt.read_manifest(sharded)
    assert raw["version"] == [2, 0] and "files" not in raw and len(raw["writers"]) == 3
    assert {r["parts"] for r in raw["rules"]} == {1, 3}  # replicated fields, and the 3-way chunk split
    names = os.listdir(sharded)
    assert sum(n.startswith("index-") for n in names) == 3
    back_model, back = fresh_like(model, "gefen_factored")
    gefen_ckpt.load(back, sharded, model=back_model)
    assert same(snapshot(back, back_model), snapshot(opt, model))
    assert gefen_ckpt.verify(sharded).ok


def test_a_read_of_some_rows_reads_only_the_indexes_holding_them(sharded):
    m = open_checkpoint(Store(sharded), whole=False)
    t = m.tensors[("embed.weight", "mv_code")]
    a, b = chunk_rows(t.rows, 3, 1)
    pieces = t.pieces_in(a, b)
    assert m.indexes.reads == 1 and {p.file for p in pieces} == {n for n, _ in m.writers[1].files}
    full = gefen_ckpt.read(sharded).params["embed.weight"].fields["mv_code"].read()
    assert torch.equal(gefen_ckpt.read(sharded).params["embed.weight"].fields["mv_code"].read(a + 1, b + 1),
                       full[a + 1:b + 1])  # across a writer boundary


def test_memory_store_round_trip(source):
    model, opt = source
    url = "memory://gefen-format2/ws2"
    gefen_ckpt.write(gefen_ckpt.export_canonical(opt, model=model), url, world_size=2)
    got = _tensors(gefen_ckpt.read(url))
    want = _tensors(gefen_ckpt.export_canonical(opt, model=model))
    assert all(torch.equal(want[k], got[k]) for k in want) and gefen_ckpt.verify(url).ok


def test_resharding_to_many_ranks_keeps_the_data_near_the_state_size(source, tmp_path):
    model, opt = source
    state = gefen_ckpt.export_canonical(opt, model=model)
    url = str(tmp_path / "ws512")
    gefen_ckpt.write(state, url, world_size=512)
    names = os.listdir(url)
    data = sum(os.path.getsize(os.path.join(url, n)) for n in names if n.startswith("data-"))
    files = sum(n.startswith("data-") for n in names)
    pieces = sum(len(t.pieces) for t in open_checkpoint(Store(url)).tensors.values())
    # per data file a 128-byte header; a small piece starts at a multiple of its dtype's size
    # (at most 7 bytes of padding): no per-piece header entry, no 64-byte alignment
    assert data <= state.total_bytes() + 128 * files + 7 * pieces, (data, state.total_bytes(), files, pieces)
    assert data - state.total_bytes() - 128 * files < 0.15 * state.total_bytes()
    assert os.path.getsize(os.path.join(url, "manifest.msgpack")) < 64 * 1024 + 160 * 512
    # consecutive small parts share a writer, whose rows of a tensor are one piece (one CRC-32)
    writers = len(gefen_ckpt.read_manifest(url)["writers"])
    assert writers < 512 and pieces <= writers * len(list(state.tensors())), (writers, pieces)
    got = _tensors(gefen_ckpt.read(url))
    assert all(torch.equal(s.read(), got[k]) for k, s in state.tensors())


def test_a_piece_may_span_a_writers_consecutive_parts_only():
    from gefen_ckpt.wire.index import _check_tiles
    from gefen_ckpt.wire.records import PieceRecord

    def check(parts, *rows):
        problems = []
        _check_tiles(type("T", (), {"label": "t"}), parts, [PieceRecord("p", "f", r, "d", "k", 0, 1, 0) for r in rows],
                     problems.append, 0)
        return problems

    assert not check([(0, 2), (2, 4)], (0, 4))  # two consecutive parts, one piece
    assert not check([(0, 2), (2, 4)], (0, 1), (1, 4))
    assert "do not match" in check([(0, 2), (4, 6)], (0, 6))[0]  # the rows between belong to another writer
    assert "missing rows [2, 4)" in check([(0, 2), (2, 4)], (0, 2))[0]
    assert "overlap" in check([(0, 4)], (0, 3), (2, 4))[0]


def _files(url) -> dict[str, bytes]:
    """Every data file and index by kind and writer (the token stripped)."""
    out = {}
    for name in os.listdir(url):
        if name.startswith(("data-", "index-")):
            kind, _, rest = name.split("-", 2)
            out[kind + rest] = open(os.path.join(url, name), "rb").read()
    return out


@pytest.mark.parametrize("world_size", [2, 7, 300])
def test_the_many_writer_pass_writes_the_bytes_of_the_writer_by_writer_path(source, tmp_path, monkeypatch,
                                                                           world_size):
    from gefen_ckpt.wire import many_writers

    model, opt = source
    state = gefen_ckpt.export_canonical(opt, model=model)
    calls = []
    real = many_writers.write
    monkeypatch.setattr(many_writers, "write", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(many_writers, "MIN_WRITER_BYTES", 0)  # one writer per part, as the writer-by-writer path
    gefen_ckpt.write(state, str(tmp_path / "one-pass"), world_size=world_size)
    assert calls, "the regular layout applies to this state"
    monkeypatch.setattr(many_writers, "regular_plan", lambda *a, **k: None)
    gefen_ckpt.write(state, str(tmp_path / "by-writer"), world_size=world_size)
    assert len(calls) == 1
    assert _files(tmp_path / "one-pass") == _files(tmp_path / "by-writer")
    assert gefen_ckpt.verify(str(tmp_path / "one-pass")).ok


def test_the_index_encoder_writes_what_msgpack_writes():
    import random

    import numpy as np

    from gefen_ckpt.wire.index import encode_index
    from gefen_ckpt.wire.many_writers import _index_head, _index_records

    rng = random.Random(0)
    edges = [0, 1, 127, 128, 255, 256, 2**16 - 1, 2**16, 2**32 - 1, 2**32, 2**40]
    for n in (0, 1, 15, 16, 300, 2**16 + 1):
        cols = [np.array([rng.choice(edges + [rng.randrange(2**33)]) for _ in range(n)], np.int64) for _ in range(5)]
        body, _ = _index_records(cols)
        entries = [(int(o), [[int(a), int(b), 0, int(f), int(c)]]) for o, a, b, f, c in zip(*cols)]
        assert _index_head(7, n) + body.tobytes() == encode_index(7, entries), n


# ----- bad input: refused by name, before any tensor data is read ------------------------------
@pytest.fixture
def no_data_reads(monkeypatch):
    """Fail the test if any data file is opened for reading (indexes are read with ``Store.read``)."""
    opened = []
    real = LocalStore.reader

    def reader(self, name):
        opened.append(name)
        return real(self, name)

    monkeypatch.setattr(LocalStore, "reader", reader)
    return opened


def refused(source, url, error, *needles, opened=None):
    model, opt = source  # a trained optimizer: a refused load must leave its state as it was
    before = snapshot(opt, model)
    with pytest.raises(error) as info:
        gefen_ckpt.load(opt, url, model=model)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert same(before, snapshot(opt, model)), "the optimizer changed"
    if opened is not None:
        assert not [n for n in opened if n.startswith("data-")], opened
    return str(info.value)


def _index(url, writer=1) -> str:
    return gefen_ckpt.read_manifest(url)["writers"][writer][0]


def test_missing_index(source, sharded, tmp_path, no_data_reads):
    url = _copy(sharded, tmp_path)
    os.remove(os.path.join(url, _index(url)))
    refused(source, url, CheckpointCorruptError, _index(url), "writer 1", "missing", opened=no_data_reads)


def test_truncated_index(source, sharded, tmp_path, no_data_reads):
    url = _copy(sharded, tmp_path)
    path = os.path.join(url, _index(url))
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-7])
    refused(source, url, CheckpointCorruptError, _index(url), "truncated", opened=no_data_reads)


def test_corrupt_index(source, sharded, tmp_path, no_data_reads):
    url = _copy(sharded, tmp_path)
    path = os.path.join(url, _index(url))
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    refused(source, url, CheckpointCorruptError, _index(url), "checksum", opened=no_data_reads)


def test_index_pin_that_disagrees_with_the_manifest(source, sharded, tmp_path, no_data_reads):
    url = _copy(sharded, tmp_path)
    _rewrite(url, lambda m: m["writers"][2].__setitem__(2, (m["writers"][2][2] + 1) % 2**32))
    refused(source, url, CheckpointCorruptError, _index(url, 2), "checksum in the manifest", opened=no_data_reads)
    url2 = str(tmp_path / "size")
    shutil.copytree(sharded, url2)
    _rewrite(url2, lambda m: m["writers"][0].__setitem__(1, m["writers"][0][1] + 1))
    refused(source, url2, CheckpointCorruptError, _index(url2, 0), "the manifest says", opened=no_data_reads)
    url3 = str(tmp_path / "huge")  # an index over the decoding limit is refused before it is read
    shutil.copytree(sharded, url3)
    index = _index(url3, 0)
    _rewrite(url3, lambda m: m["writers"][0].__setitem__(1, 2**40))
    refused(source, url3, CheckpointFormatError, "writers[0]", index, "over the limit")


def test_a_rule_that_does_not_tile_the_rows(source, sharded, tmp_path, no_data_reads):
    url = _copy(sharded, tmp_path)

    def short(m):
        rule = next(r for r in m["rules"] if r["parts"] == 3)
        rule["writers"] = rule["writers"][:2]

    _rewrite(url, short)
    refused(source, url, CheckpointFormatError, "rules[", "does not tile", opened=no_data_reads)


def test_explicit_parts_that_overlap_or_leave_a_gap(source, sharded, tmp_path, no_data_reads):
    for rows, words in (([[0, 10, 0], [5, 40, 1]], "overlap"), ([[0, 10, 0], [12, 40, 1]], "do not tile")):
        url = str(tmp_path / words.replace(" ", "-"))
        shutil.copytree(sharded, url)
        _rewrite(url, lambda m, rows=rows: m["params"]["embed.weight"]["fields"]["mv_code"].__setitem__("split", rows))
        refused(source, url, CheckpointFormatError, "embed.weight", "mv_code", words, opened=no_data_reads)


def test_index_pieces_that_overlap_or_miss_rows(source, sharded, tmp_path, no_data_reads):
    def overlap(raw):
        entry = max(raw["tensors"], key=lambda e: e[1][0][1] - e[1][0][0])
        start, stop, f, offset, crc = entry[1][0]
        entry[1][:] = [[start, stop - 1, f, offset, crc], [stop - 2, stop, f, offset, crc]]

    def drop(raw):
        raw["tensors"].pop(0)

    for change, words in ((overlap, "overlap"), (drop, "its index has none of them")):
        url = str(tmp_path / change.__name__)
        shutil.copytree(sharded, url)
        _rewrite_index(url, 0, change)
        refused(source, url, CheckpointFormatError, _index(url, 0), words, opened=no_data_reads)
        report = gefen_ckpt.verify(url)  # reads the data: it reports every problem
        assert not report.ok and any(words in p for p in report.problems), report.problems
        no_data_reads.clear()


def _as_1x(m: dict, version: list, tensors: dict) -> None:
    """``m`` as format 1.x wrote it: the data files and every piece record in the manifest, no
    writers, rules or splits (``tensors``: the checkpoint's tensors, with their pieces)."""
    files = [(name, size) for w in m.pop("writers") for name, size in zip(w[3::2], w[4::2])]
    position = {name: i for i, (name, _) in enumerate(files)}
    del m["rules"]
    entries = [((None, k), t) for k, t in m["globals"].items()]
    entries += [((fqn, n), t) for fqn, e in m["params"].items() for n, t in e["fields"].items()]
    for key, t in entries:
        del t["split"]
        t["pieces"] = [{"file": position[p.file], "key": p.key, "rows": list(p.rows), "offset": p.offset,
                        "bytes": p.nbytes, "checksum": p.checksum} for p in tensors[key].pieces]
    m["files"] = [{"name": name, "bytes": size} for name, size in files]
    m["version"] = version


@pytest.mark.parametrize("version", [[1, 1], [1, 0]])
def test_a_1_x_manifest_is_refused_naming_its_version_before_anything_else(source, sharded, tmp_path, version,
                                                                           no_data_reads):
    """Format 1.x (piece records in the manifest) was never released: a 1.x manifest, even a
    well-formed one (1.0: without the checksum it did not have yet), is refused by its version."""
    url = _copy(sharded, tmp_path)
    path = os.path.join(url, mf.MANIFEST_NAME)
    m = msgpack.unpackb(open(path, "rb").read())
    _as_1x(m, version, open_checkpoint(Store(url)).tensors)
    if version == [1, 0]:
        del m[mf.MANIFEST_CHECKSUM]
        open(path, "wb").write(msgpack.packb(m))
    else:
        open(path, "wb").write(mf.encode(m))
    words = f"checkpoint format version {version[0]}.{version[1]} is not supported (this gefen_ckpt reads 2.x only)"
    refused(source, url, CheckpointFormatError, words, mf.MANIFEST_NAME, opened=no_data_reads)
    with pytest.raises(CheckpointFormatError, match=r"version 1\.\d is not supported"):
        gefen_ckpt.read_manifest(url)
    report = gefen_ckpt.verify(url)
    assert not report.ok and report.problems == [f"{path}: {words}"], report.problems


def test_a_missing_data_file_is_named(source, sharded, tmp_path):
    url = _copy(sharded, tmp_path)
    name = [n for n in os.listdir(url) if n.startswith("data-") and "-r00002-" in n][0]
    os.remove(os.path.join(url, name))
    refused(source, url, CheckpointCorruptError, name, "writer 2")


# ----- explicit parts: a split no rule describes ----------------------------------------------------
EXPLICIT = ("embed.weight", "mv_code")


def _write_explicit(state, url, parts) -> None:
    """Commit ``state`` with ``EXPLICIT`` split into ``parts`` ``(start, stop, writer)`` (no rule
    describes them) and everything else whole on writer 0: what a collective save writes when a
    rank's rows do not follow the even split, through the same building blocks."""
    from gefen_ckpt.wire.manifest import build, tensor_order
    from gefen_ckpt.wire.many_writers import _source
    from gefen_ckpt.wire.writer import (
        RowRange,
        WriteItem,
        begin,
        commit,
        data_stem,
        new_token,
        write_index,
    )
    from gefen_ckpt.wire.writer import write_pieces as pieces_of

    store = Store(url)
    token = new_token()
    lock, previous = begin(store, token)
    with lock:
        writers = 1 + max(w for _, _, w in parts)
        items = {w: [] for w in range(writers)}
        splits = {}
        for key, src in [((None, k), s) for k, s in state.global_fields.items()] + [
                ((fqn, n), s) for fqn, e in state.params.items() for n, s in e.fields.items()]:
            if key == EXPLICIT:
                splits[key] = list(parts)
                for a, b, w in parts:
                    items[w].append(WriteItem(*key, a, RowRange(_source(src), a, b)))
            else:
                splits[key] = (1, (0,))
                items[0].append(WriteItem(*key, 0, _source(src)))
        pins, indexes = [], {}
        for w in range(writers):
            records, files = pieces_of(store, data_stem(token, w), items[w], max_file_bytes=2**30,
                                       memory_budget=2**26)
            pin, indexes[w] = write_index(store, token, w, records, files, tensor_order(state))
            pins.append(pin)
        manifest = build(state, splits, pins, layout="sharded", world_size=writers)
        commit(store, manifest, token, previous=previous, indexes=indexes)


@pytest.fixture(scope="module")
def explicit(source, tmp_path_factory):
    """The source's state with ``EXPLICIT`` held by writers 2, 0, 1 (in that order of rows) in
    uneven parts; everything else by writer 0."""
    model, opt = source
    state = gefen_ckpt.export_canonical(opt, model=model)
    rows = state.params[EXPLICIT[0]].fields[EXPLICIT[1]].shape[0]
    url = str(tmp_path_factory.mktemp("explicit") / "ckpt")
    _write_explicit(state, url, [(0, 3, 2), (3, rows - 5, 0), (rows - 5, rows, 1)])
    return url


def test_explicit_parts_round_trip_load_verify_inspect_and_reshard(source, explicit, tmp_path):
    from typer.testing import CliRunner

    from gefen_cli.app import app

    model, opt = source
    raw = gefen_ckpt.read_manifest(explicit)
    split = raw["params"][EXPLICIT[0]]["fields"][EXPLICIT[1]]["split"]
    assert isinstance(split, list) and [w for _, _, w in split] == [2, 0, 1]
    assert all(isinstance(f["split"], int) for fqn, e in raw["params"].items() for n, f in e["fields"].items()
               if (fqn, n) != EXPLICIT)
    want = _tensors(gefen_ckpt.export_canonical(opt, model=model))
    got = _tensors(gefen_ckpt.read(explicit))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    back_model, back = fresh_like(model, "gefen_factored")
    gefen_ckpt.load(back, explicit, model=back_model)
    assert same(snapshot(back, back_model), snapshot(opt, model))
    report = gefen_ckpt.verify(explicit)
    assert report.ok, report.problems
    result = CliRunner().invoke(app, ["inspect", explicit, "--json"])
    assert result.exit_code == 0, result.output
    for world_size in (2, 4):  # explicit parts -> the rule
        out = str(tmp_path / f"ws{world_size}")
        gefen_ckpt.write(gefen_ckpt.read(explicit), out, world_size=world_size)
        got = _tensors(gefen_ckpt.read(out))
        assert all(torch.equal(want[k], got[k]) for k in want) and gefen_ckpt.verify(out).ok


def test_a_read_of_explicit_rows_reads_only_their_writers_indexes(explicit):
    m = open_checkpoint(Store(explicit), whole=False)
    t = m.tensors[EXPLICIT]
    assert t.split.writers_in(t.rows, 0, 3) == {2} and t.split.writers_in(t.rows, 2, 4) == {0, 2}
    pieces = t.pieces_in(0, 3)
    assert m.indexes.reads == 1 and {p.file for p in pieces} == {n for n, _ in m.writers[2].files}
    full = gefen_ckpt.read(explicit).params[EXPLICIT[0]].fields[EXPLICIT[1]].read()
    part = gefen_ckpt.read(explicit).params[EXPLICIT[0]].fields[EXPLICIT[1]].read(1, t.rows - 2)
    assert torch.equal(part, full[1:t.rows - 2])  # across all three writers


def test_explicit_parts_that_disagree_with_the_indexes_are_refused_before_data_is_read(
        source, explicit, tmp_path, no_data_reads):
    def swapped(m):  # the parts of writers 0 and 1 exchanged: neither index holds what the manifest says
        parts = m["params"][EXPLICIT[0]]["fields"][EXPLICIT[1]]["split"]
        parts[1][2], parts[2][2] = parts[2][2], parts[1][2]

    def out_of_range(m):
        m["params"][EXPLICIT[0]]["fields"][EXPLICIT[1]]["split"][0][2] = 7

    for change, error, words in ((swapped, CheckpointFormatError, ("mv_code", "writer")),
                                 (out_of_range, CheckpointFormatError, ("mv_code", "writer 7 does not exist"))):
        url = str(tmp_path / change.__name__)
        shutil.copytree(explicit, url)
        _rewrite(url, change)
        refused(source, url, error, *words, opened=no_data_reads)
        no_data_reads.clear()


def test_explicit_parts_whose_index_is_damaged_are_refused_by_name(source, explicit, tmp_path, no_data_reads):
    url = str(tmp_path / "damaged")
    shutil.copytree(explicit, url)
    index = _index(url, 2)  # the writer of only the explicit tensor's first rows
    with open(os.path.join(url, index), "r+b") as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0xFF]))
    refused(source, url, CheckpointCorruptError, index, "writer 2", opened=no_data_reads)


def test_verify_names_every_damaged_byte_of_a_data_file_that_no_checksum_covers(sharded, tmp_path):
    """The 2.0 header (metadata strings, space padding) and the zero padding between pieces: no
    checksum covers them, so verify compares them with what the format defines and names the file
    and the offset of the damage (a flipped bit there was reported OK before)."""
    m = open_checkpoint(Store(sharded))
    covered: dict[str, set[int]] = {}
    for t in m.tensors.values():
        for p in t.pieces:
            covered.setdefault(p.file, set()).update(range(p.offset, p.offset + p.nbytes))
    name = max(covered, key=lambda f: os.path.getsize(os.path.join(sharded, f)) - len(covered[f]))
    data = open(os.path.join(sharded, name), "rb").read()
    data_start = 8 + int.from_bytes(data[:8], "little")
    uncovered = [o for o in range(len(data)) if o not in covered[name]]
    assert any(o >= data_start for o in uncovered), "the file has no padding between pieces to damage"
    url = _copy(sharded, tmp_path)
    assert gefen_ckpt.verify(url).ok
    path = os.path.join(url, name)
    for offset in uncovered:
        for bit in (0, 5):  # e.g. "2.0" -> "2.1", a padding space -> NUL, a zero pad byte -> 0x01 / 0x20
            damaged = bytearray(data)
            damaged[offset] ^= 1 << bit
            with open(path, "wb") as f:
                f.write(damaged)
            report = gefen_ckpt.verify(url)
            assert not report.ok, (offset, bit)
            assert any(name in p for p in report.problems), report.problems
            if offset >= 8 and not any("not a valid safetensors" in p for p in report.problems):
                assert any(f"byte {offset}" in p for p in report.problems), (offset, report.problems)

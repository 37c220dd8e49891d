"""Round trips through the portable format: resuming is bitwise identical to never stopping."""

from __future__ import annotations

import pytest
import torch

import gefen_ckpt
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire import reader
from gefen_ckpt.wire.manifest import open_checkpoint

from ckpt_util import OPTIMIZERS, canonical_equal, fresh_like, same, snapshot, train, trained

pytestmark = pytest.mark.timeout(120)


def _data_files(manifest: dict) -> dict[str, int]:
    """name -> bytes of every data file a manifest names."""
    return {name: size for w in manifest["writers"] for name, size in zip(w[3::2], w[4::2])}


def _pieces(url, fqn, field) -> tuple:
    return open_checkpoint(Store(url)).tensors[(fqn, field)].pieces


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_save_load_continue_is_bitwise_uninterrupted(tmp_path, kind):
    model, opt = trained(kind, steps=3)
    gefen_ckpt.save(opt, str(tmp_path / "ck"), model=model)
    resumed, opt2 = fresh_like(model, kind)
    gefen_ckpt.load(opt2, str(tmp_path / "ck"), model=resumed)
    assert same(snapshot(opt, model), snapshot(opt2, resumed))
    train(model, opt, 5, seed=7)
    train(resumed, opt2, 5, seed=7)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["gefen_factored", "hybrid_adamw"])
def test_sharded_write_reads_back_bitwise(tmp_path, kind):
    model, opt = trained(kind)
    state = gefen_ckpt.export_canonical(opt, model=model)
    gefen_ckpt.write(state, str(tmp_path / "sharded"), world_size=3)
    manifest = gefen_ckpt.read_manifest(str(tmp_path / "sharded"))
    assert (manifest["layout"], manifest["world_size"]) == ("sharded", 3)
    files = {name.split("-")[2] for name in _data_files(manifest)}
    assert files == {"r00000", "r00001", "r00002"}  # one writer per rank
    back = gefen_ckpt.read(str(tmp_path / "sharded"))
    assert canonical_equal(state, back)
    # a row-sharded field really is split like torch.chunk; replicated fields are stored once
    entry = state.params["up.weight"]
    sharded = [n for n in entry.fields if state.contract.leaf(entry.child).field(n).row_sharded]
    assert sharded
    for name in sharded:
        pieces = _pieces(str(tmp_path / "sharded"), "up.weight", name)
        assert [p.rows for p in pieces] == [(0, 16), (16, 32), (32, 48)] and len({p.file for p in pieces}) == 3
    assert len(_pieces(str(tmp_path / "sharded"), next(iter(manifest["params"])), "step")) == 1


def test_sharded_checkpoint_loads_into_single_process(tmp_path):
    model, opt = trained("gefen_block")
    gefen_ckpt.write(gefen_ckpt.export_canonical(opt, model=model), str(tmp_path / "s"), world_size=4)
    resumed, opt2 = fresh_like(model, "gefen_block")
    gefen_ckpt.load(opt2, str(tmp_path / "s"), model=resumed)
    assert same(snapshot(opt, model), snapshot(opt2, resumed))


@pytest.mark.parametrize("streamed", [False, True], ids=["cached", "streamed"])
def test_tiny_files_split_pieces_and_partial_reads(tmp_path, monkeypatch, streamed):
    """Partial reads of a piece, kept whole in the cache of small pieces or (a piece too large to
    keep) streamed in chunks: the same rows either way."""
    if streamed:
        monkeypatch.setattr(reader._PARTIAL, "budget", 0)
        monkeypatch.setattr(reader, "READ_CHUNK", 24)  # several chunks per piece, rows across chunks
    model, opt = trained("adamw")
    state = gefen_ckpt.export_canonical(opt, model=model)
    url = str(tmp_path / "tiny")
    gefen_ckpt.write(state, url, max_file_bytes=2048, memory_budget=4096)
    files = _data_files(gefen_ckpt.read_manifest(url))
    assert len(files) > 10
    assert all(size <= 2048 for size in files.values())
    pieces = _pieces(url, "embed.weight", "exp_avg")
    assert len(pieces) > 2 and len({p.file for p in pieces}) > 2
    back = gefen_ckpt.read(url)
    assert canonical_equal(state, back)
    src, want = back.params["embed.weight"].fields["exp_avg"], state.params["embed.weight"].fields["exp_avg"]
    for start, stop in [(0, 1), (3, 17), (11, 40), (39, 40), (5, 5)]:  # across piece boundaries
        assert torch.equal(src.read(start, stop), want.read(start, stop))
    with pytest.raises(IndexError):
        src.read(10, 41)
    assert gefen_ckpt.verify(url).ok


def test_rewrite_in_other_layouts_and_back(tmp_path):
    model, opt = trained("hybrid_gefen")
    state = gefen_ckpt.export_canonical(opt, model=model)
    gefen_ckpt.write(state, str(tmp_path / "a"), world_size=2, max_file_bytes=4096)
    gefen_ckpt.write(gefen_ckpt.read(str(tmp_path / "a")), str(tmp_path / "b"))  # streams lazily
    assert canonical_equal(state, gefen_ckpt.read(str(tmp_path / "b")))
    assert gefen_ckpt.read_manifest(str(tmp_path / "b"))["layout"] == "canonical"


def test_empty_optimizer_state_round_trips(tmp_path):
    model, opt = trained("gefen_factored", steps=0)
    gefen_ckpt.save(opt, str(tmp_path / "e"), model=model)
    resumed, opt2 = fresh_like(model, "gefen_factored")
    gefen_ckpt.load(opt2, str(tmp_path / "e"), model=resumed)
    assert same(snapshot(opt, model), snapshot(opt2, resumed))


def test_save_over_existing_replaces_and_collects_old_files(tmp_path):
    url = str(tmp_path / "ck")
    model, opt = trained("gefen_factored", steps=2)
    gefen_ckpt.save(opt, url, model=model)
    old = {name for w in gefen_ckpt.read_manifest(url)["writers"] for name in (w[0], *w[3::2])}
    train(model, opt, 1)
    gefen_ckpt.save(opt, url, model=model)
    new = {name for w in gefen_ckpt.read_manifest(url)["writers"] for name in (w[0], *w[3::2])}
    assert not old & new and any(n.startswith("index-") for n in new)
    on_disk = {p.name for p in (tmp_path / "ck").iterdir()}
    assert on_disk == new | {"manifest.msgpack", ".gefen-ckpt.lock"}  # the writer lock file stays (empty)
    assert (tmp_path / "ck" / ".gefen-ckpt.lock").stat().st_size == 0
    resumed, opt2 = fresh_like(model, "gefen_factored")
    gefen_ckpt.load(opt2, url, model=resumed)
    assert same(snapshot(opt, model), snapshot(opt2, resumed))


def test_manifest_records_what_inspect_needs(tmp_path):
    model, opt = trained("gefen_factored")
    gefen_ckpt.save(opt, str(tmp_path / "m"), model=model)
    m = gefen_ckpt.read_manifest(str(tmp_path / "m"))
    assert m["format"] == "gefen-ckpt" and m["version"] == [2, 0] and m["layout"] == "canonical"
    assert m["contract"]["implementation"] == "gefen.Gefen"
    assert m["topology"] == {"kind": "single"} and "time" in m["created"]
    assert m["param_groups"][0]["betas"] == [0.9, 0.999]
    entry = m["params"]["up.weight"]
    assert entry["shape"] == [48, 16] and entry["dtype"] == "float32"
    assert set(entry["fields"]) == {"step", "mv_code", "m_row_scale", "v_row", "v_col"}  # the default layout
    assert m["contract"]["version"] == "2"
    assert set(m["params"]["norm.weight"]["fields"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert m["globals"]["codebook"]["shape"] == m["globals"]["v_codebook"]["shape"] == [16]
    model, opt = trained("gefen_block")  # moments="m8"
    gefen_ckpt.save(opt, str(tmp_path / "m8"), model=model)
    m = gefen_ckpt.read_manifest(str(tmp_path / "m8"))
    assert m["contract"]["version"] == "1" and "v_codebook" not in m["globals"]
    assert set(m["params"]["up.weight"]["fields"]) == {"step", "period", "m_code", "m_scale", "v"}
    assert m["globals"]["codebook"]["shape"] == [256]


def test_progress_bar_runs(tmp_path, capsys):
    model, opt = trained("gefen_block")
    gefen_ckpt.save(opt, str(tmp_path / "p"), model=model, progress=True)
    assert gefen_ckpt.verify(str(tmp_path / "p"), progress=True).ok
    assert capsys.readouterr().out == ""  # bars go to stderr: stdout stays clean for --json


def test_other_layout_is_refused_in_one_line_before_anything_changes(tmp_path):
    """A moments='m8' checkpoint (contract version "1") offered to a default Gefen, and the
    reverse: one line naming the version and both ways out; the live optimizer is untouched."""
    model8, opt8 = trained("gefen_block")  # moments="m8"
    gefen_ckpt.save(opt8, str(tmp_path / "m8"), model=model8)
    model, opt = trained("gefen_factored")  # the default, m4v4
    gefen_ckpt.save(opt, str(tmp_path / "m4v4"), model=model)
    before = snapshot(opt, model)
    with pytest.raises(gefen_ckpt.CheckpointMismatchError) as info:
        gefen_ckpt.load(opt, str(tmp_path / "m8"), model=model)
    message = str(info.value)
    assert "\n" not in message and "version '1'" in message and "moments='m8'" in message
    assert "gefen-ckpt convert SRC DST --into Gefen" in message
    assert same(before, snapshot(opt, model))
    with pytest.raises(gefen_ckpt.CheckpointMismatchError, match=r"version '2' \(moments='m4v4'\)"):
        gefen_ckpt.load(opt8, str(tmp_path / "m4v4"), model=model8)

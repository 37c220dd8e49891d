"""``gefen_ckpt.open``, ``detect_format`` and ``convert_checkpoint``: any checkpoint by URL, called
directly (the CLI's inspect/verify/diff/convert/reshard are these calls plus printing)."""

from __future__ import annotations

import pytest

import gefen_ckpt
from gefen_ckpt.checkpoints import write
from gefen_ckpt.errors import CheckpointFormatError, CheckpointIncompleteError, CheckpointMismatchError

from ckpt_util import canonical_equal, trained

pytestmark = pytest.mark.timeout(300)
FORMATS = {"portable": "portable", "dcp": "dcp", "optim.pt": "torch"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One Gefen state saved in every format: (directory, the state)."""
    model, opt = trained("gefen_factored")
    root = tmp_path_factory.mktemp("formats")
    state = gefen_ckpt.export_canonical(opt, model=model)
    gefen_ckpt.save(opt, str(root / "portable"), model=model)
    write(state, str(root / "dcp"), "dcp")
    write(state, str(root / "optim.pt"), "torch")
    return root, state


def test_open_detects_every_format_and_reads_the_same_state(saved):
    root, state = saved
    for name, fmt in FORMATS.items():
        url = str(root / name)
        assert gefen_ckpt.detect_format(url) == fmt
        assert canonical_equal(gefen_ckpt.open(url), state), fmt
        assert canonical_equal(gefen_ckpt.open(url, format=fmt, optimizer="gefen"), state), fmt


def test_open_refuses_what_it_cannot_read(saved, tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointFormatError, match="not a checkpoint"):
        gefen_ckpt.open(str(junk))
    with pytest.raises(CheckpointIncompleteError, match="no such file"):
        gefen_ckpt.open(str(tmp_path / "absent"))
    root, _ = saved
    for name in FORMATS:  # a wrong optimizer is named, with the one that wrote it
        with pytest.raises(CheckpointMismatchError, match="holds gefen.Gefen state, not AdamW") as failure:
            gefen_ckpt.open(str(root / name), optimizer="AdamW")
        assert failure.value.held == "gefen.Gefen"
    (tmp_path / "names.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match="records its names"):
        gefen_ckpt.open(str(root / "portable"), param_names=str(tmp_path / "names.txt"))


def test_convert_checkpoint_between_formats_layouts_and_optimizers(saved, tmp_path):
    root, state = saved
    for src, to in (("portable", "torch"), ("optim.pt", "dcp"), ("dcp", "portable")):
        dst = str(tmp_path / f"{src}-as-{to}")
        assert canonical_equal(gefen_ckpt.convert_checkpoint(str(root / src), dst, to=to), state)
        assert gefen_ckpt.detect_format(dst) == to
        assert canonical_equal(gefen_ckpt.open(dst), state), (src, to)
    sharded = str(tmp_path / "sharded")
    gefen_ckpt.convert_checkpoint(str(root / "optim.pt"), sharded, to="portable", world_size=2)
    assert gefen_ckpt.read_manifest(sharded)["layout"] == "sharded"
    assert canonical_equal(gefen_ckpt.open(sharded), state)
    # into another optimizer: dense AdamW moments, with the conversion's report
    dense = gefen_ckpt.convert_checkpoint(str(root / "portable"), str(tmp_path / "adamw.pt"), into="AdamW", to="torch")
    assert dense.contract.implementation == "torch.optim.AdamW"
    assert dense.metadata["conversion"]["parameters"] == len(state.params)
    assert canonical_equal(gefen_ckpt.open(str(tmp_path / "adamw.pt"), optimizer="AdamW"), dense)
    # refusals write nothing
    with pytest.raises(ValueError, match="same location"):
        gefen_ckpt.convert_checkpoint(str(root / "portable"), str(root / "portable") + "/", to="torch")
    with pytest.raises(ValueError, match="format must be one of"):
        gefen_ckpt.convert_checkpoint(str(root / "portable"), str(tmp_path / "x.zip"), to="zip")
    assert not (tmp_path / "x.zip").exists()

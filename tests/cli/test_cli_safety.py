"""What the CLI must not do by surprise: write over an existing destination, offer choices it
then rejects, describe world size and mesh two ways, or create a bucket nobody asked for."""

from __future__ import annotations

import json
import os
import re
import uuid

import fsspec
import pytest
import torch
from typer.testing import CliRunner

import gefen_ckpt
from gefen import Gefen
from gefen_ckpt.errors import CheckpointError
from gefen_cli.app import ShardedTarget, Target, app

pytestmark = pytest.mark.timeout(300)


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.GELU(), torch.nn.Linear(40, 6))
    opt = Gefen(model.named_parameters(), lr=1e-2)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("src") / "ckpt"
    gefen_ckpt.save(opt, str(path))
    return path


def _tree(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", [
    ("reshard", "--world-size", "2"), ("reshard", "--mesh", "2x2", "--to", "dcp"),
    ("convert", "--to", "portable"), ("convert", "--to", "dcp"),
])
def test_a_non_empty_destination_is_refused_unless_overwrite(source, tmp_path, command):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "precious.txt").write_text("do not lose me")
    before = _tree(dst)
    result = invoke(command[0], source, dst, *command[1:])
    assert result.exit_code == 2, result.output
    assert "exists and is a non-empty directory" in result.output and "--overwrite" in result.output
    assert _tree(dst) == before  # nothing written
    result = invoke(command[0], source, dst, *command[1:], "--overwrite")
    assert result.exit_code == 0, result.output
    assert invoke("diff", source, dst).exit_code == 0


def test_an_existing_file_is_refused_unless_overwrite(source, tmp_path):
    dst = tmp_path / "opt.pt"
    dst.write_bytes(b"old")
    result = invoke("convert", source, dst, "--to", "torch")
    assert result.exit_code == 2 and "exists and is a file" in result.output, result.output
    assert dst.read_bytes() == b"old"
    assert invoke("convert", source, dst, "--to", "torch", "--overwrite").exit_code == 0
    assert invoke("diff", source, dst).exit_code == 0


def test_an_empty_directory_is_a_fine_destination(source, tmp_path):
    dst = tmp_path / "empty"
    dst.mkdir()
    assert invoke("reshard", source, dst, "-n", "3").exit_code == 0
    assert invoke("verify", dst).exit_code == 0


def test_a_dry_run_needs_no_overwrite(source, tmp_path):
    assert invoke("reshard", source, source.parent, "-n", "2", "--dry-run").exit_code == 0


@pytest.mark.parametrize("to", [t.value for t in Target])
def test_every_convert_target_in_the_help_works(source, tmp_path, to):
    assert to in invoke("convert", "--help").output
    dst = tmp_path / f"out-{to}"
    result = invoke("convert", source, dst, "--to", to)
    assert result.exit_code == 0, result.output
    assert invoke("diff", source, dst).exit_code == 0


@pytest.mark.parametrize("to", [t.value for t in ShardedTarget])
def test_every_reshard_target_in_the_help_works(source, tmp_path, to):
    dst = tmp_path / f"out-{to}"
    result = invoke("reshard", source, dst, "-n", "2", "--to", to)
    assert result.exit_code == 0, result.output
    assert invoke("diff", source, dst).exit_code == 0


def test_reshard_does_not_offer_torch(source, tmp_path):
    choices = re.search(r"--to\s+<([a-z|]+)>", invoke("reshard", "--help").output).group(1)
    assert choices.split("|") == ["portable", "dcp"]
    result = invoke("reshard", source, tmp_path / "x", "-n", "2", "--to", "torch")
    assert result.exit_code == 2 and not (tmp_path / "x").exists()


def test_inspect_says_one_thing_about_world_size_and_mesh(source, tmp_path):
    dst = tmp_path / "hsdp"
    assert invoke("reshard", source, dst, "--mesh", "2x2").exit_code == 0
    summary = json.loads(invoke("inspect", dst, "--json").stdout)
    assert (summary["shards"], summary["world_size"], summary["mesh"]) == (2, 4, [2, 2])
    text = invoke("inspect", dst).stdout
    assert "2 shards" in text and "world size 4, mesh 2x2 (replicate x shard)" in text
    assert "world size 2" not in text and "world_size=" not in text and "mesh=" not in text
    flat = json.loads(invoke("inspect", source, "--json").stdout)
    assert (flat["shards"], flat["world_size"], flat["mesh"]) == (1, 1, None)


# ----- object stores: a missing bucket ----------------------------------------------------------
@pytest.fixture(scope="module")
def s3(source):
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed: S3 tests need it")
    pytest.importorskip("s3fs", reason="s3fs is not installed: S3 tests need it")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = {"key": "testing", "secret": "testing",
                                "client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
    try:
        yield fsspec.filesystem("s3", skip_instance_cache=True)
    finally:
        if saved is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved
        fsspec.filesystem("s3").clear_instance_cache()
        server.stop()


def _bucket() -> str:
    return f"gefen-missing-{uuid.uuid4().hex[:12]}"


def test_saving_to_a_missing_bucket_is_an_error(s3, source, monkeypatch):
    monkeypatch.setenv("GEFEN_CKPT_CREATE_BUCKET", "0")  # restored afterwards, also when the CLI sets it
    bucket = _bucket()
    with pytest.raises(CheckpointError, match=f"bucket '{bucket}' does not exist.*GEFEN_CKPT_CREATE_BUCKET"):
        gefen_ckpt.write(gefen_ckpt.read(str(source)), f"s3://{bucket}/run/ckpt")
    s3.invalidate_cache()
    assert not s3.exists(bucket)
    monkeypatch.setenv("GEFEN_CKPT_CREATE_BUCKET", "1")  # the opt-in
    gefen_ckpt.write(gefen_ckpt.read(str(source)), f"s3://{bucket}/run/ckpt")
    assert gefen_ckpt.verify(f"s3://{bucket}/run/ckpt").ok


def test_cli_creates_a_bucket_only_when_asked(s3, source, monkeypatch):
    monkeypatch.setenv("GEFEN_CKPT_CREATE_BUCKET", "0")  # restored afterwards, also when the CLI sets it
    bucket = _bucket()
    result = invoke("reshard", source, f"s3://{bucket}/ws2", "-n", "2")
    assert result.exit_code == 1 and "does not exist" in result.output, result.output
    s3.invalidate_cache()
    assert not s3.exists(bucket)
    result = invoke("reshard", source, f"s3://{bucket}/ws2", "-n", "2", "--create-bucket")
    assert result.exit_code == 0, result.output
    assert invoke("verify", f"s3://{bucket}/ws2").exit_code == 0


# ----- SRC and DST compared after resolution ----------------------------------------------------
@pytest.mark.parametrize("spelling", ["dot-slash", "dot-dot", "symlink", "file-url", "inside"])
@pytest.mark.parametrize("command", [("reshard", "-n", "2"), ("convert", "--to", "portable")])
def test_src_and_dst_are_compared_after_resolution(source, tmp_path, monkeypatch, spelling, command):
    """``./G`` vs ``G``, ``x/../G``, a link to SRC and ``file://`` + its path are SRC itself, and a
    DST inside SRC would write into it: each is a usage error, even with --overwrite, and SRC is
    untouched."""
    import shutil

    src = tmp_path / "G"
    shutil.copytree(source, src)
    (tmp_path / "x").mkdir()
    monkeypatch.chdir(tmp_path)
    os.symlink(src, tmp_path / "link")
    dst = {"dot-slash": "./G", "dot-dot": "x/../G", "symlink": "link", "file-url": f"file://{src}",
           "inside": "G/sub"}[spelling]
    before = _tree(src)
    result = invoke(command[0], "G", dst, *command[1:], "--overwrite")
    assert result.exit_code == 2, result.output
    assert ("same location" if spelling != "inside" else "inside SRC") in result.output, result.output
    assert _tree(src) == before and not (src / "sub").exists()


def test_the_python_api_refuses_the_same_location_however_spelled(source, tmp_path):
    with pytest.raises(ValueError, match="same location"):
        gefen_ckpt.convert_checkpoint(str(source), f"file://{source}/../{source.name}", to="portable")
    with pytest.raises(ValueError, match="inside SRC"):
        gefen_ckpt.convert_checkpoint(str(source), str(source / "nested"), to="portable")
    assert not (source / "nested").exists()

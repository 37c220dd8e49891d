"""The offline tools run where torch cannot be imported: the wire format's modules, the canonical
state's description, and ``gefen-ckpt inspect`` / ``verify`` of a portable checkpoint (a
manifest, checksums and numpy need no torch). Each check runs in a fresh interpreter whose
``import torch`` raises ImportError; the checkpoint is written here, with torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import gefen_ckpt
from gefen import Gefen
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire.manifest import open_checkpoint
from gefen_cli.app import app

#: run before anything else in the child: every later ``import torch`` (or torch.*) fails
_NO_TORCH = 'import sys\nsys.modules["torch"] = None\n'
_CLI = _NO_TORCH + """
from gefen_cli.app import main
sys.argv = ["gefen-ckpt", *sys.argv[1:]]
main()
"""
#: the modules an offline reader of the format imports
TORCH_FREE = ("gefen_ckpt.wire", "gefen_ckpt.wire.manifest", "gefen_ckpt.wire.index", "gefen_ckpt.wire.peek",
              "gefen_ckpt.wire.verify", "gefen_ckpt.state.canonical", "gefen_ckpt")


def _without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """A small Gefen checkpoint (m8, two steps: a learned codebook) and its parameter names."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    opt = Gefen(model.named_parameters(), lr=1e-2, moments="m8")
    for _ in range(2):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    path = tmp_path_factory.mktemp("torch-free") / "step-2"
    gefen_ckpt.save(opt, str(path))
    return str(path), [name for name, _ in model.named_parameters()]


def test_blocking_torch_blocks_it():
    """The harness itself: in the child, importing torch fails."""
    done = _without_torch(_NO_TORCH + "import torch\n")
    assert done.returncode != 0 and "import of torch halted" in done.stderr, done.stderr


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_format_modules_import_without_torch(module):
    done = _without_torch(_NO_TORCH + f"import {module}\nprint('imported')\n")
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr


def test_inspect_without_torch_says_what_inspect_with_torch_says(portable):
    path, names = portable
    done = _without_torch(_CLI, "inspect", path, "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    with_torch = CliRunner().invoke(app, ["inspect", path, "--json"])
    assert with_torch.exit_code == 0, with_torch.output
    assert summary == json.loads(with_torch.stdout)
    assert summary["step"] == 2 and [p["fqn"] for p in summary["params"]] == names
    assert summary["codebook"]["size"] == 256 and summary["codebook"]["sorted"]

    table = _without_torch(_CLI, "inspect", path)
    assert table.returncode == 0, table.stderr
    assert all(name in table.stdout for name in names) and "totals" in table.stdout


def test_verify_without_torch_checks_every_tensor(portable, tmp_path):
    path, names = portable
    done = _without_torch(_CLI, "verify", path, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    with_torch = CliRunner().invoke(app, ["verify", path, "--json"])
    assert report == json.loads(with_torch.stdout)
    assert report["ok"] and report["problems"] == [] and report["tensors"] > len(names)

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    piece = open_checkpoint(Store(str(bad))).tensors[(names[0], "m_code")].pieces[0]
    data = bytearray((bad / piece.file).read_bytes())
    data[piece.offset] ^= 0xFF
    (bad / piece.file).write_bytes(bytes(data))
    failed = _without_torch(_CLI, "verify", str(bad))
    assert failed.returncode == 1 and "checksum" in failed.stderr and f"{names[0]}/m_code" in failed.stderr

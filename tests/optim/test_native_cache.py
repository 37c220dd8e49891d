"""The native step's calibration cache (gefen.c_kernels.calibrate_cached): a fresh process reuses the
result of an earlier one with the same library build, CPU and torch, and gets the same numbers;
a missing, corrupt or unwritable cache only costs the calibration."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import gefen.c_kernels as c_kernels

pytestmark = pytest.mark.skipif(c_kernels._lib is None, reason="gefen._gefen_step is not built")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache directory and an uncalibrated module (restored afterwards)."""
    monkeypatch.setenv("GEFEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(c_kernels, "_calibration", None)  # restored afterwards
    yield tmp_path / "cache"


def _files(cache):
    return sorted(os.listdir(cache)) if cache.exists() else []


def test_first_use_calibrates_and_caches(fresh):
    assert c_kernels._calibrated().m8
    (name,) = _files(fresh)
    assert name == f"native-calibration-{c_kernels.cache_key()}.json"
    entry = json.loads((fresh / name).read_text())
    assert entry["m8"] is True and entry["vml"] is c_kernels._calibrated().vml
    assert entry["m4v4"] is c_kernels._calibrated().m4v4 is True


def test_a_cached_result_skips_calibration(fresh, monkeypatch):
    calibration = c_kernels._calibrated()
    c_kernels._calibration = None
    monkeypatch.setattr(c_kernels, "calibrate", lambda: pytest.fail("calibrated although the cache holds the result"))
    assert c_kernels._calibrated() == calibration


@pytest.mark.parametrize("content", ["not json", "[]", '{"m8": 1, "vml": false, "m4v4": true}', ""])
def test_a_corrupt_entry_is_recalibrated_and_replaced(fresh, content):
    fresh.mkdir()
    path = fresh / f"native-calibration-{c_kernels.cache_key()}.json"
    path.write_text(content)
    assert c_kernels._calibrated().m8
    assert json.loads(path.read_text())["m8"] is True


def test_an_unwritable_cache_falls_back_to_calibrating(fresh, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GEFEN_CACHE_DIR", str(blocker / "cache"))  # a directory can never be made there
    assert c_kernels._calibrated().m8


def test_the_key_follows_the_library_build(monkeypatch, tmp_path):
    before = c_kernels.cache_key()
    other = tmp_path / "lib.so"
    shutil.copyfile(c_kernels._lib_path, other)
    with open(other, "ab") as fh:
        fh.write(b"\0")  # another build
    monkeypatch.setattr(c_kernels, "_lib_path", str(other))
    assert c_kernels.cache_key() != before


def test_the_key_follows_the_cpu(monkeypatch):
    before = c_kernels.cache_key()
    monkeypatch.setattr(c_kernels, "_cpu_identity", lambda: "another CPU")
    assert c_kernels.cache_key() != before


_PROBE = """
import json, sys, torch
import gefen.c_kernels as c_kernels
from gefen import Gefen
torch.manual_seed(0)
m = torch.nn.Linear(64, 48)
opt = Gefen(m.named_parameters(), lr=1e-2, weight_decay=0.1)
for _ in range(3):
    m(torch.randn(16, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()
print(json.dumps({"m8": c_kernels._calibrated().m8, "native": c_kernels.available(),
                  "sum": [float(p.double().sum()) for p in m.parameters()]}))
"""


def _probe(cache, n: int = 1) -> list[dict]:
    env = dict(os.environ, GEFEN_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(n)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


@pytest.mark.timeout(300)
def test_concurrent_fresh_processes_share_one_cache_and_the_same_numbers(tmp_path):
    cache = tmp_path / "cache"
    first = _probe(cache, n=3)  # all start with an empty cache: each calibrates and writes
    assert _files(cache) == [f"native-calibration-{c_kernels.cache_key()}.json"]  # one entry, no temp files left
    (again,) = _probe(cache)  # reads the cache
    for result in first + [again]:
        assert result["native"] and result == first[0]

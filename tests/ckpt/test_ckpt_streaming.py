"""Streaming and failure behaviour of the writer/reader: bounded memory, partial reads of
large tensors, odd shapes and dtypes, a save that fails half-way."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import gefen_ckpt
from gefen.contract import FieldSpec, OptimizerContract
from gefen_ckpt import CanonicalState, EagerSource, ParamState
from gefen_ckpt.errors import CheckpointCorruptError
from gefen_ckpt.io.storage import Store
from gefen_ckpt.wire.reader import stage_checkpoint

from ckpt_util import bits_equal, canonical_equal, fresh_like, same, snapshot, trained

psutil = pytest.importorskip("psutil", reason="psutil (the bench extra) measures RSS")
pytestmark = pytest.mark.timeout(120)
CONTRACT = OptimizerContract("test.Streaming", "1", (), (FieldSpec("m", "uint8", "param"),
                                                          FieldSpec("s", "float32", "row")))


class Generated:
    """A lazy uint8 source whose rows are computed on demand; records the largest read."""

    def __init__(self, rows: int, cols: int, fail_at: int | None = None):
        self.shape, self.dtype, self.fail_at, self.largest = (rows, cols), torch.uint8, fail_at, 0

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        stop = self.shape[0] if stop is None else stop
        if self.fail_at is not None and start <= self.fail_at < stop:
            raise RuntimeError("source failed")
        self.largest = max(self.largest, (stop - start) * self.shape[1])
        base = (torch.arange(self.shape[1]) % 251).to(torch.uint8)  # uint8 temporaries only
        return base.unsqueeze(0) + torch.arange(start, stop).to(torch.uint8).unsqueeze(1)


def _state(source, rows: int) -> CanonicalState:
    return CanonicalState(CONTRACT, [{"params": ["w"]}],
                          {"w": ParamState((rows, source.shape[1]), torch.float32,
                                           {"m": source, "s": EagerSource(torch.arange(rows, dtype=torch.float32))})})


def test_large_lazy_state_streams_within_budget(tmp_path):
    rows, cols, budget = 3000, 32768, 8 * 2**20  # ~98 MB of codes
    source = Generated(rows, cols)
    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], proc.memory_info().rss)

    base = proc.memory_info().rss
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        gefen_ckpt.write(_state(source, rows), str(tmp_path / "big"), memory_budget=budget, max_file_bytes=40 * 2**20)
    finally:
        done.set()
        thread.join()
    assert source.largest <= budget // 4  # one piece at a time, each within a quarter of the budget
    assert peak[0] - base < budget + 24 * 2**20, f"save grew RSS by {(peak[0] - base) / 2**20:.0f} MiB for 98 MB of state"
    from gefen_ckpt.io.storage import Store
    from gefen_ckpt.wire.manifest import open_checkpoint

    files = open_checkpoint(Store(str(tmp_path / "big"))).files  # any format version
    assert len(files) == 3 and all(f.nbytes <= 40 * 2**20 for f in files)
    back = gefen_ckpt.read(str(tmp_path / "big")).params["w"].fields["m"]
    for start, stop in [(0, 3), (63, 64), (64, 200), (1000, 2999), (2990, 3000)]:
        assert torch.equal(back.read(start, stop), source.read(start, stop))
    assert gefen_ckpt.verify(str(tmp_path / "big")).ok


def test_failed_save_keeps_previous_checkpoint_and_leaves_nothing(tmp_path):
    url = str(tmp_path / "ck")
    good = _state(Generated(64, 1024), 64)
    gefen_ckpt.write(good, url, memory_budget=64 * 1024)
    before = sorted(os.listdir(url))
    with pytest.raises(RuntimeError, match="source failed"):
        gefen_ckpt.write(_state(Generated(64, 1024, fail_at=40), 64), url, memory_budget=64 * 1024)
    assert sorted(os.listdir(url)) == before
    assert canonical_equal(gefen_ckpt.read(url), good)


def test_lazy_state_of_a_replaced_checkpoint_reports_missing_files(tmp_path):
    url = str(tmp_path / "ck")
    gefen_ckpt.write(_state(Generated(8, 64), 8), url)
    stale = gefen_ckpt.read(url)
    gefen_ckpt.write(_state(Generated(8, 64), 8), url)  # collects the files `stale` points at
    with pytest.raises(CheckpointCorruptError, match="missing"):
        stale.params["w"].fields["m"].read()


def test_odd_shapes_and_dtypes(tmp_path):
    contract = OptimizerContract("test.Odd", "1", (), (  # optional: each parameter has some of them
        FieldSpec("a", "bfloat16", "param", optional=True), FieldSpec("b", "bool", "param", optional=True),
        FieldSpec("c", "int64", "scalar", optional=True)))
    params = {
        "empty_rows": ParamState((0, 5), torch.float32, {"a": EagerSource(torch.zeros(0, 5, dtype=torch.bfloat16))}),
        "empty_cols": ParamState((4, 0), torch.float32, {"a": EagerSource(torch.zeros(4, 0, dtype=torch.bfloat16))}),
        "scalar": ParamState((), torch.float32, {"a": EagerSource(torch.tensor(1.5, dtype=torch.bfloat16)),
                                                 "c": EagerSource(torch.tensor(-7))}),
        "cube": ParamState((3, 2, 2), torch.float32, {"b": EagerSource(torch.rand(3, 2, 2) > 0.5)}),
    }
    state = CanonicalState(contract, [{"params": list(params)}], params)
    for world_size in (None, 2, 5):
        url = str(tmp_path / f"odd{world_size}")
        gefen_ckpt.write(state, url, world_size=world_size, max_file_bytes=1024)
        back = gefen_ckpt.read(url)
        assert canonical_equal(state, back)
        assert bits_equal(back.params["cube"].fields["b"].read(1, 3), params["cube"].fields["b"].read(1, 3))
        for map_files in (False, True):  # what loads stage: fresh tensors, or views of the files
            assert canonical_equal(state, stage_checkpoint(Store(url), map_files=map_files))


def test_bf16_parameters_with_adamw(tmp_path):
    model, opt = trained("adamw")
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 40, (4, 6))
    model(x).float().sum().backward()
    opt.step()
    gefen_ckpt.save(opt, str(tmp_path / "bf16"), model=model)
    assert gefen_ckpt.read_manifest(str(tmp_path / "bf16"))["params"]["up.weight"]["fields"]["exp_avg"]["dtype"] == "bfloat16"
    resumed, opt2 = fresh_like(model, "adamw")
    gefen_ckpt.load(opt2, str(tmp_path / "bf16"), model=resumed)
    assert same(snapshot(opt, model), snapshot(opt2, resumed))

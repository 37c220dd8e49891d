"""Saves and loads hold the GIL except in a bounded number of calls, whatever the number of tensors.

Every torch operation called from Python releases the GIL, and while another thread of the
process runs Python (a data-loading or logging thread) each release costs a switch interval
(5 ms) before the GIL comes back: a save that made six torch ops per tensor took ~10 s for a
242-tensor state instead of ~50 ms (docs/decisions.md). Torch ops that reach the dispatcher are
what these tests count; attribute reads (``shape``, ``data_ptr``) do not dispatch and release
nothing.
"""

from __future__ import annotations

import errno

import pytest
import torch

import gefen_ckpt
from gefen import Gefen
from gefen.contract import FieldSpec, OptimizerContract
from gefen_ckpt.io import native, storage
from gefen_ckpt.io.storage import Store
from gefen_ckpt.state.canonical import CanonicalState, EagerSource, ParamState
from gefen_ckpt.wire.dtypes import DTYPES
from gefen_ckpt.wire.reader import stage_checkpoint

from ckpt_util import canonical_equal, synthetic_gefen, transformer_shapes
from op_count import CountOps

pytestmark = pytest.mark.timeout(120)



def _gefen(layers: int) -> Gefen:
    return synthetic_gefen(transformer_shapes(dim=16, layers=layers, vocab=32), seed=layers)[1]


def test_a_save_makes_a_constant_number_of_torch_ops(tmp_path):
    counts = []
    for layers in (2, 8):
        opt = _gefen(layers)
        with CountOps() as counted:
            gefen_ckpt.save(opt, str(tmp_path / f"l{layers}"))
        counts.append(counted.total)
    assert counts[0] == counts[1] <= 2, counts  # 4x the tensors, not one op more


def test_mapped_staging_makes_one_tensor_per_piece_and_no_other_op_per_piece(tmp_path):
    """``torch.from_numpy`` (``lift_fresh``) is the one dispatch per staged piece; it is ~35x
    cheaper than a view op under contention (measured 0.7 vs 23 ms)."""
    others = []
    for layers in (2, 8):
        url = str(tmp_path / f"l{layers}")
        gefen_ckpt.save(_gefen(layers), url)
        with CountOps() as counted:
            staged = stage_checkpoint(Store(url), map_files=True)
        pieces = sum(1 for _ in staged.tensors())
        assert counted.ops.pop("aten.lift_fresh.default", 0) <= pieces
        others.append(counted.total)
    assert others[0] == others[1] <= 2, others


def test_every_storable_dtype_stages_bitwise_from_a_mapping(tmp_path):
    """Mapped staging builds tensors through numpy; dtypes numpy lacks (bfloat16, float8) go
    through an integer of their size."""
    names = sorted(DTYPES)
    contract = OptimizerContract("test.AllDtypes", "1", (), tuple(FieldSpec(n, n, "param") for n in names))
    gen = torch.Generator().manual_seed(0)
    fields = {}
    for n in names:  # random bytes (NaN patterns included), compared bitwise
        high = 2 if n == "bool" else 256
        data = torch.randint(0, high, (3, 5 * DTYPES[n][1]), dtype=torch.uint8, generator=gen)
        fields[n] = EagerSource(data.view(getattr(torch, n)))
    params = {"w": ParamState((3, 5), torch.float32, fields)}
    state = CanonicalState(contract, [{"params": ["w"]}], params)
    url = str(tmp_path / "ck")
    gefen_ckpt.write(state, url, max_file_bytes=1024)
    for map_files in (True, False):
        assert canonical_equal(state, stage_checkpoint(Store(url), map_files=map_files))


@pytest.mark.parametrize("native_io", [True, False], ids=["C thread", "Python thread"])
def test_durable_soon_waits_and_reports_failures(tmp_path, native_io, monkeypatch):
    if native_io and not native.io:
        pytest.skip("no C library on this machine/build")
    monkeypatch.setattr(native, "io", native_io)
    store = Store(str(tmp_path))
    with store.create("f.bin", durable=False) as out:
        out.write(b"data")
    assert store.durable_soon("f.bin")() is None
    wait = store.durable_soon("missing.bin")
    with pytest.raises(OSError) as failure:
        wait()
    assert failure.value.errno == errno.ENOENT
    assert storage.Store("memory://gefen-gil-test").durable_soon("anything")() is None

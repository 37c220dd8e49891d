"""gefen.geometry: block shapes and the block length rule (one block per row, from the shape alone)."""

from __future__ import annotations

import math

import pytest
import torch

from gefen import Gefen
from gefen.geometry import as_blocks, block_shape, rows_and_row_numel, shape_period, shape_problem

pytestmark = pytest.mark.usefixtures("one_thread")


def planted(shape, period, seed, noise="normal"):
    """A gradient whose magnitude is constant inside blocks of ``period`` elements of each row.

    ``g[i, j] = r_i * s[i, j // period] * z`` with row scales ``r`` in [0.5, 2], block scales ``s``
    log-uniform over one decade (strongly varying) and ``z`` standard normal (or +-1).
    """
    gen = torch.Generator().manual_seed(seed)
    rows, row_numel = rows_and_row_numel(shape)
    r = 10 ** (0.3 * (2 * torch.rand(rows, 1, generator=gen) - 1))
    s = (10 ** -torch.rand(rows, row_numel // period, generator=gen)).repeat_interleave(period, 1)
    if noise == "normal":
        z = torch.randn(rows, row_numel, generator=gen)
    else:
        z = torch.randint(0, 2, (rows, row_numel), generator=gen).float() * 2 - 1
    return (r * s * z).reshape(shape)


@pytest.mark.parametrize("shape,period", [((5, 768), 768), ((3, 16, 3, 3), 144), ((7, 1), 1), ((4, 97), 97),
                                          ((2, 1, 1), 1), ((5, 0), 1), ((3, 0, 2), 1), ((), 1), ((1,), 1), ((4096,), 1)])
def test_shape_period_is_one_block_per_row(shape, period):
    """>= 2-D tensors: one block per row; 1-D/0-D tensors and empty rows: per-element state."""
    assert shape_period(shape) == period
    assert shape_problem("block", shape, block_shape(shape, period)) is None


@pytest.mark.parametrize("shape,blocks", [((6, 12), 3), ((6, 12), 12), ((6, 4, 3), 4), ((9,), 3), ((5, 0), 2)])
def test_block_fields_of_another_block_length_are_refused(shape, blocks):
    """A block field has the shape's one block length (``shape_period``): any other block count is
    refused, even one that divides the row."""
    assert "not a valid block shape" in shape_problem("block", shape, (shape[0], blocks))


def _m8_state_with_period_4():
    """A trained m8 optimizer on a (6, 12) weight and its state_dict re-cut into blocks of 4."""
    w = torch.nn.Parameter(torch.randn(6, 12, generator=torch.Generator().manual_seed(0)))
    opt = Gefen([("w", w)], moments="m8")
    w.grad = planted((6, 12), 4, 1)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0] = {**sd["state"][0], "period": torch.tensor(4), "m_scale": torch.ones(6, 3)}
    return w, opt, sd


def test_state_with_another_period_is_refused_before_the_load_changes_anything():
    w, opt, sd = _m8_state_with_period_4()
    before = {k: v.clone() for k, v in opt.state[w].items()}
    with pytest.raises(ValueError, match="period 4 is not the block length of shape .6, 12. .12"):
        opt.load_state_dict(sd)
    assert all(torch.equal(opt.state[w][k], v) for k, v in before.items())
    fresh = Gefen([("w", torch.nn.Parameter(w.detach().clone()))], moments="m8")
    with pytest.raises(ValueError, match="period 4"):
        fresh.load_state_dict(sd)
    assert not fresh.state and fresh.codebook is None


def test_checkpoint_with_another_period_is_refused_before_the_load_changes_anything():
    """gefen_ckpt checks the block field's shape against the live parameter before reading it."""
    import dataclasses

    import gefen_ckpt

    w, opt, _ = _m8_state_with_period_4()
    state = gefen_ckpt.export_canonical(opt)
    entry = state.params["w"]
    old = {**entry.fields, "period": gefen_ckpt.EagerSource(torch.tensor(4)),
           "m_scale": gefen_ckpt.EagerSource(torch.ones(6, 3))}
    state.params["w"] = dataclasses.replace(entry, fields=old)
    fresh = Gefen([("w", torch.nn.Parameter(w.detach().clone()))], moments="m8")
    with pytest.raises(gefen_ckpt.CheckpointMismatchError, match="m_scale: .*not a valid block shape"):
        gefen_ckpt.import_canonical(fresh, state)
    assert not fresh.state and fresh.codebook is None


def test_empty_rows_state_round_trips_through_a_checkpoint(tmp_path):
    """A parameter with empty rows has P = 1 and [rows, 0] block fields, which a checkpoint takes."""
    import gefen_ckpt

    e, w = torch.nn.Parameter(torch.zeros(4, 0)), torch.nn.Parameter(torch.randn(3, 5))
    opt = Gefen([("e", e), ("w", w)], moments="m8")
    e.grad, w.grad = torch.zeros(4, 0), torch.randn(3, 5)
    opt.step()
    gefen_ckpt.save(opt, str(tmp_path / "c"))
    e2, w2 = torch.nn.Parameter(torch.zeros(4, 0)), torch.nn.Parameter(w.detach().clone())
    fresh = Gefen([("e", e2), ("w", w2)], moments="m8")
    gefen_ckpt.load(fresh, str(tmp_path / "c"))
    assert fresh.state[e2]["m_scale"].shape == (4, 0) and int(fresh.state[e2]["period"]) == 1
    assert torch.equal(fresh.state[w2]["m_code"], opt.state[w]["m_code"])


def test_the_optimizer_allocates_state_from_the_shape_alone():
    """State exists after a step with all-zero gradients, with the shape's block length, and
    nothing is learned from zeros (the codebook stays unlearned, the moments zero)."""
    w, b = torch.nn.Parameter(torch.randn(12, 40)), torch.nn.Parameter(torch.randn(12))
    w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
    opt = Gefen([w, b], lr=0.0, moments="m8")
    opt.step()
    assert int(opt.state[w]["period"]) == 40 and opt.state[w]["m_scale"].shape == (12, 1)
    assert opt.codebook is None
    assert not opt.state[w]["m_scale"].any() and not opt.state[w]["v_row"].any()
    default = Gefen([w, b], lr=0.0)  # m4v4: no period, rows are the blocks
    default.step()
    assert default.state[w]["m_row_scale"].shape == (12,) and default.state[b]["exp_avg"].shape == (12,)
    assert default.codebook is None and default.v_codebook is None
    assert not default.state[w]["m_row_scale"].any() and not default.state[w]["v_row"].any()
    assert not default.state[b]["exp_avg"].any() and not default.state[b]["exp_avg_sq"].any()


def test_optimizer_gives_vectors_and_scalars_period_one():
    """The optimizer's state agrees: P = 1 and one block per element for 1-D/0-D parameters."""
    vec, scalar = torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.tensor(0.5))
    vec.grad, scalar.grad = planted((40,), 1, 0), torch.tensor(0.25)
    opt = Gefen([vec, scalar], moments="m8")
    opt.step()
    assert int(opt.state[vec]["period"]) == 1 and opt.state[vec]["m_scale"].shape == (40, 1)
    assert int(opt.state[scalar]["period"]) == 1 and opt.state[scalar]["m_scale"].shape == (1, 1)
    default = Gefen([vec, scalar])  # m4v4: AdamW's exact per-element moments
    default.step()
    assert default.state[vec]["exp_avg"].shape == (40,) and default.state[scalar]["exp_avg_sq"].shape == ()


@pytest.mark.parametrize("shape,period", [((6, 12), 4), ((6, 12), 12), ((6, 12), 1), ((4, 3, 2, 5), 10), ((), 1), ((9,), 1)])
def test_block_shape_and_block_view(shape, period):
    """Blocks are contiguous runs of P elements inside one row; row slices keep whole blocks."""
    rows, row_numel = rows_and_row_numel(shape)
    assert block_shape(shape, period) == (rows, row_numel // period)
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    blocks = as_blocks(t, period)
    assert blocks.shape == (rows, row_numel // period, period)
    flat = t.reshape(rows, row_numel)
    for r in range(rows):
        for b in range(row_numel // period):
            assert torch.equal(blocks[r, b], flat[r, b * period : (b + 1) * period])
    blocks[0, 0, 0] = -1.0  # a view, not a copy
    assert t.reshape(-1)[0] == -1.0
    if len(shape) >= 1 and rows > 1:
        half = rows // 2
        assert torch.equal(as_blocks(t[half:], period), blocks[half:])


@pytest.mark.parametrize("period", [0, 5, 7, -4])
def test_block_shape_rejects_non_divisors(period):
    """A period that does not divide the row length is an error naming it."""
    with pytest.raises(ValueError, match=str(period)):
        block_shape((3, 12), period)




def test_the_geometry_module_is_torch_free_and_owns_the_field_shapes():
    """Contracts, the checkpoint subsystem and the CLI's torch-free inspect share one table."""
    import subprocess
    import sys

    code = "import sys, gefen.geometry, gefen.contract; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    from gefen.contract import GEOMETRIES, FieldSpec
    from gefen.geometry import field_local_shape, period_of_blocks

    assert set(GEOMETRIES) == {"scalar", "param", "block", "row", "col", "global"}
    assert shape_problem("block", (6, 4, 3), (6, 1)) is None and period_of_blocks((6, 4, 3), 1) == 12
    assert "not a valid block shape" in shape_problem("block", (6, 12), (6, 3))
    assert shape_problem("col", (6, 4, 3), (12,)) is None and shape_problem("row", (6, 4), (4,))
    assert field_local_shape("row", (2, 12), (6, 12), 12) == (2,)
    assert field_local_shape("col", (6, 5), (6, 10), 10) == (5,)  # columns split (Shard(1))
    assert FieldSpec("v", "float32", "block").check_shape((6, 12), (6, 1)) is None

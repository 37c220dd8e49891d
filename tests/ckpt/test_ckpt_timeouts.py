"""A rank that stalls in a collective save or load makes every rank raise, naming it, after the
``timeout`` the API takes (not gloo's 30 minutes). Real gloo ranks; the stall is an injected
sleep on rank 1 before the step where the ranks meet."""

from __future__ import annotations

import time

import torch

from distributed import run

STALL = 6.0
TIMEOUT = 1.5


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return model, opt


def _stalled(rank: int, world_size: int, url: str) -> dict:
    """Save with rank 1 stalled, then (the ranks stay in step after a timeout) save normally and
    load with rank 1 stalled; each phase's outcome on this rank."""
    import gefen_ckpt
    import gefen_ckpt.sharded_io as sharded_io

    model, opt = _model_and_optimizer()
    out = {}
    for phase, stalled in (("save", "write_pieces"), ("load", "open_checkpoint")):
        if phase == "load":
            gefen_ckpt.save(opt, url, model=model, timeout=60)
        real = getattr(sharded_io, stalled)

        def slow(*args, real=real, **kwargs):
            if rank == 1:
                time.sleep(STALL)
            return real(*args, **kwargs)

        setattr(sharded_io, stalled, slow)
        started = time.monotonic()
        try:
            (gefen_ckpt.save if phase == "save" else gefen_ckpt.load)(opt, url, model=model, timeout=TIMEOUT)
            out[phase] = {"error": None}
        except gefen_ckpt.CheckpointTimeoutError as exc:
            out[phase] = {"error": str(exc), "seconds": time.monotonic() - started}
        setattr(sharded_io, stalled, real)
    return out


def test_a_stalled_rank_makes_every_rank_raise_naming_it(tmp_path):
    results = run(_stalled, 2, str(tmp_path / "ck"), timeout=120)
    for phase in ("save", "load"):
        waiting, late = results[0][phase], results[1][phase]
        assert waiting["error"] and "rank(s) [1]" in waiting["error"], (phase, waiting)
        assert waiting["seconds"] < STALL, (phase, waiting)  # it gave up after the timeout, not the stall
        assert late["error"] and "rank 1 arrived after the other ranks gave up" in late["error"], (phase, late)


def _stalled_transfer(rank: int, world_size: int) -> dict:
    """``transport.gather`` to rank 1 with rank 0 (which holds the replicated state's one copy to
    send) stalling in the middle of the data round: rank 1 gives up after ``timeout`` naming
    rank 0, and rank 0 raises too."""
    import torch.distributed as dist

    from gefen_ckpt import CheckpointError, transport

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    real = dist.isend

    def late_send(*args, **kwargs):
        time.sleep(STALL)
        return real(*args, **kwargs)

    if rank == 0:
        dist.isend = late_send
    started = time.monotonic()
    try:
        transport.gather(opt, 1, timeout=TIMEOUT)
        return {"error": None}
    except CheckpointError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started}
    finally:
        dist.isend = real


def test_a_rank_that_stalls_mid_transfer_makes_transport_raise():
    late, waiting = run(_stalled_transfer, 2, timeout=120)
    assert waiting["error"] and "CheckpointTimeoutError" in waiting["error"], waiting
    assert "receiving from rank 0" in waiting["error"], waiting
    assert waiting["seconds"] < STALL, waiting  # it gave up after the timeout, not the stall
    assert late["error"], late

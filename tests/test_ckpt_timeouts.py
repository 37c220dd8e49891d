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

"""A rank that stalls in a collective save or load makes every rank raise, naming it, after the
``timeout`` the API takes (not gloo's 30 minutes). Real gloo ranks; the stall is an injected
sleep on rank 1 before the step where the ranks meet."""

from __future__ import annotations

import time

import pytest
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
    import gefen_ckpt.dist.sharded as sharded_io

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


# ----- a rank that dies or stalls in the middle of a collective save -----------------------------
PG_TIMEOUT = 6.0  # the process group's timeout: every survivor must raise within it plus a margin
MARGIN = 30.0  # start-up skew and a busy shared machine (the promise: the pg timeout + 60 s)
LONG_STALL = 20.0


def _entry(rank: int, world_size: int, workdir: str, fn, args) -> None:
    """A rank of a job with a short process-group timeout; its outcome (or nothing, if it died)
    goes to ``result<rank>.pt``."""
    import datetime
    import os
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        result = {"crashed": traceback.format_exc()}
    torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
    os._exit(0)


def _run_dying(fn, world_size: int, *args, timeout: float = 180.0) -> list[dict | None]:
    """Like ``distributed.run``, but a rank may die on purpose (its result is None); a rank still
    running at ``timeout`` (a hang) fails the test."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as workdir:
        ctx = mp.start_processes(_entry, args=(world_size, workdir, fn, args), nprocs=world_size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in ctx.processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        hung = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()
        assert not hung, f"rank(s) {hung} still running after {timeout} s: a save that never returns"
        out = []
        for rank in range(world_size):
            path = os.path.join(workdir, f"result{rank}.pt")
            out.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    for r in out:
        assert r is None or "crashed" not in r, r["crashed"]
    return out


def _sharded_optimizer(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    shapes = {"emb": (64, 16), "proj": (40, 24), "norm": (16,)}
    params = {n: torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g), mesh, [Shard(0)]))
              for n, s in shapes.items()}
    opt = torch.optim.AdamW(list(params.items()), lr=1e-2)
    for n, p in params.items():
        p.grad = distribute_tensor(torch.randn(shapes[n], generator=g), mesh, [Shard(0)])
    opt.step()
    return opt


#: fault -> (rank, function of gefen_ckpt.dist.sharded to break, what it does there)
FAULTS = {
    "rank 1 dies after its data files": (1, "write_index", "die"),
    "rank 1 stalls before the gather": (1, "write_index", "stall"),
    "rank 0 stalls before the gather": (0, "write_index", "stall"),
    "rank 0 dies before the gather": (0, "write_index", "die"),
    "rank 1 dies after the commit": (1, "agree", "die"),
    "rank 0 dies after the commit": (0, "agree", "die"),
    "rank 1 stalls after the commit": (1, "agree", "stall"),
}


def _faulty_save(rank: int, world_size: int, url: str, fault: tuple, use_async: bool) -> dict:
    """Save once (the previous checkpoint), then save again with ``fault`` = (rank, function of
    ``gefen_ckpt.dist.sharded``, "die" or "stall"[, seconds]) injected; this rank's outcome."""
    import os

    import gefen_ckpt
    import gefen_ckpt.dist.sharded as sharded_io

    opt = _sharded_optimizer(world_size)
    gefen_ckpt.save(opt, url)  # the previous checkpoint, committed
    who, where, what, *stall = fault
    real = getattr(sharded_io, where)

    def broken(*args, **kwargs):
        if where == "agree" and not str(args[1]).startswith("committing"):
            return real(*args, **kwargs)
        if rank == who and what == "die":
            os._exit(17)
        if rank == who:
            time.sleep(stall[0] if stall else LONG_STALL)
        return real(*args, **kwargs)

    setattr(sharded_io, where, broken)
    for p in opt.state.values():  # a state that differs from the previous checkpoint's
        p["exp_avg"].mul_(2)
    started = time.monotonic()
    try:
        if use_async:
            gefen_ckpt.async_save(opt, url).result(timeout=300)
        else:
            gefen_ckpt.save(opt, url)
        return {"error": None, "seconds": time.monotonic() - started}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - started,
                "committed": getattr(exc, "committed", False)}


def _leftovers(url) -> dict[str, int]:
    """Files in ``url`` that the committed manifest does not name (the lock file aside)."""
    import os

    import gefen_ckpt
    from gefen_ckpt.wire.writelock import LOCK_NAME

    raw = gefen_ckpt.read_manifest(str(url))
    named = {w[0] for w in raw["writers"]} | {n for w in raw["writers"] for n in w[3::2]} | {"manifest.msgpack"}
    return {n: os.path.getsize(os.path.join(url, n)) for n in os.listdir(url) if n not in named | {LOCK_NAME}}


#: async_save runs the same collective save on its own thread and group: three faults cover it
CASES = [(fault, False) for fault in FAULTS] + [(fault, True) for fault in (
    "rank 1 dies after its data files", "rank 0 stalls before the gather", "rank 1 dies after the commit")]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault, use_async", CASES, ids=[f"{f}{' (async)' if a else ''}" for f, a in CASES])
def test_a_rank_that_dies_or_stalls_mid_save_makes_every_survivor_raise_and_leaves_no_files(
        tmp_path, fault, use_async):
    """Every surviving rank raises within the process group's timeout (plus a margin), never waits
    forever; the failed save's files are gone, every rank's (a dead rank's too); an error after the
    commit says that the checkpoint was committed; and a re-save into the same directory is a clean
    save."""
    import os

    import gefen_ckpt
    from gefen_ckpt.wire.writelock import LOCK_NAME

    url = tmp_path / "ck"
    results = _run_dying(_faulty_save, 2, str(url), FAULTS[fault], use_async)
    who, where, what = FAULTS[fault]
    after_commit = where == "agree"
    print(f"{fault}: " + ", ".join("died" if r is None else f"raised after {r['seconds']:.1f} s" for r in results))
    for rank, out in enumerate(results):
        if out is None:
            assert what == "die" and rank == who, (rank, results)
            continue
        assert out["error"], (rank, out)
        if rank != who or what != "stall":  # a stalled rank raises once it wakes: the others did not wait
            assert out["seconds"] < PG_TIMEOUT + MARGIN, (rank, out)
        if after_commit:
            assert "was committed" in out["error"] or "may still commit" in out["error"], (rank, out)
            assert "nothing was changed" not in out["error"], (rank, out)
        else:
            assert "was committed" not in out["error"], (rank, out)
    manifest = gefen_ckpt.read_manifest(str(url))
    previous_or_new = "new" if after_commit else "previous"
    assert gefen_ckpt.verify(str(url)).ok, previous_or_new
    assert sum(_leftovers(url).values()) == 0, _leftovers(url)  # the survivors removed every rank's files
    assert os.path.getsize(url / LOCK_NAME) <= 4096
    # the next save (here: one process) is a clean save
    state = gefen_ckpt.read(str(url))
    gefen_ckpt.write(state, str(url), world_size=2)
    assert _leftovers(url) == {} and gefen_ckpt.verify(str(url)).ok
    assert len([n for n in os.listdir(url) if n.startswith("data-")]) == len(
        [n for w in gefen_ckpt.read_manifest(str(url))["writers"] for n in w[3::2]])
    assert manifest["world_size"] == 2


# ----- async saves pending at destroy_process_group and at exit ---------------------------------
def _destroy_while_pending(rank: int, world_size: int, ok_url: str, bad_url: str) -> dict:
    """An async save still writing when the script destroys the process group: it is finished
    first (committed); one that fails is reported as a warning naming its checkpoint."""
    import warnings

    import torch.distributed as dist

    import gefen_ckpt
    import gefen_ckpt.dist.sharded as sharded_io

    opt = _sharded_optimizer(world_size)
    real = sharded_io.write_pieces
    out = {}
    for key, url in (("ok", ok_url), ("bad", bad_url)):
        def slow(*args, fail=key == "bad", **kwargs):
            time.sleep(1.0)  # still writing when destroy_process_group is called
            if fail and rank == 1:
                raise OSError("disk full (injected on rank 1)")
            return real(*args, **kwargs)

        sharded_io.write_pieces = slow
        gefen_ckpt.async_save(opt, url)  # the future is never asked: a script that forgets it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.destroy_process_group()
        out[key] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        sharded_io.write_pieces = real
        if key == "ok":  # a new world for the second save, as a job that restarts its group would
            import datetime

            dist.init_process_group("gloo", init_method=f"file://{ok_url}-rendezvous", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=PG_TIMEOUT))
            opt = _sharded_optimizer(world_size)
    return out


@pytest.mark.timeout(300)
def test_destroy_process_group_finishes_or_reports_a_pending_async_save(tmp_path):
    import gefen_ckpt

    ok, bad = str(tmp_path / "ok"), str(tmp_path / "bad")
    results = _run_dying(_destroy_while_pending, 2, ok, bad)
    assert gefen_ckpt.verify(ok).ok  # finished before the group went away
    for rank, out in enumerate(results):
        assert out["ok"] == [], (rank, out)
        assert len(out["bad"]) == 1 and bad in out["bad"][0] and "not written" in out["bad"][0], (rank, out)
        assert "before destroy_process_group" in out["bad"][0]


_AT_EXIT = """
import sys, time
sys.path.insert(0, sys.argv[3])
import gefen_ckpt, gefen_ckpt.wire.writer as writer
from ckpt_util import trained
model, opt = trained("adamw", steps=1)
real = writer.write_pieces
def slow(*args, **kwargs):
    time.sleep(1.0)  # still running when the script ends
    if sys.argv[2] == "fail":
        raise OSError("disk full (injected)")
    return real(*args, **kwargs)
writer.write_pieces = slow
gefen_ckpt.async_save(opt, sys.argv[1], model=model)  # the future is never asked
"""


@pytest.mark.parametrize("outcome", ["ok", "fail"])
def test_a_pending_async_save_is_finished_or_reported_at_interpreter_exit(tmp_path, outcome):
    import os
    import subprocess
    import sys

    import gefen_ckpt

    url = str(tmp_path / "ck")
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _AT_EXIT, url, outcome, tests], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    if outcome == "ok":
        assert gefen_ckpt.verify(url).ok and "async_save" not in done.stderr, done.stderr
    else:
        assert f"gefen_ckpt.async_save to {url} failed (reported at interpreter exit)" in done.stderr, done.stderr
        assert "disk full (injected)" in done.stderr and "not written" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_randomized_kills_and_stalls_of_collective_saves_leak_nothing(tmp_path):
    """Soak: ``$GEFEN_SOAK_TRIALS`` (default 20) random faults (a rank of 2-4 dies or stalls for
    0.5-20 s at one of four steps, sync or async): every survivor raises or every rank succeeds,
    the committed checkpoint verifies, and after the next save nothing but its files is left."""
    import os
    import random

    import gefen_ckpt

    rng = random.Random(int(os.environ.get("GEFEN_SOAK_SEED", "0")))
    trials = int(os.environ.get("GEFEN_SOAK_TRIALS", "20"))
    for trial in range(trials):
        world = rng.choice([2, 3, 4])
        where = rng.choice(["write_pieces", "write_index", "gather_bytes", "agree"])
        fault = (rng.randrange(world), where, rng.choice(["die", "stall"]), rng.choice([0.5, 3.0, LONG_STALL]))
        use_async = rng.random() < 0.3
        url = tmp_path / f"t{trial}"
        results = _run_dying(_faulty_save, world, str(url), fault, use_async)
        errors = [r["error"] for r in results if r is not None]
        assert all(errors) or not any(errors), (fault, results)  # one outcome on every surviving rank
        assert gefen_ckpt.verify(str(url)).ok, (fault, results)
        assert sum(_leftovers(url).values()) == 0, (fault, _leftovers(url))
        gefen_ckpt.write(gefen_ckpt.read(str(url)), str(url), world_size=world)
        assert _leftovers(url) == {} and gefen_ckpt.verify(str(url)).ok, (fault, _leftovers(url))

"""Run a function on N real gloo ranks (CPU) with a file:// rendezvous and a hard timeout.

``run(fn, world_size, *args)`` spawns ``world_size`` processes; each calls ``fn(rank,
world_size, *args)`` inside an initialised process group and its return value (anything
torch.save can write) comes back in rank order. ``rank_env=[{...}, ...]`` sets environment
variables per rank before its interpreter starts (e.g. a different ``PYTHONHASHSEED`` each). A rank that raises makes ``run`` raise with
every failed rank's traceback, the likeliest root cause first (the other ranks get a short
grace to finish, then are killed rather than left waiting in a collective); a rank that dies
without a result, or a run past ``timeout``, fails too.

A rank leaves with ``os._exit`` once its result is on disk and its process group destroyed:
gloo's worker threads can abort the interpreter's own teardown (``terminate called without
an active exception``), a crash after the tested code finished that says nothing about it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

POLL_SECONDS = 0.05
GRACE_SECONDS = 10.0
# What gloo says on a rank whose peer went away: a consequence, reported after the cause.
PEER_LOSS_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _entry(rank: int, world_size: int, workdir: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
    # every rank's connections are up before any rank can finish and close its own: a rank that
    # returns at once (no collective of its own) would otherwise fail a peer still connecting
    dist.barrier()
    out = os.path.join(workdir, f"result{rank}.pt")
    try:
        result = {"ok": fn(rank, world_size, *args)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, out + ".tmp")
    os.replace(out + ".tmp", out)  # a result file is complete or absent
    if "ok" in result:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _result(workdir: str, rank: int, cache: dict) -> dict | None:
    if rank not in cache:
        path = os.path.join(workdir, f"result{rank}.pt")
        if not os.path.exists(path):
            return None
        cache[rank] = torch.load(path, weights_only=False)
    return cache[rank]


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """``os.environ`` with ``values`` set, restored after (a spawned interpreter starts with it)."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start(world_size: int, workdir: str, fn, args, rank_env) -> list:
    """One spawned process per rank, each started under its own ``rank_env`` entry."""
    ctx, procs = mp.get_context("spawn"), []
    for rank in range(world_size):
        proc = ctx.Process(target=_entry, args=(rank, world_size, workdir, fn, args))
        with _environ(rank_env[rank] if rank_env else {}):
            proc.start()
        procs.append(proc)
    return procs


def run(fn, world_size: int, *args, timeout: float = 120.0, rank_env: list[dict[str, str]] | None = None) -> list:
    if rank_env is not None and len(rank_env) != world_size:
        raise ValueError(f"rank_env has {len(rank_env)} entries for {world_size} ranks")
    with tempfile.TemporaryDirectory() as workdir:
        procs = _start(world_size, workdir, fn, args, rank_env)
        deadline, cache, killed = time.monotonic() + timeout, {}, set()
        ended: dict[int, int] = {}  # rank -> the poll at which it was first seen ended
        try:
            while any(p.is_alive() for p in procs):
                _note_ended(procs, ended)
                if _failures(fn, workdir, procs, cache, killed, ended):
                    _wait_for_all(procs, time.monotonic() + GRACE_SECONDS)
                    break
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"distributed run of {fn.__name__} on {world_size} ranks exceeded {timeout}s")
                time.sleep(POLL_SECONDS)
        finally:
            for rank, p in enumerate(procs):
                if p.is_alive():
                    p.kill()
                    killed.add(rank)
                p.join()
        _note_ended(procs, ended)
        failures = _failures(fn, workdir, procs, cache, killed, ended)
        if failures:
            raise RuntimeError("\n\n".join(failures))
        return [_result(workdir, rank, cache)["ok"] for rank in range(world_size)]


def _note_ended(procs, ended: dict[int, int]) -> None:
    tick = max(ended.values(), default=-1) + 1
    for rank, p in enumerate(procs):
        if rank not in ended and not p.is_alive():
            ended[rank] = tick


def _wait_for_all(procs, until: float) -> None:
    """Once one rank failed, give the others a moment to fail too (they usually do at once, in
    the collective the failed rank left), so the report can name the root cause."""
    while any(p.is_alive() for p in procs) and time.monotonic() < until:
        time.sleep(POLL_SECONDS)


def _failures(fn, workdir: str, procs, cache: dict, killed: set[int], ended: dict[int, int]) -> list[str]:
    """Reports for the finished ranks that failed, likeliest root cause first: a rank that died
    without a result (the first to end first: a peer that died with it followed), then one that
    raised on its own, then one that only lost a peer (ranks the harness killed itself are not
    reported)."""
    found = []
    for rank, p in enumerate(procs):
        if p.is_alive() or rank in killed:
            continue
        res = _result(workdir, rank, cache)
        if res is None:
            found.append((0, ended.get(rank, 0), rank,
                          f"rank {rank} of {fn.__name__} died without a result (exit code {p.exitcode})"))
        elif "error" in res:
            lost_peer = any(marker in res["error"] for marker in PEER_LOSS_MARKERS)
            found.append((2 if lost_peer else 1, 0, rank, f"rank {rank} of {fn.__name__} failed:\n{res['error']}"))
    return [message for *_, message in sorted(found)]


def row_scaled_grads(shapes: dict[str, tuple[int, ...]], step: int) -> dict[str, torch.Tensor]:
    """The same full gradients on every world size for step ``step``, with per-row scales (so
    period choice and the codebook see structure, not i.i.d. noise)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, shape in shapes.items():
        scale = torch.rand(shape[0], generator=g).add(0.1).view(-1, *([1] * (len(shape) - 1)))
        out[name] = torch.randn(shape, generator=g) * scale
    return out

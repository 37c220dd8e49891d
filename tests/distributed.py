"""Run a function on N real gloo ranks (CPU) with a file:// rendezvous and a hard timeout.

``run(fn, world_size, *args)`` spawns ``world_size`` processes; each calls ``fn(rank,
world_size, *args)`` inside an initialised process group and its return value (anything
torch.save can write) comes back in rank order. A rank that raises makes ``run`` raise with
that rank's traceback (the other ranks are killed at once rather than left waiting in a
collective); a rank that dies without a result, or a run past ``timeout``, fails too.

A rank leaves with ``os._exit`` once its result is on disk and its process group destroyed:
gloo's worker threads can abort the interpreter's own teardown (``terminate called without
an active exception``), a crash after the tested code finished that says nothing about it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

POLL_SECONDS = 0.05


def _entry(rank: int, world_size: int, workdir: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
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


def run(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    with tempfile.TemporaryDirectory() as workdir:
        ctx = mp.start_processes(_entry, args=(world_size, workdir, fn, args), nprocs=world_size, join=False,
                                 start_method="spawn")
        procs, deadline, cache = ctx.processes, time.monotonic() + timeout, {}
        try:
            while any(p.is_alive() for p in procs):
                _raise_for_failures(fn, workdir, procs, cache)
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"distributed run of {fn.__name__} on {world_size} ranks exceeded {timeout}s")
                time.sleep(POLL_SECONDS)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        _raise_for_failures(fn, workdir, procs, cache)
        return [_result(workdir, rank, cache)["ok"] for rank in range(world_size)]


def _raise_for_failures(fn, workdir: str, procs, cache: dict) -> None:
    """Raise for a finished rank without a result (the likeliest root cause: report it first)
    or with an error."""
    done = [(rank, p.exitcode, _result(workdir, rank, cache)) for rank, p in enumerate(procs) if not p.is_alive()]
    for rank, code, res in done:
        if res is None:
            raise RuntimeError(f"rank {rank} of {fn.__name__} died without a result (exit code {code})")
    for rank, _, res in done:
        if "error" in res:
            raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{res['error']}")


def row_scaled_grads(shapes: dict[str, tuple[int, ...]], step: int) -> dict[str, torch.Tensor]:
    """The same full gradients on every world size for step ``step``, with per-row scales (so
    period choice and the codebook see structure, not i.i.d. noise)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, shape in shapes.items():
        scale = torch.rand(shape[0], generator=g).add(0.1).view(-1, *([1] * (len(shape) - 1)))
        out[name] = torch.randn(shape, generator=g) * scale
    return out

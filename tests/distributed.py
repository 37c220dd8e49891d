"""Run a function on N real gloo ranks (CPU) with a file:// rendezvous and a hard timeout.

``run(fn, world_size, *args)`` spawns ``world_size`` processes; each calls ``fn(rank,
world_size, *args)`` inside an initialised process group and its return value (anything
torch.save can write) comes back in rank order. A rank that raises makes ``run`` raise with
that rank's traceback; a hang past ``timeout`` kills every rank and fails.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, workdir: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
    out = os.path.join(workdir, f"result{rank}.pt")
    try:
        torch.save({"ok": fn(rank, world_size, *args)}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
    finally:
        dist.destroy_process_group()


def run(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    with tempfile.TemporaryDirectory() as workdir:
        ctx = mp.start_processes(_entry, args=(world_size, workdir, fn, args), nprocs=world_size, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"distributed run of {fn.__name__} on {world_size} ranks exceeded {timeout}s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world_size):
            path = os.path.join(workdir, f"result{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} of {fn.__name__} died without a result")
            res = torch.load(path, weights_only=False)
            if "error" in res:
                raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{res['error']}")
            results.append(res["ok"])
        return results

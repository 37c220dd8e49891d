"""Live healing through torchft: how long a rejoining replica waits for a healthy one's state,
and how many bytes travel, with ``gefen_ckpt.torchft_transport.GefenTransport`` against torchft's
own ``PGTransport`` and ``HTTPTransport``, in the same run.

Two processes (gloo on CPU, ``file://`` rendezvous): rank 0 holds the state, rank 1 receives it.
Each repetition starts at a barrier; the time is rank 1's, from the barrier until
``recv_checkpoint`` returns the state (so the sender's preparation counts). States, each wrapped
as torchft's Manager sends them (``{"user": {"default": ...}, "torchft": {...}}``):

* 4,096 tensors of 4 bytes each (the metadata-bound case);
* a model with ~1M parameters and its Gefen (m4v4) state after two steps;
* with ``--full`` (``make bench FULL=1``) the same at ~100M parameters.

Each transport is timed twice: as repetitions in one process come (the receiver's allocator
reuses the pages the previous repetition freed), and into fresh memory (the receiver hands its
free heap back to the OS, ``malloc_trim``, before each repetition, so every page it receives into
is faulted in, as in a replica process that has just started).

Bytes: ours counts every message; PGTransport's its pickled metadata plus each tensor's whole
storage (what it sends); HTTPTransport's the serialised stream it serves. Run alone with
``python -m benchmarks.bench_heal [--quick] [--full]``.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch

from benchmarks.common import md_table, write_json

TIMEOUT = timedelta(seconds=300)
TRANSPORTS = ("gefen", "torchft PG", "torchft HTTP")


def full_run() -> bool:
    return "--full" in sys.argv[1:] or os.environ.get("GEFEN_BENCH_FULL", "") not in ("", "0")


def _wrap(user: dict) -> dict:
    return {"user": {"default": user}, "torchft": {"step": 10, "batches_committed": 20}}


def small_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return _wrap({f"t{i}": torch.randn(1, generator=g) for i in range(4096)})


def gefen_model_state(millions: float) -> dict:
    """A stack of square layers with ~``millions`` M parameters and its Gefen state after 2 steps."""
    from gefen import Gefen

    dim = 512 if millions < 10 else 2048
    layers = max(1, round(millions * 1e6 / (dim * dim + dim)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    opt = Gefen(model.named_parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, dim)).square().mean().backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    return _wrap({"model": model.state_dict(), "optim": opt.state_dict()})


def state_bytes(state) -> int:
    """Bytes of the distinct tensors in ``state`` (shared ones once)."""
    seen, total = set(), 0
    for leaf in torch.utils._pytree.tree_leaves(state):
        if isinstance(leaf, torch.Tensor):
            key = (leaf.untyped_storage().data_ptr(), leaf.storage_offset(), tuple(leaf.shape), leaf.dtype)
            if key not in seen:
                seen.add(key)
                total += leaf.numel() * leaf.element_size()
    return total


def _pg_bytes(state) -> int:
    import pickle

    from torchft.checkpointing.pg_transport import _prepare_state_dict

    meta, tensors = _prepare_state_dict(state, 10, torch.device("cpu"))
    return len(pickle.dumps(meta)) + sum(t.numel() for t in tensors)


def _http_bytes(state) -> int:
    from torchft.checkpointing._serialization import _streaming_save

    buf = io.BytesIO()
    _streaming_save(state, buf)
    return buf.tell()


def _make(name: str, pg):
    if name == "gefen":
        from gefen_ckpt.torchft_transport import GefenTransport

        return GefenTransport(pg, TIMEOUT)
    if name == "torchft PG":
        from torchft.checkpointing.pg_transport import PGTransport

        return PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu"))
    from torchft.checkpointing.http_transport import HTTPTransport

    return HTTPTransport(timeout=TIMEOUT, num_chunks=0)


def _trim() -> None:
    """Return the free heap to the OS (glibc; elsewhere nothing), so the next receive faults its
    pages in afresh."""
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _worker(rank: int, workdir: str, cases: list[str], reps: int, full: bool) -> None:
    import http.server

    import torch.distributed as dist

    http.server.BaseHTTPRequestHandler.log_message = lambda *a: None  # one line per request otherwise

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=2)
    pg = dist.distributed_c10d._get_default_group()
    results = {}
    for case in cases:
        state = None  # only the sender holds one
        if rank == 0:
            state = small_state() if case == "4096 x 4 B" else gefen_model_state(100 if case.startswith("100M") else 1)
        for name in TRANSPORTS:
            transport = _make(name, pg)
            meta = [transport.metadata()]
            dist.broadcast_object_list(meta, src=0)  # the Manager passes the sender's metadata along
            times = {"warm": [], "fresh": []}
            for mode in times:
                for _ in range(reps + 1):  # the first is a warm-up
                    if rank == 1 and mode == "fresh":
                        _trim()
                    dist.barrier()
                    start = time.perf_counter()
                    if rank == 0:
                        transport.send_checkpoint([1], 10, state, TIMEOUT)
                    else:
                        got = transport.recv_checkpoint(0, meta[0], 10, TIMEOUT)
                        times[mode].append(time.perf_counter() - start)
                        del got
                    dist.barrier()
                    if rank == 0:
                        transport.disallow_checkpoint()
            transport.shutdown()
            if rank == 0:
                sent = (transport.last_send.bytes if name == "gefen" else
                        _pg_bytes(state) if name == "torchft PG" else _http_bytes(state))
                results[(case, name)] = {"bytes": sent, "state_bytes": state_bytes(state)}
            else:
                results[(case, name)] = {"seconds": statistics.median(times["warm"][1:]),
                                         "fresh_seconds": statistics.median(times["fresh"][1:]), "reps": reps}
    torch.save(results, os.path.join(workdir, f"out{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def measure(quick: bool, full: bool) -> dict:
    import torch.multiprocessing as mp

    cases = ["4096 x 4 B", "1M params"] + (["100M params"] if full else [])
    reps = 2 if quick else 5
    with tempfile.TemporaryDirectory() as workdir:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, workdir, cases, reps, full)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + (1800 if full else 600)
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                raise TimeoutError("bench_heal: the two processes did not finish in time")
            if p.exitcode != 0:
                raise RuntimeError(f"bench_heal: a process exited with {p.exitcode}")
        sender = torch.load(os.path.join(workdir, "out0.pt"))
        receiver = torch.load(os.path.join(workdir, "out1.pt"))
    return {f"{case} | {name}": {**sender[(case, name)], **receiver[(case, name)]} for case, name in sender}


def run(quick: bool) -> dict:
    try:
        import torchft  # noqa: F401
    except ImportError:
        return {"title": "Live healing (torchft)", "plots": [],
                "markdown": "Not measured: torchft is not installed (`pip install 'gefen[torchft]'`)."}
    full = full_run() and not quick
    data = measure(quick, full)
    rows, targets = [], []
    cases = list(dict.fromkeys(k.split(" | ")[0] for k in data))
    for case in cases:
        ours = data[f"{case} | gefen"]
        best = {key: min(data[f"{case} | {n}"][key] for n in TRANSPORTS[1:]) for key in ("seconds", "fresh_seconds")}
        for name in TRANSPORTS:
            d = data[f"{case} | {name}"]
            rows.append([case, name, f"{d['seconds'] * 1e3:.1f}", f"{d['fresh_seconds'] * 1e3:.1f}", f"{d['bytes']:,}",
                         f"{d['bytes'] / d['state_bytes']:.3f}"])
        targets.append([case, f"{ours['seconds'] / best['seconds']:.2f}x",
                        f"{ours['fresh_seconds'] / best['fresh_seconds']:.2f}x",
                        f"{ours['bytes'] / ours['state_bytes']:.3f}x the state's bytes"])
    markdown = "\n".join([
        "A rejoining replica receives a healthy one's state through torchft's `CheckpointTransport` "
        "(two gloo processes on this machine's CPUs, one state per row; receive time is the median of "
        f"{2 if quick else 5} repetitions after a warm-up, from a barrier until the state is in hand, "
        "once as repetitions come and once into fresh memory (the receiver returns its free heap to the "
        "OS first, as a replica process that has just started); bytes are what the sender puts on the "
        "wire, shared tensors such as the codebooks counted once in the state's bytes). Ours checks a "
        "CRC-32 of every tensor on arrival; torchft's transports check nothing.", "",
        md_table(["state", "transport", "receive (ms)", "receive, fresh memory (ms)", "bytes sent",
                  "bytes / state bytes"], rows), "",
        md_table(["state", "receive time, ours / best torchft", "same, fresh memory", "bytes on the wire, ours"],
                 targets), "",
        "Re-run: `python -m benchmarks.run_all --only heal --full` (the 100M row needs `--full`).",
    ])
    write_json("heal", data)
    return {"title": "Live healing (torchft)", "markdown": markdown, "plots": [], "data": data}


if __name__ == "__main__":
    result = run("--quick" in sys.argv[1:])
    print(result["markdown"])

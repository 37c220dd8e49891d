"""Time the training loop is blocked by a checkpoint save: ``gefen_ckpt.save`` (synchronous),
``gefen_ckpt.async_save`` (until it returns: the copy into host buffers) and torch's
``dcp.async_save`` of ``get_state_dict`` (until it returns: DCP's staging copy), on the same
Gefen state, each to a fresh directory, in one process (a 1-rank gloo group for DCP). The
async rows also give the time until the checkpoint is committed (``future.result()``). Median
of ``REPEATS`` saves after one warm-up (the async buffers are reused from the second save).
Run alone: ``python -m benchmarks.bench_async_save [--quick]``.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import md_table, write_json

REPEATS = 3


def _state(layers: int, dim: int):
    import gefen

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    opt = gefen.Gefen(model.named_parameters(), lr=1e-3)
    model(torch.randn(4, dim)).sum().backward()
    opt.step()
    return model, opt


def _timed(fn) -> tuple[float, float]:
    start = time.perf_counter()
    waiter = fn()
    blocked = time.perf_counter() - start
    if waiter is not None:
        waiter.result()
    return blocked, time.perf_counter() - start


def run(quick: bool) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import gefen_ckpt

    layers, dim = (4, 1024) if quick else (8, 4096)
    model, opt = _state(layers, dim)
    scratch = Path(tempfile.mkdtemp(prefix="gefen-async-"))
    dist.init_process_group("gloo", init_method=f"file://{scratch / 'rdv'}", rank=0, world_size=1)
    try:
        n = [0]

        def fresh() -> str:
            n[0] += 1
            return str(scratch / f"ck{n[0]}")

        def dcp_async():
            msd, osd = get_state_dict(model, opt)
            return dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=fresh())

        def dcp_sync():
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=fresh())

        methods = {"gefen_ckpt.save": lambda: gefen_ckpt.save(opt, fresh(), model=model),
                   "gefen_ckpt.async_save": lambda: gefen_ckpt.async_save(opt, fresh(), model=model),
                   "dcp.save (get_state_dict)": dcp_sync, "dcp.async_save (get_state_dict)": dcp_async}
        results = {}
        for name, fn in methods.items():
            _timed(fn)  # warm-up
            runs = [_timed(fn) for _ in range(REPEATS)]
            results[name] = {"blocked_s": statistics.median(r[0] for r in runs),
                             "committed_s": statistics.median(r[1] for r in runs)}
        state_bytes = gefen_ckpt.export_canonical(opt, model=model).total_bytes()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(scratch, ignore_errors=True)
    data = {"params": sum(p.numel() for p in model.parameters()), "state_bytes": state_bytes, "methods": results}
    write_json("async_save", data)
    sync = results["gefen_ckpt.save"]["blocked_s"]
    markdown = (
        f"A Gefen state of {data['params'] / 1e6:.0f}M parameters ({state_bytes / 2**20:.0f} MiB of optimizer state; "
        "DCP saves the model too), median of 3 saves after a warm-up, one process:\n\n"
        + md_table(["method", "training blocked (s)", "until committed (s)", "blocked vs gefen_ckpt.save"],
                   [[k, f"{v['blocked_s']:.3f}", f"{v['committed_s']:.3f}", f"{v['blocked_s'] / sync:.2f}x"]
                    for k, v in results.items()])
        + "\n\nRe-run: `python -m benchmarks.bench_async_save` (`--quick`: 4 x 1024^2).\n")
    return {"title": "Async save: time the training loop is blocked", "markdown": markdown, "plots": [], "data": data}


if __name__ == "__main__":
    print(run("--quick" in sys.argv)["markdown"])

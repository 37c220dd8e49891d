"""Follow an optimizer through a collective ``gefen_ckpt.save``: the product functions rank 0
runs, each counted once in the order first called, grouped into *stops* (consecutive functions
of one file). A stop in a file the save had already left is a *return*: the number says how
often the data goes back and forth between modules instead of along a straight line.

    python -m benchmarks.save_path [--list]

2 gloo ranks on CPU, a small ReLU MLP under Gefen after one step; prints JSON
(functions, stops, files, returns) and with ``--list`` every stop.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = str(Path(__file__).resolve().parents[1])
PRODUCT = tuple(os.path.join(ROOT, p) + os.sep for p in ("gefen", "gefen_ckpt", "cli"))


def _trace_save(optimizer, url: str) -> list[tuple[str, str]]:
    import gefen_ckpt

    seen, order = set(), []

    def on_call(frame, event, _):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PRODUCT):
            key = (code.co_filename, code.co_name, code.co_firstlineno)
            if key not in seen:
                seen.add(key)
                order.append((os.path.relpath(code.co_filename, ROOT), code.co_name))

    sys.setprofile(on_call)
    try:
        gefen_ckpt.save(optimizer, url)
    finally:
        sys.setprofile(None)
    return order


def _worker(rank: int, tmp: str, out: str) -> None:
    import gefen
    import gefen_ckpt

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    optimizer = gefen.Gefen(model.named_parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    gefen_ckpt.save(optimizer, f"{tmp}/warm-up")  # imports and caches out of the way
    order = _trace_save(optimizer, f"{tmp}/checkpoint")
    if rank == 0:
        Path(out).write_text(json.dumps(order))
    dist.destroy_process_group()


def measure() -> tuple[dict, list[tuple[str, list[str]]]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/order.json"
        mp.spawn(_worker, args=(tmp, out), nprocs=2)
        order = json.loads(Path(out).read_text())
    stops: list[tuple[str, list[str]]] = []
    for file, function in order:
        if stops and stops[-1][0] == file:
            stops[-1][1].append(function)
        else:
            stops.append((file, [function]))
    visited, returns = set(), 0
    for file, _ in stops:
        returns += file in visited
        visited.add(file)
    return {"functions": len(order), "stops": len(stops), "files": len(visited), "returns": returns}, stops


if __name__ == "__main__":
    counts, stops = measure()
    print(json.dumps(counts))
    if "--list" in sys.argv:
        for file, functions in stops:
            print(f"{file}: {', '.join(functions)}")

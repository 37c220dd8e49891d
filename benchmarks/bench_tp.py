"""Gefen's step under tensor parallelism vs data parallelism alone, on the same global tensors.

Four gloo ranks on the CPU hold the same transformer-shaped MLP blocks (``common.transformer_shapes``'
MLP up ``[4d, d]`` / down ``[d, 4d]`` pairs) two ways: data parallel only (``fully_shard`` on a
1-D mesh of 4: every matrix split by rows) and a 2x2 ``(dp, tp)`` mesh (``ColwiseParallel`` on
up, ``RowwiseParallel`` on down, then ``fully_shard`` on ``dp``: up split by rows over both
dimensions, down by rows over ``dp`` and by columns over ``tp``). The same global gradients are
set on both; the wall time of ``opt.step()`` (max over the ranks, median over interleaved
rounds after a warm-up) is compared. Under tensor parallelism the step adds two small
collectives (whole-row sums of g^2, whole-row max |m|) and runs the torch reference for the
column-split matrices (the fused kernels do not take column splits). Also reported: the
optimizer's state bytes per parameter summed over the ranks (row statistics of a column-split
matrix are held by each of its ``tp`` ranks).

Run alone with ``python -m benchmarks.bench_tp [--quick] [--muon]``; ``--muon`` times ``GefenMuon``
on the matrices instead (under tensor parallelism: one small max over ``tp`` for the column-split
rows' momentum scales; both layouts gather whole matrices for Newton-Schulz).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_tp.py`
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table, plot, structured_tensor, write_json

WORLD = 4
LAYOUTS = {"data parallel (4)": None, "dp x tp (2 x 2)": (2, 2)}


def blocks(d: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, 4 * d, bias=False),
                                                     torch.nn.Linear(4 * d, d, bias=False),
                                                     torch.nn.LayerNorm(d)) for _ in range(layers)])


def laid_out(d: int, layers: int, dims: tuple[int, int] | None) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = blocks(d, layers)
    if dims is None:
        mesh = init_device_mesh("cpu", (WORLD,))
    else:
        mesh2 = init_device_mesh("cpu", dims, mesh_dim_names=("dp", "tp"))
        for block in model:
            parallelize_module(block, mesh2["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        mesh = mesh2["dp"]
    for block in model:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def local_state_bytes(opt) -> int:
    tensors = {id(v): v for entry in opt.state.values() for v in entry.values() if isinstance(v, torch.Tensor)}
    return sum(v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes for v in tensors.values())


def global_state_bytes(opt) -> int:
    """Bytes of every per-parameter field at its global shape, once (what a checkpoint holds)."""
    return sum(v.numel() * v.element_size() for entry in opt.state_dict()["state"].values()
               for name, v in entry.items() if isinstance(v, torch.Tensor) and not name.endswith("codebook"))


def _rank(rank: int, d: int, layers: int, rounds: int, workdir: str, muon: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from gefen import Gefen, GefenMuon

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=WORLD)
    setups = {}
    for name, dims in LAYOUTS.items():
        model = laid_out(d, layers, dims)
        opt = GefenMuon([(n, p) for n, p in model.named_parameters() if p.dim() == 2], lr=1e-3) if muon \
            else Gefen(model.named_parameters(), lr=1e-3, weight_decay=0.1)
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = distribute_tensor(structured_tensor(tuple(p.shape), gen, 0.02), p.device_mesh, p.placements,
                                       src_data_rank=None)
        setups[name] = (model, opt)
    times = {name: [] for name in LAYOUTS}
    for r in range(rounds + 1):  # round 0: first steps (state allocation, codebooks), not timed
        for name, (_, opt) in setups.items():
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
            if r:
                times[name].append(float(took))
    sizes = {name: torch.tensor([local_state_bytes(opt)], dtype=torch.int64) for name, (_, opt) in setups.items()}
    for t in sizes.values():
        dist.all_reduce(t)
    global_bytes = {name: global_state_bytes(opt) for name, (_, opt) in setups.items()}
    numel = sum(p.numel() for p in setups[next(iter(LAYOUTS))][0].parameters())
    if rank == 0:
        torch.save({"times": times, "bytes": {n: int(t) for n, t in sizes.items()}, "global_bytes": global_bytes,
                    "numel": numel}, os.path.join(workdir, "result.pt"))
    dist.destroy_process_group()


def run(quick: bool) -> dict:
    return measure(quick, muon=False)


def measure(quick: bool, muon: bool) -> dict:
    import torch.multiprocessing as mp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    d, layers, rounds = (256, 2, 3) if quick else (512, 4, 7)
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_rank, args=(d, layers, rounds, workdir, muon), nprocs=WORLD)
        result = torch.load(os.path.join(workdir, "result.pt"))
    times, n = result["times"], result["numel"]
    med = {name: statistics.median(ts) for name, ts in times.items()}
    per_param = {name: b / n for name, b in result["bytes"].items()}
    per_param_global = {name: b / n for name, b in result["global_bytes"].items()}
    base, tp = LAYOUTS
    ratio = med[tp] / med[base]
    data = {"params": n, "d_model": d, "layers": layers, "rounds": rounds, "world": WORLD, "times_s": times,
            "median_s": med, "state_bytes_per_param": per_param, "global_state_bytes_per_param": per_param_global,
            "tp_over_dp": ratio}
    name = "tp_muon" if muon else "tp"
    write_json(name, data)
    png = plot(name, {"optimizer step": {k: v * 1e3 for k, v in med.items()}}, ylabel="ms (median, slowest rank)",
               title=f"{'GefenMuon' if muon else 'Gefen'} step, {n / 1e6:.1f}M params on {WORLD} gloo ranks")
    rows = [[name, f"{med[name] * 1e3:.0f}", f"{per_param_global[name]:.3f}", f"{per_param[name]:.3f}"]
            for name in LAYOUTS]
    markdown = "\n\n".join([
        f"{layers} MLP blocks of d = {d} ({n / 1e6:.1f}M parameters) on {WORLD} gloo ranks (CPU, one thread each), "
        f"the same global parameters and gradients on both layouts; `opt.step()` wall time of the slowest rank, "
        f"median of {rounds} interleaved rounds after a warm-up step. State bytes per global parameter: every "
        "field once at its global shape (what a checkpoint holds), and every rank's local state summed (column "
        "fields are replicated over the ranks that split rows, row fields over those that split columns).",
        md_table(["layout", "step ms", "state B/param (global)", "state B/param (all ranks' memory)"], rows),
        md_table(["target", "measured", "met"], [
            ["state <= 1.05 B/param under tensor parallelism", f"{per_param_global[tp]:.3f}",
             "yes" if per_param_global[tp] <= 1.05 else "no"],
            ["step time, 2x2 (dp, tp) / data parallel", f"{ratio:.2f}", "(reported)"],
        ]),
        "Re-run: `python -m benchmarks.run_all --only tp` (or `make bench`).",
    ])
    return {"title": "Tensor parallelism: the step on a (dp, tp) mesh vs data parallel only", "markdown": markdown,
            "plots": [str(png)], "data": data}


if __name__ == "__main__":
    out = measure("--quick" in sys.argv, muon="--muon" in sys.argv)
    print(out["markdown"])

"""Gefen's step under tensor parallelism vs data parallelism alone, on the same global tensors.

Four gloo ranks on the CPU hold the same transformer-shaped MLP blocks (``common.transformer_shapes``'
MLP up ``[4d, d]`` / down ``[d, 4d]`` pairs) two ways: data parallel only (``fully_shard`` on a
1-D mesh of 4: every matrix split by rows) and a 2x2 ``(dp, tp)`` mesh (``ColwiseParallel`` on
up, ``RowwiseParallel`` on down, then ``fully_shard`` on ``dp``: up split by rows over both
dimensions, down by rows over ``dp`` and by columns over ``tp``). The same global gradients are
set on both; the wall time of ``opt.step()`` (max over the ranks, median over rounds that
interleave every optimizer and layout, after a warm-up step) is compared for ``Gefen``,
``GefenMuon`` and ``GefenMuonHybrid``, and so is the number of collectives one step issues
(counted at the ``torch.distributed`` calls, after the first step). Under tensor parallelism
every parameter steps on the C kernels: a column-split matrix's row statistics (whole rows'
sums of g^2 and max |m|; GefenMuon: its rows' momentum scales) are computed on the shard, reduced
over ``tp`` in one collective, and passed to the kernels. Also reported: the optimizer's state
bytes per parameter (Gefen; row statistics of a column-split matrix are held by each of its
``tp`` ranks).

Run alone with ``python -m benchmarks.bench_tp [--quick]``.
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


KINDS = ("Gefen", "GefenMuon", "GefenMuonHybrid")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


def optimizer(kind: str, model: torch.nn.Module):
    from gefen import Gefen, GefenMuon, GefenMuonHybrid

    if kind == "Gefen":
        return Gefen(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    if kind == "GefenMuon":
        return GefenMuon([(n, p) for n, p in model.named_parameters() if p.dim() == 2], lr=1e-3)
    return GefenMuonHybrid(model, lr=1e-3)


def counted_step(opt) -> int:
    """One ``opt.step()``; returns how many collectives it issued (``torch.distributed`` calls)."""
    import torch.distributed as dist

    count, real = [0], {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(fn):
        def call(*args, **kw):
            count[0] += 1
            return fn(*args, **kw)
        return call

    for name, fn in real.items():
        setattr(dist, name, counting(fn))
    try:
        opt.step()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return count[0]


def _rank(rank: int, d: int, layers: int, rounds: int, workdir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=WORLD)
    setups = {}
    for kind in KINDS:
        for name, dims in LAYOUTS.items():
            model = laid_out(d, layers, dims)
            opt = optimizer(kind, model)
            gen = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.grad = distribute_tensor(structured_tensor(tuple(p.shape), gen, 0.02), p.device_mesh, p.placements,
                                           src_data_rank=None)
            setups[kind, name] = (model, opt)
    times = {key: [] for key in setups}
    for r in range(rounds + 1):  # round 0: first steps (state allocation, codebooks), not timed
        for key, (_, opt) in setups.items():
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
            if r:
                times[key].append(float(took))
    collectives = {key: counted_step(opt) for key, (_, opt) in setups.items()}
    gefen = {name: setups["Gefen", name][1] for name in LAYOUTS}
    sizes = {name: torch.tensor([local_state_bytes(opt)], dtype=torch.int64) for name, opt in gefen.items()}
    for t in sizes.values():
        dist.all_reduce(t)
    global_bytes = {name: global_state_bytes(opt) for name, opt in gefen.items()}
    numel = sum(p.numel() for p in setups["Gefen", next(iter(LAYOUTS))][0].parameters())
    if rank == 0:
        torch.save({"times": times, "collectives": collectives, "bytes": {n: int(t) for n, t in sizes.items()},
                    "global_bytes": global_bytes, "numel": numel}, os.path.join(workdir, "result.pt"))
    dist.destroy_process_group()


def run(quick: bool) -> dict:
    import torch.multiprocessing as mp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    d, layers, rounds = (256, 2, 3) if quick else (512, 4, 7)
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_rank, args=(d, layers, rounds, workdir), nprocs=WORLD)
        result = torch.load(os.path.join(workdir, "result.pt"))
    times, n, collectives = result["times"], result["numel"], result["collectives"]
    med = {key: statistics.median(ts) for key, ts in times.items()}
    per_param = {name: b / n for name, b in result["bytes"].items()}
    per_param_global = {name: b / n for name, b in result["global_bytes"].items()}
    base, tp = LAYOUTS
    # the median of each round's ratio: the two layouts of a round run back to back, so a load
    # change between rounds (the machine is shared) cancels
    ratios = {kind: statistics.median(t / b for t, b in zip(times[kind, tp], times[kind, base])) for kind in KINDS}
    data = {"params": n, "d_model": d, "layers": layers, "rounds": rounds, "world": WORLD,
            "times_s": {f"{k} / {name}": ts for (k, name), ts in times.items()},
            "median_s": {f"{k} / {name}": t for (k, name), t in med.items()},
            "collectives_per_step": {f"{k} / {name}": c for (k, name), c in collectives.items()},
            "state_bytes_per_param": per_param, "global_state_bytes_per_param": per_param_global,
            "tp_over_dp": ratios}
    write_json("tp", data)
    png = plot("tp", {kind: {name: med[kind, name] * 1e3 for name in LAYOUTS} for kind in KINDS},
               ylabel="ms (median, slowest rank)", title=f"optimizer step, {n / 1e6:.1f}M params on {WORLD} gloo ranks")
    rows = [[kind, name, f"{med[kind, name] * 1e3:.0f}", str(collectives[kind, name]),
             f"{ratios[kind]:.2f}" if name == tp else ""] for kind in KINDS for name in LAYOUTS]
    markdown = "\n\n".join([
        f"{layers} MLP blocks of d = {d} ({n / 1e6:.1f}M parameters) on {WORLD} gloo ranks (CPU, one thread each), "
        f"the same global parameters and gradients on both layouts; `opt.step()` wall time of the slowest rank, "
        f"median of {rounds} rounds that interleave every optimizer and layout, after a warm-up step (the ratio: "
        "the median of the rounds' ratios); collectives: "
        "`torch.distributed` calls of one later step. Under tensor parallelism every parameter steps on the C "
        "kernels, given its rows' statistics reduced over `tp`.",
        md_table(["optimizer", "layout", "step ms", "collectives / step", "2x2 / data parallel"], rows),
        "State bytes per global parameter (Gefen): every field once at its global shape (what a checkpoint "
        "holds), and every rank's local state summed (column fields are replicated over the ranks that split "
        "rows, row fields over those that split columns).",
        md_table(["layout", "state B/param (global)", "state B/param (all ranks' memory)"],
                 [[name, f"{per_param_global[name]:.3f}", f"{per_param[name]:.3f}"] for name in LAYOUTS]),
        md_table(["target", "measured", "met"], [
            ["state <= 1.05 B/param under tensor parallelism", f"{per_param_global[tp]:.3f}",
             "yes" if per_param_global[tp] <= 1.05 else "no"],
            ["Gefen step, 2x2 (dp, tp) / data parallel <= 1.3", f"{ratios['Gefen']:.2f}",
             "yes" if ratios["Gefen"] <= 1.3 else "no"],
        ]),
        "Re-run: `python -m benchmarks.run_all --only tp` (or `make bench`).",
    ])
    return {"title": "Tensor parallelism: the step on a (dp, tp) mesh vs data parallel only", "markdown": markdown,
            "plots": [str(png)], "data": data}


if __name__ == "__main__":
    print(run("--quick" in sys.argv)["markdown"])

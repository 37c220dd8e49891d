"""torch's own checkpoint API with Gefen vs AdamW: time and bytes of the stock flow.

The flow training frameworks run: ``get_state_dict(model, opt)`` + ``dcp.save`` of
``{"model": ..., "optim": ...}``, and to resume, a *fresh* optimizer: ``get_state_dict``
(which fills it by a zero-gradient step), ``dcp.load``, ``set_state_dict``. Same parameters
(``common.transformer_shapes``: 24.1M, or 11.5M with ``quick``), each optimizer after two steps
on the same structured gradients, one process (no process group: DCP then skips its
collectives; per-rank work under FSDP2 is this work on each rank's rows). Reported: the
optimizer's in-memory state bytes per parameter, its bytes on disk (the checkpoint directory
minus the model's share, which is the same file content for both), and median wall times of
save and of the whole resume over interleaved rounds, with their Gefen/AdamW ratios.

Run alone with ``python -m benchmarks.bench_stock_dcp [--quick]``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

if __package__ in (None, ""):  # `python benchmarks/bench_stock_dcp.py`
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from benchmarks.common import md_table, numel, plot, structured_tensor, transformer_shapes, write_json
from gefen import Gefen

OPTIMIZERS = {
    "Gefen": lambda named: Gefen(named, lr=1e-3, weight_decay=0.1),
    "AdamW": lambda named: torch.optim.AdamW(named, lr=1e-3, weight_decay=0.1, foreach=True),
}


class ParamSet(torch.nn.Module):
    """The transformer-shaped parameters as a module (names with dots become nested modules)."""

    def __init__(self, shapes, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.names = []
        for name, shape in shapes:
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(structured_tensor(shape, gen, 0.02)))
            self.names.append(name.replace(".", "_"))


def trained(kind: str, shapes, steps: int = 2):
    model = ParamSet(shapes, seed=0)
    opt = OPTIMIZERS[kind](list(model.named_parameters()))
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = structured_tensor(tuple(p.shape), gen)
        opt.step()
    opt.zero_grad()
    return model, opt


def state_bytes(opt) -> int:
    """Bytes of the tensors in ``opt.state`` and the optimizer-wide codebook, each storage once."""
    seen, total = set(), 0
    tensors = [v for entry in opt.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    if getattr(opt, "codebook", None) is not None:
        tensors.append(opt.codebook)
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def save(model, opt, path: str) -> None:
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def resume(kind: str, shapes, path: str) -> None:
    model = ParamSet(shapes, seed=2)
    opt = OPTIMIZERS[kind](list(model.named_parameters()))
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


def run(quick: bool) -> dict:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    size = 6.5 if quick else 25
    shapes = transformer_shapes(size)
    n = numel(shapes)
    rounds = 3 if quick else 5
    work = tempfile.mkdtemp(prefix="gefen-bench-stock-dcp-")
    try:
        trained_sets = {kind: trained(kind, shapes) for kind in OPTIMIZERS}
        model_only = os.path.join(work, "model-only")
        dcp.save({"model": trained_sets["AdamW"][0].state_dict()}, checkpoint_id=model_only)
        model_bytes = dir_bytes(model_only)
        times = {kind: {"save": [], "resume": []} for kind in OPTIMIZERS}
        disk = {}
        for r in range(rounds + 1):  # round 0 warms up (imports, first allocations)
            for kind, (model, opt) in trained_sets.items():
                path = os.path.join(work, f"{kind}-{r}")
                start = time.perf_counter()
                save(model, opt, path)
                saved = time.perf_counter()
                resume(kind, shapes, path)
                done = time.perf_counter()
                if r:
                    times[kind]["save"].append(saved - start)
                    times[kind]["resume"].append(done - saved)
                disk[kind] = dir_bytes(path) - model_bytes
                shutil.rmtree(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: {op: statistics.median(v) for op, v in ops.items()} for k, ops in times.items()}
    memory = {kind: state_bytes(opt) / n for kind, (_, opt) in trained_sets.items()}
    on_disk = {kind: b / n for kind, b in disk.items()}
    rows = [[kind, f"{memory[kind]:.3f}", f"{on_disk[kind]:.3f}", f"{med[kind]['save'] * 1e3:.0f}",
             f"{med[kind]['resume'] * 1e3:.0f}"] for kind in OPTIMIZERS]
    ratio = {op: med["Gefen"][op] / med["AdamW"][op] for op in ("save", "resume")}
    data = {"params": n, "rounds": rounds, "times_s": times, "median_s": med, "state_bytes_per_param": memory,
            "disk_bytes_per_param": on_disk, "model_bytes": model_bytes, "gefen_over_adamw": ratio}
    write_json("stock_dcp", data)
    png = plot("stock_dcp", {"save": {k: med[k]["save"] for k in OPTIMIZERS},
                             "resume": {k: med[k]["resume"] for k in OPTIMIZERS}},
               ylabel="seconds (median)", title=f"stock get_state_dict + DCP, {n / 1e6:.1f}M params, one process")
    markdown = "\n\n".join([
        f"{n / 1e6:.1f}M transformer-shaped parameters, one process, median of {rounds} interleaved rounds "
        "(after one warm-up round). *save*: `get_state_dict` + `dcp.save` of model and optimizer; *resume*: a "
        "fresh model and optimizer, `get_state_dict` + `dcp.load` + `set_state_dict`. Optimizer bytes on disk "
        "are the checkpoint's bytes minus a model-only checkpoint's.",
        md_table(["optimizer", "state B/param (memory)", "optimizer B/param (disk)", "save ms", "resume ms"], rows),
        md_table(["target", "measured", "met"], [
            ["state <= 1.05 B/param", f"{memory['Gefen']:.3f}", "yes" if memory["Gefen"] <= 1.05 else "no"],
            ["stock DCP checkpoint of the optimizer <= 1.05 x its state",
             f"{on_disk['Gefen'] / memory['Gefen']:.3f} x", "yes" if on_disk["Gefen"] <= 1.05 * memory["Gefen"] else "no"],
            ["save time, Gefen / AdamW", f"{ratio['save']:.2f}", "(reported)"],
            ["resume time, Gefen / AdamW", f"{ratio['resume']:.2f}", "(reported)"],
        ]),
        "Re-run: `python -m benchmarks.run_all --only stock_dcp` (or `make bench`).",
    ])
    return {"title": "torch's own checkpoint API (get_state_dict + DCP): Gefen vs AdamW", "markdown": markdown,
            "plots": [str(png)], "data": data}


if __name__ == "__main__":
    out = run("--quick" in sys.argv)
    print(out["markdown"])

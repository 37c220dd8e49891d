"""Replicated state (DDP, HSDP): how evenly the ranks share a save's writes and a load's reads,
against the single-writer rule (one replica writes every row, every rank reads its own rows) and
against torch's ``dcp.save`` / ``dcp.load`` of the same model through ``get_state_dict``, in the
same run.

Four gloo ranks on this machine's CPUs, a ~25M-parameter Gefen (m4v4) state, as DDP (every rank
holds everything) and as HSDP (2 replicas x 2 shards), on local disk and on S3 (moto's server on
loopback). Per rank: bytes written and read (``gefen_ckpt.last_io_stats()``; DCP's written bytes
are the sizes of each rank's files), store requests; the time of a save or load is its slowest
rank's, the median of the repetitions. And the rule alone at scale, with no data: a
Llama-3-405B-shaped Gefen state on HSDP 8 x 2,048, its balance and one rank's planning time.

Run alone with ``python -m benchmarks.bench_replicas [--quick]``; ``--ab N [--hsdp] [--params M]``:
only the default local-disk loads, the balanced checkpoint and the single-writer one (each saved
once, of an M-million-parameter state, default 25), loaded alternately N times each: medians of the
slowest rank's wall time and of each rank's CPU time.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import md_table, plot, structured_tensor, transformer_shapes, write_json

WORLD = 4
LAYOUTS = ("DDP 4", "HSDP 2x2")
METHODS = ("gefen-ckpt", "gefen-ckpt, read once", "single writer", "dcp")
BUCKET = "gefen-bench-replicas"


# ----- in each rank ---------------------------------------------------------------------------
class Holder(torch.nn.Module):
    """The parameters as a module (``get_state_dict`` walks a module)."""

    def __init__(self, named):
        super().__init__()
        for name, p in named:
            self.register_parameter(name.replace(".", "_"), p)


def _model(layout: str, millions: float, steps: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from gefen import Gefen

    gen = torch.Generator().manual_seed(0)
    shapes = transformer_shapes(millions)
    full = {n: structured_tensor(s, gen, 0.02) for n, s in shapes}
    mesh = init_device_mesh("cpu", (2, WORLD // 2)) if layout.startswith("HSDP") else None
    lay = (lambda t: distribute_tensor(t, mesh, [Replicate(), Shard(0)])) if mesh is not None else (lambda t: t)
    model = Holder([(n, torch.nn.Parameter(lay(t))) for n, t in full.items()])
    opt = Gefen(model.named_parameters(), lr=1e-3)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            p.grad = lay(structured_tensor(tuple(p.shape), g))
        opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def single_writer_rules(parts: dict) -> dict:
    """The rule before replicas shared the I/O: every row written by the first replica."""
    from gefen_ckpt.wire.index import Rule

    made = {}
    return {k: made.setdefault(id(p.holders), Rule(p.holders.shards, tuple(p.holders.grid[0].tolist())))
            for k, p in parts.items()}


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _case(method: str, model, opt, fresh, url: str, options: dict | None) -> dict:
    """One save and one load of ``method``; this rank's numbers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import gefen_ckpt
    import gefen_ckpt.dist.sharded as sharded_io

    out = {}
    if method == "dcp":
        def save():
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, storage_writer=_dcp_writer(url))

        def load():
            fmodel, fopt = fresh
            msd, osd = get_state_dict(fmodel, fopt)
            dcp.load({"model": msd, "optim": osd}, storage_reader=_dcp_reader(url))
            set_state_dict(fmodel, fopt, model_state_dict=msd, optim_state_dict=osd)

        out["save_s"], out["load_s"] = _timed(save), _timed(load)
        return out
    real = sharded_io.rules_for
    if method == "single writer":
        sharded_io.rules_for = single_writer_rules
    try:
        out["save_s"] = _timed(lambda: gefen_ckpt.save(opt, url, storage_options=options))
        out["save"] = gefen_ckpt.last_io_stats().as_dict()
    finally:
        sharded_io.rules_for = real
    once = {"gefen-ckpt": None, "gefen-ckpt, read once": True}.get(method, False)  # None: the default, by store
    out["load_s"] = _timed(lambda: gefen_ckpt.load(fresh[1], url, storage_options=options, read_once=once))
    out["load"] = gefen_ckpt.last_io_stats().as_dict()
    return out


def _dcp_writer(url: str):
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url) if url.startswith("s3://") else FileSystemWriter(url)


def _dcp_reader(url: str):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url) if url.startswith("s3://") else FileSystemReader(url)


def _rank(rank: int, workdir: str, endpoint: str | None, millions: float, reps: int) -> None:
    import fsspec
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=WORLD)
    if endpoint:  # DCP's fsspec reader and writer take no options: the global config serves both
        fsspec.config.conf["s3"] = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": endpoint}}
    results = {}
    for layout in LAYOUTS:
        model, opt = _model(layout, millions, steps=2)
        fresh = _model(layout, millions, steps=0)
        for store in ("local disk", "S3") if endpoint else ("local disk",):
            methods = [m for m in METHODS if not (store == "S3" and m == "gefen-ckpt, read once")]  # S3's default
            for rep in range(-1, reps):  # rep -1 warms up (connections, first allocations): not recorded
                for method in methods if rep % 2 else methods[::-1]:  # alternating order: drift cancels
                    tag = f"{layout}-{method}-{rep}".replace(" ", "_").replace(",", "")
                    url = (os.path.join(workdir, tag) if store == "local disk"
                           else f"s3://{BUCKET}/{workdir.strip('/').replace('/', '_')}/{tag}")
                    result = _case(method, model, opt, fresh, url, None)
                    if rank == 0:
                        result["files"] = _files(url)
                    if rep >= 0:
                        results.setdefault((layout, store, method), []).append(result)
                    dist.barrier()
    torch.save(results, os.path.join(workdir, f"result{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _files(url: str) -> dict[str, int]:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {e["name"].rsplit("/", 1)[-1]: int(e["size"]) for e in fs.ls(root, detail=True) if e["type"] == "file"}


def _ab_rank(rank: int, workdir: str, layout: str, reps: int, millions: float) -> None:
    """``--ab``: save both checkpoints once, then load them alternately (``reps`` each after a
    warm-up pair); this rank's (checkpoint, slowest rank's wall s, this rank's CPU s) per load."""
    import torch.distributed as dist

    import gefen_ckpt
    import gefen_ckpt.dist.sharded as sharded_io

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=WORLD)
    _, opt = _model(layout, millions, steps=2)
    _, fresh = _model(layout, millions, steps=0)
    urls = {"gefen-ckpt": os.path.join(workdir, "balanced"), "single writer": os.path.join(workdir, "single")}
    real = sharded_io.rules_for
    gefen_ckpt.save(opt, urls["gefen-ckpt"])
    sharded_io.rules_for = single_writer_rules
    try:
        gefen_ckpt.save(opt, urls["single writer"])
    finally:
        sharded_io.rules_for = real
    loads = []
    for rep in range(-1, reps):
        for name in list(urls) if rep % 2 else list(urls)[::-1]:
            cpu = time.process_time()
            wall = _timed(lambda url=urls[name]: gefen_ckpt.load(fresh, url))
            if rep >= 0:
                loads.append((name, wall, time.process_time() - cpu))
    torch.save(loads, os.path.join(workdir, f"ab{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def ab(layout: str, reps: int, millions: float = 25) -> str:
    """The default local-disk load of the balanced checkpoint against the single-writer one, in
    alternating order (drift cancels): a difference of a few percent needs this, not ``run``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gefen-bench-replicas-ab-") as workdir:
        mp.spawn(_ab_rank, args=(workdir, layout, reps, millions), nprocs=WORLD)
        per_rank = [torch.load(os.path.join(workdir, f"ab{r}.pt")) for r in range(WORLD)]
    lines, wall, cpu = [], {}, {}
    for name in ("gefen-ckpt", "single writer"):
        wall[name] = statistics.median(w for n, w, _ in per_rank[0] if n == name)
        cpu[name] = [statistics.median(c for n, _, c in loads if n == name) for loads in per_rank]
        lines.append(f"{layout}, {millions:g}M params, local disk, default load, {name}: {wall[name] * 1e3:.1f} ms (median of {reps}, "
                     f"slowest rank); CPU per rank {', '.join(f'{c * 1e3:.1f}' for c in cpu[name])} ms")
    ratio = [sum(cpu["gefen-ckpt"]) / sum(cpu["single writer"]), wall["gefen-ckpt"] / wall["single writer"]]
    lines.append(f"gefen-ckpt / single writer: wall {ratio[1]:.3f}, CPU {ratio[0]:.3f}")
    return "\n".join(lines)


# ----- the rule at scale ----------------------------------------------------------------------
def llama_405b_rule(repeats: int) -> dict:
    """Balance and planning time of ``gefen.replicas.assign`` for a Llama-3-405B-shaped Gefen
    (m4v4) state on HSDP 8 x 2,048 (126 layers of d = 16,384, MLP 53,248; fields as stored)."""
    from gefen.replicas import Holders, assign, nested_chunk

    replicas, shards = 8, 2048
    grid, everyone = Holders(np.arange(replicas * shards).reshape(replicas, shards)), Holders.replicated(
        range(replicas * shards))
    tensors = []
    for _ in range(126):
        for rows, cols in [(16384, 16384), (1024, 16384), (1024, 16384), (16384, 16384), (53248, 16384),
                           (16384, 53248), (53248, 16384)]:
            # 4-bit m codes, fp16 block scales, fp32 v row factors; the per-parameter step counter
            tensors += [(rows, cols // 2, grid), (rows, cols // 32 * 2, grid), (rows, 4, grid), (1, 4, everyone)]
        tensors += [(16384, 8, grid), (16384, 8, grid)]  # the two norms' AdamW moments
    tensors += [(128256, 16384 // 2, grid), (128256, 16384 // 32 * 2, grid), (128256, 4, grid)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = assign(tensors)
        times.append(time.perf_counter() - start)
    load = np.zeros(replicas * shards)
    for (rows, row_bytes, _), a in zip(tensors, plan):
        for k, r in enumerate(a.writers):
            start, stop = nested_chunk(rows, a.parts, a.sub, k)
            load[r] += (stop - start) * row_bytes
    single = np.zeros(replicas * shards)
    for rows, row_bytes, h in tensors:
        for s, r in enumerate(h.grid[0]):
            start, stop = nested_chunk(rows, h.shards, 1, s)
            single[r] += (stop - start) * row_bytes
    return {"tensors": len(tensors), "state_bytes": float(load.sum()), "busiest_over_mean": float(load.max() / load.mean()),
            "single_writer_busiest_over_mean": float(single.max() / single.mean()),
            "planning_s": statistics.median(times), "planning_s_all": times}


# ----- the parent -----------------------------------------------------------------------------
def _s3_server():
    try:
        import fsspec
        import moto.server
        import s3fs  # noqa: F401
    except ImportError:
        return None, None
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    fs = fsspec.filesystem("s3", key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint},
                           skip_instance_cache=True)
    fs.mkdir(BUCKET)
    return server, endpoint


def _summary(per_rank: list[dict], method: str) -> dict:
    first = per_rank[0]
    ck_bytes = sum(first["files"].values())
    out = {"save_s": first["save_s"], "load_s": first["load_s"], "checkpoint_bytes": ck_bytes}
    if method == "dcp":
        written = [sum(b for n, b in first["files"].items() if n.startswith(f"__{r}_")) for r in range(WORLD)]
        out.update(written=written, busiest_writer=max(written) / (sum(written) / WORLD))
        return out
    written = [r["save"]["bytes_written"] for r in per_rank]
    read = [r["load"]["bytes_read"] for r in per_rank]
    out.update(written=written, read=read, busiest_writer=max(written) / (sum(written) / WORLD),
               written_over_ckpt=sum(written) / ck_bytes, busiest_reader=max(read) / (sum(read) / WORLD),
               read_over_ckpt=sum(read) / ck_bytes,
               save_requests=sum(r["save"]["requests"] for r in per_rank),
               load_requests=sum(r["load"]["requests"] for r in per_rank),
               sent=sum(r["load"]["bytes_sent"] for r in per_rank))
    return out


def run(quick: bool) -> dict:
    import torch.multiprocessing as mp

    millions, reps = (5, 1) if quick else (25, 3)
    server, endpoint = _s3_server()
    try:
        with tempfile.TemporaryDirectory(prefix="gefen-bench-replicas-") as workdir:
            mp.spawn(_rank, args=(workdir, endpoint, millions, reps), nprocs=WORLD)
            per_rank = [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False) for r in range(WORLD)]
    finally:
        if server is not None:
            server.stop()
    cases = {}
    for key in per_rank[0]:
        reps_of = [_summary([pr[key][i] for pr in per_rank], key[2]) for i in range(len(per_rank[0][key]))]
        summary = dict(reps_of[-1])
        summary["save_s"] = statistics.median(r["save_s"] for r in reps_of)
        summary["load_s"] = statistics.median(r["load_s"] for r in reps_of)
        cases[key] = summary
    rule = llama_405b_rule(1 if quick else 3)
    params = sum(int(np.prod(s)) for _, s in transformer_shapes(millions))
    data = {"params": params, "world": WORLD, "repetitions": reps, "s3": endpoint is not None,
            "cases": {" / ".join(k): v for k, v in cases.items()}, "llama_405b_rule": rule}
    write_json("replicas", data)
    stores = list(dict.fromkeys(k[1] for k in cases))
    png = plot("replicas", {f"{lay}, {st}": {f"{m} save": cases[lay, st, m]["save_s"] for m in METHODS
                                             if (lay, st, m) in cases and "read once" not in m}
                            | {f"{m} load": cases[lay, st, m]["load_s"] for m in METHODS if (lay, st, m) in cases}
                            for lay in LAYOUTS for st in stores},
               ylabel="seconds (median, slowest rank)", title=f"save / load of {params / 1e6:.1f}M params on 4 ranks")

    def f(x, digits=2):
        return "-" if x is None else f"{x:.{digits}f}"

    rows = []
    for (lay, st, m), c in cases.items():
        rows.append([lay, st, m, f(c["save_s"]), f(c["load_s"]), f(c["busiest_writer"]), f(c.get("written_over_ckpt"), 3),
                     f(c.get("busiest_reader")), f(c.get("read_over_ckpt"), 3),
                     f"{c.get('save_requests', '-')} / {c.get('load_requests', '-')}"])
    ours = [c for (_, _, m), c in cases.items() if m == "gefen-ckpt"]
    single = {(lay, st): cases[lay, st, "single writer"] for lay, st, m in cases if m == "gefen-ckpt"}
    forced = {(lay, st): cases[lay, st, "gefen-ckpt, read once"]["load_s"] / single[lay, st]["load_s"]
              for lay, st, m in cases if m == "gefen-ckpt, read once"}
    worst = {
        "busiest writer / mean": max(c["busiest_writer"] for c in ours),
        "bytes written / checkpoint": max(c["written_over_ckpt"] for c in ours),
        "busiest reader / mean": max(c["busiest_reader"] for (_, _, m), c in cases.items() if "gefen" in m
                                     and c["read_over_ckpt"] < 1.5),  # the loads that read once
        "storage bytes read / checkpoint": max(c["read_over_ckpt"] for (_, st, m), c in cases.items()
                                               if m == "gefen-ckpt, read once" or (m == "gefen-ckpt" and st == "S3")),
    }
    speed = {(lay, st): (cases[lay, st, "gefen-ckpt"]["save_s"] / single[lay, st]["save_s"],
                         cases[lay, st, "gefen-ckpt"]["load_s"] / single[lay, st]["load_s"]) for lay, st in single}
    markdown = "\n".join([
        f"{WORLD} gloo ranks on this machine, a {params / 1e6:.1f}M-parameter Gefen (m4v4) state after two steps, as DDP "
        "(every rank holds all of it) and HSDP (2 replicas x 2 shards), on local disk"
        + (" and on S3 (moto's server on loopback)" if endpoint else " (S3 skipped: moto[server] or s3fs missing)")
        + f"; {reps} repetition(s) after a warm-up, in alternating order, times the median of the slowest rank's. "
        "*gefen-ckpt*: `gefen_ckpt.save` (the replica rule spreads the writes) and `load()` with its default (read once "
        "from a remote store, each rank its own rows from a local disk); *read once*: `load(read_once=True)`; *single "
        "writer*: the same save with every row written by the first replica, and every rank reading its own rows; *dcp*: `get_state_dict` + `dcp.save` / `dcp.load` + "
        "`set_state_dict` of the same model and optimizer (DCP's written bytes per rank are its files' sizes; its reads "
        "are not counted). Bytes and requests from `gefen_ckpt.last_io_stats()` on every rank.",
        "",
        md_table(["layout", "storage", "method", "save s", "load s", "busiest writer / mean", "written / checkpoint",
                  "busiest reader / mean", "read / checkpoint", "requests save / load"], rows),
        "",
        md_table(["layout, storage", "save: gefen-ckpt / single writer", "load (default): gefen-ckpt / single writer",
                  "load, read once: gefen-ckpt / single writer"],
                 [[f"{lay}, {st}", f(s, 2), f(ld, 2), f(forced.get((lay, st)) or (ld if st == "S3" else None), 2)]
                  for (lay, st), (s, ld) in speed.items()]),
        "",
        f"The rule alone, Llama-3-405B-shaped Gefen state ({rule['tensors']:,} tensors, {rule['state_bytes'] / 2**30:.0f} "
        f"GiB) on HSDP 8 x 2,048: busiest rank / mean {rule['busiest_over_mean']:.3f} (single writer "
        f"{rule['single_writer_busiest_over_mean']:.2f}); one rank's planning {rule['planning_s']:.2f} s.",
        "",
        md_table(["target (docs/design.md 12)", "measured", "met"], [
            ["busiest writer / mean <= 1.10 (DDP, HSDP)", f(worst["busiest writer / mean"], 3),
             "yes" if worst["busiest writer / mean"] <= 1.10 else "**no**"],
            ["bytes written / checkpoint <= 1.01", f(worst["bytes written / checkpoint"], 3),
             "yes" if worst["bytes written / checkpoint"] <= 1.01 else "**no**"],
            ["storage bytes read / checkpoint <= 1.05", f(worst["storage bytes read / checkpoint"], 3),
             "yes" if worst["storage bytes read / checkpoint"] <= 1.05 else "**no**"],
            ["busiest reader / mean <= 1.10", f(worst["busiest reader / mean"], 3),
             "yes" if worst["busiest reader / mean"] <= 1.10 else "**no**"],
            ["405B on 8 x 2,048: busiest / mean <= 1.10", f(rule["busiest_over_mean"], 3),
             "yes" if rule["busiest_over_mean"] <= 1.10 else "**no**"],
            ["405B on 8 x 2,048: one rank's planning <= 1 s", f"{rule['planning_s']:.2f} s",
             "yes" if rule["planning_s"] <= 1.0 else "**no**"],
        ]),
        "",
        "Re-run: `python -m benchmarks.run_all --only replicas` (or `make bench`).",
    ])
    return {"title": "Replicated state: balanced saves and read-once loads", "markdown": markdown, "plots": [str(png)],
            "data": data}


if __name__ == "__main__":
    if "--ab" in sys.argv:
        millions = float(sys.argv[sys.argv.index("--params") + 1]) if "--params" in sys.argv else 25
        print(ab(LAYOUTS[1] if "--hsdp" in sys.argv else LAYOUTS[0], int(sys.argv[sys.argv.index("--ab") + 1]), millions))
    else:
        print(run("--quick" in sys.argv[1:])["markdown"])

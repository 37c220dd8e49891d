"""Manifest scale: the manifest of a 70B-parameter transformer saved by 1024 ranks.

The manifest's decoding limits (docs/format.md) must admit a real large run. This builds the
manifest a 1024-rank sharded save of Gefen state (``synthetic_gefen``'s fields: ``m_code``,
``m_scale``, ``v_row``/``v_col`` or ``v``, ``step``, ``period``) over Llama-2-70B shapes
(vocab 32000, d 8192, 80 layers, GQA k/v 1024 x 8192, MLP 28672) would commit: one piece per
rank of every row-sharded field, replicated fields once, one data file per rank. No tensor
data: the data files are sparse files of the recorded sizes (the codebook, the one piece
``inspect`` reads, is zeros with a matching checksum). Then, each in a fresh process:

* ``gefen-ckpt inspect DIR --json`` (decode, validate, summarise);
* ``gefen-ckpt reshard DIR OUT --world-size 768 --dry-run --json`` (the plan; writes nothing);
* the same commands' start-up baseline: ``inspect`` of a tiny checkpoint.

Wall time and peak RSS (``getrusage(RUSAGE_CHILDREN)`` in a wrapper, as bench_reshard).
Quick mode: 8 layers, 128 ranks. Run alone: ``python -m benchmarks.bench_manifest [--quick]``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

from benchmarks.common import ROOT, md_table, write_json

SCRATCH = Path(__file__).resolve().parent / "scratch" / "manifest"
_PEAK = """
import resource, subprocess, sys, time
start = time.perf_counter()
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def llama_shapes(layers: int = 80, dim: int = 8192, kv: int = 1024, mlp: int = 28672,
                 vocab: int = 32000) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, dim)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (dim, dim), p + "self_attn.k_proj.weight": (kv, dim),
                       p + "self_attn.v_proj.weight": (kv, dim), p + "self_attn.o_proj.weight": (dim, dim),
                       p + "mlp.gate_proj.weight": (mlp, dim), p + "mlp.up_proj.weight": (mlp, dim),
                       p + "mlp.down_proj.weight": (dim, mlp), p + "input_layernorm.weight": (dim,),
                       p + "post_attention_layernorm.weight": (dim,)})
    shapes.update({"model.norm.weight": (dim,), "lm_head.weight": (vocab, dim)})
    return shapes


def _fields(shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Gefen's m8 fields for a parameter (one block per row for matrices, as ``synthetic_gefen``)."""
    rows = shape[0]
    out = {"step": ("int64", ()), "period": ("int64", ()), "m_code": ("uint8", shape), "m_scale": ("float32", (rows, 1))}
    if len(shape) == 2:
        out.update(v_row=("float32", (rows,)), v_col=("float32", (shape[1],)))
    else:
        out["v"] = ("float32", (rows, 1))
    return out


def synthesize(root: Path, shapes: dict[str, tuple[int, ...]], ranks: int) -> dict:
    """Write the manifest (and sparse data files) of a ``ranks``-rank sharded save; its stats."""
    import math

    import torch

    import gefen
    from gefen.contract import contract_of
    from gefen_ckpt.format import manifest as mf
    from gefen_ckpt.format.datafile import ALIGNMENT
    from gefen_ckpt.format.dtypes import itemsize
    from gefen_ckpt.layout import chunk_rows

    contract = contract_of(gefen.Gefen([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, moments="m8"))
    token = "0123456789abcdef"
    ends = [8 + 4096] * ranks  # each rank's file: a header's worth, then aligned pieces
    params, pieces_total = {}, 0

    def place(rank: int, nbytes: int) -> int:
        offset = -(-ends[rank] // ALIGNMENT) * ALIGNMENT
        ends[rank] = offset + nbytes
        return offset

    def tensor(fqn, name, dtype, shape, crc=0):
        nonlocal pieces_total
        rows = shape[0] if shape else 1
        row_bytes = math.prod(shape[1:]) * itemsize(dtype)
        spans = ([chunk_rows(rows, ranks, r) for r in range(ranks)] if shape and contract.field(name).row_sharded
                 else [(0, rows)])
        pieces = []
        for rank, (start, stop) in enumerate(spans):
            if stop > start:
                nbytes = (stop - start) * row_bytes
                pieces.append({"file": rank, "key": f"{fqn}/{name}@{start}:{stop}", "rows": [start, stop],
                               "offset": place(rank, nbytes), "bytes": nbytes, "checksum": crc})
        pieces_total += len(pieces)
        return {"dtype": dtype, "shape": list(shape), "pieces": pieces}

    for fqn, shape in shapes.items():
        params[fqn] = {"shape": list(shape), "dtype": "float32", "child": None,
                       "fields": {n: tensor(fqn, n, d, s) for n, (d, s) in _fields(shape).items()}}
    codebook = tensor(None, "codebook", "float32", (256,), zlib.crc32(bytes(1024)))
    manifest = {
        "format": mf.FORMAT_NAME, "version": list(mf.FORMAT_VERSION), "layout": "sharded", "world_size": ranks,
        "alignment": ALIGNMENT, "checksum": "crc32", "contract": contract.to_dict(),
        "param_groups": [{"params": list(shapes), "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                          "weight_decay": 0.0}],
        "files": [{"name": f"data-{token}-r{r:05d}-00000.safetensors", "bytes": ends[r]} for r in range(ranks)],
        "globals": {"codebook": codebook}, "params": params,
        "topology": {"kind": "sharded", "world_size": ranks}, "created": {}, "metadata": {"step": 1000},
    }
    missing = [h for h in contract.hyperparameters if h not in manifest["param_groups"][0]]
    manifest["param_groups"][0].update({h: 0.0 for h in missing})
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    data = mf.encode(manifest)
    (root / mf.MANIFEST_NAME).write_bytes(data)
    for f in manifest["files"]:
        with open(root / f["name"], "wb") as out:
            out.truncate(f["bytes"])  # sparse: no tensor data
    return {"params": len(shapes), "numel": sum(math.prod(s) for s in shapes.values()), "ranks": ranks,
            "pieces": pieces_total, "files": ranks, "manifest_bytes": len(data)}


def cli(*args: str) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``python -m gefen_cli ARGS`` measured by a fresh wrapper."""
    out = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-m", "gefen_cli", *args],
                         check=True, capture_output=True, text=True, cwd=ROOT)
    seconds, rss = out.stdout.split()[-2:]
    return float(seconds), int(rss)


def run(quick: bool) -> dict:
    layers, ranks, target = (8, 128, 96) if quick else (80, 1024, 768)
    big, tiny = SCRATCH / "big", SCRATCH / "tiny"
    try:
        started = time.perf_counter()
        stats = synthesize(big, llama_shapes(layers=layers), ranks)
        stats["synthesize_s"] = time.perf_counter() - started
        synthesize(tiny, llama_shapes(layers=1, dim=64, kv=16, mlp=128, vocab=100), 2)
        rows = {
            "inspect (start-up baseline: a 2-rank tiny checkpoint)": cli("inspect", str(tiny), "--json"),
            f"inspect ({stats['numel'] / 1e9:.1f}B params, {ranks} ranks)": cli("inspect", str(big), "--json"),
            f"reshard --dry-run to {target} ranks": cli("reshard", str(big), str(SCRATCH / "out"), "--world-size",
                                                        str(target), "--dry-run", "--json"),
        }
    finally:
        shutil.rmtree(SCRATCH, ignore_errors=True)
    data = {"stats": stats, "runs": {k: {"seconds": s, "peak_rss": r} for k, (s, r) in rows.items()}}
    write_json("manifest", data)
    mb = stats["manifest_bytes"] / 2**20
    markdown = (
        f"The manifest of a {stats['numel'] / 1e9:.1f}B-parameter transformer (Llama-2-70B shapes, "
        f"{stats['params']} parameters) saved by {ranks} ranks: {stats['pieces']:,} pieces in {ranks} files, "
        f"a {mb:.1f} MiB manifest ({mb / 256 * 100:.0f}% of the 256 MiB limit), no tensor data (sparse files). "
        "Each command runs in a fresh process (`python -m gefen_cli`); peak RSS of that process.\n\n"
        + md_table(["command", "wall (s)", "peak RSS (MiB)"],
                   [[k, f"{v['seconds']:.1f}", f"{v['peak_rss'] / 2**20:.0f}"] for k, v in data["runs"].items()])
        + "\n\nRe-run: `python -m benchmarks.bench_manifest` (about 3 minutes; `--quick`: 8 layers, 128 ranks).\n"
    )
    return {"title": "Manifest scale (70B parameters, 1024 ranks)", "markdown": markdown, "plots": [], "data": data}


if __name__ == "__main__":
    result = run("--quick" in sys.argv)
    print(result["markdown"])
    os.sys.stdout.flush()

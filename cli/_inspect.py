"""``gefen-ckpt inspect``: a summary of a checkpoint from its manifest and tensor shapes (two tiny
reads: the codebook, and one ``step`` when the manifest records none). Both ways in end in one
description, a ``CanonicalState`` whose dtypes are the format's names and whose tensors are
``Stored`` views: a portable checkpoint's from its manifest without importing torch
(``describe_manifest``), DCP and torch.save files' from their ``CanonicalState`` (``describe_state``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gefen.geometry import period_of_blocks
from gefen_ckpt.state.canonical import CanonicalState

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


# ----- what inspect knows of a checkpoint ----------------------------------------------------
@dataclass(frozen=True)
class Stored:
    """A stored tensor as inspect sees it, torch-free: shape, the format's dtype name, and ``read``
    for its values (float64, flat)."""

    shape: tuple[int, ...]
    dtype: str
    read: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        from gefen_ckpt.wire.dtypes import itemsize

        return math.prod(self.shape) * itemsize(self.dtype)


def describe_manifest(store, manifest) -> CanonicalState:
    """A validated portable manifest (``gefen_ckpt.wire.manifest.Manifest``), torch-free."""
    import functools

    from gefen_ckpt.wire import peek

    def stored(key) -> Stored:
        t = manifest.tensors[key]
        return Stored(t.shape, t.dtype, functools.partial(peek.read_values, store, t))

    return manifest.state({key: stored(key) for key in manifest.tensors})


def describe_state(state: CanonicalState) -> CanonicalState:
    """A ``gefen_ckpt.CanonicalState`` (DCP, torch.save files) described as ``describe_manifest``'s."""
    import torch

    from gefen_ckpt.wire.dtypes import dtype_name

    def stored(_, source) -> Stored:
        return Stored(tuple(source.shape), dtype_name(source.dtype),
                      lambda: source.read().detach().to(torch.float64).reshape(-1).numpy())

    described = state.with_sources(stored)
    for entry in described.params.values():  # with_sources made these ParamStates
        entry.dtype = dtype_name(entry.dtype)
    return described


# ----- the summary ----------------------------------------------------------------------------
def codebook_summary(key: str, source: Stored) -> dict:
    try:
        values = source.read()
    except ValueError as exc:  # a dtype without a numpy equivalent (float8): describe, do not summarise
        return {"key": key, "size": math.prod(source.shape), "dtype": source.dtype, "note": f"values not shown: {exc}"}
    out = {"key": key, "size": int(values.size), "dtype": source.dtype}
    if values.size:
        q = _quantiles(values, QUANTILES)
        out.update(min=float(values.min()), max=float(values.max()),
                   quantiles={str(p): float(v) for p, v in zip(QUANTILES, q)},
                   sorted=bool((values[1:] >= values[:-1]).all()))
    return out


def _quantiles(values: np.ndarray, quantiles) -> list[float]:
    """``np.quantile(values, quantiles)`` (its default, linear method, to the bit), without the
    ~0.1 s import of ``numpy.ma`` that ``np.quantile`` costs every ``inspect``."""
    ordered = np.sort(values.astype(np.float64, copy=False).ravel())
    out = []
    for p in quantiles:
        pos = p * (ordered.size - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, ordered.size - 1)
        a, b, t = ordered[lo], ordered[hi], pos - lo
        d = b - a
        out.append(float(b - d * (1 - t)) if t >= 0.5 else float(a + d * t))
    return out


def _step(described: CanonicalState, manifest: dict) -> int | None:
    for where in (manifest, manifest.get("metadata") or {}, described.metadata):
        if isinstance(where, dict) and isinstance(where.get("step"), (int, float)):
            return int(where["step"])
    for entry in described.params.values():
        source = entry.fields.get("step")
        if source is not None and math.prod(source.shape) == 1:
            return int(source.read()[0])
    return None


def _version(v):
    if isinstance(v, (list, tuple)):
        return ".".join(map(str, v))
    return None if v is None else str(v)


def summarize(url: str, fmt: str, state: CanonicalState, manifest: dict | None = None,
              files: dict | None = None) -> dict:
    """Plain (JSON-able) summary; ``manifest``: the portable manifest, ``files``: name -> bytes."""
    manifest = manifest or {}
    contract = state.contract
    params = []
    for fqn in (fqn for group in state.param_groups for fqn in group["params"]):
        entry = state.params.get(fqn)
        if entry is None:
            params.append({"fqn": fqn, "shape": None, "dtype": None, "child": None, "numel": None,
                           "period": None, "fields": [], "state_bytes": 0, "bytes_per_param": None})
            continue
        leaf = contract.leaf(entry.child if contract.children else None)
        fields = []
        for name in sorted(entry.fields):
            source = entry.fields[name]
            try:
                geometry = leaf.field(name).geometry
            except KeyError:
                geometry = None
            fields.append({"name": name, "shape": list(source.shape), "dtype": source.dtype,
                           "geometry": geometry, "bytes": source.nbytes})
        numel = math.prod(entry.shape)
        nbytes = sum(f["bytes"] for f in fields)
        period = next((period_of_blocks(entry.shape, f["shape"][1]) for f in fields  # from a block field's shape
                       if f["geometry"] == "block" and len(f["shape"]) == 2 and f["shape"][1] > 0), None)
        params.append({"fqn": fqn, "shape": list(entry.shape), "dtype": entry.dtype, "child": entry.child,
                       "numel": numel, "period": period, "fields": fields, "state_bytes": nbytes,
                       "bytes_per_param": nbytes / numel if numel else None})
    global_bytes = sum(s.nbytes for s in state.global_fields.values())
    codebooks = [codebook_summary(k, s) for k, s in sorted(state.global_fields.items())
                 if k.rsplit("/", 1)[-1] in ("codebook", "v_codebook")]
    groups = [{"index": i, "child": g.get("child"), "params": len(g["params"]),
               "hyperparameters": {k: v for k, v in g.items() if k not in ("params", "child")}}
              for i, g in enumerate(state.param_groups)]
    numel_total = sum(p["numel"] or 0 for p in params)
    total_bytes = sum(p["state_bytes"] for p in params) + global_bytes
    return {
        "path": url,
        "format": manifest.get("format", fmt) if fmt != "torch" else "torch",
        "format_version": _version(manifest.get("version")),
        "layout": manifest.get("layout", "torch state_dict" if fmt == "torch" else None),
        **_ranks(manifest.get("world_size"), state.metadata.get("source_topology")),
        "optimizer": {"implementation": contract.implementation, "version": contract.version,
                      "schema_version": contract.schema_version,
                      "children": [[n, c.implementation] for n, c in contract.children]},
        "step": _step(state, manifest),
        "topology": state.metadata.get("source_topology"),
        "created": manifest.get("created") or state.metadata.get("created") or None,
        "param_groups": groups,
        "params": params,
        "global_fields": [{"key": k, "shape": list(s.shape), "dtype": s.dtype, "bytes": s.nbytes}
                          for k, s in sorted(state.global_fields.items())],
        "codebook": codebooks[0] if len(codebooks) == 1 else (codebooks or None),
        "totals": {
            "params": len(params),
            "params_with_state": len(state.params),
            "numel": numel_total,
            "state_bytes": total_bytes,
            "bytes_per_param": total_bytes / numel_total if numel_total else None,
            "files": len(files) if files is not None else None,
            "file_bytes": sum(files.values()) if files is not None else None,
        },
    }


def _ranks(shards: int | None, topology: dict | None) -> dict:
    """``shards`` (from the layout), ``world_size`` and ``mesh`` (replicate x shard) of the topology
    written for: an HSDP mesh RxS has R*S ranks and S shards."""
    topology = topology or {}
    mesh = topology.get("mesh")
    world = topology.get("world_size") or (mesh[0] * mesh[1] if mesh else shards)
    return {"shards": shards, "world_size": world, "mesh": list(mesh) if mesh else None}


# ----- rendering ----------------------------------------------------------------------------
def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    return str(v)


def _shape(shape) -> str:
    return "x".join(map(str, shape)) if shape else "()" if shape is not None else "-"


def render(summary: dict, console: Console) -> None:
    opt = summary["optimizer"]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    version = summary["format_version"]
    head.add_row("checkpoint", escape(summary["path"]))
    layout = summary.get("layout")
    head.add_row("format", f"{summary['format']}" + (f" {version}" if version is not None else "")
                 + (f", {layout} layout" if layout else "")
                 + (f", {summary['shards']} shard{'s' if summary['shards'] != 1 else ''}"
                    if summary.get("shards") and layout == "sharded" else ""))
    if summary.get("world_size"):
        mesh = summary.get("mesh")
        head.add_row("ranks", f"world size {summary['world_size']}"  # a 1xN mesh is plain sharding
                     + (f", mesh {mesh[0]}x{mesh[1]} (replicate x shard)" if mesh and mesh[0] > 1 else ""))
    head.add_row("optimizer", escape(
        f"{opt['implementation']} (version {opt['version']}, schema {opt['schema_version']})"
        + (f"; children: {', '.join(f'{n}={i}' for n, i in opt['children'])}" if opt["children"] else "")))
    head.add_row("step", _fmt(summary["step"]) if summary["step"] is not None else "-")
    topology = {k: v for k, v in (summary.get("topology") or {}).items() if k not in ("world_size", "mesh")}
    if topology:  # world size and mesh are on the "ranks" line
        head.add_row("topology", escape(", ".join(f"{k}={_fmt(v)}" for k, v in topology.items())))
    created = summary.get("created")
    if created:
        head.add_row("created", escape(", ".join(f"{k}={v}" for k, v in created.items()) if isinstance(created, dict)
                                       else _fmt(created)))
    console.print(head)

    groups = Table(title="param groups", title_justify="left")
    for col in ("#", "child", "params", "hyperparameters"):
        groups.add_column(col)
    for g in summary["param_groups"]:
        groups.add_row(str(g["index"]), escape(g["child"] or "-"), str(g["params"]),
                       escape(", ".join(f"{k}={_fmt(v)}" for k, v in g["hyperparameters"].items())))
    console.print(groups)

    params = Table(title="parameters", title_justify="left")
    for col, kw in (("FQN", {"overflow": "fold"}), ("shape", {}), ("dtype", {}), ("period", {"justify": "right"}),
                    ("fields", {}), ("state", {"justify": "right"}), ("B/param", {"justify": "right"})):
        params.add_column(col, **kw)
    for p in summary["params"]:
        fields = "  ".join(f"{f['name']}:{f['dtype']}[{_shape(f['shape'])}]" for f in p["fields"]) or "(no state)"
        params.add_row(escape(p["fqn"]) + (f" [dim]({escape(p['child'])})[/]" if p["child"] else ""),
                       _shape(p["shape"]),
                       p["dtype"] or "-", str(p["period"]) if p["period"] is not None else "-", escape(fields),
                       human_bytes(p["state_bytes"]),
                       f"{p['bytes_per_param']:.3f}" if p["bytes_per_param"] is not None else "-")
    console.print(params)

    books = summary["codebook"]
    for cb in books if isinstance(books, list) else [books] if books else []:
        q = ", ".join(f"q{float(k) * 100:g}={v:.4g}" for k, v in cb.get("quantiles", {}).items())
        values = (escape(cb["note"]) if "note" in cb else
                  f"min={cb.get('min', float('nan')):.4g} max={cb.get('max', float('nan')):.4g}; {q}")
        console.print(f"[bold]{escape(cb['key'])}[/]: {cb['size']} codes ({cb['dtype']}), {values}")

    t = summary["totals"]
    bpp = f"{t['bytes_per_param']:.3f}" if t["bytes_per_param"] is not None else "-"
    line = (f"[bold]totals[/]: {t['params']} parameters ({t['params_with_state']} with state), "
            f"{t['numel']:,} elements, state {human_bytes(t['state_bytes'])} = {bpp} B/param")
    if t["files"] is not None:
        line += f"; {t['files']} file{'s' if t['files'] != 1 else ''}, {human_bytes(t['file_bytes'])} on disk"
    console.print(line)

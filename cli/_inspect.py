"""``gefen-ckpt inspect``: a summary of a checkpoint built from its manifest and tensor shapes.

Everything comes from the canonical state's *shapes and dtypes* (lazy sources: no data is
read) and the manifest, except two tiny reads: the codebook (to summarise its values) and one
parameter's ``step`` scalar when the manifest does not record the step.
"""

from __future__ import annotations

import math

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gefen.contract import OptimizerContract
from gefen_ckpt.canonical import CanonicalState

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def _nbytes(source) -> int:
    return _numel(source.shape) * source.dtype.itemsize


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _leaf(contract: OptimizerContract, child: str | None) -> OptimizerContract:
    if child is None or not contract.children:
        return contract
    for name, c in contract.children:
        if name == child:
            return c
        if c.children:
            try:
                return _leaf(c, child)
            except KeyError:
                pass
    raise KeyError(child)


def period_of(shape: tuple[int, ...], fields: dict, contract: OptimizerContract) -> int | None:
    """Block length P from the shape of a ``block``-geometry field (``row_numel // blocks``)."""
    row_numel = _numel(shape[1:]) if shape else 1
    for name, source in sorted(fields.items()):
        try:
            spec = contract.field(name)
        except KeyError:
            continue
        if spec.geometry == "block" and len(source.shape) == 2 and source.shape[1] > 0:
            return row_numel // source.shape[1]
    return None


def codebook_summary(key: str, source) -> dict:
    values = source.read().detach().to(torch.float64).reshape(-1)
    out = {"key": key, "size": int(values.numel()), "dtype": _dtype(source.dtype)}
    if values.numel():
        q = torch.quantile(values, torch.tensor(QUANTILES, dtype=torch.float64))
        out.update(min=values.min().item(), max=values.max().item(),
                   quantiles={str(p): v for p, v in zip(QUANTILES, q.tolist())},
                   sorted=bool((values[1:] >= values[:-1]).all()))
    return out


def _step(state: CanonicalState, manifest: dict) -> int | None:
    for where in (manifest, manifest.get("metadata") or {}, state.metadata):
        if isinstance(where, dict) and isinstance(where.get("step"), (int, float)):
            return int(where["step"])
    for entry in state.params.values():
        source = entry.fields.get("step")
        if source is not None and _numel(source.shape) == 1:
            return int(source.read().reshape(-1)[0].item())
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
    params, numel_total, state_bytes_total = [], 0, 0
    for fqn in state.fqns():
        entry = state.params.get(fqn)
        if entry is None:
            params.append({"fqn": fqn, "shape": None, "dtype": None, "child": None, "numel": None,
                           "period": None, "fields": [], "state_bytes": 0, "bytes_per_param": None})
            continue
        leaf = _leaf(contract, entry.child)
        fields = []
        for name in sorted(entry.fields):
            source = entry.fields[name]
            try:
                geometry = leaf.field(name).geometry
            except KeyError:
                geometry = None
            fields.append({"name": name, "shape": list(source.shape), "dtype": _dtype(source.dtype),
                           "geometry": geometry, "bytes": _nbytes(source)})
        numel = _numel(entry.shape)
        nbytes = sum(f["bytes"] for f in fields)
        numel_total += numel
        state_bytes_total += nbytes
        params.append({"fqn": fqn, "shape": list(entry.shape), "dtype": _dtype(entry.dtype), "child": entry.child,
                       "numel": numel, "period": period_of(tuple(entry.shape), entry.fields, leaf),
                       "fields": fields, "state_bytes": nbytes, "bytes_per_param": nbytes / numel if numel else None})
    global_bytes = sum(_nbytes(s) for s in state.global_fields.values())
    codebooks = [codebook_summary(k, s) for k, s in sorted(state.global_fields.items())
                 if k.rsplit("/", 1)[-1] == "codebook"]
    groups = [{"index": i, "child": g.get("child"), "params": len(g["params"]),
               "hyperparameters": {k: v for k, v in g.items() if k not in ("params", "child")}}
              for i, g in enumerate(state.param_groups)]
    total_bytes = state_bytes_total + global_bytes
    return {
        "path": url,
        "format": manifest.get("format", fmt) if fmt != "torch" else "torch",
        "format_version": _version(manifest.get("version")),
        "layout": manifest.get("layout", "torch state_dict" if fmt == "torch" else None),
        "world_size": manifest.get("world_size"),
        "optimizer": {"implementation": contract.implementation, "version": contract.version,
                      "schema_version": contract.schema_version,
                      "children": [[n, c.implementation] for n, c in contract.children]},
        "step": _step(state, manifest),
        "topology": state.metadata.get("source_topology"),
        "created": manifest.get("created") or state.metadata.get("created") or None,
        "param_groups": groups,
        "params": params,
        "global_fields": [{"key": k, "shape": list(s.shape), "dtype": _dtype(s.dtype), "bytes": _nbytes(s)}
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


# ----- rendering ----------------------------------------------------------------------------
def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


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
                 + (f", world size {summary['world_size']}" if summary.get("world_size") else ""))
    head.add_row("optimizer", escape(
        f"{opt['implementation']} (version {opt['version']}, schema {opt['schema_version']})"
        + (f"; children: {', '.join(f'{n}={i}' for n, i in opt['children'])}" if opt["children"] else "")))
    head.add_row("step", _fmt(summary["step"]) if summary["step"] is not None else "-")
    if summary.get("topology"):
        head.add_row("topology", escape(", ".join(f"{k}={_fmt(v)}" for k, v in summary["topology"].items())))
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
        console.print(f"[bold]{escape(cb['key'])}[/]: {cb['size']} codes ({cb['dtype']}), "
                      f"min={cb.get('min', float('nan')):.4g} max={cb.get('max', float('nan')):.4g}; {q}")

    t = summary["totals"]
    bpp = f"{t['bytes_per_param']:.3f}" if t["bytes_per_param"] is not None else "-"
    line = (f"[bold]totals[/]: {t['params']} parameters ({t['params_with_state']} with state), "
            f"{t['numel']:,} elements, state {human_bytes(t['state_bytes'])} = {bpp} B/param")
    if t["files"] is not None:
        line += f"; {t['files']} file{'s' if t['files'] != 1 else ''}, {human_bytes(t['file_bytes'])} on disk"
    console.print(line)

"""Compare two canonical states field by field, streaming rows (``gefen-ckpt diff`` prints the report).

Tensors are compared in chunks of whole rows (dim 0) read from the lazy sources, so memory
stays bounded by a few times ``chunk_bytes`` (a single row larger than that is read on its
own, and a portable-format piece is read whole: the writer bounds pieces by its memory budget). The
default is bit-exact (raw bytes, so NaN == NaN of the same payload and +0 != -0); with
``atol`` values are compared numerically (``|a - b| <= atol``, NaN equal to NaN).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from gefen_ckpt.dist.placement import row_ranges
from gefen_ckpt.state.canonical import CanonicalState

DEFAULT_CHUNK_BYTES = 64 * 2**20


def _diff(kind: str, key: str, message: str, **extra) -> dict:
    return {"kind": kind, "key": key, "message": message, **extra}


def _piece_starts(source) -> list[int]:
    """Row offsets where the stored pieces of a lazy portable-format source begin (a read that
    straddles a piece boundary costs nothing extra, but one that covers part of a piece reads
    the whole piece, so chunks are cut at these rows). Empty for other sources."""
    pieces = getattr(getattr(source, "tensor", None), "pieces", None) or ()
    try:
        return sorted({int(p.rows[0]) for p in pieces})
    except (AttributeError, TypeError, ValueError, IndexError):
        return []


def _compare_chunks(a, b, atol: float | None, chunk_bytes: int, advance: Callable[[int], None]) -> tuple[int, float]:
    """(number of differing elements, max |a - b| over them) of two same-shape sources."""
    shape, itemsize = tuple(a.shape), a.dtype.itemsize
    row_numel = math.prod(shape[1:])
    batch = max(1, chunk_bytes // 8 // 4)  # elements per float64 comparison batch
    numeric = a.dtype != torch.bool and not a.dtype.is_complex
    count, worst = 0, 0.0
    for start, stop in row_ranges(shape, itemsize, chunk_bytes, _piece_starts(a) + _piece_starts(b)):
        x = a.read(start, stop).reshape(-1)
        y = b.read(start, stop).reshape(-1)
        for lo in range(0, x.numel(), batch):
            xs, ys = x[lo:lo + batch], y[lo:lo + batch]
            if atol is None or not numeric:
                bad = (xs.contiguous().view(torch.uint8).reshape(-1, itemsize)
                       != ys.contiguous().view(torch.uint8).reshape(-1, itemsize)).any(dim=1)
            else:
                bad = ~torch.isclose(xs.to(torch.float64), ys.to(torch.float64), rtol=0.0, atol=atol, equal_nan=True)
            n = int(bad.sum())
            if n:
                count += n
                if numeric:
                    d = (xs[bad].to(torch.float64) - ys[bad].to(torch.float64)).abs()
                    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
                    worst = max(worst, float(d.max()))
        advance((stop - start) * row_numel * itemsize)
    return count, worst


def _versionless(contract: dict) -> dict:
    out = {k: v for k, v in contract.items() if k != "version"}
    out["children"] = [[name, _versionless(c)] for name, c in contract.get("children", [])]
    return out


def _versions(contract) -> str:
    own = f"{contract.implementation} {contract.version!r}"
    kids = ", ".join(f"{n}: {_versions(c)}" for n, c in contract.children)
    return f"{own} ({kids})" if kids else own


def diff_states(a: CanonicalState, b: CanonicalState, *, atol: float | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress=None) -> dict:
    """A JSON-able report: ``equal``, a list of ``differences`` (kind, key, message, ...) and
    ``notes`` (informational, e.g. contracts that differ only in their implementation version).

    ``progress``: optional ``(total_bytes) -> advance(nbytes)`` factory for a progress bar.
    """
    differences: list[dict] = []
    notes: list[str] = []
    if a.contract != b.contract:
        ca, cb = _versionless(a.contract.to_dict()), _versionless(b.contract.to_dict())
        if ca == cb:  # loading ignores the implementation version too: informational only
            notes.append(f"contract versions differ: {_versions(a.contract)} vs {_versions(b.contract)}")
        else:
            what = [k for k in ca if ca[k] != cb.get(k)]
            differences.append(_diff("contract", "contract", f"optimizer contracts differ in {', '.join(what)}: "
                                     f"{a.contract.implementation} vs {b.contract.implementation}"))
    if len(a.param_groups) != len(b.param_groups):
        differences.append(_diff("param_groups", "param_groups",
                                 f"{len(a.param_groups)} vs {len(b.param_groups)} param groups"))
    for i, (ga, gb) in enumerate(zip(a.param_groups, b.param_groups)):
        if ga.get("params") != gb.get("params"):
            differences.append(_diff("param_groups", f"param_groups[{i}]", f"param group {i} has different members"))
        for k in sorted((set(ga) | set(gb)) - {"params"}):
            if ga.get(k) != gb.get(k):
                differences.append(_diff("hyperparameter", f"param_groups[{i}].{k}",
                                         f"param group {i}: {k} = {ga.get(k)!r} vs {gb.get(k)!r}"))

    pairs = [(key, a.global_fields.get(key), b.global_fields.get(key))
             for key in sorted(set(a.global_fields) | set(b.global_fields))]
    for fqn in dict.fromkeys([*a.params, *b.params]):
        ea, eb = a.params.get(fqn), b.params.get(fqn)
        if ea is None or eb is None:
            differences.append(_diff("missing", fqn, f"{fqn}: state only in {'A' if eb is None else 'B'}"))
            continue
        if tuple(ea.shape) != tuple(eb.shape):
            differences.append(_diff("shape", fqn, f"{fqn}: parameter shape {tuple(ea.shape)} vs {tuple(eb.shape)}"))
        if ea.dtype != eb.dtype:
            differences.append(_diff("dtype", fqn, f"{fqn}: parameter dtype {ea.dtype} vs {eb.dtype}"))
        if ea.child != eb.child:
            differences.append(_diff("child", fqn, f"{fqn}: owned by child {ea.child!r} vs {eb.child!r}"))
        for name in sorted(set(ea.fields) | set(eb.fields)):
            pairs.append((f"{fqn}/{name}", ea.fields.get(name), eb.fields.get(name)))

    comparable = []
    for key, sa, sb in pairs:
        if sa is None or sb is None:
            differences.append(_diff("missing", key, f"{key}: only in {'A' if sb is None else 'B'}"))
        elif tuple(sa.shape) != tuple(sb.shape):
            differences.append(_diff("shape", key, f"{key}: shape {tuple(sa.shape)} vs {tuple(sb.shape)}"))
        elif sa.dtype != sb.dtype:
            differences.append(_diff("dtype", key, f"{key}: dtype {sa.dtype} vs {sb.dtype}"))
        else:
            comparable.append((key, sa, sb))

    total = sum(math.prod(s.shape) * s.dtype.itemsize for _, s, _ in comparable)
    advance = progress(total) if progress is not None else (lambda n: None)
    elements = 0
    for key, sa, sb in comparable:
        count, worst = _compare_chunks(sa, sb, atol, chunk_bytes, advance)
        numel = math.prod(sa.shape)
        elements += numel
        if count:
            differences.append(_diff("values", key, f"{key}: {count} of {numel} elements differ"
                                     + (f" (max |a-b| = {worst:.6g})" if worst else ""),
                                     count=count, numel=numel, max_abs_diff=worst))
    return {"equal": not differences, "atol": atol, "differences": differences, "notes": notes,
            "compared": {"tensors": len(comparable), "elements": elements, "bytes": total}}

"""The one loader of the C libraries built next to the packages (``gefen._gefen_step``,
``gefen._kmeans_dp``, ``gefen_ckpt._native``): a plain source tree, a failed build or a library
lacking a symbol gives None, and the caller takes its Python path or (the codebook solver, which
has none) says how to build it."""

from __future__ import annotations

import ctypes
import importlib.util


def load(name: str, signatures: dict[str, tuple[list, object]]) -> ctypes.CDLL | None:
    """The library of module ``name`` with ``signatures`` (symbol -> (argument types, result
    type)) declared, or None when it is not built, does not load or lacks one of the symbols."""
    try:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            return None
        lib = ctypes.CDLL(spec.origin)
        for symbol, (args, result) in signatures.items():
            fn = getattr(lib, symbol)
            fn.argtypes, fn.restype = args, result
    except (ImportError, OSError, AttributeError):
        return None
    return lib

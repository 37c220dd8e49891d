"""The one import of Triton, an optional dependency (the ``gpu`` and ``test`` extras).

Without Triton (a plain ``pip install``) this module still imports, with ``triton`` and ``tl``
None; ``require()`` then raises the ImportError that ``gefen.triton.dispatch`` records as the
reason a CUDA step runs the eager path. ``kernels`` calls it before it defines a kernel.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # a plain install: the GPU kernels are off, nothing else changes
    triton = tl = None
    _missing: ImportError | None = exc
else:
    _missing = None


def require() -> None:
    """Raise, naming the extra that provides Triton, when it is not importable."""
    if triton is None:
        raise ImportError("gefen's GPU kernels need Triton: pip install 'gefen[gpu]'") from _missing

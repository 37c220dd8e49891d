"""gefen_ckpt: portable, reshardable checkpoints of optimizer state (SPEC sections 4-10).

The exception types are imported eagerly; everything else on first use, so that reading a
manifest (``gefen-ckpt inspect``/``verify``) does not pay for importing torch.
"""

import importlib

from gefen_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    UnsupportedLayoutError,
)

_LAZY = {
    **dict.fromkeys(("load", "read", "read_manifest", "save", "write"), "gefen_ckpt.api"),
    **dict.fromkeys(("VerifyReport", "verify"), "gefen_ckpt.format.verify"),
    **dict.fromkeys(("CanonicalState", "EagerSource", "ParamState", "TensorSource"), "gefen_ckpt.canonical"),
    **dict.fromkeys(("export_canonical", "import_canonical"), "gefen_ckpt.exchange"),
}

__all__ = [
    "CanonicalState",
    "ParamState",
    "TensorSource",
    "EagerSource",
    "export_canonical",
    "import_canonical",
    "save",
    "load",
    "read",
    "write",
    "read_manifest",
    "verify",
    "VerifyReport",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointCorruptError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "UnsupportedLayoutError",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gefen_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

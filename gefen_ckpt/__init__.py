"""gefen_ckpt: portable, reshardable checkpoints of optimizer state (SPEC sections 4-10)."""

from gefen_ckpt.api import VerifyReport, load, read, read_manifest, save, verify, write
from gefen_ckpt.canonical import CanonicalState, EagerSource, ParamState, TensorSource
from gefen_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIncompleteError,
    CheckpointMismatchError,
    UnsupportedLayoutError,
)
from gefen_ckpt.exchange import export_canonical, import_canonical

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

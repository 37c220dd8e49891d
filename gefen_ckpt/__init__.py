"""gefen_ckpt: portable, reshardable checkpoints of optimizer state (docs/design.md sections 4-10).

The exception types are imported eagerly; everything else on first use, so that reading a
manifest (``gefen-ckpt inspect``/``verify``) does not pay for importing torch.
"""

from gefen._lazy import lazy_exports
from gefen_ckpt.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIncompleteError,
    CheckpointLockedError,
    CheckpointMismatchError,
    CheckpointStorageError,
    CheckpointTimeoutError,
    UnsupportedLayoutError,
)

_LAZY = {
    **dict.fromkeys(("load", "read", "read_manifest", "save", "write"), "gefen_ckpt.api"),
    **dict.fromkeys(("VerifyReport", "verify"), "gefen_ckpt.wire.verify"),
    **dict.fromkeys(("CanonicalState", "EagerSource", "ParamState", "TensorSource"), "gefen_ckpt.state.canonical"),
    **dict.fromkeys(("export_canonical", "import_canonical"), "gefen_ckpt.dist.optimizer_state"),
    **dict.fromkeys(("open", "detect_format", "convert_checkpoint"), "gefen_ckpt.checkpoints"),
    "convert_state": "gefen_ckpt.formats.convert",
    **dict.fromkeys(("last_io_stats", "IOStats"), "gefen_ckpt.io.iostats"),
    "async_save": "gefen_ckpt.async_io",
    "name_state_dict": "gefen_ckpt.formats.names",
}

__all__ = [
    *_LAZY,
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointCorruptError",
    "CheckpointIncompleteError",
    "CheckpointMismatchError",
    "CheckpointStorageError",
    "CheckpointLockedError",
    "CheckpointTimeoutError",
    "UnsupportedLayoutError",
]

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

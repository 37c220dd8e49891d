"""The portable wire format (docs/design.md 7, ``docs/format.md``): a directory of aligned safetensors
data files and one msgpack manifest, published last."""

from gefen_ckpt.wire.manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME"]

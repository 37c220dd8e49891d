"""The portable wire format (docs/design.md 7, ``docs/format.md``): a directory of aligned safetensors
data files and one msgpack manifest, published last."""

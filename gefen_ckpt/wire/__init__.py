"""The portable wire format (``docs/format.md``): manifest, per-writer indexes, data files, their
writers, readers and checks. May import gefen_ckpt.io and gefen_ckpt.state (torch-free to read)."""

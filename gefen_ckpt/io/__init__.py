"""Storage: the files of a checkpoint on any fsspec URL (and their C loops), I/O counters, progress.

Imports only gefen_ckpt.errors."""

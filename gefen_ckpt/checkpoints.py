"""Any checkpoint by URL (docs/design.md 10): ``open`` reads a portable or DCP directory (lazily)
or a ``torch.save`` file as a ``CanonicalState``, ``verify_any`` checks one, ``write`` writes one
in any format, and ``convert_checkpoint`` does both with an optional change of optimizer between.
The CLI is these calls plus printing."""

from __future__ import annotations

PORTABLE, DCP, TORCH = "portable", "dcp", "torch"
FORMATS = (PORTABLE, DCP, TORCH)


def detect_format(url: str) -> str:
    """``"dcp"`` (a directory with ``.metadata``), ``"portable"`` (another directory: its manifest
    is checked when read) or ``"torch"``; a clear error for anything else."""
    import fsspec

    from gefen_ckpt.errors import CheckpointFormatError, CheckpointIncompleteError

    fs, path = fsspec.core.url_to_fs(url)
    if fs.isdir(path):
        return DCP if fs.exists(path.rstrip("/") + "/.metadata") else PORTABLE
    if not fs.exists(path):
        raise CheckpointIncompleteError(f"{url}: no such file or directory")
    from gefen_ckpt.formats.torch_file import is_torch_file  # imports torch: only for a file

    if is_torch_file(url):
        return TORCH
    raise CheckpointFormatError(f"{url}: not a checkpoint (neither a gefen_ckpt directory nor a torch.save file)")


def location(url: str) -> tuple[str, str]:
    """(filesystem, path) that one location has however it is spelled: a local path resolved
    (``file://``, ``.``/``..``, symbolic links), another filesystem's path as fsspec strips it."""
    import os
    import posixpath

    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    fs, path = fsspec.core.url_to_fs(str(url))
    if isinstance(fs, LocalFileSystem):
        return "file", os.path.realpath(path)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, posixpath.normpath("/" + path.strip("/"))


def check_locations(src: str, dst: str) -> None:
    """Writing ``dst`` must not replace or write into ``src`` (``ValueError``): compared after
    resolution, so ``./G`` and ``G``, a link to SRC or ``file://`` + its path are SRC too."""
    (fs_a, a), (fs_b, b) = location(src), location(dst)
    if fs_a != fs_b:
        return
    if a == b:
        raise ValueError(f"SRC and DST are the same location ({src} and {dst} are both {a})")
    if b.startswith(a.rstrip("/") + "/"):
        raise ValueError(f"DST {dst} is inside SRC {src}: writing it would change the source")


def check_names(url: str, format: str, param_names: str | None, names_from: str | None) -> None:
    """Names can be given only to a torch state_dict (the other formats record them), and only once."""
    if param_names and names_from:
        raise ValueError("give the parameter names one way (a names file or a model), not both")
    if (param_names or names_from) and format != TORCH:
        raise ValueError(f"parameter names can be given only for a torch.save'd optimizer state_dict; "
                         f"{url} is a {format} checkpoint, which records its names")


def check_optimizer(url: str, implementation: str, optimizer: str | None) -> None:
    """``optimizer``, when given, must name the one that wrote ``url`` (``names_optimizer``); the
    error's ``held`` names the one that did."""
    from gefen_ckpt.wire.manifest import names_optimizer

    if optimizer is not None and not names_optimizer(optimizer, implementation):
        from gefen_ckpt.errors import CheckpointMismatchError

        error = CheckpointMismatchError(f"{url} holds {implementation} state, not {optimizer}")
        error.held = implementation
        raise error


def check_key(url: str, format: str, key: str | None) -> None:
    """A state-dict key picks one optimizer among several, which only a DCP checkpoint can hold."""
    if key is not None and format != DCP:
        raise ValueError(f"a key picks an optimizer inside a DCP checkpoint; {url} is a {format} checkpoint")


def open(url: str, *, format: str | None = None, optimizer: str | None = None, param_names: str | None = None,
         names_from: str | None = None, key: str | None = None):
    """The checkpoint at ``url`` as a ``CanonicalState`` (``format``: skip the detection).

    ``optimizer`` names the optimizer that wrote it (checked; needed for a torch file whose state
    does not say, e.g. Adam vs AdamW). A torch state_dict saved without names gets them from
    ``param_names`` (a file, one name a line) or ``names_from`` (a model checkpoint, in order).
    ``key``: the state-dict key of the optimizer in a DCP checkpoint that holds several."""
    format = format or detect_format(url)
    check_names(url, format, param_names, names_from)
    check_key(url, format, key)
    if format == TORCH:
        return _open_torch(url, optimizer, param_names, names_from)
    if format == DCP:
        from gefen_ckpt.dcp import read_dcp

        state = read_dcp(url, key)
    else:
        from gefen_ckpt.api import read

        state = read(url)
    check_optimizer(url, state.contract.implementation, optimizer)
    return state


def _open_torch(url: str, optimizer: str | None, param_names: str | None, names_from: str | None):
    from gefen_ckpt.errors import CheckpointError, CheckpointMismatchError
    from gefen_ckpt.formats.torch_file import canonical_from_state_dict, load_torch_state_dict

    sd = load_torch_state_dict(url)
    if param_names or names_from:
        from gefen_ckpt.formats.names import name_state_dict, read_model_params, read_param_names

        sd = (name_state_dict(sd, names=read_param_names(param_names), source=param_names) if param_names
              else name_state_dict(sd, model_params=read_model_params(names_from), source=names_from))
    try:
        return canonical_from_state_dict(sd, optimizer)
    except CheckpointMismatchError as exc:
        if optimizer is None:
            raise
        try:  # what the state_dict's own fields say wrote it, if they say
            held = canonical_from_state_dict(sd).contract.implementation
        except CheckpointError:
            raise exc from None
        check_optimizer(url, held, optimizer)
        raise


def verify_any(url: str, *, format: str | None = None, optimizer: str | None = None, param_names: str | None = None,
               names_from: str | None = None, progress: bool = False, key: str | None = None) -> dict:
    """How intact the checkpoint at ``url`` is, as plain data: ``ok``, ``problems`` (one line
    each, naming the file or tensor) and counts; never raises for a problem it can report.
    Portable: every checksum and that the pieces cover every tensor once (``gefen_ckpt.verify``).
    The formats without checksums get a ``note`` saying what was checked instead: DCP, that every
    row of every tensor reads back as described (in bounded chunks); torch, that the file loads
    with ``weights_only`` and fits the optimizer's contract."""
    format = format or detect_format(url)
    if format == PORTABLE:
        import dataclasses

        from gefen_ckpt.io.storage import Store
        from gefen_ckpt.wire.manifest import open_checkpoint
        from gefen_ckpt.wire.verify import verify

        check_names(url, format, param_names, names_from)
        check_key(url, format, key)
        if optimizer is not None:
            check_optimizer(url, open_checkpoint(Store(url)).contract.implementation, optimizer)
        report = dataclasses.asdict(verify(url, progress=progress))
        del report["url"]
        return report
    state = open(url, format=format, optimizer=optimizer, param_names=param_names, names_from=names_from, key=key)
    tensors = sum(1 for _ in state.tensors())
    if format == TORCH:
        return {"ok": True, "problems": [], "tensors": tensors, "bytes": state.total_bytes(),
                "note": "torch.save files carry no checksums: checked loading (weights_only) and the contract"}
    from gefen_ckpt.dist.placement import row_ranges
    from gefen_ckpt.errors import CheckpointError

    problems, checked = [], 0
    for key, source in state.tensors():
        try:
            for start, stop in row_ranges(source.shape, source.dtype.itemsize, 64 << 20):
                checked += source.read(start, stop).nbytes
        except (CheckpointError, RuntimeError, ValueError, OSError) as exc:
            problems.append(f"{key}: {exc}")
    return {"ok": not problems, "problems": problems, "tensors": tensors, "bytes_checked": checked,
            "note": "DCP stores no checksums: checked that every tensor's rows read back as described"}


def write(state, url: str, format: str = PORTABLE, *, world_size: int | None = None,
          max_file_bytes: int | None = None, memory_budget: int | None = None, progress: bool = False) -> None:
    """Write ``state`` to ``url`` as ``format`` (portable: sharded over ``world_size`` if given;
    DCP: in torch's stock layout, in chunks of a quarter of ``memory_budget``, under the source's key
    and layout with the rest of the source checkpoint when ``state`` was read from one)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if format == DCP:
        from gefen_ckpt.dcp import write_dcp

        chunks = {"chunk_bytes": memory_budget // 4} if memory_budget else {}
        key = state.metadata.get("key") if state.metadata.get("source_format") == DCP else None
        write_dcp(state, url, key=key or "optim", world_size=world_size, **chunks)
    elif format == TORCH:
        from gefen_ckpt.formats.torch_file import save_torch_state_dict, state_dict_from_canonical

        save_torch_state_dict(state_dict_from_canonical(state), url)
    else:
        from gefen_ckpt.api import write as write_portable

        sizes = {k: v for k, v in (("max_file_bytes", max_file_bytes), ("memory_budget", memory_budget)) if v}
        write_portable(state, url, world_size=world_size, progress=progress, **sizes)


def convert_checkpoint(src: str, dst: str, *, to: str | None = None, into: str | None = None, moments: str = "m4v4",
                       format: str | None = None, optimizer: str | None = None, param_names: str | None = None,
                       names_from: str | None = None, key: str | None = None, **write_options):
    """``open`` ``src``, ``convert_state`` it ``into`` another optimizer if given (e.g. ``"Gefen"``
    from AdamW), ``write`` it to ``dst`` as ``to`` (default: ``src``'s format) and return it;
    nothing is written unless the whole conversion succeeds."""
    check_locations(src, dst)
    format = format or detect_format(src)
    state = open(src, format=format, optimizer=optimizer, param_names=param_names, names_from=names_from, key=key)
    if into is not None:
        from gefen_ckpt.formats.convert import convert_state

        state = convert_state(state, into, moments=moments)
    write(state, dst, to or format, **write_options)
    return state

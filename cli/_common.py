"""What every ``gefen-ckpt`` command shares: consoles, error reporting, sizes, opening checkpoints."""

from __future__ import annotations

import os
import re
import sys

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

# torch (and the gefen_ckpt modules that import it) is imported inside the commands, so `--help` stays
# fast; gefen_ckpt.checkpoints imports nothing heavy.
from gefen_ckpt.checkpoints import DCP, PORTABLE, TORCH, check_key, check_optimizer, detect_format  # noqa: F401
from gefen_ckpt.io.progress import columns

#: exit codes (documented in docs/cli.md): 1 is about the data (problems ``verify`` found, checkpoints
#: that differ, a checkpoint that cannot be read), 2 about the command line (the usage of click/typer)
EXIT_OK, EXIT_DIFFERENT, EXIT_DATA, EXIT_USAGE = 0, 1, 1, 2
#: set by ``--debug`` (or ``$GEFEN_CKPT_TRACEBACK``): errors re-raise with their traceback
debug = False


def out() -> Console:
    """Console for results (stdout). Wide when not a terminal, so piped tables keep their FQNs."""
    return Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200, highlight=False)


def err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str, code: int = EXIT_DATA):
    """Print a one-line red error on stderr and exit ``code``."""
    line = " ".join(str(message).split()) or "unknown error"
    err().print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True)
    raise typer.Exit(code)


#: typer's own exits and usage errors, which pass through the error policy (click's base of usage
#: errors is reached through typer: importing click would be an undeclared dependency)
CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
TYPER_EXITS = (typer.Exit, typer.Abort, CLICK_ERROR)


def click_error(exc: Exception) -> None:
    """A usage error click or typer raised (unknown option, bad value, missing argument): one line
    naming the command's help, instead of click's boxed panel; exit 2 (click's own code)."""
    if debug_wanted():
        raise exc
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:  # no arguments at all: the help
        typer.echo(ctx.get_help())
        raise typer.Exit(getattr(exc, "exit_code", EXIT_USAGE))
    hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
    fail(f"{exc.format_message()}{hint}", getattr(exc, "exit_code", EXIT_USAGE))


def debug_wanted() -> bool:
    return debug or bool(os.environ.get("GEFEN_CKPT_TRACEBACK"))


def exit_on_error(exc: Exception):
    """The CLI's one error policy (docs/cli.md): whatever went wrong, one red line on stderr and exit
    1 (the data), never a traceback (``--debug`` or ``GEFEN_CKPT_TRACEBACK=1`` re-raises). The
    command's first path argument (``command_paths``) prefixes a message that names no path, and a
    wrong --optimizer (``checkpoints.check_optimizer``'s ``held``) is told what the option means."""
    if getattr(exc, "held", None) is not None:
        exc = type(exc)(f"{exc}: --optimizer names the optimizer that wrote SRC (convert's --into names the one to "
                        "convert into)")
    if debug_wanted():
        raise exc
    from gefen_ckpt.errors import CheckpointError

    if isinstance(exc, FileNotFoundError) and exc.filename:
        message = f"{exc.filename}: no such file or directory"
    elif isinstance(exc, (CheckpointError, OSError)):
        message = str(exc) or type(exc).__name__
    else:  # not a documented failure: say what it was, in one line
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if command_paths and not any(_mentions(message, p) for p in command_paths):
        message = f"{command_paths[0]}: {message}"
    fail(message)


def _mentions(message: str, path: str) -> bool:
    """Does ``message`` name ``path``, or another spelling of the same local file (``/abs/opt.pt``)?"""
    if path in message:
        return True
    if "://" in path:
        return False
    target = os.path.realpath(path)
    return any(os.path.realpath(word) == target for word in message.replace(":", " ").split() if os.path.exists(word))


#: the commands' parameters that name checkpoints, and their values in the running command
PATH_PARAMS = ("path", "src", "a", "b", "dst")
command_paths: list[str] = []


def parse_storage_options(items: list[str]) -> dict:
    """``["endpoint_url=http://h:9000", "config_kwargs={...}"]`` -> options (JSON values where they parse)."""
    import json

    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--storage-option")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options


def set_storage_options(options: dict, args: list[str]) -> None:
    """Apply ``options`` to the protocol of every URL among ``args`` (fsspec's per-protocol
    configuration, so every way a command opens a URL uses them)."""
    import fsspec.config

    for arg in args:
        protocol, sep, _ = arg.partition("://")
        if sep and protocol not in ("file", "local"):
            fsspec.config.conf.setdefault(protocol, {}).update(options)


def progress() -> Progress:
    """A byte-progress bar on stderr (drawn only on a terminal; removed when done)."""
    console = err()
    return Progress(*columns(), console=console, transient=True, disable=not console.is_terminal)


def want_progress() -> bool:
    return err().is_terminal


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | None) -> int | None:
    """``"2GiB"``, ``"256MiB"``, ``"1e9"``, ``"500mb"`` -> bytes (``None`` stays ``None``)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise typer.BadParameter(f"{text!r} is not a size (examples: 2GiB, 256MiB, 1000000)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise typer.BadParameter(f"{text!r} must be positive")
    return value


# ----- opening checkpoints (gefen_ckpt.checkpoints) ---------------------------------------------
def check_destination(src: str, dst: str, overwrite: bool, create_bucket: bool, writes: bool = True) -> None:
    """SRC and DST must differ, DST not inside SRC (``check_locations``), and (when the command
    ``writes``) DST must not be an existing file or non-empty directory unless ``--overwrite``: a
    typo in DST must not replace a checkpoint.
    ``--create-bucket`` lets this process's saves create a missing bucket."""
    from gefen_ckpt.checkpoints import check_locations

    try:
        check_locations(src, dst)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    if not writes:
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(dst)
    if not overwrite and fs.exists(path) and not (fs.isdir(path) and not fs.ls(path, detail=False)):
        what = "a non-empty directory" if fs.isdir(path) else "a file"
        fail(f"{dst} exists and is {what}: pass --overwrite to replace it", EXIT_USAGE)
    if create_bucket:
        from gefen_ckpt.io.storage import CREATE_BUCKET_ENV

        os.environ[CREATE_BUCKET_ENV] = "1"


def settle_imports() -> None:
    """Import torch and the rest of gefen_ckpt, then exempt everything imported (~170k objects) from
    the cyclic garbage collector: its full collections cost up to a third of a short reshard
    (measured 0.49 -> 0.31 s). Unfrozen at exit, or Triton's nanobind extension reports every frozen
    object in a cycle as leaked."""
    import atexit
    import gc

    import gefen_ckpt.api  # noqa: F401

    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once, however often a command settles
    atexit.register(gc.unfreeze)


def refuse_names(url: str, fmt: str, param_names: str | None, names_from: str | None) -> None:
    """--param-names/--names-from: only for a torch state_dict, and only one of them (a usage error)."""
    from gefen_ckpt.checkpoints import check_names

    try:
        check_names(url, fmt, param_names, names_from)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--param-names/--names-from") from None


def open_manifest(url: str, optimizer: str | None, param_names: str | None, names_from: str | None,
                  key: str | None):
    """(Store, validated manifest) of a portable checkpoint, its options checked, without importing
    torch or listing the directory."""
    from gefen_ckpt.io.storage import Store
    from gefen_ckpt.wire.manifest import open_checkpoint

    refuse_names(url, PORTABLE, param_names, names_from)
    check_key(url, PORTABLE, key)
    store = Store(url)
    manifest = open_checkpoint(store, whole=False)
    check_optimizer(url, manifest.contract.implementation, optimizer)
    return store, manifest


def open_state(url: str, fmt: str | None = None, optimizer: str | None = None,
               param_names: str | None = None, names_from: str | None = None, key: str | None = None):
    """(format, CanonicalState) of a checkpoint (``gefen_ckpt.open``)."""
    import gefen_ckpt

    fmt = fmt or detect_format(url)
    settle_imports()
    refuse_names(url, fmt, param_names, names_from)
    return fmt, gefen_ckpt.open(url, format=fmt, optimizer=optimizer, param_names=param_names, names_from=names_from,
                                key=key)

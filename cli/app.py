"""``gefen-ckpt``: inspect, verify, diff, convert and reshard optimizer checkpoints offline.

Thin by design: parse arguments, call ``gefen_ckpt``, print (exit codes: the app's help, docs/cli.md).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from enum import Enum
from typing import Annotated

import typer
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from . import _common as common


class _Commands(TyperGroup):
    """The command group: usage errors and aborts as one line, with the CLI's exit codes."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        """Click's usage errors as one line (``common.click_error``) rather than its boxed panel."""
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except common.CLICK_ERROR as exc:
            try:
                common.click_error(exc)
            except typer.Exit as done:
                code = done.exit_code
        except typer.Abort:
            common.err().print("aborted")
            code = common.EXIT_DATA
        if not standalone_mode:
            return code
        raise SystemExit(code if isinstance(code, int) else common.EXIT_OK)

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        ctx.meta["gefen_ckpt.args"] = list(args)
        return super().parse_args(ctx, args)


class _Command(TyperCommand):
    """A command: any exception it raises goes through the CLI's one error policy,
    ``common.exit_on_error``, which names its checkpoint arguments (``common.command_paths``)
    (typer's exits and usage errors pass through)."""

    def invoke(self, ctx: typer.Context):
        common.command_paths[:] = [ctx.params[k] for k in common.PATH_PARAMS if isinstance(ctx.params.get(k), str)]
        try:
            return super().invoke(ctx)
        except common.TYPER_EXITS:
            raise
        except Exception as exc:
            common.exit_on_error(exc)


app = typer.Typer(
    cls=_Commands,
    name="gefen-ckpt",
    help=(
        "Inspect, verify, compare and convert Gefen / torch optimizer checkpoints offline: no GPU, "
        "no process group, bounded memory. PATHs may be local paths or fsspec URLs "
        "(file://, memory://, s3://...).\n\n"
        "Exit codes: 0 success; 1 about the data: problems found (verify), checkpoints differ (diff), or a "
        "checkpoint that cannot be read (missing path, not a checkpoint, corrupt, does not fit); 2 bad usage "
        "(unknown option, bad value, SRC and DST overlap, a non-empty DST without --overwrite). Errors are one "
        "line on stderr; --debug shows the traceback."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _storage(
    ctx: typer.Context,
    storage_option: Annotated[list[str] | None, typer.Option(
        "--storage-option", "-S", metavar="KEY=VALUE",
        help="Option for the storage of every URL on the command line (repeatable), e.g. "
             "endpoint_url=http://minio:9000, key=..., secret=..., "
             "'config_kwargs={\"connect_timeout\": 5, \"read_timeout\": 30, \"retries\": {\"max_attempts\": 2}}'. "
             "VALUE is JSON if it parses as JSON, else a string.")] = None,
    debug: Annotated[bool, typer.Option(
        "--debug", help="Show the traceback of an error (default: one line on stderr).")] = False,
):
    """Options that apply to every command (they go before the command name)."""
    common.debug = debug
    if storage_option:
        common.set_storage_options(common.parse_storage_options(storage_option),
                                   ctx.meta.get("gefen_ckpt.args", []))


PathArg = Annotated[str, typer.Argument(
    help="Checkpoint directory (portable format) or torch.save file; any fsspec URL.")]


OptimizerOpt = Annotated[str | None, typer.Option(
    "--optimizer",
    help="Optimizer that wrote the checkpoint (e.g. AdamW, Adam, SGD, Gefen, GefenMuonHybrid); default: recorded in "
         "it or inferred from a torch file's field names.")]
ParamNamesOpt = Annotated[str | None, typer.Option(
    "--param-names", metavar="FILE",
    help="Names for a torch optimizer state_dict saved without them: one FQN per line (or a JSON list), in the "
         "state_dict's parameter order.")]
NamesFromOpt = Annotated[str | None, typer.Option(
    "--names-from", metavar="MODEL",
    help="Names for a torch optimizer state_dict saved without them, from the model's torch.save'd state_dict (or a "
         "directory with pytorch_model*.bin): matched in named_parameters() order, checked by shape.")]

KeyOpt = Annotated[str | None, typer.Option(
    "--key", metavar="KEY",
    help="DCP only: the state-dict key of the optimizer to read when the checkpoint holds several (e.g. optimizer, "
         "optim); default: the only one.")]


class Target(str, Enum):
    portable = "portable"
    torch = "torch"
    dcp = "dcp"


class Moments(str, Enum):
    m4v4 = "m4v4"
    m8 = "m8"


class ShardedTarget(str, Enum):
    """reshard's outputs: layouts that hold shards (a torch.save file is one process's dict)."""

    portable = "portable"
    dcp = "dcp"


Overwrite = Annotated[bool, typer.Option(
    "--overwrite", help="Replace DST if it exists and is not empty (default: refuse).")]
CreateBucket = Annotated[bool, typer.Option(
    "--create-bucket", help="Create DST's bucket on an object store if it does not exist (default: error).")]


def _echo_json(data) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


# ----- inspect ------------------------------------------------------------------------------
@app.command(cls=_Command)
def inspect(
    path: PathArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    optimizer: OptimizerOpt = None,
    param_names: ParamNamesOpt = None,
    names_from: NamesFromOpt = None,
    key: KeyOpt = None,
):
    """Summarise a checkpoint without reading its tensor data.

    Shows the format and version, the optimizer (implementation, contract version), the step, every param group's hyperparameters, and per parameter FQN: shape, dtype, block period, each state field's dtype and shape, bytes per parameter; then the codebook (size, min, max, quantiles) and totals. Only two tiny tensors are ever read: the codebook, and one step counter when the manifest does not record the step. A torch.save file is read whole (that format has no index).

    [bold]Examples[/bold]

      gefen-ckpt inspect ckpt/step-1000

      gefen-ckpt inspect s3://bucket/run7/step-1000 --json | jq .totals.bytes_per_param

      gefen-ckpt inspect optimizer.pt
    """
    from . import _inspect

    fmt = common.detect_format(path)
    manifest, files = None, None
    if fmt == common.PORTABLE:
        store, parsed = common.open_manifest(path, optimizer, param_names, names_from, key)
        manifest, files = parsed.raw, {f.name: f.nbytes for f in parsed.files}
        described = _inspect.describe_manifest(store, parsed)
    else:
        if fmt == common.TORCH:
            import fsspec

            fs, p = fsspec.core.url_to_fs(path)
            files = {p.rsplit("/", 1)[-1]: int(fs.size(p))}
        described = _inspect.describe_state(common.open_state(path, fmt, optimizer, param_names, names_from,
                                                              key)[1])
    summary = _inspect.summarize(path, fmt, described, manifest, files)
    if as_json:
        _echo_json(summary)
    else:
        _inspect.render(summary, common.out())


# ----- verify -------------------------------------------------------------------------------
@app.command(cls=_Command)
def verify(
    path: PathArg,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    optimizer: OptimizerOpt = None,
    param_names: ParamNamesOpt = None,
    names_from: NamesFromOpt = None,
    key: KeyOpt = None,
):
    """Check every stored piece's checksum and that the pieces cover every tensor exactly once.

    Reads all the data (with a progress bar on a terminal) and reports each problem on its own line, naming the file and tensor. For a torch.save file (which has no checksums) it checks that the file loads with weights_only=True and that its state fits the optimizer's contract. Exit 0 when everything is intact, 1 when problems were found, 2 when the path is not a readable checkpoint at all.

    [bold]Examples[/bold]

      gefen-ckpt verify ckpt/step-1000

      gefen-ckpt verify s3://bucket/run7/step-1000 && echo intact
    """
    fmt = common.detect_format(path)
    common.refuse_names(path, fmt, param_names, names_from)
    if fmt != common.PORTABLE:
        common.settle_imports()
    from gefen_ckpt.checkpoints import verify_any

    data = {"path": path, "format": fmt, **verify_any(path, format=fmt, optimizer=optimizer, param_names=param_names,
                                                      names_from=names_from, progress=common.want_progress(), key=key)}
    if as_json:
        _echo_json(data)
    else:
        console = common.out()
        counts = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in data.items()
                           if k not in ("path", "format", "ok", "problems", "warnings", "note"))
        for warning in data.get("warnings", []):
            common.err().print(f"[yellow]warning:[/] {escape(' '.join(warning.split()))}", soft_wrap=True)
        if data["ok"]:
            console.print(f"[bold green]OK[/] {path} ({counts})" + (f"; {data['note']}" if data.get("note") else ""),
                          soft_wrap=True)
        else:
            err = common.err()
            for problem in data["problems"]:
                err.print(f"[red]problem:[/] {escape(' '.join(problem.split()))}", soft_wrap=True)
            err.print(f"[bold red]FAILED[/] {path}: {len(data['problems'])} problem(s)", soft_wrap=True)
    if not data["ok"]:
        raise typer.Exit(common.EXIT_DIFFERENT)


# ----- diff ---------------------------------------------------------------------------------
@app.command(cls=_Command)
def diff(
    a: Annotated[str, typer.Argument(help="First checkpoint (portable directory or torch.save file).")],
    b: Annotated[str, typer.Argument(help="Second checkpoint (portable directory or torch.save file).")],
    atol: Annotated[float | None, typer.Option(
        "--atol", min=0.0, help="Absolute tolerance for values (default: bit-exact comparison).")] = None,
    chunk: Annotated[str, typer.Option(
        "--chunk", help="Bytes compared at a time (bounds memory), e.g. 64MiB.")] = "64MiB",
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    optimizer: OptimizerOpt = None,
    param_names: ParamNamesOpt = None,
    names_from: NamesFromOpt = None,
    key: KeyOpt = None,
):
    """Compare two checkpoints field by field: contract, hyperparameters, FQNs, shapes, dtypes, values.

    Values are bit-exact by default; --atol X accepts |a - b| <= X (NaN equals NaN). Tensors are streamed in row chunks (--chunk), so memory stays bounded whatever the model size. The two sides may be in different formats (a portable checkpoint against a torch file). Exit 0 when equal, 1 when they differ, 2 on errors.

    [bold]Examples[/bold]

      gefen-ckpt diff ckpt/step-1000 resharded/step-1000

      gefen-ckpt diff ckpt/step-1000 optimizer.pt --atol 1e-6

      gefen-ckpt diff a b --json | jq '.differences[].key'
    """
    from gefen_ckpt.tools.diff import diff_states

    chunk_bytes = common.parse_size(chunk)
    def side(path: str):  # the names apply to a torch side (a portable or DCP side records its own)
        fmt = common.detect_format(path)
        names = (param_names, names_from) if fmt == common.TORCH else (None, None)
        return common.open_state(path, fmt, optimizer, *names, key if fmt == common.DCP else None)[1]

    sa, sb = side(a), side(b)
    with common.progress() as bar:
        def start(total):
            task = bar.add_task("comparing", total=total)
            return lambda n: bar.advance(task, n)

        report = diff_states(sa, sb, atol=atol, chunk_bytes=chunk_bytes, progress=start)
    report = {"a": a, "b": b, **report}
    if as_json:
        _echo_json(report)
    else:
        console = common.out()
        c = report["compared"]
        for note in report["notes"]:
            common.err().print(f"[dim]note:[/] {escape(note)}", soft_wrap=True)
        if report["equal"]:
            console.print(f"[bold green]equal[/] ({c['tensors']} tensors, {c['elements']:,} elements"
                          + (f", atol={atol:g}" if atol is not None else ", bit-exact") + ")", soft_wrap=True)
        else:
            for d in report["differences"]:
                console.print(f"[yellow]{d['kind']}[/] {escape(d['message'])}", soft_wrap=True)
            console.print(f"[bold red]different[/]: {len(report['differences'])} difference(s) "
                          f"({c['tensors']} tensors compared)", soft_wrap=True)
    raise typer.Exit(common.EXIT_OK if report["equal"] else common.EXIT_DIFFERENT)


# ----- convert ------------------------------------------------------------------------------
@app.command(cls=_Command)
def convert(
    src: Annotated[str, typer.Argument(
        help="Source checkpoint: portable or DCP directory, or torch.save file (auto-detected).")],
    dst: Annotated[str, typer.Argument(
        help="Destination: a directory for --to portable/dcp, a file for --to torch.")],
    to: Annotated[Target | None, typer.Option(
        "--to", help="Output format: portable, torch or dcp (default: the source's).")] = None,
    into: Annotated[str | None, typer.Option(
        "--into", help="Convert the state into another optimizer's: Gefen, GefenMuon, GefenMuonHybrid or AdamW "
                       "(default: keep the source's optimizer).")] = None,
    moments: Annotated[Moments, typer.Option(
        "--moments", help="With --into Gefen or GefenMuonHybrid: the Gefen state layout, m4v4 (the default, contract "
                          "version 2) or m8 (8-bit codes, version 1: what Gefen(moments='m8') loads).")] = Moments.m4v4,
    optimizer: OptimizerOpt = None,
    param_names: ParamNamesOpt = None,
    names_from: NamesFromOpt = None,
    max_file_bytes: Annotated[str | None, typer.Option(
        "--max-file-bytes", help="Largest data file (portable), e.g. 2GiB.")] = None,
    memory_budget: Annotated[str | None, typer.Option(
        "--memory-budget", help="Extra memory while writing (portable), e.g. 256MiB.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was written (and the conversion's errors) "
                                                         "as JSON.")] = False,
    key: KeyOpt = None,
    overwrite: Overwrite = False,
    create_bucket: CreateBucket = False,
):
    """Convert between formats (portable, torch, DCP) and, with --into, between optimizers.

    Formats: a torch file is loaded with torch.load(weights_only=True) (no pickled code runs) and keyed by FQN from its param groups' param_names (or --param-names / --names-from when it was saved without them); a torch output loads with optimizer.load_state_dict(torch.load(path, weights_only=True)).

    --into: AdamW/Adam -> Gefen, GefenMuon or GefenMuonHybrid (warm start: the codebooks are learned from the moments as from a first step; Gefen's default m4v4 layout keeps 1-D moments (exp_avg in bf16) and codes each matrix element's first moment and exp_avg_sq / factored estimate by nearest rounding, --moments m8 quantises exp_avg as the m8 step does and keeps a factored second moment; step and hyperparameters carried), Gefen of one layout -> the other (e.g. a version 1 checkpoint for today's default Gefen), and Gefen, GefenMuon or the hybrid -> AdamW (dense exp_avg / exp_avg_sq that torch.optim.AdamW.load_state_dict accepts). The relative errors of the first and second moments are printed. Nothing is written unless the whole conversion succeeds.

    [bold]Examples[/bold]

      gefen-ckpt convert optimizer.pt ckpt/step-1000 --to portable

      gefen-ckpt convert adamw.pt gefen.pt --into Gefen

      gefen-ckpt convert old-m8-ckpt/ new-ckpt/ --into Gefen

      gefen-ckpt convert checkpoint-500/optimizer.pt gefen.pt --into Gefen --param-names names.txt

      gefen-ckpt convert ckpt/step-1000 adamw.pt --into AdamW --to torch
    """
    sizes = {"max_file_bytes": common.parse_size(max_file_bytes), "memory_budget": common.parse_size(memory_budget)}
    common.check_destination(src, dst, overwrite, create_bucket)
    fmt = common.detect_format(src)
    common.refuse_names(src, fmt, param_names, names_from)
    target = to.value if to is not None else fmt
    common.settle_imports()
    from gefen_ckpt import convert_checkpoint

    with common.err().status(f"converting {src}", spinner="dots") if common.want_progress() else nullcontext():
        state = convert_checkpoint(src, dst, to=target, into=into, moments=moments.value, format=fmt,
                                   optimizer=optimizer, param_names=param_names, names_from=names_from,
                                   key=key, progress=common.want_progress(), **sizes)
    report = state.metadata.get("conversion") if into is not None else None
    if as_json:
        _echo_json({"src": src, "dst": dst, "from_format": fmt, "to": target,
                    "optimizer": state.contract.implementation, "parameters_with_state": len(state.params),
                    "conversion": report})
        return
    console = common.out()
    console.print(f"[green]wrote[/] {dst} ({target}, {state.contract.implementation}, "
                  f"{len(state.params)} parameters with state) from {src} ({fmt})", soft_wrap=True)
    if report is not None:
        console.print(escape(conversion_summary(report)), soft_wrap=True)


def conversion_summary(report: dict) -> str:
    """The conversion report in one or two lines for people."""
    def moment(name: str, r) -> str:
        if r is None:
            return f"{name}: not kept by the target"
        return f"{name} relative error {r['rel_error']:.3g} (worst {r['worst']['fqn']}: {r['worst']['rel_error']:.3g})"

    text = (f"converted {report['from']} -> {report['into']}: {report['parameters']} parameters; "
            f"{moment('first moment', report['first_moment'])}; {moment('second moment', report['second_moment'])}")
    if report["restarted"]:
        text += (f"\n{len(report['restarted'])} parameter(s) without a second moment in the source start afresh: "
                 + ", ".join(report["restarted"][:5]) + (" ..." if len(report["restarted"]) > 5 else ""))
    return text


# ----- reshard ------------------------------------------------------------------------------
@app.command(cls=_Command)
def reshard(
    src: Annotated[str, typer.Argument(help="Source checkpoint: portable or DCP directory, or torch.save file.")],
    dst: Annotated[str, typer.Argument(help="Destination directory (written atomically).")],
    world_size: Annotated[int | None, typer.Option(
        "--world-size", "-n", help="Target number of ranks (FSDP2 Shard(0) over all of them), at most 1048576 "
                                   "(2^20).")] = None,
    mesh: Annotated[str | None, typer.Option(
        "--mesh", help="Target HSDP mesh RxS (replicate x shard): data is split over S ranks.")] = None,
    memory_budget: Annotated[str | None, typer.Option(
        "--memory-budget", help="Extra memory while resharding, e.g. 256MiB (default).")] = None,
    max_file_bytes: Annotated[str | None, typer.Option(
        "--max-file-bytes", help="Largest data file, e.g. 2GiB (default).")] = None,
    to: Annotated[ShardedTarget, typer.Option(
        "--to", help="Output format: portable (our sharded layout) or dcp (torch's layout, flattened and "
                     "with the rest of SRC when SRC is a DCP checkpoint in that layout); for a torch.save file use "
                     "`convert`.")] = ShardedTarget.portable,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the plan (bytes each target rank will read) and write nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    optimizer: OptimizerOpt = None,
    param_names: ParamNamesOpt = None,
    names_from: NamesFromOpt = None,
    key: KeyOpt = None,
    overwrite: Overwrite = False,
    create_bucket: CreateBucket = False,
):
    """Rewrite a checkpoint for another world size or mesh, offline and streaming.

    Compressed state stays compressed and bit-exact: every block lies inside a row of the global parameter, so the target layout is a torch.chunk split of each row-sharded field along dim 0 (what FSDP2 Shard(0) gives each rank); replicated fields are stored once. Memory stays within --memory-budget whatever the checkpoint's size. Loading the result with gefen_ckpt.load on the target ranks reads only each rank's pieces.

    [bold]Examples[/bold]

      gefen-ckpt reshard ckpt/step-1000 ckpt/step-1000-ws3 --world-size 3

      gefen-ckpt reshard ckpt/step-1000 ckpt/hsdp --mesh 2x4 --dry-run

      gefen-ckpt reshard s3://bucket/run7/step-1000 s3://bucket/run7/step-1000-ws64 -n 64 --memory-budget 1GiB
    """
    from gefen_ckpt.tools.reshard import plan, plan_manifest, retarget

    sizes = {"max_file_bytes": common.parse_size(max_file_bytes), "memory_budget": common.parse_size(memory_budget)}
    target = _target(world_size, mesh)
    common.check_destination(src, dst, overwrite, create_bucket, writes=not dry_run)
    if dry_run and common.detect_format(src) == common.PORTABLE:
        from gefen_ckpt.wire.manifest import total_tensor_bytes

        _, manifest = common.open_manifest(src, optimizer, param_names, names_from, key)
        _print_plan(src, dst, target, plan_manifest(manifest, target.shard), total_tensor_bytes(manifest), as_json)
        return
    fmt, state = common.open_state(src, optimizer=optimizer, param_names=param_names, names_from=names_from,
                                   key=key)
    ranks = plan(state, target.shard)
    if dry_run or as_json:
        _print_plan(src, dst, target, ranks, state.total_bytes(), as_json)
    if not dry_run:
        from gefen_ckpt import checkpoints

        checkpoints.write(retarget(state, target), dst, to.value, world_size=target.shard,
                      progress=common.want_progress(), **sizes)
        if not as_json:
            common.out().print(f"[green]wrote[/] {dst}: {target.shard} shard(s) x {target.replicate} replica(s), "
                               f"{state.total_bytes():,} bytes of state from {src} ({fmt})", soft_wrap=True)


def _target(world_size: int | None, mesh: str | None):
    """The target mesh of --world-size / --mesh, within ``MAX_WORLD_SIZE`` (a usage error else)."""
    from gefen_ckpt.tools.reshard import MAX_WORLD_SIZE, Mesh

    if world_size is not None and not 1 <= world_size <= MAX_WORLD_SIZE:
        raise typer.BadParameter(f"{world_size} is not in 1..{MAX_WORLD_SIZE} (the most ranks a target may have)",
                                 param_hint="--world-size")
    if mesh is None and world_size is None:
        raise typer.BadParameter("give --world-size or --mesh")
    try:
        target = Mesh.parse(mesh) if mesh is not None else Mesh(1, world_size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--mesh") from None
    if world_size is not None and world_size != target.world_size:
        raise typer.BadParameter(f"--world-size {world_size} contradicts --mesh {mesh}")
    return target


def _print_plan(src, dst, target, ranks, total: int, as_json: bool) -> None:
    """One row (JSON entry) per run of consecutive shard ranks with the same figures."""
    if as_json:
        _echo_json({"source": src, "destination": dst, "mesh": [target.replicate, target.shard],
                    "world_size": target.world_size, "total_bytes": total,
                    "ranks": [{"shard_rank": r.rank, "last_shard_rank": r.last, "read_bytes": r.read_bytes,
                               "sharded_bytes": r.sharded_bytes, "replicated_bytes": r.replicated_bytes,
                               "empty_fields": r.empty_fields}
                              for r in ranks]})
        return
    from rich.table import Table

    table = Table(title=f"reshard {src} -> {dst} (mesh {target.replicate}x{target.shard})")
    for col in ("shard rank", "reads (bytes)", "own rows (bytes)", "replicated (bytes)", "empty fields"):
        table.add_column(col, justify="right")
    for r in ranks:
        table.add_row(str(r.rank) if r.count == 1 else f"{r.rank}-{r.last}", f"{r.read_bytes:,}", f"{r.sharded_bytes:,}", f"{r.replicated_bytes:,}",
                      str(r.empty_fields))
    common.out().print(table)
    if any(r.empty_fields for r in ranks):
        common.out().print("[yellow]note[/]: some ranks own no rows of some small tensors (empty shards load fine)")


def main() -> None:
    """Entry point of the ``gefen-ckpt`` console script."""
    app()


if __name__ == "__main__":
    main()

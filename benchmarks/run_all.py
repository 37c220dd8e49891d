"""Run every benchmark and rewrite ``docs/benchmarks.md``.

Usage::

    python -m benchmarks.run_all [--quick] [--only NAME ...]     # `make bench` runs the full set

Every module ``benchmarks/bench_<name>.py`` found next to this file is imported and its ``run``
called; adding a benchmark means adding such a module, nothing here changes.

The convention each benchmark module follows::

    def run(quick: bool) -> dict:
        return {
            "title": str,       # heading of its section in docs/benchmarks.md
            "markdown": str,    # the section body: what was measured and how, a table of the
                                #   numbers, and a table against the docs/design.md 12 targets they answer to
                                #   (ratios to baselines measured in the same run, since absolute
                                #   times on shared machines are noisy)
            "plots": [str],     # paths of the PNGs it wrote (usually benchmarks/out/*.png)
            "data": {...},      # optional: JSON-able raw numbers
        }

* ``quick=True`` is a smoke run (well under a minute where possible); the full run stays under
  4 minutes. A module may change torch's thread count; run_all restores it afterwards.
* The module writes its own raw results to ``benchmarks/out/<name>.json`` (``common.write_json``)
  and plots with ``common.plot``; run_all copies the plots to ``docs/img/`` (prefixed with
  ``<name>_`` unless the file name already starts with ``<name>``) and links them.
* A module that raises, or returns something else, gets a section saying so (with the
  traceback) and makes run_all exit with status 1; the other benchmarks still run.
* ``--only NAME`` re-runs some benchmarks; the sections of the others are taken from the last
  run recorded in ``docs/benchmarks.json`` (the records the page is rendered from, committed
  with it, so that a fresh clone keeps the page whole too).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib
import json
import os
import re
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/run_all.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, machine_limits, md_table

DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
CACHE = ROOT / "docs" / "benchmarks.json"


def discover() -> list[str]:
    """Names (``bench_<name>`` without the prefix) of every benchmark module, sorted."""
    return sorted(p.stem.removeprefix("bench_") for p in Path(__file__).parent.glob("bench_*.py"))


def run_one(name: str, quick: bool) -> dict:
    """Import and run one benchmark; never raises. Returns its (checked) section record."""
    threads = torch.get_num_threads()
    start = time.perf_counter()
    try:
        module = importlib.import_module(f"benchmarks.bench_{name}")
        result = module.run(quick)
        _check(result)
        record = {"ok": True, "title": result["title"], "markdown": result["markdown"],
                  "plots": [_in_repo(p) for p in result["plots"]]}
    except Exception as exc:  # report it in the docs, keep going
        record = {"ok": False, "title": f"bench_{name}", "markdown": "", "plots": [],
                  "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    finally:
        torch.set_num_threads(threads)
        gc.collect()
    record.update(seconds=round(time.perf_counter() - start, 1), quick=quick,
                  when=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    return record


def _check(result) -> None:
    if not isinstance(result, dict):
        raise TypeError(f"run() returned {type(result).__name__}, expected a dict")
    for key, kind in (("title", str), ("markdown", str), ("plots", (list, tuple))):
        if not isinstance(result.get(key), kind):
            raise TypeError(f"run() result needs {key!r} of type {kind}, got {result.get(key)!r} "
                            "(see the convention in benchmarks/run_all.py)")
    missing = [p for p in result["plots"] if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"plots not written: {missing}")


def _in_repo(path) -> str:
    """A plot's path relative to the repository (the JSON record names no machine's folders)."""
    return Path(os.path.relpath(Path(path).resolve(), ROOT)).as_posix()


def publish_plots(name: str, plots: list[str]) -> list[str]:
    """Copy plots to docs/img/; return their paths relative to docs/."""
    IMG.mkdir(parents=True, exist_ok=True)
    links = []
    for plot in plots:
        src = ROOT / plot
        target = src.name if src.name.startswith(name) else f"{name}_{src.name}"
        if src.is_file():
            shutil.copyfile(src, IMG / target)
        if (IMG / target).is_file():
            links.append(f"img/{target}")
    return links


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def render(records: dict[str, dict], machine: dict) -> str:
    """The whole docs/benchmarks.md page."""
    now = max((r["when"] for r in records.values() if r.get("when")), default=None) \
        or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")  # the newest run shown
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `python -m benchmarks.run_all` (`make bench`) on {now}; edit the benchmark "
        "modules, not this page. Absolute times on a shared machine are noisy: every table compares "
        "against baselines measured in the same run, next to the machine's own limits.",
        "",
        md_table(["machine", "value"], [
            ["CPU", f"{machine['cpu']} ({machine['cpu_count']} CPUs, {machine['cpu_capability']})"],
            ["memcpy (torch copy_, 256 MiB)", f"{machine['memcpy_gbps']} GB/s at {machine['torch_threads']} threads"],
            ["in-place read + write stream (torch mul_, 256 MiB)",
             f"{machine['stream_gbps']} GB/s of traffic at {machine['torch_threads']} threads"],
            ["torch / python", f"{machine['torch']} / {machine['python']}"],
        ]),
        "",
        md_table(["benchmark", "status", "run", "seconds"], [
            [f"[{r['title']}](#{_anchor(r['title'])})", "ok" if r["ok"] else "**failed**",
             f"{r['when']}{' (quick)' if r['quick'] else ''}", r["seconds"]] for r in records.values()
        ]),
        "",
    ]
    for name, r in records.items():
        lines += [f"## {r['title']}", ""]
        if not r["ok"]:
            lines += [f"`bench_{name}` **failed**: `{r['error']}`", "", "```", r["traceback"].rstrip(), "```", ""]
            continue
        lines += [r["markdown"].strip(), ""]
        lines += [f"![{r['title']}]({link})" for link in publish_plots(name, r["plots"])]
        lines += ["", f"_`bench_{name}`: {r['seconds']} s{' (quick run)' if r['quick'] else ''}._", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes and repetitions")
    parser.add_argument("--full", action="store_true",
                        help="also the sizes that take minutes (bench_io's ~400 MB state); same as GEFEN_BENCH_FULL=1")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks (bench_NAME.py)")
    parser.add_argument("--render-only", action="store_true",
                        help=f"run nothing: rewrite {DOC.name} from the records in {CACHE.name}")
    args = parser.parse_args(argv)
    if args.render_only:
        cached = json.loads(CACHE.read_text())
        DOC.write_text(render(cached["records"], cached["machine"]))
        print(f"[run_all] wrote {DOC.relative_to(ROOT)}", flush=True)
        return 0
    if args.full:
        os.environ["GEFEN_BENCH_FULL"] = "1"  # read by the modules with a full-only size
    names = discover()
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        parser.error(f"no benchmark module for {unknown}; found {names}")
    cached = json.loads(CACHE.read_text()) if args.only and CACHE.is_file() else {}
    machine = machine_limits()
    records = {}
    for name in names:
        if args.only and name not in args.only:
            if name in cached.get("records", {}):
                records[name] = cached["records"][name]
            continue
        print(f"[run_all] bench_{name} ...", flush=True)
        records[name] = run_one(name, args.quick)
        status = "ok" if records[name]["ok"] else f"FAILED: {records[name]['error']}"
        print(f"[run_all] bench_{name}: {status} ({records[name]['seconds']} s)", flush=True)
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    CACHE.write_text(json.dumps({"machine": machine, "records": records}, indent=2) + "\n")
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render(records, machine))
    print(f"[run_all] wrote {DOC.relative_to(ROOT)}", flush=True)
    return 0 if all(r["ok"] for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

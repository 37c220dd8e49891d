"""`make demo`: Gefen next to AdamW, then train -> save -> reshard 2 -> 3 ranks -> resume -> inspect.

About 2-5 minutes on a 2-core machine (2 min 15 s measured on a shared one). Everything it
writes goes under one fresh directory in the system temp folder, printed first and removed at
the end (also when interrupted) unless ``--keep`` (``make demo KEEP=1``).

    python examples/demo.py [--keep] [--workdir DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

# Nothing heavy is imported before the first line is printed: importing torch alone takes
# seconds on a small machine, and the demo should say what it does straight away.


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the working directory at the end")
    parser.add_argument("--workdir", default=None, help="write here instead of a fresh temp directory "
                        "(created if needed; never removed)")
    parser.add_argument("--steps", type=int, default=30, help="steps before and after the reshard (part 2)")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="gefen-demo-")
    os.makedirs(workdir, exist_ok=True)
    owned = args.workdir is None and not args.keep
    print("Gefen demo, about 2-5 minutes on a 2-core machine, in two parts:\n"
          "  part 1: train a small MLP for 300 steps with AdamW, then with Gefen; compare loss and state size\n"
          f"  part 2: train on 2 ranks (FSDP2, CPU), save, reshard offline to 3 ranks, resume {args.steps} steps\n"
          f"writing under {workdir}" + (" (removed at the end; --keep or `make demo KEEP=1` keeps it)" if owned
                                        else " (kept)"), flush=True)
    start = time.perf_counter()
    try:
        print("\npart 1: loading torch and gefen ...", flush=True)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import compare_adamw
        import train_reshard_resume

        compare_adamw.main()
        print(f"\npart 2 (after {time.perf_counter() - start:.0f} s): train -> save -> reshard -> resume", flush=True)
        train_reshard_resume.run(workdir, args.steps)
    finally:
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ndone in {time.perf_counter() - start:.0f} s"
          + (f"; removed {workdir}" if owned else f"; files are in {workdir}"), flush=True)


if __name__ == "__main__":
    main()

"""`make demo` (examples/demo.py) says what it does at once, names the one directory it writes
under, and removes it at the end (or when interrupted) unless asked to keep it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", str(DEMO), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> tuple[str, float]:
    """Lines up to the first matching ``pattern``, and when it came (seconds since the call)."""
    start, seen = time.monotonic(), []
    while time.monotonic() - start < timeout:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return "".join(seen), time.monotonic() - start
    pytest.fail(f"no line matching {pattern!r} within {timeout} s; got {''.join(seen)!r}")


@pytest.mark.timeout(120)
def test_demo_names_its_task_and_directory_at_once_and_cleans_up_when_interrupted():
    proc = _start()
    try:
        head, seconds = _read_until(proc, r"^writing under ", timeout=30)
        assert seconds < 2.0, f"the first lines took {seconds:.1f} s"
        assert "part 1: train" in head and "part 2: train on 2 ranks" in head and "minutes" in head
        workdir = re.search(r"writing under (\S+)", head).group(1)
        assert os.path.isdir(workdir) and "removed at the end" in head
        _read_until(proc, r"^part 1", timeout=30)
        proc.send_signal(signal.SIGINT)  # as Ctrl-C would
        proc.communicate(timeout=60)
        assert not os.path.exists(workdir)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_whole_demo_keeps_its_directory_only_when_asked():
    for keep in (False, True):
        proc = _start("--steps", "10", *(["--keep"] if keep else []))
        out, _ = proc.communicate(timeout=800)
        assert proc.returncode == 0, out
        workdir = re.search(r"writing under (\S+)", out).group(1)
        assert "step 300/300" in out and "max |difference|" in out and "done in" in out
        assert os.path.isdir(workdir) == keep, out
        if keep:
            assert os.path.isdir(os.path.join(workdir, "ckpt-ws3", "optim"))
            subprocess.run(["rm", "-rf", workdir], check=True)

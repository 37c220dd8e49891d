"""Every import of the installed packages is a declared dependency (a plain `pip install .`
must give a working library and CLI; the test extras must not hide a missing one)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = ("gefen", "gefen_ckpt", "cli")  # cli/ is installed as gefen_cli
FIRST_PARTY = {"gefen", "gefen_ckpt", "gefen_cli"}


def _declared() -> set[str]:
    """Import names of pyproject's [project] dependencies (distribution names normalised)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0] for dep in project["dependencies"]}
    return {n.lower().replace("-", "_") for n in names}


def _imports(path: Path) -> set[str]:
    """Top-level modules of every absolute import in a file (lazy imports inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_every_third_party_import_is_declared():
    declared = _declared()
    undeclared = {}
    for package in INSTALLED:
        for path in sorted((ROOT / package).rglob("*.py")):
            for module in _imports(path) - FIRST_PARTY - set(sys.stdlib_module_names):
                if module not in declared:
                    undeclared.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not undeclared, f"imported but not in [project] dependencies: {undeclared}"


def test_scanner_sees_lazy_imports(tmp_path):
    """The scan must catch an import inside a function (the CLI imports lazily)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import click\n    from rich.console import Console\n")
    assert _imports(probe) == {"click", "rich"}

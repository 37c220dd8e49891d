"""Every import of the installed packages is a declared dependency (a plain `pip install .`
must give a working library and CLI; the test extras must not hide a missing one)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
INSTALLED = ("gefen", "gefen_ckpt", "cli")  # cli/ is installed as gefen_cli
FIRST_PARTY = {"gefen", "gefen_ckpt", "gefen_cli"}
#: optional imports -> (the extras that declare them, the only modules that import them). Those
#: modules are imported only behind a guard (gefen.triton.dispatch imports gefen.triton.launch in
#: a try block) or by the user (nothing imports gefen_ckpt.torchft_transport).
OPTIONAL = {"triton": (("gpu", "test"), {"gefen/triton/kernels.py"}),
            "torchft": (("torchft",), {"gefen_ckpt/torchft_transport.py"})}


def _names(deps: list[str]) -> set[str]:
    names = {re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0] for dep in deps}
    return {n.lower().replace("-", "_") for n in names}


def _declared() -> set[str]:
    """Import names of pyproject's [project] dependencies (distribution names normalised)."""
    return _names(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


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
                if module not in declared and str(path.relative_to(ROOT)) not in OPTIONAL.get(module, ((), ()))[1]:
                    undeclared.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not undeclared, f"imported but not in [project] dependencies: {undeclared}"


def test_optional_imports_are_in_their_extras():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, (names, _) in OPTIONAL.items():
        assert all(module in _names(extras[name]) for name in names), module


def _imports_module(path: Path, dotted: str) -> bool:
    parent, _, name = dotted.rpartition(".")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name == dotted for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module == dotted or (
                node.module in (parent, None) and any(a.name == name for a in node.names))):
            return True
    return False


def test_nothing_imports_the_torchft_transport():
    """torchft stays optional: only a user's own import reaches gefen_ckpt.torchft_transport."""
    users = [str(path.relative_to(ROOT)) for package in INSTALLED for path in sorted((ROOT / package).rglob("*.py"))
             if _imports_module(path, "gefen_ckpt.torchft_transport")]
    assert not users
    assert _imports_module(ROOT / "examples" / "torchft_heal.py", "gefen_ckpt.torchft_transport")  # the check sees one


def test_scanner_sees_lazy_imports(tmp_path):
    """The scan must catch an import inside a function (the CLI imports lazily)."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import click\n    from rich.console import Console\n")
    assert _imports(probe) == {"click", "rich"}


def _first_party_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (lazy imports too; ``from pkg import mod``
    counts as ``pkg.mod``)."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in paths:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(paths)
                deps |= subs or {node.module}
        graph[name] = deps - {name}
    return graph


def test_gefen_modules_import_no_cycle_and_the_reference_is_pure():
    """One direction between gefen's modules (docs/design.md 2): the torch reference imports no
    kernel, and no module imports one that imports it back."""
    graph = _first_party_graph("gefen")
    kernels = {d for d in graph["gefen.functional"] if d == "gefen.c_kernels" or d.startswith("gefen.triton")}
    assert not kernels, f"the reference gefen.functional imports kernels: {sorted(kernels)}"
    _assert_acyclic(graph)


def test_gefen_ckpt_modules_import_no_cycle():
    """gefen_ckpt's modules point one way too (docs/design.md 2), lazy imports included."""
    _assert_acyclic(_first_party_graph("gefen_ckpt"))


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    done, path = set(), []

    def visit(module):
        assert module not in path, f"import cycle: {' -> '.join(path[path.index(module):] + [module])}"
        if module not in done:
            path.append(module)
            for dep in sorted(graph[module]):
                visit(dep)
            path.pop()
            done.add(module)

    for module in sorted(graph):
        visit(module)

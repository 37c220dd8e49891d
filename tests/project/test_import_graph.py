"""The package's floors, read from the source: gefen_ckpt's sub-packages import only their own
floor and the ones below (any import, also inside a function), and no modules import each
other in a circle at load time. ``gefen`` sits below all of them and imports none."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: gefen_ckpt's floors, lowest first; a module on floor k may import floors <= k
FLOORS = [
    ("gefen_ckpt.errors",),
    ("gefen_ckpt.io",),
    ("gefen_ckpt.state",),
    ("gefen_ckpt.wire",),
    ("gefen_ckpt.formats",),
    ("gefen_ckpt.dist",),
    ("gefen_ckpt.tools", "gefen_ckpt.dcp", "gefen_ckpt.transport", "gefen_ckpt.torchft_transport"),
    ("gefen_ckpt.api", "gefen_ckpt.async_io", "gefen_ckpt.checkpoints", "gefen_ckpt"),
]


def modules(package: str) -> dict[str, Path]:
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, module: str, known: set[str], top_level_only: bool) -> set[str]:
    """The modules of ``known`` that ``module`` imports (at load time only, with ``top_level_only``)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[: -node.level + (path.name == "__init__.py")] + ([base] if base else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                out.add(name if name in known else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known}


def floor(module: str) -> int:
    best, level = -1, None
    for k, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, level = len(name), k
    assert level is not None, f"{module} is on no floor: add it to FLOORS"
    return level


def test_every_module_has_a_floor_and_imports_none_above_it():
    found = modules("gefen_ckpt")
    wrong = []
    for module, path in found.items():
        for target in imports(path, module, set(found), top_level_only=False):
            if floor(target) > floor(module):
                wrong.append(f"{module} (floor {floor(module)}) imports {target} (floor {floor(target)})")
    assert not wrong, "\n".join(sorted(wrong))


def test_gefen_imports_nothing_of_gefen_ckpt():
    found = modules("gefen")
    wrong = [m for m, p in found.items() if any(t.startswith("gefen_ckpt") for t in
                                                   imports(p, m, set(modules("gefen_ckpt")), top_level_only=False))]
    assert not wrong


def test_no_import_circles_at_load_time():
    found = {**modules("gefen"), **modules("gefen_ckpt"), **modules("cli")}
    graph = {m: imports(p, m, set(found), top_level_only=True) - {m} for m, p in found.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_each_sub_package_says_what_it_owns_and_may_import():
    for init in (ROOT / "gefen_ckpt").glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert doc and ("import" in doc.lower()), f"{init.relative_to(ROOT)}: say what it owns and may import"

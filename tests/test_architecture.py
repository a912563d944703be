"""The shape of the house (issue 17): floors of imports, no circle, no UI in the core, a short loop."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from .helpers import run_process

ROOT = Path(__file__).resolve().parent.parent / "nbtrain"

# The floors, lowest first. A module may import its own floor and the ones below; an import to a higher floor
# "runs back up". viz/ and ui/ sit on top; a method that draws imports them inside itself (DESIGN rule 1) and is
# not counted.
FLOORS = [
    ("nbtrain.config", "nbtrain.hardware", "nbtrain.precision", "nbtrain.hub", "nbtrain._version", "nbtrain._logs",
     "nbtrain.course"),
    ("nbtrain.data", "nbtrain.models"),
    ("nbtrain.memory", "nbtrain.integrations.exports"),
    ("nbtrain.engine",),
    ("nbtrain.compare", "nbtrain.integrations", "nbtrain.cli", "nbtrain.__main__", "nbtrain.viz", "nbtrain.ui",
     "nbtrain"),
]
DRAWING = ("nbtrain.viz", "nbtrain.ui")
CORE = ["nbtrain", "nbtrain.config", "nbtrain.hardware", "nbtrain.precision", "nbtrain.engine", "nbtrain.data",
        "nbtrain.models", "nbtrain.memory", "nbtrain.compare", "nbtrain.integrations.exports", "nbtrain.cli"]
UI = ("ipywidgets", "plotly", "IPython")


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in ROOT.rglob("*.py")}


def _floor(mod: str) -> int:
    best, floor = "", len(FLOORS) - 1
    for i, names in enumerate(FLOORS):
        for n in names:   # the longest matching prefix decides (nbtrain.integrations.exports vs .integrations)
            if (mod == n or mod.startswith(n + ".")) and len(n) > len(best):
                best, floor = n, i
    return floor


def _imports(mod: str, type_checking: bool = False) -> list[tuple[str, bool]]:
    """(imported nbtrain module, at module level?) for every import in ``mod``, TYPE_CHECKING blocks excepted
    unless ``type_checking``."""
    path = MODULES[mod]
    tree = ast.parse(path.read_text())
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    skip = set()
    for node in ast.walk(tree):
        if not type_checking and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            skip.update(id(n) for n in ast.walk(node))
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]
        out += [(t, id(node) in top) for t in targets if t in MODULES and t != mod]
    return out


def test_config_and_hardware_are_the_ground_floor():
    assert [t for t, _ in _imports("nbtrain.config")] == [], "config.py must import nothing from nbtrain"
    assert {t for t, _ in _imports("nbtrain.hardware")} <= {"nbtrain.config"}


@pytest.mark.parametrize("type_checking", [False, True], ids=["imports", "with-type-hints"])
def test_no_import_circle(type_checking):
    # Type-hint-only imports count too: two modules that name each other are one module in two files.
    edges = {m: {t for t, _ in _imports(m, type_checking)} for m in MODULES}
    # Package __init__ files import their own modules; a module importing its package's __init__ is a circle.
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(t):] + [t]))
            if not state.get(t):
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if not state.get(m):
            visit(m)


def test_at_most_one_import_runs_back_up():
    up = [(m, t) for m in MODULES for t, _ in _imports(m)
          if _floor(t) > _floor(m) and not t.startswith(DRAWING)]
    assert len(up) <= 1, up


@pytest.fixture(scope="module")
def ui_modules_after_import():
    """One fresh process imports each core module in turn and says which UI modules each import pulled in."""
    code = ("import json, sys\nout = {}\nfor m in %r:\n    __import__(m)\n"
            "    out[m] = sorted({k.split('.')[0] for k in sys.modules} & set(%r))\nprint(json.dumps(out))"
            % (CORE, UI))
    r = run_process([sys.executable, "-c", code], 300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_ui(ui_modules_after_import, module):
    assert ui_modules_after_import[module] == [], f"{module} loaded {ui_modules_after_import[module]}"


def test_loop_is_short():
    lines = (ROOT / "engine" / "loop.py").read_text().splitlines()
    assert len(lines) < 300
    tree = ast.parse("\n".join(lines))
    run = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_run")
    assert run.end_lineno - run.lineno < 140, "the step loop should read top to bottom in one screenful or two"

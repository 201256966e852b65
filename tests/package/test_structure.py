"""The package's structure: floors that import only downwards, no import cycle, modules that each say
what they own in their first line and stay small enough to read in one sitting (WORKSPACE.md)."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mixloop"
# Each module's floor, by the longest matching prefix; a module imports only from its floor or below.
FLOORS = {
    "mixloop.errors": 0, "mixloop.interrupts": 0, "mixloop.files": 0, "mixloop.machine": 0,
    "mixloop.engine": 1,
    "mixloop.config": 2,
    "mixloop.config_reference": 3, "mixloop.doctor": 3,
    "mixloop.runner": 4,
    "mixloop.cli": 5,
    "mixloop.tools": 6,
    "mixloop": 7, "mixloop.train": 7, "mixloop.diagnose": 7, "mixloop.benchmark": 7,
}
MAX_LINES = 600
# Modules allowed past MAX_LINES, each with its reason in WORKSPACE.md ("Modules over 600 lines").
LONGER = {}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _floor(module: str) -> int:
    prefix = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[prefix]


def _imports(path: pathlib.Path) -> set[str]:
    """The mixloop modules `path` imports, anywhere in it (a function's late import included)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module)
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in imported if name in MODULES}


IMPORTS = {module: _imports(path) - {module} for module, path in MODULES.items()}


def test_every_module_has_a_floor_and_imports_none_above_it():
    upward = [f"{module} (floor {_floor(module)}) imports {other} (floor {_floor(other)})"
              for module, others in IMPORTS.items() for other in others
              if _floor(other) > _floor(module) and not module.startswith(other + ".")
              and other != "mixloop"]
    assert upward == []


def test_no_import_cycle():
    cycles, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for other in sorted(IMPORTS[module]):
            if other == "mixloop" or module.startswith(other + "."):
                continue  # A package's __init__ is not a dependency of its modules' code.
            if state.get(other) == "open":
                cycles.append(" -> ".join(path[path.index(other):] + [other]))
            elif other not in state:
                visit(other, path + [other])
        state[module] = "done"

    for module in sorted(MODULES):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_engine_imports_only_itself_and_the_lowest_floor():
    """The engine is usable alone: it imports nothing from config, the doctor, the runner or tools."""
    engine = {module: others for module, others in IMPORTS.items() if module.startswith("mixloop.engine")}
    assert {module: sorted(o for o in others if _floor(o) > 0 and not o.startswith("mixloop.engine"))
            for module, others in engine.items()} == {module: [] for module in engine}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_module_says_what_it_owns_and_stays_short(module):
    path = MODULES[module]
    source = path.read_text()
    docstring = ast.get_docstring(ast.parse(source))
    assert docstring and docstring.strip(), f"{module} has no module docstring"
    assert len(source.splitlines()) <= LONGER.get(module, MAX_LINES), (
        f"{module} has {len(source.splitlines())} lines; split it or give its reason in WORKSPACE.md")

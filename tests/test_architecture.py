"""The module map holds (ARCHITECTURE.md): floors import only downwards, relay/ knows transports only
through their contract, serving never opens calibration, the library never imports the lab, no import
circle, no module outside tests/ imports another module's private name, no source file over 500 lines."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "ctxrelay"
BENCH = ROOT / "benchmarks" / "ctxrelay_bench"
TOOLS = [ROOT / "scripts", ROOT / "experiments"]  # scripts of the checkout: public names only

# floor of each top-level module or package (ARCHITECTURE.md); the lab stands on top of the library
FLOORS = {
    "errors": 1, "paths": 1, "timing": 1, "text": 1, "seal": 1, "tensorfile": 1, "metrics": 1, "state": 1,
    "artifact": 1, "results": 1, "results_index": 1,
    "models": 2, "zoo": 2, "data": 2,
    "transports": 3,
    "relay": 4,
    "serve": 5, "demo": 5, "engines": 5,
    "cli": 6, "__init__": 6,
    "ctxrelay_bench": 7,
}  # fmt: skip


def _package_modules(pkg_dir: Path) -> dict[str, Path]:
    out = {}
    for p in pkg_dir.rglob("*.py"):
        parts = list(p.relative_to(pkg_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = {**_package_modules(SRC), **_package_modules(BENCH)}
PACKAGES = ("ctxrelay", "ctxrelay_bench")


def _imports(path: Path, top_level_only: bool = False) -> list[str]:
    """Modules of the two distributions that `path` imports (annotation-only imports under TYPE_CHECKING
    left out).

    `from pkg import sub` counts as importing pkg.sub only: Python loads a parent package for any
    submodule, so that edge says nothing about the layering."""
    tree = ast.parse(path.read_text())
    out: list[str] = []

    def visit(nodes, depth):
        for node in nodes:
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                continue
            if isinstance(node, ast.Import):
                out.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                mods = [m for m in subs if m in MODULES]
                out.extend(mods)
                if len(mods) < len(subs):
                    out.append(node.module)
            elif not top_level_only or isinstance(node, ast.If | ast.Try):
                visit(ast.iter_child_nodes(node), depth + 1)

    visit(tree.body, 0)
    return [m for m in out if m.split(".")[0] in PACKAGES]


def _floor(module: str) -> int:
    parts = module.split(".")
    if parts[0] == "ctxrelay_bench":
        return FLOORS["ctxrelay_bench"]
    return FLOORS["__init__"] if len(parts) == 1 else FLOORS[parts[1]]


def test_every_module_has_a_floor():
    assert all(m.startswith("ctxrelay_bench") or len(m.split(".")) == 1 or m.split(".")[1] in FLOORS for m in MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_down_the_floors(module):
    mine = _floor(module)
    for target in _imports(MODULES[module]):
        if target in MODULES:
            assert _floor(target) <= mine, f"{module} (floor {mine}) imports {target} (floor {_floor(target)})"


def test_the_library_never_imports_the_lab():
    for module, path in MODULES.items():
        if module.startswith("ctxrelay."):
            lab = [t for t in _imports(path) if t.startswith("ctxrelay_bench")]
            assert not lab, f"{module} imports {lab}: `ctxrelay bench` finds the lab by entry point only"


def test_relay_knows_transports_only_through_their_contract():
    for module, path in MODULES.items():
        if module.startswith("ctxrelay.relay"):
            for target in _imports(path):
                if target.startswith("ctxrelay.transports."):
                    assert target.split(".")[2] in ("base", "RelayOutput", "Transport", "UnknownTransport"), (
                        f"{module} imports {target}: relay/ may use only the transport contract"
                    )


def test_serving_never_opens_calibration():
    """A transport's serving path (everything in its package outside calibration/) imports calibration
    code only inside its `calibrate` entry (a function-level import), so a reader of the relay never
    opens it."""
    for module, path in MODULES.items():
        if module.startswith("ctxrelay.transports.") and ".calibration" not in module:
            calib = [t for t in _imports(path, top_level_only=True) if ".calibration" in t]
            assert not calib, f"{module} imports {calib} at import time"


def test_no_import_circle_among_modules():
    graph = {m: {t for t in _imports(p, top_level_only=True) if t in MODULES and t != m} for m, p in MODULES.items()}
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for t in graph[m]:
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join([*stack, m, t]))
            if t not in state:
                visit(t, [*stack, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def _private_imports(path: Path) -> list[str]:
    """`from M import _name` and `M._name` where M is an imported module of either distribution."""
    tree = ast.parse(path.read_text())
    found, aliases = [], {}
    for node in ast.walk(tree):
        ours = isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES
        if ours:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in MODULES:
                    aliases[a.asname or a.name] = sub
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_outside_tests_imports_a_private_name():
    files = [*MODULES.values(), *(p for d in TOOLS if d.exists() for p in d.rglob("*.py"))]
    found = [f for p in files for f in _private_imports(p)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_no_source_file_over_500_lines():
    files = [*MODULES.values()]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these files: {long}"

"""The module map holds (ARCHITECTURE.md): floors import only downwards, relay/ knows transports only
through their contract, no import circle, no source file over 500 lines."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "ctxrelay"

# floor of each top-level module or package of ctxrelay (ARCHITECTURE.md)
FLOORS = {
    "errors": 1, "paths": 1, "timing": 1, "text": 1, "seal": 1, "tensorfile": 1, "metrics": 1, "state": 1,
    "artifact": 1,
    "models": 2, "zoo": 2, "data": 2,
    "transports": 3,
    "relay": 4,
    "serve": 5, "bench": 5,
    "cli": 6, "__init__": 6,
}  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(path: Path, top_level_only: bool = False) -> list[str]:
    """ctxrelay modules `path` imports (annotation-only imports under TYPE_CHECKING left out).

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
    return [m for m in out if m.startswith("ctxrelay.")]


MODULES = _modules()


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS["__init__"] if len(parts) == 1 else FLOORS[parts[1]]


def test_every_module_has_a_floor():
    assert all(len(m.split(".")) == 1 or m.split(".")[1] in FLOORS for m in MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_go_down_the_floors(module):
    mine = _floor(module)
    for target in _imports(MODULES[module]):
        if target in MODULES:
            assert _floor(target) <= mine, f"{module} (floor {mine}) imports {target} (floor {_floor(target)})"


def test_relay_knows_transports_only_through_their_contract():
    for module, path in MODULES.items():
        if module.startswith("ctxrelay.relay"):
            for target in _imports(path):
                if target.startswith("ctxrelay.transports."):
                    assert target.split(".")[2] in ("base", "RelayOutput", "Transport", "UnknownTransport"), (
                        f"{module} imports {target}: relay/ may use only the transport contract"
                    )


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


def test_no_source_file_over_500_lines():
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these files: {long}"

"""The project's import graph: no cycle, layers in order, presentation on top, no torch below.

Every import counts, wherever it is written: at module level, inside a function (the imports that
hide a cycle from Python, which resolves them late), under ``if TYPE_CHECKING`` (a dependency all
the same), absolute or relative, ``import x.y`` or ``from x import y``. The graph is read from the
source with :mod:`ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("models", "sim", "runtime", "validation")  # each may import only itself and those before it
PRESENTATION = "validation.present"
PRESENTATION_LIBRARIES = ("rich", "plotly")
# The orchestrator of a simulation; the runtime should depend on the plan and its placement only.
ORCHESTRATOR = "sim.simulate"

# Known exceptions (none left): an entry names an edge to be removed, and why it is there.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()
KNOWN_ORCHESTRATOR_IMPORTS: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``module`` imports (project modules by their module name, others by their
    top-level package)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            # ``from package import module`` imports the module; ``from module import name`` the module
            names = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                     for alias in node.names]
        else:
            continue
        for name in names:
            found.add(name if name in known or name.split(".")[0] in LAYERS else name.split(".")[0])
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {module: _imported(module, path, known) - {module} for module, path in modules.items()}


def _layer(module: str) -> int | None:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def test_the_graph_sees_function_level_and_relative_imports(graph):
    # runtime.measure imports the worker inside functions only: the walk must see it.
    assert "runtime.worker" in graph["runtime.measure"]
    assert "sim.collectives.registry" in graph["sim.calibrated"]
    assert len(graph) > 60


def test_no_import_cycle(graph):
    edges = {m: {d for d in deps if d in graph and (m, d) not in KNOWN_CYCLE_EDGES} for m, deps in graph.items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles)


def test_layers_import_only_downwards(graph):
    upward = [f"{m} imports {d}" for m, deps in sorted(graph.items()) for d in sorted(deps)
              if _layer(d) is not None and _layer(d) > _layer(m)]
    assert not upward, "a lower layer imports a higher one (models <- sim <- runtime <- validation): " + \
        ", ".join(upward)


def test_presentation_only_at_the_top(graph):
    wrong = [f"{m} imports {d}" for m, deps in sorted(graph.items()) for d in sorted(deps)
             if (d.startswith(PRESENTATION) or d in PRESENTATION_LIBRARIES) and not m.startswith("validation")]
    assert not wrong, "presentation (rich, plotly, validation.present) below the top: " + ", ".join(wrong)


def test_models_and_sim_never_import_torch(graph):
    wrong = [m for m, deps in sorted(graph.items()) if _layer(m) in (0, 1) and "torch" in deps]
    assert not wrong, f"torch imported in {', '.join(wrong)}"


def test_runtime_does_not_import_the_orchestrator(graph):
    wrong = {(m, ORCHESTRATOR) for m, deps in graph.items() if m.startswith("runtime") and ORCHESTRATOR in deps}
    assert wrong <= KNOWN_ORCHESTRATOR_IMPORTS, f"runtime imports {ORCHESTRATOR}: {sorted(wrong - KNOWN_ORCHESTRATOR_IMPORTS)}"


def test_cycle_finder_finds_a_hidden_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm,
    R. Tarjan, "Depth-first search and linear graph algorithms", SIAM J. Comput. 1(2), 1972)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(components)

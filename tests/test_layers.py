"""The drawing of ``ncljax/``'s imports: layers that import only downwards, and no circle
between modules (late imports inside functions count as imports)."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ncljax")

# Bottom to top: a package may import its own modules and those of the packages before it.
LAYERS = (
    "rules",
    "masking",
    "backend",
    "cluster",
    "optim",
    "evidence",
    "losses",
    "labels",
    "models",
    "methods",
    "data",
    "evaluate",
    "config",
    "configs",
    "cli",
    "train",
    "audit",
    "retrieve",
    "report",
    "embed",
    "__main__",
)


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[: -len(".py")]
                found[rel.replace(os.sep, ".").removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(path: str) -> set[str]:
    """The ``ncljax`` modules ``path`` imports, anywhere in the file."""
    with open(path) as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.split(".")[0] == "ncljax" and n != "ncljax"}


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def _layer(module: str) -> str:
    return module.split(".")[1]


def test_every_package_is_in_a_layer():
    assert {_layer(m) for m in MODULES if m != "ncljax"} == set(LAYERS)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "ncljax"))
def test_a_module_imports_only_its_package_and_the_layers_below(module):
    level = LAYERS.index(_layer(module))
    upward = sorted(
        target
        for target in GRAPH[module]
        if _layer(target) != _layer(module) and LAYERS.index(_layer(target)) > level
    )
    assert not upward, f"{module} imports upwards: {upward}"


def test_no_circle_between_modules():
    """Tarjan's strongly connected components of the module graph: each is one module."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_commands_load_no_solver_they_may_not_use():
    """ott-jax (about 1 s) and scipy.stats (about 0.5 s) load when first used, so a flag error
    or ``--help`` of a command that never solves a transport problem does not pay for them."""
    import subprocess
    import sys

    code = (
        "import sys, ncljax.train.__main__, ncljax.audit, ncljax.retrieve, ncljax.report;"
        "print(sorted(m for m in ('ott', 'scipy.stats') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""The package's import structure: no circles, each layer above the ones it uses.

Read statically (``ast``), function-local imports included, so a circle hidden
inside a function body is caught as well as one at module level.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlx_kvlingo"

# Bottom to top. A module may import from its own layer's modules and from layers
# below; the foundation modules are single files under mlx_kvlingo/.
LAYERS = [
    ("blas", "errors", "files", "cpu_math", "metrics", "progress", "plotting"),
    ("models",),
    ("data",),
    ("translator",),
    ("switching",),
    ("chat",),
    ("measure",),
    ("train",),
    ("pairs",),
    ("serve",),
]
NETWORK_MODULES = ("http", "socket", "socketserver")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules():
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_names(path: Path):
    """(line, absolute module name, imported names) for every import in a file."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            yield node.lineno, module, [a.name for a in node.names]


def internal_edges(known):
    """module -> set of package modules it imports (a name that is a submodule
    counts as that submodule; importing a submodule does not count its parents)."""
    edges = {}
    for name, path in known.items():
        out = set()
        for _, module, names in imported_names(path):
            if not module.startswith("mlx_kvlingo"):
                continue
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
            out.update(subs or ([module] if module in known else []))
        edges[name] = out - {name}
    return edges


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)  # the package's own __init__: the public API, above all
    for i, layer in enumerate(LAYERS):
        if parts[1] in layer:
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def test_no_import_circles():
    edges = internal_edges(modules())
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_each_layer_imports_only_from_below():
    edges = internal_edges(modules())
    wrong = [f"{m} ({layer_of(m)}) imports {n} ({layer_of(n)})"
             for m, targets in sorted(edges.items()) for n in sorted(targets)
             if layer_of(n) > layer_of(m)]
    assert not wrong, "\n".join(wrong)


def test_the_library_never_imports_the_cli_or_typer():
    found = [f"{p.relative_to(ROOT)}:{line} imports {module}"
             for p in modules().values()
             for line, module, _ in imported_names(p)
             if module.split(".")[0] in ("typer", "mlx_kvlingo_cli", "cli")]
    assert not found, "\n".join(found)


def test_only_the_server_module_touches_sockets():
    found = [f"{p.relative_to(ROOT)}:{line} imports {module}"
             for name, p in modules().items()
             for line, module, _ in imported_names(p)
             if module.split(".")[0] in NETWORK_MODULES and name != "mlx_kvlingo.serve.server"]
    assert not found, "\n".join(found)


# What builds a switched cache: translating rows, recomputing them in a pass with the
# tokens read after them. A conversation's catch-up and the server use switching's
# switches (switching.catch_up, switching.api), never these parts.
CACHE_BUILDERS = {"translate_span", "translate_aligned", "translate_into", "translate_cache",
                  "recompute_and_read", "recompute_spans", "map_early_layer"}


@pytest.mark.parametrize("layer", ["chat", "serve"])
def test_a_conversation_builds_no_switched_cache_itself(layer):
    found = [f"{p.relative_to(ROOT)}:{line} imports {sorted(set(names) & CACHE_BUILDERS)}"
             for name, p in modules().items() if name.split(".")[1:2] == [layer]
             for line, module, names in imported_names(p)
             if module.startswith("mlx_kvlingo.switching") and set(names) & CACHE_BUILDERS]
    assert not found, "\n".join(found)
    assert any(name.split(".")[1:2] == [layer] for name in modules())


@pytest.mark.parametrize("folder", ["tests", "benchmarks", "examples"])
def test_no_private_names_imported_from_the_package(folder):
    found = []
    for p in sorted((ROOT / folder).rglob("*.py")):
        for line, module, names in imported_names(p):
            if not module.startswith(("mlx_kvlingo", "mlx_kvlingo_cli")):
                continue
            private = [n for n in names if n.startswith("_")]
            if private or any(part.startswith("_") for part in module.split(".")):
                found.append(f"{p.relative_to(ROOT)}:{line} from {module} import {names}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("folder", ["benchmarks", "examples", "cli"])
def test_scripts_import_the_package_before_mlx(folder):
    """mlx_kvlingo preloads a fast BLAS, which works only before mlx.core is
    imported: a script that imports mlx or mlx_lm first runs on the reference BLAS."""
    late = []
    for p in sorted((ROOT / folder).rglob("*.py")):
        order = [module.split(".")[0] for _, module, _ in imported_names(p)
                 if module.split(".")[0] in ("mlx", "mlx_lm", "mlx_kvlingo")]
        if order and order[0] != "mlx_kvlingo" and "mlx_kvlingo" in order:
            late.append(str(p.relative_to(ROOT)))
    assert not late, "import mlx_kvlingo first in: " + ", ".join(late)

"""The package imports in one direction (docs/design.md, "The order of the package's layers").

The import graph of `megatron_scalerl` is read from the source with `ast`: every `import` and `from ... import`,
those inside functions included (imports under `if TYPE_CHECKING:` are not run and are left out). A unit is a
subpackage or a top-level module; each has a layer, and a unit may import only units of lower layers. No two modules
may import each other in a circle, inside a package or across packages.
"""

import ast
import functools
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_scalerl"

# The order of docs/design.md, section 5: a unit may import the units of lower layers only.
LAYERS = [
    {"errors", "choices", "recipe_rules", "rope_note"},
    {"__init__", "fileio", "command_line", "http_json"},  # __init__: the package's, which imports rope_note
    {"recipe"},
    {"algo", "forecast", "metrics", "run_dir", "gpu_hours"},
    {"platform"},
    {"checkpoint"},
    {"models"},
    {"weight_sync"},
    {"rollout"},
    {"trainer"},
    {"launch"},
    {"evaluation", "verify"},
    {"demo", "recipe_cli", "convert_cli"},
    {"sweep"},
    {"cli"},
]
# Edges that go up the order today, each with its way out (docs/design.md lists them): to be removed, never added to.
KNOWN_UPWARD = {
    # `--model hf:DIR` (and `model_preset: hf:DIR` in a recipe file) reads an HF config.json through the model
    # family's translation, which builds the recipe's ModelConfig: resolved when model families become plug-ins
    ("megatron_scalerl.recipe", "megatron_scalerl.models.hf_io"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes of `tree`, inside functions too, not under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, names resolved to the deepest module that exists."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def existing(name: str) -> str:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    package = package[:len(package) - node.level + 1]
                    base = ".".join(package + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                if target.split(".")[0] == PACKAGE.name and existing(target) != name:
                    graph[name].add(existing(target))
    return graph


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_layer():
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    placed = set().union(*LAYERS)
    assert units <= placed, f"units without a layer (add them to LAYERS and docs/design.md): {units - placed}"
    assert all(sum(unit in layer for layer in LAYERS) == 1 for unit in placed)


def test_imports_go_down_the_layers_only():
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    upward = sorted((a, b) for a, targets in import_graph().items() for b in targets
                    if _unit(a) != _unit(b) and layer[_unit(b)] >= layer[_unit(a)] and (a, b) not in KNOWN_UPWARD)
    assert not upward, "imports that go up (or across) the layer order:\n" + "\n".join(
        f"  {a} (layer {layer[_unit(a)]}) -> {b} (layer {layer[_unit(b)]})" for a, b in upward)


def test_no_module_imports_itself_in_a_circle():
    graph = {a: {b for b in targets if (a, b) not in KNOWN_UPWARD} for a, targets in import_graph().items()}
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def test_the_known_upward_edges_still_exist():
    """An exception whose import is gone must leave KNOWN_UPWARD (and docs/design.md) with it."""
    graph = import_graph()
    assert all(b in graph.get(a, ()) for a, b in KNOWN_UPWARD)

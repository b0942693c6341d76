"""The package imports in one direction (docs/design.md, "The order of the package's layers").

The import graph of `megatron_scalerl` is read from the source with `ast`: every `import` and `from ... import`,
those inside functions included (imports under `if TYPE_CHECKING:` are not run and are left out). A unit is a
subpackage or a top-level module; each has a layer, and a unit may import only units of lower layers. No two modules
may import each other in a circle, inside a package or across packages.

One exception to "a unit is a subpackage": a model family's folder spans two layers (docs/model_families.md). Its
pure side (`families/<name>/__init__.py` and any other module there) is the `families` unit, below `recipe`; its
torch side, `families/<name>/model` (a module or a package), is part of the `models` unit.

One unit has sides: `weight_sync` holds both ends of weight sync. Its receiving side runs in every vLLM worker and
imports of ours only the modules both ends share, which import nothing else of ours (`WEIGHT_SYNC_SIDES`); a worker
that imports our worker extension is checked to load nothing of the trainer.
"""

import ast
import functools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_scalerl"

# The order of docs/design.md, section 5: a unit may import the units of lower layers only.
LAYERS = [
    {"errors", "section"},
    # __init__: the package's; families: the model families' pure side (HF config.json
    # translation, layer plans, serving specifics)
    {"__init__", "fileio", "http_json", "ports", "process_exit", "families"},
    {"recipe", "run"},
    {"algo", "forecast", "batches"},
    {"platform", "tasks"},
    {"checkpoint"},
    {"models"},
    {"weight_sync"},
    {"inference"},
    {"orchestrator", "trainer"},
    {"launch"},
    {"evaluation", "verify"},
    {"demo"},
    {"sweep"},
    {"commands"},
    {"__main__"},
]
FAMILY_MODEL_SIDE = "model"  # families/<name>/model: a family's torch side, in the `models` unit (models/family.py)

# The sides of `weight_sync` (docs/design.md, section 5), module names below the package. "shared": both ends use
# them; they import of ours only each other, and the protocol nothing at all. "receiving": inside every vLLM worker;
# of ours only the shared modules and each other. "trainer": the trainer's and the launcher's side, which may import
# the shared modules and any lower layer.
WEIGHT_SYNC_SIDES = {
    "shared": {"weight_sync", "weight_sync.protocol", "weight_sync.transport", "weight_sync.broadcast",
               "weight_sync.disk"},
    "receiving": {"weight_sync.receiver", "weight_sync.worker_methods", "weight_sync.fp32_head"},
    "trainer": {"weight_sync.sender", "weight_sync.fleet_control", "weight_sync.generator_link",
                "weight_sync.launch_checks"},
}
WORKER_EXTENSION_MODULE = "megatron_scalerl.inference.worker_extension"  # what vLLM imports in every worker
# What a generator's worker must never load: megatron-core and the trainer's side of the package
TRAINER_MODULES = ("megatron.core", "megatron_scalerl.models", "megatron_scalerl.recipe", "megatron_scalerl.trainer",
                   "megatron_scalerl.launch", "megatron_scalerl.orchestrator",
                   *(f"megatron_scalerl.{module}" for module in WEIGHT_SYNC_SIDES["trainer"]))


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
    if parts[1:2] == ["families"] and parts[3:4] == [FAMILY_MODEL_SIDE]:
        return "models"
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_layer():
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    placed = set().union(*LAYERS)
    assert units <= placed, f"units without a layer (add them to LAYERS and docs/design.md): {units - placed}"
    assert all(sum(unit in layer for layer in LAYERS) == 1 for unit in placed)


def test_imports_go_down_the_layers_only():
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    upward = sorted((a, b) for a, targets in import_graph().items() for b in targets
                    if _unit(a) != _unit(b) and layer[_unit(b)] >= layer[_unit(a)])
    assert not upward, "imports that go up (or across) the layer order:\n" + "\n".join(
        f"  {a} (layer {layer[_unit(a)]}) -> {b} (layer {layer[_unit(b)]})" for a, b in upward)


def test_every_weight_sync_module_has_a_side():
    modules = {m.removeprefix(f"{PACKAGE.name}.") for m in map(_module_name, PACKAGE.rglob("*.py"))
               if _unit(m) == "weight_sync"}
    sided = set().union(*WEIGHT_SYNC_SIDES.values())
    assert modules == sided, (f"weight_sync modules without a side (add them to WEIGHT_SYNC_SIDES and docs/design.md): "
                              f"{sorted(modules - sided)}; sides naming no module: {sorted(sided - modules)}")
    assert sum(len(side) for side in WEIGHT_SYNC_SIDES.values()) == len(sided)


def test_weight_syncs_receiving_side_imports_only_what_both_ends_share():
    graph = import_graph()
    ours = {side: {f"{PACKAGE.name}.{m}" for m in modules} for side, modules in WEIGHT_SYNC_SIDES.items()}
    allowed = {"shared": ours["shared"], "receiving": ours["shared"] | ours["receiving"]}
    wrong = [f"  {module} ({side}) -> {target}" for side, permitted in allowed.items() for module in sorted(ours[side])
             for target in sorted(graph.get(module, ())) if target not in permitted]
    wrong += [f"  {PACKAGE.name}.weight_sync.protocol -> {target}"
              for target in sorted(graph.get(f"{PACKAGE.name}.weight_sync.protocol", ()))]
    assert not wrong, "weight_sync imports that break its sides (WEIGHT_SYNC_SIDES):\n" + "\n".join(wrong)


def test_a_generator_worker_loads_nothing_of_the_trainer():
    """What vLLM imports in every worker (our worker extension, which registers the receiver) leaves megatron-core
    and the trainer's modules unloaded, at run time: the static rule above, and whatever vLLM pulls in."""
    pytest.importorskip("vllm")
    probe = (f"import sys\nimport {WORKER_EXTENSION_MODULE}\nwatched = {TRAINER_MODULES!r}\n"
             "print('loaded:' + ','.join(sorted(m for m in sys.modules\n"
             "                                  if any(m == w or m.startswith(w + '.') for w in watched))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    loaded = next(line for line in done.stdout.splitlines() if line.startswith("loaded:")).removeprefix("loaded:")
    assert loaded == "", f"importing {WORKER_EXTENSION_MODULE} loaded {loaded}"


def test_no_module_imports_itself_in_a_circle():
    graph = import_graph()
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


def _deferred_imports_without_a_reason(tree: ast.AST, lines: list[str]) -> list[int]:
    """Line numbers of imports of the package inside a function whose run of import statements (the consecutive
    imports it belongs to) has no `# deferred` comment."""
    bare = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for body in (node.body for node in ast.walk(function) if hasattr(node, "body") and isinstance(node.body, list)):
            run_start = None
            for statement in body:
                if not isinstance(statement, (ast.Import, ast.ImportFrom)):
                    run_start = None
                    continue
                run_start = run_start or statement.lineno
                names = [a.name for a in statement.names] if isinstance(statement, ast.Import) else [statement.module]
                ours = any((name or "").split(".")[0] == PACKAGE.name for name in names)
                said = any("# deferred" in line for line in lines[run_start - 1:statement.end_lineno])
                if ours and not said and statement.lineno not in bare:
                    bare.append(statement.lineno)
    return bare


def test_an_import_of_ours_inside_a_function_says_why():
    """The package's own modules are imported at the top of a module. The exception defers a heavy import (torch,
    megatron-core, vLLM, scipy, matplotlib) out of a module that must stay light (a process that must start fast, a
    command that must answer fast): it says so with a `# deferred: <why>` comment on the import or on the first
    import of its run."""
    bare = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        bare += [f"{path.relative_to(PACKAGE.parent)}:{line}"
                 for line in _deferred_imports_without_a_reason(ast.parse(text), text.splitlines())]
    assert not bare, "imports inside functions without a '# deferred: <why>' comment:\n  " + "\n  ".join(bare)


DESIGN = PACKAGE.parent / "docs" / "design.md"


def unit_imports() -> dict[str, set[str]]:
    """{unit: the other units its modules import}."""
    out: dict[str, set[str]] = defaultdict(set)
    for module, targets in import_graph().items():
        out[_unit(module)] |= {_unit(t) for t in targets if _unit(t) != _unit(module)}
    return out


def design_table() -> dict[str, tuple[int, set[str]]]:
    """docs/design.md section 5's table: {unit: (its layer, the units its "What they import of ours" cell names)};
    that cell reads `unit: a, b; unit2: c` (`-`: nothing)."""
    text = DESIGN.read_text()
    section = text[text.index("## 5. The order of the package's layers"):text.index("## 6.")]
    table = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        for entry in cells[3].split(";"):
            unit, _, names = entry.partition(":")
            imported = {n.strip().strip("`") for n in names.split(",")} - {"-", ""}
            table[unit.strip().strip("`")] = (int(cells[0]), imported)
    return table


def test_the_design_docs_table_is_the_import_graph():
    table, graph = design_table(), unit_imports()
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    wrong = [f"  {unit}: layer {table.get(unit, ('missing',))[0]} in the table, {layer[unit]} in LAYERS"
             for unit in sorted(layer) if table.get(unit, (None,))[0] != layer[unit]]
    wrong += [f"  {unit}: the table says it imports {sorted(table[unit][1])}, it imports {sorted(graph[unit])}"
              for unit in sorted(layer) if unit in table and table[unit][1] != graph[unit]]
    assert not wrong, "docs/design.md section 5 disagrees with the code (regenerate its last column):\n" + "\n".join(wrong)

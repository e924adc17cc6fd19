"""The layering, in one line: kernels < recipes < parallel < trainer < cli. A package imports
only from its own layer and the ones before it, and no two modules import each other, even
through others; imports inside functions count as much as those at the top."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "recipes", "parallel", "trainer", "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The lctrain modules `path` imports (as kernels.pallas, parallel.planner, ...):
    `from lctrain.parallel import planner` imports the module parallel.planner, `from
    lctrain.parallel import make_strategy` the package parallel."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("lctrain."):
                module = node.module.removeprefix("lctrain.")
            else:
                continue
            found.update(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules
                         else module for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name.removeprefix("lctrain.") for alias in node.names
                         if alias.name.startswith("lctrain."))
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(path): path for layer in LAYERS for path in (ROOT / layer).rglob("*.py")}
    return {name: {target for target in imports_of(path, set(files))
                   if target in files and target != name}
            for name, path in files.items()}


def test_every_import_goes_down_the_layers():
    upward = [f"{source} -> {target}" for source, targets in graph().items()
              for target in targets
              if LAYERS.index(target.split(".")[0]) > LAYERS.index(source.split(".")[0])]
    assert upward == []


def test_no_module_imports_itself_through_others():
    edges = graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert cycles == []


def test_the_walk_sees_imports_inside_functions():
    """The checks above would pass on nothing: the graph has the function-level import of
    cli/main.py (the trainer, imported once the recipe is read)."""
    assert "trainer.train.loop" in graph()["cli.main"]


# Inside trainer/, the subpackages in the same way (each one's __init__ says what it owns).
TRAINER_LAYERS = ("outputs", "model", "data", "state", "hf", "evaluation", "train")


def test_trainer_subpackages_import_down_their_order():
    def rank(module: str) -> int:
        return TRAINER_LAYERS.index(module.split(".")[1])

    inside = {name: {target for target in targets if target.startswith("trainer.")}
              for name, targets in graph().items() if name.startswith("trainer.")}
    assert set(TRAINER_LAYERS) == {name.split(".")[1] for name in inside if name.count(".") >= 2}
    upward = [f"{source} -> {target}" for source, targets in inside.items()
              if source.count(".") >= 2 for target in targets
              if target.count(".") >= 2 and rank(target) > rank(source)]
    assert upward == []

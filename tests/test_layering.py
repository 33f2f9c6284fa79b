"""No module imports from a layer above its own (see ARCHITECTURE.md for the picture)."""

from __future__ import annotations

import ast
from pathlib import Path

import slipstream

# Lowest first. A module may import from its own layer and the layers below it.
LAYERS = [
    {
        "_version",
        "atomic",
        "errors",
        "extras",
        "fields",
        "refusal",
        "hardware",
        "modes",
        "host_reads",
        "noise",
        "data",
        "rewards",
        "reward_models",
        "utilisation",
    },  # shared helpers and errors, data (and online RL's reward functions and reward models), FLOPs
    {
        "packing",
        "moe",
        "offload",
        "loss",
        "lora",
        "compile",
        "fused",
    },  # the optimizations, each its own folder
    {"speedups", "optimize"},  # the toggles and the one function that applies them
    # model builders and loaders; the sampler that runs them for online RL and the other engines (vLLM); the parity kit (a fast arm
    # vs a reference, one training step: the sweep's and doctor's)
    {
        "models",
        "rollouts",
        "engines",
        "agents",
        "parity",
        "compat",
    },  # compat: the compatibility sweep, on the parity kit
    # the objectives: the plug-ins the loop calls (their rows, bins, step losses and evaluation)
    {"objectives"},
    {"train"},  # the training loop: set-up, the step, checkpoints, metrics
    {"export"},  # slipstream export: a run's adapter merged into its base model
    {"generation"},  # slipstream generate: text from a run's base model + adapter
    {"bench"},  # the A/B harness
    {"doctor"},  # slipstream doctor: the machine, each fast path's choice and its check
    {"cli", "__main__"},  # the command line
]
LAYER_OF = {name: index for index, names in enumerate(LAYERS) for name in names}
ROOT = Path(slipstream.__file__).parent


def _component(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return parts[0]


def _imported_components(path: Path) -> set[tuple[str, int]]:
    """Top-level slipstream components ``path`` imports (module level or inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = path.relative_to(ROOT).parent.parts
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [alias.name for alias in node.names] if not target else []
                component = target[0] if target else (names[0] if names else "")
            elif node.module and node.module.split(".")[0] == "slipstream":
                rest = node.module.split(".")[1:]
                component = rest[0] if rest else node.names[0].name
            else:
                continue
            found.add((component, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "slipstream" and len(parts) > 1:
                    found.add((parts[1], node.lineno))
    return found


def test_every_component_has_a_layer():
    components = {_component(p) for p in ROOT.rglob("*.py") if p.name != "__init__.py" or p.parent != ROOT}
    assert components - set(LAYER_OF) == set()


def test_no_import_runs_upward():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent == ROOT and path.name == "__init__.py":
            continue  # the package's public face may gather from every layer
        own = LAYER_OF[_component(path)]
        for component, line in _imported_components(path):
            if component in LAYER_OF and LAYER_OF[component] > own:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {component}")
    assert not upward, "\n".join(upward)


def test_the_walk_sees_relative_absolute_and_function_level_imports(tmp_path):
    """The check is only as good as its parser: it must see every form of import."""
    components = {c for c, _ in _imported_components(ROOT / "packing" / "batch.py")}
    assert "data" in components  # from ..data.labels import IGNORE_INDEX
    components = {c for c, _ in _imported_components(ROOT / "parity.py")}
    assert {"speedups", "packing"} <= components  # a top-level module's relative imports
    components = {c for c, _ in _imported_components(ROOT / "speedups" / "packed_attention.py")}
    assert {"packing", "loss"} <= components
    components = {c for c, _ in _imported_components(ROOT / "speedups" / "moe_routing.py")}
    assert "moe" in components
    components = {c for c, _ in _imported_components(ROOT / "train" / "driver.py")}
    assert "models" in components  # a function-level import (the QLoRA loader)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The slipstream modules ``path`` imports (module level or inside functions), as dotted names
    under ``slipstream`` ("bench.runner"); ``from .x import name`` counts ``x.name`` when that is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = list(path.relative_to(ROOT).parent.parts)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "slipstream":
                base = []
            else:
                continue
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            if node.module and node.module.split(".")[0] == "slipstream":
                module = ".".join(node.module.split(".")[1:])
            for alias in node.names:
                child = f"{module}.{alias.name}" if module else alias.name
                found.add(child if child in known else module)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "slipstream":
                    found.add(".".join(alias.name.split(".")[1:]))
    return {name for name in found if name in known} | {
        package for name in found if name in known for package in _packages_of(name) if package in known
    }


def _packages_of(module: str) -> list[str]:
    """The packages whose ``__init__`` Python runs before ``module`` ("a.b.c": "a", "a.b")."""
    parts = module.split(".")
    return [".".join(parts[:depth]) for depth in range(1, len(parts))]


def _module_graph() -> dict[str, set[str]]:
    """Module -> the modules importing it runs: those it names and, before them, their packages'
    ``__init__``s (importing ``objectives.base`` runs ``objectives/__init__`` first), except the
    packages the importer sits in (already running when it runs). The top-level
    ``slipstream/__init__`` gathers everything and is left out."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py") if p != ROOT / "__init__.py"}
    known = set(paths)

    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return {
        name: {target for target in _imported_modules(p, known) if not inside(name, target)}
        for name, p in paths.items()
    }


def test_the_graph_counts_the_packages_an_import_runs_first():
    """``from ..objectives.pairs import X`` in ``train/config.py`` runs ``objectives/__init__`` (which
    imports every objective) first: the cycle test is blind to such cycles without that edge."""
    assert _packages_of("objectives.base") == ["objectives"]
    assert _packages_of("bench.peers.trl_step") == ["bench", "bench.peers"]
    graph = _module_graph()
    assert {"objectives", "objectives.pairs"} <= graph["train.config"]
    assert "objectives" not in graph["objectives.sft"]  # its own package is already running


def test_no_import_circles_between_modules():
    """No module reaches itself through the modules it imports (package ``__init__``s counted, as
    :func:`_module_graph` says)."""
    graph = _module_graph()
    circles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                circles.append(" -> ".join([*trail[trail.index(target) :], target]))
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "\n".join(circles)

"""Refusals as data: the helpers, and every refusal's ``avoid`` agreeing with Speedups and its text."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import re
from pathlib import Path

import slipstream
from slipstream.refusal import Refusal, avoid_of, optimize_call, refusal_in
from slipstream.speedups import Speedups

ROOT = Path(slipstream.__file__).parent
# Modules that import an optional extra at their top (skipped only when the extra is missing).
OPTIONAL = {"slipstream.bench.peers.unsloth_worker"}
# Non-refusal raises whose message names an optimize option (none: the padding guard's are refusals).
KNOWN_NON_REFUSALS: set[tuple[str, str]] = set()


class Refused(Refusal, NotImplementedError):
    avoid = {"chunked_loss": False}


def test_a_refusal_says_its_way_out_as_config_lines_and_a_python_call():
    error = Refused("the loss cannot be chunked")
    assert str(error) == "the loss cannot be chunked"
    assert error.refused == "Refused"
    assert error.config_lines() == ["speedups.chunked_loss: false"]
    assert error.python_call() == "slipstream.optimize(model, chunked_loss=False)"
    assert isinstance(error, NotImplementedError)  # existing except clauses still catch it


def test_a_raise_site_may_name_another_way_out_or_none():
    error = Refused("x", refused="Gemma's softcapping", avoid={"moe_routing": "stock", "checkpointing": None})
    assert error.refused == "Gemma's softcapping"
    assert error.config_lines() == ["speedups.moe_routing: stock", "speedups.checkpointing: null"]
    assert error.python_call() == "slipstream.optimize(model, moe_routing='stock', checkpointing=None)"
    assert Refused.avoid == {"chunked_loss": False}  # the class default is untouched
    nothing = Refused("x", avoid=None)
    assert nothing.config_lines() == [] and nothing.python_call() is None
    assert optimize_call(None) is None and optimize_call({}) is None


def test_the_refusal_is_found_along_the_cause_chain():
    refusal = Refused("inner")
    assert refusal_in(refusal) is refusal
    try:
        try:
            raise refusal
        except Refused as inner:
            raise RuntimeError("outer") from inner
    except RuntimeError as outer:
        assert refusal_in(outer) is refusal
        assert avoid_of(outer) == {"chunked_loss": False}
        avoid_of(outer)["chunked_loss"] = True  # a copy
        assert refusal.avoid == {"chunked_loss": False}
    context = ValueError("while handling")
    context.__context__ = refusal
    assert refusal_in(context) is refusal
    assert refusal_in(ValueError("no refusal")) is None and refusal_in(None) is None
    assert avoid_of(Refused("x", avoid=None)) is None
    loop = ValueError("a")
    loop.__cause__ = ValueError("b")
    loop.__cause__.__cause__ = loop
    assert refusal_in(loop) is None  # a cycle ends the walk


# ---------------------------------------------------------------- every refusal slipstream defines


def _import_everything() -> None:
    for module in pkgutil.walk_packages([str(ROOT)], prefix="slipstream."):
        if module.name.endswith("__main__"):
            continue  # runs the CLI
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError:
            if module.name not in OPTIONAL:
                raise


def _refusal_classes() -> dict[str, type[Refusal]]:
    _import_everything()
    found, todo = {}, [Refusal]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("slipstream."):
                assert found.setdefault(sub.__name__, sub) is sub, f"two refusals named {sub.__name__}"
    return found


def test_every_refusal_names_speedups_fields_it_can_set():
    classes = _refusal_classes()
    assert {
        "UnsupportedArchitecture",
        "UnsupportedLoss",
        "UnsupportedExperts",
        "FusedKernelsUnavailable",
    } <= set(classes)
    fields = {f.name for f in dataclasses.fields(Speedups)}
    for name, cls in classes.items():
        stdlib = [b for b in cls.__mro__ if issubclass(b, Exception) and b is not Exception]
        assert any(not issubclass(b, Refusal) for b in stdlib), f"{name}: no stdlib base beside Refusal"
        if cls.avoid is None:
            continue
        assert cls.avoid and set(cls.avoid) <= fields, f"{name}.avoid {cls.avoid} is not Speedups fields"
        Speedups(**cls.avoid)  # and values those fields accept


# ---------------------------------------------------------------- raise sites: text and data agree

_CALL = re.compile(r"optimize\(model, ([^)]*)\)")
_UNKNOWN = "\x00"


class _Module:
    """One source file: its module-level assignments and the names it imports (to follow them)."""

    def __init__(self, path: Path, source: str | None = None):
        self.path = path
        self.tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
        self.assigned: dict[str, ast.expr] = {}
        self.imported: dict[str, tuple[Path, str]] = {}
        package = path.parent
        for node in self.tree.body:
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                self.assigned[node.targets[0].id] = node.value
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.parent
                target = base.joinpath(*(node.module or "").split(".")) if node.module else base
                file = target / "__init__.py" if target.is_dir() else target.with_suffix(".py")
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (file, alias.name)


class _Scanner:
    def __init__(self, classes: dict[str, type[Refusal]]):
        self.classes = classes
        self.modules: dict[Path, _Module] = {}

    def module(self, path: Path) -> _Module:
        if path not in self.modules:
            self.modules[path] = _Module(path)
        return self.modules[path]

    def _constant(self, module: _Module, name: str) -> tuple[_Module, ast.expr] | None:
        if name in module.assigned:
            return module, module.assigned[name]
        if name in module.imported:
            file, original = module.imported[name]
            if file.exists():
                return self._constant(self.module(file), original)
        return None

    def avoid(self, module: _Module, node: ast.expr):
        """The dict (or None) an ``avoid=`` expression / ``optimize_call`` argument stands for."""
        if isinstance(node, ast.Attribute) and node.attr == "avoid" and isinstance(node.value, ast.Name):
            return self.classes[node.value.id].avoid
        if isinstance(node, ast.Name) and (found := self._constant(module, node.id)) is not None:
            return self.avoid(*found)
        return ast.literal_eval(node)

    def text(self, module: _Module, node: ast.expr) -> str:
        """The message's text, each part it cannot know ahead of the raise as ``_UNKNOWN``."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(self.text(module, part) for part in node.values)
        if isinstance(node, ast.FormattedValue):
            return self.text(module, node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.text(module, node.left) + self.text(module, node.right)
        if isinstance(node, ast.Name) and (found := self._constant(module, node.id)) is not None:
            return self.text(*found)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "optimize_call":
            return optimize_call(self.avoid(module, node.args[0])) or ""
        return _UNKNOWN

    def raises(self, module: _Module):
        """(line, exception class name, message text, the avoid= node or None) of every raise."""
        for node in ast.walk(module.tree):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            message = self.text(module, node.exc.args[0]) if node.exc.args else ""
            avoid = next((k.value for k in node.exc.keywords if k.arg == "avoid"), None)
            yield node.lineno, name, message, avoid

    def mismatches(self, module: _Module) -> tuple[list[str], int]:
        """What disagrees in ``module``, and how many refusal messages naming a way out agreed."""
        problems, agreed = [], 0
        where = module.path.relative_to(ROOT) if module.path.is_relative_to(ROOT) else module.path
        for line, name, message, avoid_node in self.raises(module):
            named = _CALL.findall(message)
            if name not in self.classes:
                if named and (str(where), name) not in KNOWN_NON_REFUSALS:
                    problems.append(f"{where}:{line}: a {name} names optimize({named[0]}): make it a Refusal")
                continue
            avoid = self.classes[name].avoid if avoid_node is None else self.avoid(module, avoid_node)
            for options in named:
                if _UNKNOWN in options:
                    problems.append(f"{where}:{line}: the option named cannot be read ahead of the raise")
                    continue
                call = ast.parse(f"f({options})", mode="eval").body
                said = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
                if said != (avoid or {}):
                    problems.append(
                        f"{where}:{line}: {name} says optimize(model, {options}) but avoids {avoid}"
                    )
                else:
                    agreed += 1
        return problems, agreed


def test_every_raise_site_names_the_option_its_avoid_holds():
    scanner = _Scanner(_refusal_classes())
    problems, agreed = [], 0
    for path in sorted(ROOT.rglob("*.py")):
        found, count = scanner.mismatches(scanner.module(path))
        problems += found
        agreed += count
    assert not problems, "\n".join(problems)
    assert agreed >= 30  # the scan read the messages (packing, loss, moe, offload, fused, optimize)


def test_the_scan_catches_text_that_drifted_from_the_data(tmp_path):
    scanner = _Scanner(_refusal_classes())
    source = """
from slipstream.refusal import optimize_call
STOCK = {"moe_routing": "stock"}
def f():
    raise UnsupportedLoss("Use slipstream.optimize(model, chunked_loss=False).")
def g():
    raise UnsupportedLoss("Use slipstream.optimize(model, packed_attention=False).")
def h():
    raise UnsupportedExperts(f"Use {optimize_call(STOCK)}", avoid={"moe_routing": "sorted"})
def i():
    raise ValueError("Use slipstream.optimize(model, chunked_loss=False)")
"""
    path = tmp_path / "drifted.py"
    problems, agreed = scanner.mismatches(_Module(path, source))
    assert agreed == 1
    assert [p.split(": ", 1)[0].rsplit(":", 1)[1] for p in problems] == ["7", "9", "11"]
    assert "avoids {'chunked_loss': False}" in problems[0] and "make it a Refusal" in problems[2]

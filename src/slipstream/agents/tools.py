"""``grpo.tools`` and ``grpo.environment``: what a trajectory may call, as TRL 1.16's GRPOTrainer takes it.

TRL's convention, kept exactly:

- ``tools=[functions]``: plain Python functions (sync or ``async``) with type hints and a docstring whose
  ``Args:`` describe each parameter; the chat template renders them into the prompt from the JSON schema
  transformers derives (``get_json_schema``), and the model calls them by name with keyword arguments.
- ``environment_factory=Class``: one instance per rollout; its public methods other than ``reset`` and
  ``get_reward`` are tools too; ``reset(**row)`` is called before the rollout's first turn with the row's
  fields, and the text it returns (if any) is appended to the last user message; ``get_reward()``, where the
  class defines it, scores the finished rollout as one more reward (weight 1, named after the class).
- A tool that raises returns ``{"error": "<message>"}`` to the model (as text) and counts as a failure; the
  rollout goes on. So does a tool not in the set.

Beyond TRL: a call that runs longer than ``grpo.tool_timeout_s`` is answered with
``{"error": "timed out after N s"}`` (a failure) and the rollout goes on; the call's thread is left to
finish in the background (Python cannot stop a thread), so a tool that can hang should hold no lock the
next call needs. A result whose ``str()`` raises is an error result the same way. Whatever is wrong with a
tool file or environment class (missing, not callable, no docstring or type hints for its schema, two tools
of one name, no ``reset``) is one line at start, before anything is written.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..rewards import RewardError, import_source


class ToolError(ValueError):
    """A tool or environment that cannot be used; the message names the key and the file."""


def _load(spec: Any, base: Path | None, key: str) -> tuple[Any, str]:
    if not isinstance(spec, str) or ":" not in spec:
        raise ToolError(f"'{key}' entries are 'file.py:name' or 'module:name', got {spec!r}")
    module, _, attribute = spec.rpartition(":")
    try:
        found = getattr(import_source(module, base, "tool"), attribute, None)
    except RewardError as error:
        raise ToolError(f"'{key}': {error}") from None
    if found is None:
        raise ToolError(f"'{key}': {module} has no {attribute!r}")
    return found, spec


def _schema(fn: Callable, where: str) -> dict:
    """The JSON schema the chat template renders for ``fn`` (transformers' own derivation)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except (
        Exception
    ) as error:  # transformers raises its own TypeHintParsingException / DocstringParsingException
        raise ToolError(
            f"{where}: {' '.join(str(error).split())} (a tool needs type hints and a docstring whose Args: "
            "describe each parameter, as TRL's tools do)"
        ) from None


def _methods(cls: type) -> list[str]:
    """An environment's tools: its public functions other than ``reset`` and ``get_reward`` (TRL lists them
    on the class, so properties are not evaluated)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


@dataclass
class ToolSet:
    """The configured tools and environment class, checked; ``open()`` makes one rollout's :class:`Toolbox`."""

    functions: list[Callable] = field(default_factory=list)
    environment: type | None = None
    timeout_s: float = 30.0
    described: str = ""  # what was configured, for the policy line

    @classmethod
    def load(
        cls,
        tools: Sequence[str],
        environment: str | None,
        base: Path | None,
        timeout_s: float,
    ) -> ToolSet:
        functions = []
        for index, spec in enumerate(tools):
            fn, where = _load(spec, base, f"grpo.tools[{index}]")
            if not callable(fn) or inspect.isclass(fn):
                raise ToolError(f"'grpo.tools[{index}]': {where} is not a function")
            _schema(fn, f"'grpo.tools[{index}]' {where}")
            functions.append(fn)
        env_class = None
        if environment is not None:
            env_class, where = _load(environment, base, "grpo.environment")
            if not inspect.isclass(env_class):
                raise ToolError(f"'grpo.environment': {where} is not a class")
            if not callable(getattr(env_class, "reset", None)):
                raise ToolError(f"'grpo.environment': {where} defines no reset() (TRL's environments must)")
            try:
                probe = env_class()
            except Exception as error:
                raise ToolError(
                    f"'grpo.environment': {where}() raised {type(error).__name__}: {error} (it is made with no "
                    "arguments, one instance per rollout)"
                ) from None
            for name in _methods(env_class):
                _schema(getattr(probe, name), f"'grpo.environment' {where}.{name}")
        names = [fn.__name__ for fn in functions] + (_methods(env_class) if env_class else [])
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ToolError(
                f"'grpo.tools': two tools named {', '.join(twice)} (a model calls a tool by its name)"
            )
        if not names:
            raise ToolError("'grpo.environment': the class has no public method for the model to call")
        described = ", ".join(names)
        return cls(functions, env_class, timeout_s, described)

    @property
    def rewards_itself(self) -> bool:
        """The environment scores its rollouts (``get_reward``): one more reward, as TRL adds it."""
        return self.environment is not None and callable(getattr(self.environment, "get_reward", None))

    def schema_tools(self) -> list[Callable]:
        """What the chat template is given as ``tools``: the functions, then the environment's methods (of a
        throwaway instance: the schema reads names, hints and docstrings only)."""
        tools = list(self.functions)
        if self.environment is not None:
            probe = self.environment()
            tools += [getattr(probe, name) for name in _methods(self.environment)]
        return tools

    def open(self, row: dict) -> tuple[Toolbox, str | None]:
        """One rollout's toolbox (its own environment instance) and what ``reset(**row)`` returned."""
        instance = None
        observation = None
        calls: dict[str, Callable] = {fn.__name__: fn for fn in self.functions}
        if self.environment is not None:
            instance = self.environment()
            observation = instance.reset(**row)
            if observation is not None and not isinstance(observation, str):
                raise ToolError(
                    f"'grpo.environment': {self.environment.__name__}.reset() returned "
                    f"{type(observation).__name__}; it must return text to append to the prompt, or None"
                )
            calls.update({name: getattr(instance, name) for name in _methods(self.environment)})
        return Toolbox(calls, self.timeout_s, instance), observation


@dataclass
class ToolResult:
    name: str
    content: str  # what the model reads, rendered as the template's tool message
    failed: bool
    seconds: float


@dataclass
class Toolbox:
    """One rollout's tools: called by name with keyword arguments, each call under the timeout."""

    calls: dict[str, Callable]
    timeout_s: float
    environment: Any = None

    def call(self, name: str, arguments: Any) -> ToolResult:
        began = time.perf_counter()
        fn = self.calls.get(name)
        if fn is None:
            return ToolResult(name, str({"error": f"Tool {name} not found."}), True, 0.0)
        if not isinstance(arguments, dict):
            return ToolResult(
                name, str({"error": f"arguments must be an object, got {arguments!r}"}), True, 0.0
            )
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                value = fn(**arguments)
                if inspect.isawaitable(value):
                    value = asyncio.run(_awaited(value))
                outcome["value"] = value
            except BaseException as error:  # a user's tool: whatever it raised goes back to the model
                outcome["error"] = error

        worker = threading.Thread(target=run, name=f"tool-{name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        seconds = time.perf_counter() - began
        if worker.is_alive():
            return ToolResult(name, str({"error": f"timed out after {self.timeout_s:g} s"}), True, seconds)
        if "error" in outcome:
            return ToolResult(name, str({"error": str(outcome["error"])}), True, seconds)
        try:
            content = str(outcome["value"])
        except Exception as error:
            return ToolResult(name, str({"error": f"the result cannot be printed: {error}"}), True, seconds)
        return ToolResult(name, content, False, seconds)


async def _awaited(value):
    return await value

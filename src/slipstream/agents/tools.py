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
- A turn's calls run as TRL runs them: the sync tools one after another in the trainer's own thread (a tool
  may use ``signal``, as TRL's own agent example does), then the async tools concurrently; the results
  follow in that order. A list result goes to the template as it is; anything else as ``str(result)``.

Beyond TRL: a call that runs longer than ``grpo.tool_timeout_s`` is answered with
``{"error": "timed out after N s"}`` (a failure) and the rollout goes on. A sync tool is interrupted by a
signal (SIGUSR2) sent to its thread, which breaks sleeps and blocking reads; one stuck inside a C call
returns when that call does, and is still answered as timed out. Off the main thread (no signals there)
the call runs in a worker thread that is left to finish in the background. A result that cannot be
printed is an error result the same way. Whatever is wrong with a tool file or environment class
(missing, not callable, no docstring or type hints for its schema, two tools of one name, no ``reset``)
is one line at start, before anything is written.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
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
    # transformers raises its own TypeHintParsingException / DocstringParsingException
    except Exception as error:
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
    content: str | list  # what the model reads: the result as text (a list as returned: TRL's rule)
    failed: bool
    seconds: float


def _error(name: str, message: str, seconds: float = 0.0) -> ToolResult:
    return ToolResult(name, str({"error": message}), True, seconds)


def _content(name: str, value: Any, seconds: float) -> ToolResult:
    """TRL's rendering of a result: a list goes to the template as it is (content blocks, or rows), anything
    else as ``str(value)``; a result that cannot be printed is an error (beyond TRL, which would crash)."""
    try:
        text = str(value)
    except Exception as error:
        return _error(name, f"the result cannot be printed: {error}", seconds)
    return ToolResult(name, value if isinstance(value, list) else text, False, seconds)


class _ToolTimeout(BaseException):
    """Raised in the calling thread when a sync tool overruns its time (a BaseException: the tool's own
    ``except Exception`` does not swallow it)."""


def _call_in_this_thread(fn: Callable, arguments: dict, timeout_s: float) -> Any:
    """``fn(**arguments)`` in the caller's thread, as TRL calls a sync tool: a tool may use ``signal``
    (TRL's own agent example times its query with ``signal.alarm``) or thread-local state. A watchdog
    thread sends the main thread a real signal (SIGUSR2: it interrupts sleeps and blocking reads, and
    leaves the tool's own SIGALRM alone) when the call overruns; its handler raises :class:`_ToolTimeout`."""
    lock, done, fired, handled = threading.Lock(), threading.Event(), threading.Event(), threading.Event()
    main = threading.main_thread().ident

    def on_signal(signum, frame):
        handled.set()
        if fired.is_set():
            raise _ToolTimeout

    def watchdog():
        if done.wait(timeout_s):
            return
        with lock:
            if not done.is_set():
                fired.set()
                signal.pthread_kill(main, signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, on_signal)
    watcher = threading.Thread(target=watchdog, name="tool-watchdog", daemon=True)
    try:
        watcher.start()
        try:
            value = fn(**arguments)
        finally:
            with lock:
                done.set()
            while fired.is_set() and not handled.is_set():  # the signal is on its way: take it here
                time.sleep(0.001)
        if fired.is_set():  # overran, though the tool swallowed the interruption: timed out all the same
            raise _ToolTimeout
        return value
    finally:
        signal.signal(signal.SIGUSR2, previous)
        watcher.join()


def _call_in_a_thread(fn: Callable, arguments: dict, timeout_s: float) -> Any:
    """Off the main thread (no signals there): ``fn`` in a worker thread, abandoned when it overruns."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn(**arguments)
        except Exception as error:
            outcome["error"] = error

    worker = threading.Thread(target=run, name="tool", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _ToolTimeout
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@dataclass
class Toolbox:
    """One rollout's tools: a turn's calls run as TRL runs them, each under the timeout."""

    calls: dict[str, Callable]
    timeout_s: float
    environment: Any = None

    def call(self, name: str, arguments: Any) -> ToolResult:
        """One call (a turn of one call)."""
        (result,) = self.call_turn([(name, arguments)])
        return result

    def call_turn(self, calls: Sequence[tuple[str, Any]]) -> list[ToolResult]:
        """A turn's calls, ``(name, arguments)`` each, answered in TRL's order: the sync tools' results (and
        every call that failed at once: an unknown tool, bad arguments) in the order called, then the async
        tools' results, which run concurrently. A call that raises or overruns is answered ``{'error': ...}``.
        """
        results: list[ToolResult] = []
        pending: list[tuple[str, Any]] = []  # (name, coroutine)
        for name, arguments in calls:
            fn = self.calls.get(name)
            began = time.perf_counter()
            try:
                if fn is None:
                    raise ValueError(f"Tool {name} not found.")
                if not isinstance(arguments, dict):
                    raise ValueError(f"arguments must be an object, got {arguments!r}")
                if inspect.iscoroutinefunction(fn):
                    pending.append((name, fn(**arguments)))
                    continue
                value = self._run_sync(fn, arguments)
            except _ToolTimeout:
                results.append(
                    _error(name, f"timed out after {self.timeout_s:g} s", time.perf_counter() - began)
                )
                continue
            except Exception as error:  # a user's tool: what it raised goes back to the model
                results.append(_error(name, str(error), time.perf_counter() - began))
                continue
            results.append(_content(name, value, time.perf_counter() - began))
        if pending:
            results += asyncio.run(self._gather(pending))
        return results

    def _run_sync(self, fn: Callable, arguments: dict) -> Any:
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_kill"):
            return _call_in_this_thread(fn, arguments, self.timeout_s)
        return _call_in_a_thread(fn, arguments, self.timeout_s)

    async def _gather(self, pending: list[tuple[str, Any]]) -> list[ToolResult]:
        """The async calls of a turn, concurrently (TRL gathers them), each under the timeout."""

        async def one(name: str, coroutine) -> ToolResult:
            began = time.perf_counter()
            try:
                value = await asyncio.wait_for(coroutine, self.timeout_s)
            except TimeoutError:
                return _error(name, f"timed out after {self.timeout_s:g} s", time.perf_counter() - began)
            except Exception as error:
                return _error(name, str(error), time.perf_counter() - began)
            return _content(name, value, time.perf_counter() - began)

        return list(await asyncio.gather(*(one(name, coroutine) for name, coroutine in pending)))

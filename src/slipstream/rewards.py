"""Reward functions for online RL (``training.objective: grpo``): named in the config, called in
TRL's convention, and checked before a single value is used.

A reward function is called as TRL's ``GRPOTrainer`` calls it (TRL 1.16, ``_calculate_rewards``),
every argument by keyword: ``f(prompts=..., completions=..., completion_ids=..., **columns,
trainer_state=..., log_extra=..., log_metric=...) -> list[float | None]``, so a reward file written
for TRL works unchanged (``def reward(completions, **kwargs)`` included), and an ``async def`` one
is awaited, every async function of a step concurrently. One value per completion, in order;
``prompts[i]`` is the prompt completion i answers (a string, or the message list when the row's
prompt was one, in which case ``completions[i]`` is ``[{"role": "assistant", "content": text}]``);
every other column of the prompt rows comes as a keyword argument holding one value per completion;
``trainer_state`` is a ``transformers.TrainerState`` whose ``global_step`` is the optimizer steps
done and ``max_steps`` the run's; ``log_metric(name, value)`` adds a metric to the step's record
(the mean of its values); ``log_extra(column, values)`` (one value a completion) is kept with the held-out
completions in ``samples.jsonl`` (training steps' completions are not written). None
means "does not apply to this completion": it is left out of that function's mean and adds 0 to the
weighted sum (TRL's ``nansum``).

A function is named ``module:function`` (``grpo.rewards``): a ``.py`` file next to the config
(``rewards.py:correct``) or an importable module (``my_pkg.rewards:correct``), or a built-in by its
bare name (:data:`BUILTINS`), each with a ``weight`` and ``args`` bound as keyword arguments.

What a function does wrong stops the run with one line that names it (:class:`RewardError`):
it raised, returned something that is not a list of the completions' length, or a value that is
neither a finite number nor None.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .reward_models import SequenceClassifierReward, is_reward_model_dir


class RewardError(ValueError):
    """A reward function could not be loaded or returned what cannot be used; the message names it."""


def _text(completion: Any) -> str:
    """A completion's text: the string itself, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


_TAGS: dict[str, re.Pattern] = {}


def tagged(text: str, tag: str) -> str | None:
    """The text inside the last ``<tag>...</tag>`` of ``text`` (stripped), or None."""
    pattern = _TAGS.setdefault(tag, re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL))
    found = pattern.findall(text)
    return found[-1].strip() if found else None


def _same_answer(given: str, expected: Any) -> bool:
    """Equal as numbers where both read as one (``42`` = ``42.0``), else as stripped strings."""
    expected = str(expected).strip()
    try:
        return math.isclose(float(given.replace(",", "")), float(expected.replace(",", "")), rel_tol=1e-9)
    except ValueError:
        return given == expected


def answer_tag(
    prompts, completions, completion_ids=None, *, tag: str = "answer", column: str = "answer", **columns
):
    """1.0 where the last ``<tag>...</tag>`` of the completion equals the row's ``column`` value, else 0.0."""
    if column not in columns:
        names = sorted(set(columns) - set(TRL_KEYWORDS))
        raise KeyError(f"the prompt rows have no column {column!r} (columns: {', '.join(names) or 'none'})")
    out = []
    for completion, expected in zip(completions, columns[column], strict=True):
        found = tagged(_text(completion), tag)
        out.append(1.0 if found is not None and _same_answer(found, expected) else 0.0)
    return out


def format_regex(prompts, completions, completion_ids=None, *, pattern: str, **columns):
    """1.0 where the whole completion (stripped) matches ``pattern`` (``re.DOTALL``), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.fullmatch(_text(c).strip()) else 0.0 for c in completions]


def length_penalty(prompts, completions, completion_ids, *, limit: int, **columns):
    """``-(tokens over limit) / limit``: 0 for a completion of at most ``limit`` tokens."""
    if limit <= 0:
        raise ValueError(f"length_penalty: limit must be > 0, got {limit}")
    return [-max(0, len(ids) - limit) / limit for ids in completion_ids]


# The built-in rewards, named without a module.
BUILTINS: dict[str, Callable] = {
    "answer_tag": answer_tag,
    "format_regex": format_regex,
    "length_penalty": length_penalty,
}


# What TRL hands every reward function beside the completions and the rows' columns.
TRL_KEYWORDS = ("trainer_state", "log_extra", "log_metric")
_CALL_KEYWORDS = ("prompts", "completions", "completion_ids", *TRL_KEYWORDS)


@dataclass
class RewardCall:
    """One scoring's ``trainer_state`` and what the functions logged through ``log_metric`` / ``log_extra``."""

    step: int = 0  # optimizer steps done (``trainer_state.global_step``)
    max_steps: int = 0
    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(column, []).extend(values)

    @functools.cached_property
    def trainer_state(self) -> Any:
        """One state for every function of the scoring, as TRL hands its own to each."""
        from transformers import TrainerState  # TRL's own state type: a function may read any of its fields

        return TrainerState(global_step=self.step, max_steps=self.max_steps)

    def keywords(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in TRL_KEYWORDS}

    def metric_means(self) -> dict[str, float]:
        return {name: sum(values) / len(values) for name, values in self.metrics.items() if values}


@dataclass
class RewardFunction:
    """One configured reward: what the config named it, the function (its ``args`` bound), its weight."""

    name: str  # the function's own name (metrics: ``reward_<name>``)
    fn: Callable
    weight: float = 1.0
    source: str = ""  # where it came from, as the config named it (a file's path made absolute)

    @property
    def described(self) -> str:
        return self.name if self.source in ("", self.name) else f"{self.name} ({self.source})"

    def __call__(
        self, prompts, completions, completion_ids, columns: dict[str, list], call: RewardCall | None = None
    ) -> list[float]:
        """The function's values, checked: one per completion, each finite (None read as NaN: left out)."""
        return [values[0] for values in score([self], prompts, completions, completion_ids, columns, call)]

    def start(self, prompts, completions, completion_ids, columns: dict[str, list], call: RewardCall) -> Any:
        """The function called in TRL's convention: its values, or its coroutine (an async function)."""
        try:
            return self.fn(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                **columns,
                **call.keywords(),
            )
        except Exception as error:  # a user's function: whatever it raised, named with it
            raise RewardError(f"reward {self.described} raised {type(error).__name__}: {error}") from error

    async def finish(self, pending: Any) -> Any:
        try:
            return await pending
        except Exception as error:
            raise RewardError(f"reward {self.described} raised {type(error).__name__}: {error}") from error

    def check(self, values: Any, count: int) -> list[float]:
        """One finite float per completion (a None read as NaN), or a RewardError naming the function."""
        if not isinstance(values, (list, tuple)) and not hasattr(values, "tolist"):
            raise RewardError(
                f"reward {self.described} returned {type(values).__name__}; it must return a list of "
                f"{count} numbers (None where it does not apply)"
            )
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        if len(values) != count:
            raise RewardError(
                f"reward {self.described} returned {len(values)} values for {count} completions"
            )
        out = []
        for index, value in enumerate(values):
            if value is None:
                out.append(math.nan)
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardError(
                    f"reward {self.described} returned {value!r} for completion {index}: a reward must be a "
                    "finite number, or None where it does not apply"
                )
            out.append(float(value))
        return out


def import_source(module: str, base: Path | None, what: str = "reward") -> Any:
    """A module by file (``x.py``, or ``x`` with ``x.py`` next to the config) or by import name."""
    path = None
    if module.endswith(".py"):
        path = Path(module) if base is None else base / module
    elif base is not None and "." not in module:
        path = base / f"{module}.py"
    if path is not None and path.is_file():
        name = f"slipstream_rewards_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        try:
            spec.loader.exec_module(loaded)
        except Exception as error:
            del sys.modules[name]
            raise RewardError(f"{path}: importing it raised {type(error).__name__}: {error}") from error
        return loaded
    if module.endswith(".py"):
        raise RewardError(f"{path}: no such {what} file")
    try:
        return importlib.import_module(module)
    except Exception as error:
        raise RewardError(f"cannot import {module!r} ({type(error).__name__}: {error})") from error


def _check_args(fn: Callable, args: dict, name: str, key: str, builtin: bool) -> None:
    """``args`` must fit ``fn``: every keyword a built-in takes is known and its required ones given;
    a user's function is checked as far as its signature says."""
    signature = inspect.signature(fn)
    if builtin:
        options = {
            p.name: p for p in signature.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
        }
        unknown = sorted(set(args) - set(options))
        if unknown:
            raise RewardError(
                f"'{key}.args' do not fit {name}: unknown {', '.join(unknown)} (it takes {', '.join(options)})"
            )
        missing = [n for n, p in options.items() if p.default is inspect.Parameter.empty and n not in args]
        if missing:
            raise RewardError(f"'{key}.args' do not fit {name}: it needs {', '.join(missing)}")
        return
    try:
        signature.bind_partial(**args)
    except TypeError as error:
        raise RewardError(f"'{key}.args' do not fit {name}: {error}") from None
    parameters = signature.parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        positional_only = inspect.Parameter.POSITIONAL_ONLY
        refused = [k for k in _CALL_KEYWORDS if k not in parameters or parameters[k].kind is positional_only]
        if refused:
            raise RewardError(
                f"'{key}': {name} takes neither {', '.join(refused)} nor **kwargs; a reward function is called "
                f"as TRL calls it, with {', '.join(_CALL_KEYWORDS)} and the rows' columns as keywords"
            )


def load_reward(spec: Any, base: Path | None = None, key: str = "grpo.rewards") -> RewardFunction:
    """One ``grpo.rewards`` entry: ``"module:function"`` / a built-in's name, or a mapping
    ``{function, weight, args}``; ``base`` is the config's directory (reward files are found next to it)."""
    if isinstance(spec, str):
        spec = {"function": spec}
    if not isinstance(spec, dict):
        raise RewardError(f"'{key}' must be 'module:function' or a mapping with 'function', got {spec!r}")
    unknown = set(spec) - {"function", "weight", "args"}
    if unknown:
        raise RewardError(
            f"'{key}': unknown key(s) {', '.join(sorted(unknown))} (valid: function, weight, args)"
        )
    name = spec.get("function")
    if not isinstance(name, str) or not name.strip():
        raise RewardError(
            f"'{key}.function' must name a reward: 'module:function' or one of {', '.join(BUILTINS)}"
        )
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise RewardError(f"'{key}.weight' must be a finite number, got {weight!r}")
    args = spec.get("args") or {}
    if not isinstance(args, dict):
        raise RewardError(f"'{key}.args' must be a mapping of keyword arguments, got {args!r}")
    if ":" in name:
        module, _, attribute = name.rpartition(":")
        fn = getattr(import_source(module, base), attribute, None)
        if fn is None or not callable(fn):
            raise RewardError(f"'{key}.function': {module!r} has no function {attribute!r}")
    elif name in BUILTINS:
        fn = BUILTINS[name]
    elif is_reward_model_dir(directory := Path(name) if base is None else base / name):
        if args:
            raise RewardError(f"'{key}.args': a reward model ({name}) takes none")
        try:
            scorer = SequenceClassifierReward(directory, f"{key}.function")
        except ValueError as error:
            raise RewardError(str(error)) from None
        return RewardFunction(name=directory.name, fn=scorer, weight=float(weight), source=name)
    else:
        raise RewardError(
            f"'{key}.function': {name!r} is neither 'module:function', a built-in ({', '.join(BUILTINS)}) "
            "nor a reward model directory"
        )
    _check_args(fn, args, name, key, builtin=name in BUILTINS)
    bound = functools.partial(fn, **args) if args else fn
    short = name.rpartition(":")[2]
    return RewardFunction(name=short, fn=bound, weight=float(weight), source=name)


def load_rewards(specs: Sequence[Any], base: Path | None = None) -> list[RewardFunction]:
    """Every ``grpo.rewards`` entry loaded (errors name ``grpo.rewards[i]``); a name used twice gets
    ``_2``, ``_3``, ... (each function's metrics keep their own key)."""
    functions = [load_reward(spec, base, f"grpo.rewards[{index}]") for index, spec in enumerate(specs)]
    seen: dict[str, int] = {}
    for function in functions:
        seen[function.name] = seen.get(function.name, 0) + 1
        if seen[function.name] > 1:
            function.name = f"{function.name}_{seen[function.name]}"
    return functions


def score(
    functions: Sequence[RewardFunction],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    call: RewardCall | None = None,
) -> list[list[float]]:
    """``[completions][functions]``: every function's checked values (NaN where it returned None);
    the async functions awaited together, as TRL gathers them."""
    call = call or RewardCall()
    outputs = [fn.start(prompts, completions, completion_ids, columns, call) for fn in functions]
    pending = [i for i, out in enumerate(outputs) if inspect.isawaitable(out)]
    if pending:

        async def gather():
            return await asyncio.gather(*(functions[i].finish(outputs[i]) for i in pending))

        for index, values in zip(pending, asyncio.run(gather()), strict=True):
            outputs[index] = values
    per_function = [fn.check(out, len(completions)) for fn, out in zip(functions, outputs, strict=True)]
    return [list(values) for values in zip(*per_function, strict=True)]


def weighted(values: Sequence[float], functions: Sequence[RewardFunction]) -> float:
    """One completion's reward: the weighted sum of its functions' values, a None (NaN) adding 0."""
    return sum(v * fn.weight for v, fn in zip(values, functions, strict=True) if not math.isnan(v))

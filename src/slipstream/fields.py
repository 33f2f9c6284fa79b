"""Typed fields: the rules a value must follow, declared on its annotation, checked in one place.

A field's annotation says everything: its type, its choices (``Literal``) and its range
(``Annotated[int, Range(ge=1)]``). :func:`coerce` reads a value as such an annotation (numbers
written ``1e-4`` included, which YAML 1.1 leaves as strings) and raises :class:`ConfigError`
naming the key. The training config, the A/B config and :class:`slipstream.Speedups` all use
it, so a rule is written once and an option is one typed field.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal


class ConfigError(ValueError):
    """A config problem; the message names the file (where there is one) and the key."""


_HOLDS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


@dataclass(frozen=True)
class Range:
    """Bounds a number (or every number of a list) must lie within."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def violation(self, value: float) -> str | None:
        for bound, symbol in ((self.ge, ">="), (self.gt, ">"), (self.le, "<="), (self.lt, "<")):
            if bound is not None and not _HOLDS[symbol](value, bound):
                return f"must be {symbol} {bound:g}"
        return None


@dataclass(frozen=True)
class Length:
    """How many items a list must hold."""

    exactly: int


Positive = Annotated[int, Range(ge=1)]
NonNegative = Annotated[int, Range(ge=0)]
# The precisions, listed once: a run's (ab) and, with "auto", a training config's.
Precision = Literal["float32", "bfloat16", "float16"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # Precision and "auto" (test_fields checks)


_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def coerce(value: Any, expected: Any, key: str, where: str) -> Any:
    """``value`` read as ``expected`` (a type, Literal, Optional or Annotated with rules)."""
    origin = typing.get_origin(expected)
    if origin is Annotated:
        inner, *rules = typing.get_args(expected)
        value = coerce(value, inner, key, where)
        for rule in rules:
            if isinstance(rule, Length) and len(value) != rule.exactly:
                raise ConfigError(f"{where}: '{key}' must hold {rule.exactly} numbers, got {len(value)}")
            if isinstance(rule, Range):
                for number in value if isinstance(value, list) else [value]:
                    problem = rule.violation(number)
                    if problem:
                        raise ConfigError(f"{where}: '{key}' {problem}, got {number!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(expected)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, key, where)
            except ConfigError as error:
                errors.append(error)
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(expected)
        if isinstance(value, bool) and value not in choices:
            # YAML 1.1 reads a bare off / on (no / yes, false / true) as a boolean: the word meant
            word = "on" if value else "off"
            if word in choices:
                return word
        if value not in choices:
            raise ConfigError(
                f"{where}: '{key}' must be one of {', '.join(map(str, choices))}, got {value!r}"
            )
        return value
    if origin is list:
        (item,) = typing.get_args(expected)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: '{key}' must be a list, got {type(value).__name__}")
        return [coerce(v, item, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if expected is float and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}: '{key}' must be true or false, got {value!r}")
    if expected in (int, float, str) and (not isinstance(value, expected) or isinstance(value, bool)):
        kind = {int: "an integer", float: "a number", str: "a string"}[expected]
        raise ConfigError(f"{where}: '{key}' must be {kind}, got {value!r}")
    return value


def check_fields(instance: Any, prefix: str = "") -> None:
    """Check every field of a dataclass ``instance`` against its annotation (raises ConfigError)."""
    for name, expected in field_types(type(instance)).items():
        coerce(getattr(instance, name), expected, f"{prefix}{name}", type(instance).__name__)


def choices(expected: Any) -> tuple | None:
    """The values a ``Literal`` (or ``Literal | None``) annotation allows, else None."""
    if typing.get_origin(expected) in (typing.Union, types.UnionType):
        for option in typing.get_args(expected):
            found = choices(option)
            if found:
                return found
    if typing.get_origin(expected) is Annotated:
        return choices(typing.get_args(expected)[0])
    return typing.get_args(expected) if typing.get_origin(expected) is Literal else None


def is_kind(expected: Any, kind: type) -> bool:
    """Whether annotation ``expected`` (maybe Optional / Annotated) is ``kind``."""
    if expected is kind:
        return True
    return any(is_kind(arg, kind) for arg in typing.get_args(expected) if arg is not type(None))

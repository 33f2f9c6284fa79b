"""``Refusal``: slipstream declining what it cannot do exactly, as data.

A refusal carries *what* was refused and the ``Speedups`` change that avoids it
(``avoid={"packed_attention": False}``), so every reader takes the way out from the exception
itself: the training loop prints the config line (``speedups.packed_attention: false``), the
compatibility sweep follows the advice as a user would, doctor reports it. Nothing parses a
refusal's message; the message is for people.

Each optimization's error (``UnsupportedArchitecture``, ``UnsupportedLoss``, ...) subclasses
``Refusal`` beside its stdlib base (``NotImplementedError``, ``ValueError``), so existing
``except`` clauses keep working; its class attribute ``avoid`` is the usual way out, and a raise
site that knows a better one passes ``avoid=`` (``None``: no option avoids it, the input must
change).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_UNSET: Any = object()


def _yaml_value(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def optimize_call(avoid: Mapping[str, Any] | None) -> str | None:
    """The ``slipstream.optimize`` call that sets ``avoid`` (``slipstream.optimize(model,
    packed_attention=False)``), or None: what a refusal's message names, generated from the same
    dict as its ``avoid`` so the two cannot drift."""
    if not avoid:
        return None
    options = ", ".join(f"{key}={value!r}" for key, value in avoid.items())
    return f"slipstream.optimize(model, {options})"


class Refusal(Exception):  # noqa: N818 - a refusal is an outcome, not a fault
    """slipstream will not do this exactly; ``refused`` says what, ``avoid`` the option that avoids it."""

    avoid: dict[str, Any] | None = None  # the Speedups fields to set to avoid it (class default)

    def __init__(self, message: str = "", *, refused: str | None = None, avoid: Any = _UNSET) -> None:
        super().__init__(message)
        self.refused = refused or type(self).__name__
        if avoid is not _UNSET:
            self.avoid = dict(avoid) if avoid is not None else None

    def config_lines(self) -> list[str]:
        """The training config's lines that avoid it (``speedups.chunked_loss: false``), or []."""
        return [f"speedups.{key}: {_yaml_value(value)}" for key, value in (self.avoid or {}).items()]

    def python_call(self) -> str | None:
        """The ``slipstream.optimize`` call that avoids it, or None."""
        return optimize_call(self.avoid)


def refusal_in(error: BaseException | None) -> Refusal | None:
    """The refusal ``error`` is, or was raised from (its ``__cause__`` / ``__context__`` chain)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Refusal):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def avoid_of(error: BaseException | None) -> dict[str, Any] | None:
    """The option that avoids the refusal in ``error`` (a copy), or None where there is none."""
    refusal = refusal_in(error)
    return dict(refusal.avoid) if refusal is not None and refusal.avoid else None


__all__ = ["Refusal", "avoid_of", "optimize_call", "refusal_in"]

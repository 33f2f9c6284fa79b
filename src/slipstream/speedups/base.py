"""``Speedup``: everything one speedup is, in one object, so adding one is adding one module.

A speedup declares its config fields (``Option``: name, type, default, stock value, help), how
``optimize`` applies it to a model and puts the stock path back (``apply``, one method for both
arms: it reads its own fields and undoes what the state says it installed), the policy lines it
logs (``state.say``), what ``auto`` decides and why (``decide``: doctor's row), its parity cases
(``parity_cases``: what the compatibility sweep and doctor run against the stock path) and its
leave-one-out arm for ``slipstream ab --preset ablation`` (``ablation``). The registry
(``speedups.registry``) lists them; ``Speedups`` (the typed options), ``Speedups.stock()``,
``optimize``, the A/B's ablation arms, doctor's rows and the sweep's columns are generated from it.
Modelled on torchtitan's model converters, written for transformers models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

NO_STOCK: Any = object()  # an option whose stock arm leaves the model as it is (checkpointing)


def one_line(error: BaseException) -> str:
    """An error as one line of a report: its type and its message's words."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}"[:400]


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` as ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Option:
    """One typed field of ``Speedups``: its annotation carries the rules (``fields.check_fields``)."""

    name: str
    annotation: Any
    default: Any
    help: str
    stock: Any = NO_STOCK  # the value of the stock arm (the model as transformers and PEFT run it)

    def dataclass_field(self) -> dataclasses.Field:
        return field(default=self.default, metadata={"help": self.help})


@dataclass
class ApplyContext:
    """What one ``optimize`` call hands every speedup: the model under any PEFT wrapper, its state,
    the requested ``Speedups``, the run's optimizer steps (``auto``'s break-evens) and what earlier
    speedups found (``facts``: packed attention's backend, the attention costs)."""

    base: Any
    # optimize.OptimizeState (duck-typed: speedups sit beside optimize, not below it); a speedup keeps
    # its own state in a dataclass of its module, ``state.of(ItsState)``
    state: Any
    speedups: Any
    expected_steps: int | None = None
    environment_note: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self):
        return next(self.base.parameters()).device

    @property
    def dtype(self):
        """The hidden states' dtype (the embeddings'; a 4-bit model's packed weights are uint8)."""
        embeddings = self.base.get_input_embeddings()
        return embeddings.weight.dtype if embeddings is not None else next(self.base.parameters()).dtype


@dataclass
class DecisionContext:
    """What doctor knows when it asks each speedup for its ``auto`` decision: the requested model's
    config (its real sizes: vocabulary, width), the family's tiny model (its structure), the model
    the MoE check runs (the family's own or a stand-in), the device, the training dtype and the
    packed attention's cost figures measured here."""

    config: Any
    family: str
    model: Any
    moe_model: Any
    moe_stand_in: str
    device: Any
    dtype: Any
    costs: Any


@dataclass(frozen=True)
class AblationRun:
    """What the A/B knows when it asks whether a leave-one-out arm would differ from ``slipstream``:
    its config (``bench.ABConfig``), the device, the ``slipstream`` arm's ``Speedups`` and the
    model's transformers config (read without building the model)."""

    config: Any
    device: str
    speedups: Any
    model_config: Any


@dataclass(frozen=True)
class ParityCase:
    """One check that a speedup computes what the stock path computes, run by the parity kit in the
    compatibility sweep (a column per case) and in doctor (a row per case).

    ``fast`` / ``stock``: the ``Speedups`` changes of its two arms, on top of the subject's (doctor)
    or the verdict's advised options (the sweep). ``packed_only``: meaningful only where the packed
    attention runs (a ``-`` otherwise in the sweep; doctor runs it on the packed row, on the
    per-document SDPA backend whose option it is, where a GPU's ``auto`` would pick varlen). ``lora``: the arms train LoRA on every linear. ``moe``: runs
    on a model with experts (a stand-in where the family has none). ``offload``: offloaded
    checkpointing on the fast arm. ``stock_layout``: "alone" compares with each document run alone.
    ``sweep`` / ``doctor``: where it runs (a case may be one tool's only). ``only_with_compile``: in
    the sweep only under ``--compile`` (inductor builds). ``shown``: the sweep's cell when it passes,
    from the stock model (None: nothing to switch there, the cell is ``-`` and the case skipped).
    ``runs_in``: a context manager the sweep runs it in, given whether the sweep compiles."""

    label: str
    fast: dict[str, Any]
    stock: dict[str, Any]
    arms: str
    packed_only: bool = False
    lora: bool = False
    moe: bool = False
    offload: bool = False
    stock_layout: str | None = None
    sweep: bool = True
    doctor: bool = True
    only_with_compile: bool = False
    header: str | None = None  # its column's header in docs/compatibility.md (default: the label)
    # doctor: the cases after this one run on the packed row only where it is ok (packed attention)
    sets_layout: bool = False
    shown: Callable[[Any], str | None] | None = None
    runs_in: Callable[[bool], AbstractContextManager] | None = None


class Speedup:
    """One speedup (subclass it in a module of its own and register it: ``speedups.registry``)."""

    name: ClassVar[str]  # how its policy lines start and what doctor and the sweep call it
    options: ClassVar[tuple[Option, ...]]
    stage: ClassVar[int] = 50  # the order optimize applies it in (packed attention first, checkpointing last)
    # the ablation arm's change (``slipstream-no-<ablation_name>``); None: no leave-one-out arm
    ablation: ClassVar[dict[str, Any] | None] = None
    ablation_name: ClassVar[str | None] = None
    doctor_label: ClassVar[str | None] = None  # doctor's decision row (None: the speedup has no row)
    sweep_column: ClassVar[str | None] = None  # the sweep's on / off column, read from the policy log
    sweep_header: ClassVar[str | None] = None  # that column's header in docs/compatibility.md

    def apply(self, run: ApplyContext) -> None:
        """Switch the speedup on, or its stock path back, as ``run.speedups`` says; log each choice."""
        raise NotImplementedError

    def decide(self, context: DecisionContext) -> tuple[str, str]:
        """What ``auto`` would run on ``context.device`` and why: doctor's row."""
        return "-", "no automatic decision"

    def ablation_applies(self, run: AblationRun) -> bool:
        """Whether the A/B's ``slipstream`` arm would pull this lever on ``device`` (an ablation arm
        that would run the same thing twice is dropped from the preset)."""
        return True

    def sweep_cell(self, policies: list[str], moe: bool, offloaded: str) -> str:
        """The sweep's column for this speedup, from the main arm's policy log (``moe``: the model
        has experts; ``offloaded``: whether the harness ran the arm offloaded, or why not)."""
        return "on" if any(line.startswith(f"{self.name}: on") for line in policies) else "off"

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return ()

    def stock_values(self) -> dict[str, Any]:
        return {option.name: option.stock for option in self.options if option.stock is not NO_STOCK}

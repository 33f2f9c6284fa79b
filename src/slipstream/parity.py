"""The parity kit: one training step of a fast arm against a reference, and how far apart they are.

The compatibility sweep (:mod:`slipstream.compat`) and ``slipstream doctor``
(:mod:`slipstream.doctor.checks`) both judge a speedup this way: random :func:`documents`, the
stock :func:`reference` step (each document alone through the model itself), an :class:`Arm`'s
step under ``slipstream.optimize`` (the documents packed in one row, or each alone), and
:func:`compare` / :func:`problems`: the relative error of the logits, the loss and every gradient,
and what is off beyond :data:`TOLERANCE`.

What the callers add on top stays theirs: the sweep's outcomes (pass / refused / WRONG / CRASH)
and its columns, doctor's counted second step (host syncs), its captured policy log and its
low-precision judging against an fp32 run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .models.tiny_any import RESERVED_HIGH, RESERVED_LOW
from .offload import DeviceDescription, checkpointing_layers, enable_checkpointing
from .optimize import optimize, state_of
from .packing import collate_packed
from .speedups import Speedups

# Relative error bounds in fp32 (summation order differs between the arms; a cross-document
# leak shows as 1e-2 .. 1e0).
TOLERANCE = {"logits": 1e-4, "loss": 1e-5, "grad": 1e-3}
# Longer than the tiny sliding / chunk windows (8), so windows matter; on both sides of the tiny
# position thresholds (16), and all below the dynamic-RoPE model's max_position_embeddings (32),
# itself below the packed row (48).
LENGTHS = (11, 21, 16)
SEED = 0
LAYOUTS = ("packed", "alone")  # the documents packed in one row; each document alone, one row each


# --------------------------------------------------------------------------- the documents


def _vocab_size(model: torch.nn.Module) -> int:
    embeddings = model.get_input_embeddings()
    size = getattr(embeddings, "num_embeddings", None)
    return int(size if size is not None else model.config.get_text_config().vocab_size)


def documents(model: torch.nn.Module, lengths=LENGTHS, seed: int = SEED) -> list[list[int]]:
    """Random documents over the ordinary ids of the tiny vocabulary (no special tokens)."""
    vocab = _vocab_size(model)
    low, high = RESERVED_LOW, max(RESERVED_LOW + 1, vocab - RESERVED_HIGH)
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=generator).tolist() for n in lengths]


def inputs_of(docs: list[list[int]], layout: str, device: torch.device | None = None):
    """``docs`` as one step's input: a ``PackedBatch`` (packed) or one [1, L] tensor per document (alone)."""
    if layout == "packed":
        return collate_packed([{"input_ids": doc} for doc in docs], device=device)
    if layout == "alone":
        return [torch.tensor([doc], device=device) for doc in docs]
    raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")


# --------------------------------------------------------------------------- one step


@dataclass
class Step:
    """One training step's figures: the loss, every parameter's gradient (fp32), the logits if asked."""

    loss: float
    grads: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # per document, [L, V] fp32
    inputs: Any = field(default=None, repr=False)  # what it trained on (inputs_of), for a step again


def logits_of(model: torch.nn.Module, inputs, layout: str) -> list[torch.Tensor]:
    """Per document, its [L, V] logits in fp32 (a forward without labels, no grad)."""
    with torch.no_grad():
        if layout == "packed":
            out = model(**{k: v for k, v in inputs.model_inputs().items() if k != "labels"})
            return [out.logits[0, start:end].float() for start, end in inputs.doc_bounds()]
        return [model(input_ids=ids).logits[0].float() for ids in inputs]


def train_step(model: torch.nn.Module, inputs, layout: str) -> list[torch.Tensor]:
    """Forward + backward of one batch; its loss as detached parts still on the device (read after
    any counting): the packed row's loss, or each document's loss weighted by its label tokens
    (the loss of a padded batch is their sum)."""
    if layout == "packed":
        out = model(**inputs.model_inputs())
        out.loss.backward()
        return [out.loss.detach()]
    total = sum(ids.shape[1] - 1 for ids in inputs)
    parts = []
    for ids in inputs:
        part = model(input_ids=ids, labels=ids).loss * (ids.shape[1] - 1) / total
        part.backward()
        parts.append(part.detach())
    return parts


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient there is, in fp32 (a copy)."""
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, docs, layout, device=None, logits: bool = False, seed: int | None = None) -> Step:
    inputs = inputs_of(docs, layout, device)
    seen = logits_of(model, inputs, layout) if logits else None
    if seed is not None:
        torch.manual_seed(seed)
    loss = sum(part.item() for part in train_step(model, inputs, layout))
    return Step(float(loss), grads_of(model), seen, inputs)


def reference(model: torch.nn.Module, docs: list[list[int]]) -> Step:
    """The stock reference step: each document alone through ``model`` itself (training mode); its
    logits, and the loss and gradients of the token-weighted loss over every document."""
    model.train()
    model.zero_grad(set_to_none=True)
    return _step(model, docs, "alone", logits=True)


# --------------------------------------------------------------------------- an arm


def copy_model(
    base: torch.nn.Module, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> torch.nn.Module:
    """A copy with the same weights (rebuilt from its config when a module holds a non-leaf
    tensor), moved to ``device`` / ``dtype`` where given."""
    try:
        model = copy.deepcopy(base)
    except RuntimeError:
        model = type(base)._from_config(
            base.config, attn_implementation=base.config._attn_implementation, dtype=torch.float32
        )
        model.load_state_dict(base.state_dict())
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model


def policies_of(model: torch.nn.Module) -> list[str]:
    """The decisions ``optimize`` logged on ``model`` so far ([] where it never ran)."""
    return list(getattr(state_of(model), "policies", []) or [])


class Arm:
    """One arm: a copy of ``base`` (on ``device`` in ``dtype`` where given) that :meth:`set_up`
    puts under ``optimize`` and :meth:`step` trains. Built in two calls so that a caller catching
    a refusal still holds the copy (``policies``: what ``optimize`` decided before it refused)."""

    def __init__(
        self, base: torch.nn.Module, device: torch.device | None = None, dtype: torch.dtype | None = None
    ):
        self.device = device
        self.model = copy_model(base, device, dtype)
        self.model.zero_grad(set_to_none=True)
        self.offloaded = False  # the offload schedule installed (set_up's ``offload``)

    def set_up(
        self,
        options: Speedups | Mapping[str, Any],
        *,
        wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        offload=None,
    ) -> Arm:
        """``optimize(model, options)`` (a ``Speedups`` or its fields by name); then ``wrap`` (the
        model to train instead, e.g. a LoRA around it); then, given an offload engine and where the
        model has decoder layers to checkpoint, the double-buffered offload schedule on that engine
        (every activation offloaded, however small)."""
        if isinstance(options, Mapping):
            optimize(self.model, **options)
        else:  # a Speedups (of whichever registry built it)
            optimize(self.model, options)
        if wrap is not None:
            self.model = wrap(self.model)
        if offload is not None and checkpointing_layers(self.model):
            cuda = self.device is not None and torch.device(self.device).type == "cuda"
            description = DeviceDescription.detect(torch.device(self.device)) if cuda else None
            enable_checkpointing(self.model, "offload-double", description, offload, min_offload_bytes=0)
            self.offloaded = True
        return self

    def step(
        self, docs: list[list[int]], layout: str = "packed", *, logits: bool = False, seed: int | None = None
    ) -> Step:
        """One training step on ``docs`` in ``layout``; ``logits``: a forward without labels first
        (the per-document logits); ``seed``: ``torch.manual_seed`` right before the step."""
        self.model.train()
        return _step(self.model, docs, layout, self.device, logits=logits, seed=seed)

    @property
    def policies(self) -> list[str]:
        return policies_of(self.model)


# --------------------------------------------------------------------------- comparing


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


def gradient_errors(actual: dict, expected: dict) -> dict[str, float]:
    """Relative error of every parameter's gradient (inf where only one side has a nonzero one).

    A gradient far smaller than the model's largest is compared against that scale, so fp32 noise
    on a near-zero gradient is not called a difference."""
    scale = max((g.norm().item() for g in expected.values() if g is not None), default=1.0)
    errors: dict[str, float] = {}
    for name in sorted(set(actual) | set(expected)):
        a, e = actual.get(name), expected.get(name)
        if a is None and e is None:
            continue
        if a is None or e is None:
            if (a if e is None else e).abs().max().item() != 0:
                errors[name] = float("inf")
            continue
        errors[name] = (a - e).norm().item() / max(e.norm().item(), 1e-4 * scale, 1e-12)
    return errors


@dataclass
class Errors:
    """How far one step is from another, every figure relative."""

    loss: float
    grad: float  # the largest of ``grads``
    worst_param: str | None  # its parameter (None where every gradient matches exactly)
    grads: dict[str, float] = field(default_factory=dict, repr=False)  # parameter -> relative error
    logits: float | None = None  # the largest over the documents (None: not compared)


def compare(actual: Step, expected: Step) -> Errors:
    """Relative error of the loss, of every parameter gradient (:func:`gradient_errors`) and, where
    both steps kept them, of each document's logits."""
    loss = abs(actual.loss - expected.loss) / max(abs(expected.loss), 1e-12)
    grads = gradient_errors(actual.grads, expected.grads)
    worst = max(grads, key=grads.__getitem__, default=None)
    logits = None
    if actual.logits is not None and expected.logits is not None:
        logits = max(_relative(a, e) for a, e in zip(actual.logits, expected.logits, strict=True))
    if worst is None or grads[worst] == 0:
        return Errors(loss, 0.0, None, grads, logits)
    return Errors(loss, grads[worst], worst, grads, logits)


def problems(errors: Errors, tolerance: Mapping[str, float] = TOLERANCE) -> list[str]:
    """What is off beyond ``tolerance`` (a NaN is off), one phrase each; [] when it matches."""
    found = []
    if errors.logits is not None and not errors.logits <= tolerance["logits"]:
        found.append(f"logits off by {errors.logits:.2g} (relative)")
    if not errors.loss <= tolerance["loss"]:
        found.append(f"loss off by {errors.loss:.2g}")
    if not errors.grad <= tolerance["grad"]:
        found.append(f"gradient of {errors.worst_param} off by {errors.grad:.2g}")
    return found


__all__ = [
    "LAYOUTS",
    "LENGTHS",
    "SEED",
    "TOLERANCE",
    "Arm",
    "Errors",
    "Step",
    "compare",
    "copy_model",
    "documents",
    "gradient_errors",
    "grads_of",
    "inputs_of",
    "logits_of",
    "policies_of",
    "problems",
    "reference",
    "train_step",
]

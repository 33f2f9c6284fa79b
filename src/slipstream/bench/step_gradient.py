"""An arm's step-0 gradient, kept for the fp32 truth (``bench/truth.py``), and the cosine of two of them.

In a reduced-precision run every arm's step 0 is judged by its distance to the same step in fp32 (same
weights, same batch): its loss and gradient norm come from its own figures, its gradient's direction
from here. :class:`HeldGradient` holds the trainable parameters' gradients at the arm's first optimizer
step (a hook on every torch optimizer of the process, so TRL's trainers count too: their gradients
are clipped by then, which scales them all alike and leaves the direction, all the cosine reads), by
reference, not copied; after the step's clock has stopped, :meth:`HeldGradient.save` writes them to a
file as fp32, a few MiB at a time (no second copy of them lives on the device or in the host's
memory), and says where (``ArmResult.step0_gradient``: the file, the parameters' names and sizes).
The runner reads the files (:func:`gradient_cosine`) and removes them: they never reach ``ab.json``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..packing.batch import cut

# Above this many trainable values (1 GiB as fp32) an arm keeps no gradient: its cosine is not measured.
GRADIENT_LIMIT = 2**28
# Values copied to the host and written at a time (4 MiB as fp32): all the host ever holds of them.
CHUNK = 2**20
# Name segments that wrappers insert (torch.compile, checkpointing, FSDP, DDP): left out when matching.
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def parameter_name(name: str) -> str:
    """``name`` without the segments wrappers insert, so arms that wrap differently match by name."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name.removeprefix("module.")


class HeldGradient:
    """The gradients of ``model``'s parameters at the process's next optimizer step (see the module);
    inert when ``directory`` is None."""

    def __init__(self, model: torch.nn.Module, directory: str | None, name: str):
        self.model, self.directory, self.name = model, directory, name
        self.held: list[tuple[str, torch.Tensor]] | None = None
        self.handle = register_optimizer_step_pre_hook(self._hold) if directory else None

    def _hold(self, optimizer, args, kwargs) -> None:
        self.close()  # once: the first optimizer step only
        self.held = [
            (parameter_name(name), param.grad)
            for name, param in self.model.named_parameters()
            if param.requires_grad and param.grad is not None
        ]

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def save(self) -> dict[str, Any] | None:
        """Write the held gradients to ``directory`` as fp32 and let go of them: ``{"file", "names",
        "sizes"}``, or ``{"skipped": why}``; None when none is held (no directory, or no update ran:
        a step that was not finite skips its optimizer)."""
        self.close()
        held, self.held = self.held, None
        if not held:
            return None
        total = sum(grad.numel() for _, grad in held)
        if total > GRADIENT_LIMIT:
            return {
                "skipped": f"{total:,} trainable values, more than the {GRADIENT_LIMIT:,} kept for a cosine"
            }
        path = os.path.join(self.directory, f"{self.name}.f32")
        names, sizes = [], []
        with open(path, "wb") as out:
            for name, grad in held:
                flat = grad.detach().reshape(-1)
                for start in range(0, flat.numel(), CHUNK):
                    # to the host first, then fp32 there: no fp32 copy of a bf16 gradient on the device
                    flat[start : start + CHUNK].to("cpu").float().numpy().tofile(out)
                names.append(name)
                sizes.append(grad.numel())
        return {"file": path, "names": names, "sizes": sizes}


def _by_name(kept: dict) -> dict[str, np.ndarray]:
    values = np.memmap(kept["file"], dtype=np.float32, mode="r")
    # each parameter's values, one after another
    return dict(zip(kept["names"], cut(values, kept["sizes"]), strict=True))


def gradient_cosine(reference: dict | None, other: dict | None) -> tuple[float | None, str | None]:
    """The cosine of two kept gradients (:meth:`HeldGradient.save`), matched by parameter name:
    ``(cosine, None)``, or ``(None, why not)``."""
    for kept, whose in ((reference, "the fp32 step"), (other, "this arm")):
        if kept is None:
            return None, f"{whose} kept no step-0 gradient"
        if "skipped" in kept:
            return None, f"{whose} kept no step-0 gradient ({kept['skipped']})"
    mine, theirs = _by_name(reference), _by_name(other)
    if set(mine) != set(theirs):
        shared = len(set(mine) & set(theirs))
        return None, f"its trainable parameters are named otherwise ({shared} of {len(mine)} names match)"
    dot = norm_a = norm_b = 0.0
    for name, a in mine.items():
        b = theirs[name]
        if a.shape != b.shape:
            return None, f"parameter {name} has {b.size} values here, {a.size} in the fp32 step"
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        dot += float(a64 @ b64)
        norm_a += float(a64 @ a64)
        norm_b += float(b64 @ b64)
    if norm_a == 0.0 or norm_b == 0.0 or not math.isfinite(dot):
        return None, "a gradient is zero or not finite"
    return dot / math.sqrt(norm_a * norm_b), None

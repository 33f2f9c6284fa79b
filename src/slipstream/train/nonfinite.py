"""``training.on_nonfinite``: what the loop does with a step whose loss or gradient norm is NaN / inf.

``train_step`` (``step.py``) never applies such a step; this decides whether the run goes on,
says so in one line, and points at the checkpoint to go back to (``checkpoints.py`` marks the
one that would compute the same step again, and refuses to write anything non-finite).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .checkpoints import first_nonfinite, mark_leads_to_nonfinite, newest_resumable
from .config import TrainConfig
from .distributed import Distributed, unwrap
from .errors import TrainError


class NonFiniteSteps:
    """``training.on_nonfinite``: what a step whose loss or gradient norm is NaN / infinite does.

    ``train_step`` never applies such a step. ``stop`` ends the run at the first one; ``skip``
    goes on (the update dropped, the step counted and logged) until ``max_consecutive_skips``
    come in a row. The verdict rests on the loss summed over the ranks and the grad norm, which
    every rank reads alike, so every rank decides the same. Nothing here reads the device.
    """

    def __init__(
        self, config: TrainConfig, info: Distributed, out: Path, total: int, model: torch.nn.Module
    ) -> None:
        self.config, self.info, self.out, self.total, self.model = config, info, out, total, model
        self.skipped = 0  # over the run (this process's part of it, after a resume)
        self.in_a_row = 0

    def record(self, step: int, loss: float, grad_norm: float) -> str:
        """Count step ``step`` (1-based, non-finite); returns the line that says it was skipped.

        Raises ``TrainError`` (one line) when the run must stop."""
        training = self.config.training
        what = _nonfinite_what(loss, grad_norm)
        self.skipped += 1
        self.in_a_row += 1
        if training.on_nonfinite == "stop":
            raise TrainError(self._stop_message(step, what, "training.on_nonfinite: stop", repeats=True))
        if self.in_a_row >= training.max_consecutive_skips:
            why = f"{self.in_a_row} non-finite steps in a row, training.max_consecutive_skips"
            raise TrainError(self._stop_message(step, what, why, repeats=True))
        return (
            f"slipstream train: step {step}: {what}: update skipped (training.on_nonfinite: skip; "
            f"{self.in_a_row} in a row, the run stops at {training.max_consecutive_skips})"
        )

    def finite(self) -> None:
        self.in_a_row = 0

    def check_weights(self, step: int, state: dict[str, torch.Tensor] | None = None) -> None:
        """Before step ``step``'s checkpoint or the final adapter, on every rank: stop if an update
        made a trainable weight non-finite (a finite loss and grad norm with too large a step).

        A later step's loss would show it too, but not before this write; the writers refuse such
        weights as well, on rank 0 only. ``state``: the gathered weights under FSDP2."""
        if state is None:
            state = {n: p.detach() for n, p in unwrap(self.model).named_parameters() if p.requires_grad}
        bad = first_nonfinite(state)
        if bad is not None:
            what = f"its update made the trainable weight {bad!r} NaN or infinite"
            raise TrainError(self._stop_message(step, what, "nothing non-finite is written", repeats=False))

    def _stop_message(self, step: int, what: str, why: str, *, repeats: bool) -> str:
        """The one line a non-finite stop prints. ``repeats``: the step's own computation was
        non-finite, so the checkpoint right before it would compute it again (it is marked)."""
        marked = None
        if self.info.is_main and repeats:
            marked = mark_leads_to_nonfinite(self.out, step)
        self.info.barrier()
        lower = f"{self.config.optimizer.lr / 10:g}"
        newest = newest_resumable(self.out)
        passed = ""
        if marked is not None:
            passed = f" ({marked.name} is passed over: its weights would compute step {step} again)"
        if newest is not None:
            where = (
                f"the last finite checkpoint to go back to is {newest}{passed}: run the same command with "
                f"--resume --force --set optimizer.lr={lower} (a lower learning rate) to continue from it"
            )
        else:
            where = (
                f"no earlier checkpoint to go back to{passed}: run the same command with --overwrite "
                f"--set optimizer.lr={lower} (a lower learning rate) to start over"
            )
        return (
            f"step {step} of {self.total}: {what} ({why}): the run stopped; nothing of that step was "
            f"applied or written; {where}"
        )


def _nonfinite_what(loss: float, grad_norm: float) -> str:
    parts = [f"{name} is {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm))]
    bad = [part for part, value in zip(parts, (loss, grad_norm), strict=True) if not math.isfinite(value)]
    return " and the ".join(bad) if len(bad) > 1 else bad[0]


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None

"""The first steps of a run as ``slipstream train`` plans them: what every arm of ``slipstream ab`` replays.

:func:`record_steps` reads the rows through the run's own objective (``objective.read``: the same
rows, held-out split, bins and step order as ``train``) and keeps the bins of its first optimizer
steps in the order ``train`` takes them (``step_plan``), with the run's own step count, which its
learning-rate schedule runs over. The A/B plans nothing of its own: every arm trains these bins
(a slipstream arm through the step driver, a stock arm or a peer as rows), so what it times is the
start of the very run ``train`` would run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..objectives import ObjectiveData
from .config import ConfigError, TrainConfig
from .distributed import Distributed
from .driver import step_plan
from .inputs import load_tokenizer, objective_of


@dataclass
class StepRecord:
    """A run's first optimizer steps: each step's bins (every rank's micro-batches), in train's order."""

    steps: list[list[list[dict]]]  # [step][bin] -> the bin's rows
    run_steps: int  # the run's optimizer steps (training.steps, or its epochs' steps): the schedule's length
    data: ObjectiveData  # what the objective read (its rows, reports and held-out set)


def record_steps(config: TrainConfig, steps: int, tokenizer: Any = None) -> StepRecord:
    """The first ``steps`` optimizer steps of ``config``'s run, one process holding every rank's bins;
    ConfigError where the run trains fewer steps (naming the keys that set them)."""
    info = Distributed()  # this process alone: a step's bins are every rank's micro-batches
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
    data = objective_of(config).read(tokenizer, info)
    run_steps, bins_for, _ = step_plan(len(data.bins), config, info.world_size, data.blocks)
    if run_steps < steps:
        how = "training.steps" if config.training.steps else f"training.epochs {config.training.epochs or 1}"
        raise ConfigError(
            f"the run trains {run_steps} optimizer steps ({how}); an A/B of {steps} steps would replay "
            "steps it never trains: lower ab.steps (--steps), or raise training.steps"
        )
    return StepRecord([[data.bins[i] for i in bins_for(step)] for step in range(steps)], run_steps, data)

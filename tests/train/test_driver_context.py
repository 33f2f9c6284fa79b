"""What the driver hands an objective (``StepDriver.context``): the rounds and the resume hint are the loop's."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from slipstream.objectives.base import ObjectiveContext
from slipstream.train.distributed import Distributed
from slipstream.train.driver import StepDriver


def _context(tmp_path, updates_per_round: int) -> ObjectiveContext:
    driver = StepDriver(
        config=None,
        info=Distributed(),
        objective=SimpleNamespace(updates_per_round=updates_per_round, weight=len),
        model=torch.nn.Linear(1, 1),
        optimizer=None,
        scheduler=None,
        bins=[[{"input_ids": [1]}]] * 6,
        bins_for=lambda step: [step],  # step i trains bin i
        total=6,
        device=torch.device("cpu"),
        dtype=torch.float32,
        out=tmp_path,
    )
    return driver.context()


def test_steps_of_one_round_get_the_rounds_bins(tmp_path):
    one = _context(tmp_path, 1)
    assert isinstance(one, ObjectiveContext) and [one.step_bins(s) for s in range(4)] == [[0], [1], [2], [3]]
    rounds = _context(tmp_path, 2)  # GRPO's num_iterations 2: round r is steps 2r, 2r + 1
    assert [rounds.step_bins(s) for s in range(6)] == [[0], [0], [1], [1], [2], [2]]


def test_the_resume_hint_names_the_newest_checkpoint(tmp_path):
    context = _context(tmp_path, 1)
    assert context.resume_hint() == "no checkpoint to resume from"
    step = tmp_path / "checkpoints" / "step-000004"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    hint = context.resume_hint()
    assert hint.startswith("--resume continues from ") and hint.endswith("step-000004"), hint

"""What the loop hands an objective (``objective_context``): the rounds and the resume hint are the loop's."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from slipstream.objectives.base import ObjectiveContext
from slipstream.train.distributed import Distributed
from slipstream.train.setup import objective_context


def _run(tmp_path, updates_per_round: int):
    return SimpleNamespace(
        objective=SimpleNamespace(updates_per_round=updates_per_round),
        info=Distributed(),
        tokenizer=None,
        bins=[[{"input_ids": [1]}]] * 6,
        label_tokens=[1] * 6,
        evals=None,
        device=torch.device("cpu"),
        dtype=torch.float32,
        model=torch.nn.Linear(1, 1),
        base_model=torch.nn.Linear(1, 1),
        total=6,
        bins_for=lambda step: [step],  # step i trains bin i
        out=tmp_path,
    )


def test_steps_of_one_round_get_the_rounds_bins(tmp_path):
    one = objective_context(_run(tmp_path, 1))
    assert isinstance(one, ObjectiveContext) and [one.step_bins(s) for s in range(4)] == [[0], [1], [2], [3]]
    rounds = objective_context(_run(tmp_path, 2))  # GRPO's num_iterations 2: round r is steps 2r, 2r + 1
    assert [rounds.step_bins(s) for s in range(6)] == [[0], [0], [1], [1], [2], [2]]


def test_the_resume_hint_names_the_newest_checkpoint(tmp_path):
    context = objective_context(_run(tmp_path, 1))
    assert context.resume_hint() == "no checkpoint to resume from"
    step = tmp_path / "checkpoints" / "step-000004"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    hint = context.resume_hint()
    assert hint.startswith("--resume continues from ") and hint.endswith("step-000004"), hint

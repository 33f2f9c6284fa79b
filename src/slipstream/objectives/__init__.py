"""Objectives as plug-ins of the one training loop (:mod:`.base`: the interface and the registry).

Registered here: ``sft`` (:mod:`.sft`), and the preference objectives on packed pairs
(:mod:`.pairs`): ``dpo``, ``ipo``, ``simpo`` and ``orpo``, and the reward model, ``reward``; ``kto`` on unpaired
rows (:mod:`.kto`); online RL: ``grpo`` (:mod:`.grpo`). ``register_objective`` adds another.
"""

from . import dpo, grpo, ipo, kto, orpo, reward, sft, simpo  # noqa: F401 - each registers its objective
from .base import Objective, ObjectiveData, objective_for, objective_names, register_objective

__all__ = ["Objective", "ObjectiveData", "objective_for", "objective_names", "register_objective"]

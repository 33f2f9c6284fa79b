"""``training.objective: dpo`` (Rafailov et al. 2023, the "sigmoid" loss): ``-log sigmoid(beta *
((s_c - s_c^ref) - (s_r - s_r^ref)))`` on summed answer log-probs against the reference computed
before step 0; rewards ``beta * (s - s^ref)``. Settings: ``preference.beta``, ``prefix_sharing``,
``reference``."""

from __future__ import annotations

from ..loss.preference import dpo_terms
from .base import register_objective
from .pairs import PairObjective


@register_objective
class DPO(PairObjective):
    name = "dpo"

    def pair_terms(self, policy, reference, lengths):
        return dpo_terms(policy, reference, lengths, self.settings.beta)

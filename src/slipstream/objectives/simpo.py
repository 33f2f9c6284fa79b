"""``training.objective: simpo`` (Meng et al. 2024, reference-free): ``-log sigmoid(beta * (a_c -
a_r) - gamma)`` on per-token mean log-probs; rewards ``beta * a``. Settings: ``preference.beta``,
``preference.simpo_gamma``, ``prefix_sharing`` (``preference.reference`` is not read)."""

from __future__ import annotations

from ..loss.preference import simpo_terms
from .base import register_objective
from .pairs import PairObjective


@register_objective
class SimPO(PairObjective):
    name = "simpo"
    reference_free = True

    def pair_terms(self, policy, reference, lengths):
        return simpo_terms(policy, lengths, self.settings.beta, self.settings.simpo_gamma)

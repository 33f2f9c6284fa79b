"""``training.objective: ipo`` (Azar et al. 2023, as TRL computes it): ``(((a_c - a_c^ref) - (a_r -
a_r^ref)) - 1 / (2 beta))^2`` on per-token mean log-probs against the reference; rewards ``beta *
(a - a^ref)``. Settings: ``preference.beta``, ``prefix_sharing``, ``reference``."""

from __future__ import annotations

from ..loss.preference import ipo_terms
from .base import register_objective
from .pairs import PairObjective


@register_objective
class IPO(PairObjective):
    name = "ipo"

    def pair_terms(self, policy, reference, lengths):
        return ipo_terms(policy, reference, lengths, self.settings.beta)

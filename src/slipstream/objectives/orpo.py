"""``training.objective: orpo``: odds-ratio preference optimisation (Hong et al. 2024), reference-free.

As TRL's ``ORPOTrainer`` computes it, with ``a`` an answer's *mean* per-token log-prob:

    loss = -a_c - lambda * log sigmoid(log_odds),
    log_odds = (a_c - a_r) - (log(1 - exp(a_c)) - log(1 - exp(a_r)))

(``log(1 - exp(x))`` computed stably, ``loss.preference.log1m_exp``). The NLL term is the chosen
answer's mean over its own tokens, and the step averages pairs, so every pair weighs the same
(TRL averages the NLL over the batch's chosen tokens: the same where answers are equally long).
Rewards are ``beta * a`` (as TRL logs them); the step also logs the NLL and the log-odds.

Settings (the ``preference`` section, as every pair objective reads it): ``lambda`` is
``preference.beta``, as TRL's ``ORPOConfig.beta`` is the paper's lambda (default 0.1), and pairs are
packed as DPO packs them (``preference.prefix_sharing``: the prompt once per pair).
``preference.reference`` and ``simpo_gamma`` are not read: nothing runs before step 0.
"""

from __future__ import annotations

from ..loss.preference import METRICS, orpo_terms
from .base import register_objective
from .pairs import PairObjective


@register_objective
class ORPO(PairObjective):
    name = "orpo"
    reference_free = True
    metrics = (*METRICS, "nll", "log_odds")

    def pair_terms(self, policy, reference, lengths):
        return orpo_terms(policy, lengths, self.settings.beta)

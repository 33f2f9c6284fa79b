"""Preference tuning (DPO, IPO, SimPO) on the packed hot path: the prompt of a pair runs once.

rows -> pairs (:mod:`.data`) -> bins -> ``prompt | chosen | rejected`` packed rows
(:func:`slipstream.packing.pairs.collate_pairs`: the rejected answer attends to the prompt and
itself, positions continuing from the prompt) -> every answer's summed log-prob through the chunked
LM head (:mod:`slipstream.loss.answer_logprobs`, no logits) -> the loss (:mod:`.losses`) against the
reference computed once before step 0 (:mod:`.reference`, :func:`.objective.reference_pass`).
``slipstream train`` runs it with ``training.objective: dpo`` (or ipo, simpo, orpo: the plug-ins in
``slipstream.objectives``); the loop, the one optimizer step, the checkpoints and the CLI are the
SFT ones.
"""

from .data import PairReport, load_pairs, pack_pairs, split_pairs, tokenize_pair
from .losses import METRICS, PreferenceLossName, preference_terms
from .objective import answer_sums, evaluate_pairs, pair_loss, reference_pass, reference_sums

__all__ = [
    "METRICS",
    "PairReport",
    "PreferenceLossName",
    "answer_sums",
    "evaluate_pairs",
    "load_pairs",
    "pack_pairs",
    "pair_loss",
    "preference_terms",
    "reference_pass",
    "reference_sums",
    "split_pairs",
    "tokenize_pair",
]

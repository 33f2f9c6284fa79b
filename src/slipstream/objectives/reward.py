"""``training.objective: reward``: a reward model (Bradley-Terry) on preference pairs, as TRL's
``RewardTrainer`` trains one, with each pair's prompt run once.

The model is loaded as ``AutoModelForSequenceClassification`` with ``num_labels=1`` (:mod:`..models.heads`):
the body, and a ``score`` linear layer whose output at a sequence's last token is its reward. With LoRA the
adapter is on the body and ``score`` is trained in full (PEFT's ``SEQ_CLS`` task: ``modules_to_save``), as
TRL's ``RewardTrainer`` trains it with a PEFT config.

A pair is packed as the DPO objectives pack it (``prompt | chosen | rejected``, the rejected answer
attending to the prompt, positions continuing from it: :mod:`slipstream.packing.pairs`), so the prompt runs
once; ``score`` runs on every row position (one [T, hidden] x [hidden, 1] product) and each answer's reward is
read at its last token (``AnswerSpans.ends``): the hidden state prompt + answer run alone ends with. TRL runs
prompt + chosen and prompt + rejected as two right-padded rows. The loss (:func:`slipstream.loss.reward.
reward_terms`): ``-log sigmoid(r_c - r_r - margin)`` plus ``reward.center_rewards_coefficient * (r_c +
r_r)^2``, averaged over the step's pairs; the metrics are the pair objectives' (chosen and rejected reward,
margin, accuracy: TRL's ``margin`` and ``accuracy``). TRL also logs the min / mean / max reward; the mean is
(chosen + rejected) / 2 here, min and max are not kept.

What differs from the causal-LM pair objectives: nothing runs before step 0 but a one-sequence check that the
model's head is where it is read (:func:`..models.heads.check_reward_head`); a pair longer than
``data.max_seq_len`` is a bad row, not cut (the score would be read at another token; TRL drops such pairs);
pairs as prefix trees across pairs (``data.share_prefixes tree``) are not supported yet, and 4-bit
(``quantization.four_bit``) loads only causal LMs here: both refused by key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, Any

import torch

from ..errors import TrainError
from ..fields import Range
from ..loss.preference import metric_sums
from ..loss.reward import reward_terms
from ..models.heads import HeadError, check_reward_head, classifier_of, reward_scores, say_which_id_pads
from ..packing.pairs import collate_pairs
from .base import ObjectiveContext, register_objective
from .pairs import PairObjective

logger = logging.getLogger("slipstream")


@dataclass(frozen=True)
class RewardSettings:
    """The reward model's settings: the config's ``reward:`` section (TRL's ``RewardConfig`` names)."""

    # TRL's center_rewards_coefficient: + coefficient * (r_c + r_r)^2 per pair, pulling rewards to mean 0
    center_rewards_coefficient: Annotated[float, Range(ge=0)] | None = None


@register_objective
class RewardModel(PairObjective):
    name = "reward"
    model_head = "reward"
    reference_free = True
    cuts_answers = False
    prompt_shared_by = "a pair's two answers"

    def __init__(self, config: Any = None, settings=None, reward: RewardSettings | None = None) -> None:
        super().__init__(config, settings)
        self.reward = reward if reward is not None else config.reward
        self.chunked = False  # no LM head: the scores are read from the score head
        self.pad_id: int | None = None  # the model config's pad id (before_training), which ends skip

    @classmethod
    def validate(cls, config, fail) -> None:
        super().validate(config, fail)
        if config.training.sample_prompts:
            fail(
                "training.sample_prompts",
                "training.objective reward trains a sequence classifier: it scores, it does not answer prompts; "
                "leave training.sample_prompts out",
            )
        if config.quantization.four_bit:
            fail(
                "quantization.four_bit",
                "quantization.four_bit loads causal LMs only; training.objective reward loads a sequence "
                "classifier: train it in the run's dtype",
            )

    def read(self, tokenizer, info):
        data = super().read(tokenizer, info)
        eval_rows = [pair for b in data.evals.bins for pair in b] if data.evals is not None else []
        for rows, source in ((data.rows, self.config.data.path), (eval_rows, "the held-out pairs")):
            given = sum("margin" in pair for pair in rows)
            if 0 < given < len(rows):
                raise TrainError(
                    f"{source}: {given} of {len(rows)} pairs give 'margin': give it on every row or on none "
                    "(TRL's RewardTrainer reads the column for the whole batch)"
                )
        return data

    def before_training(self, context: ObjectiveContext) -> str | None:
        """The head checked where it is read (one short sequence, as transformers runs it); the policy line."""
        self.pad_id = say_which_id_pads(context.base_model, context.tokenizer)
        first = context.bins[0][0]
        sequence = (list(first["prompt_ids"]) + list(first["chosen_ids"]))[-32:]
        try:
            check_reward_head(context.base_model, sequence)
        except HeadError as error:
            raise TrainError(f"{self.config.model.path or self.config.model.preset}: {error}") from None
        inner = classifier_of(context.base_model)
        center = self.reward.center_rewards_coefficient
        return (
            f"reward head: {type(inner).__name__}.score read at each answer's last token (checked against "
            f"transformers' own forward), trained in full; Bradley-Terry"
            + (f" + {center:g} x (r_c + r_r)^2" if center else "")
            + (
                "; the prompt once per pair"
                if self.settings.prefix_sharing
                else "; the prompt with each answer"
            )
        )

    def collate(self, rows, device, prepared=None):
        margins = None
        if rows and "margin" in rows[0]:
            margins = torch.tensor([float(pair["margin"]) for pair in rows], dtype=torch.float32)
            margins = margins.to(device)
        batch = collate_pairs(rows, self.settings.prefix_sharing, device=device, pad_id=self.pad_id)
        return batch, margins

    def micro_batch(self, model, micro, weight):
        batch, margins = micro
        terms = reward_terms(reward_scores(model, batch), margins, self.reward.center_rewards_coefficient)
        return terms.losses.sum() / weight, metric_sums(terms)

    def summary(self, bins, last) -> dict:
        found = super().summary(bins, last)
        found["preference"] = {
            "objective": self.name,
            "center_rewards_coefficient": self.reward.center_rewards_coefficient,
            "prefix_sharing": self.settings.prefix_sharing,
            "pairs": sum(len(b) for b in bins),
            "last_step": None if last is None else {k: last[k] for k in self.metrics},
        }
        return found

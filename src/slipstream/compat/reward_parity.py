"""The compatibility sweep's *reward* column: an architecture's reward head (``training.objective: reward``)
on packed preference pairs, against transformers' own sequence classifier run on each sequence alone.

The architecture's sequence-classification twin of the stock model (its class from transformers' registry,
``num_labels=1``, seeded weights; the pad id set to a token some answer ends with, so the last-non-pad rule
is exercised) runs the sweep's preference pairs two ways: each ``prompt + answer`` alone through its stock
forward (eval, no grad: ``logits[0, 0]``, transformers' own pooling), and packed with the prompt shared
(``collate_pairs(prefix_sharing=True)``) through a copy under the verdict's options, each reward read from
``score`` at the answer's last non-pad token (:func:`slipstream.models.heads.reward_scores`). Within
``REWARD_TOLERANCE`` (relative to the largest reward) it passes; an architecture without a
sequence-classification class, or whose classifier is placed differently (another module than ``score``,
another token: :func:`slipstream.models.heads.check_reward_head`), is *refused* by name.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..models.heads import check_reward_head, sequence_classifier_class
from ..modes import eval_mode
from ..optimize import optimize
from ..parity import SEED, copy_model, policies_of
from .arm import ArmResult, failed

REWARD_TOLERANCE = 1e-4  # relative to the largest |reward| (fp32)


def reward_twin(stock: torch.nn.Module, pad_id: int, seed: int = SEED) -> torch.nn.Module:
    """The stock model's architecture as a one-label sequence classifier, seeded (HeadError: it has none)."""
    config = copy.deepcopy(stock.config)
    config.num_labels = 1
    config.get_text_config().pad_token_id = pad_id
    cls = sequence_classifier_class(config, f"{type(stock).__name__} (model_type {config.model_type!r})")
    torch.manual_seed(seed)
    twin = cls._from_config(
        config, attn_implementation=stock.config._attn_implementation, dtype=torch.float32
    )
    return twin.eval()


def check_reward(
    stock: torch.nn.Module, pairs: list[dict[str, list[int]]], options: dict[str, Any]
) -> ArmResult:
    """The reward column's outcome for ``stock`` on ``pairs`` under ``optimize(**options)``."""
    from ..models.heads import reward_scores
    from ..packing.pairs import collate_pairs

    model = stock
    try:
        pad_id = pairs[0]["chosen_ids"][-1]
        twin = reward_twin(stock, pad_id)
        with eval_mode(twin), torch.no_grad():
            want = torch.stack(
                [
                    twin(input_ids=torch.tensor([pair["prompt_ids"] + pair[key]])).logits.reshape(()).float()
                    for pair in pairs
                    for key in ("chosen_ids", "rejected_ids")
                ]
            )
        model = copy_model(twin)
        optimize(model, **{**options, "chunked_loss": False})
        model.eval()
        check_reward_head(model, pairs[0]["prompt_ids"] + pairs[0]["chosen_ids"])
        with torch.no_grad():
            got = reward_scores(model, collate_pairs(pairs, prefix_sharing=True, pad_id=pad_id))
        result = ArmResult("pass")
        result.logits_error = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        if not result.logits_error <= REWARD_TOLERANCE:
            result.status = "WRONG"
            result.detail = (
                f"packed rewards off by {result.logits_error:.2g} (relative; got "
                f"{[round(v, 5) for v in got.tolist()]}, alone {[round(v, 5) for v in want.tolist()]})"
            )
    except Exception as error:  # noqa: BLE001 - every failure is an outcome here
        result = failed(error)
    result.policies = policies_of(model)
    return result

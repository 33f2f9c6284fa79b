"""The reward head: an architecture without a sequence-classification class, or whose classifier reads
another token or module than ``score`` at the last non-pad token, is refused by name."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, CohereConfig, CTRLConfig
from transformers.modeling_outputs import SequenceClassifierOutputWithPast

from slipstream.models import build_model
from slipstream.models.heads import HeadError, auto_class, build_with_head, check_reward_head


def test_an_architecture_without_a_sequence_classifier_is_refused_by_name(tmp_path):
    config = CohereConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    with pytest.raises(
        HeadError, match=r"no sequence-classification class for CohereConfig \(model_type 'cohere'\)"
    ):
        build_with_head(config, "reward")
    config.save_pretrained(tmp_path)
    with pytest.raises(HeadError, match=f"{tmp_path}: transformers has no sequence-classification class"):
        auto_class(tmp_path, "reward")


def test_a_classifier_under_another_name_is_refused_by_name():
    config = CTRLConfig(vocab_size=64, n_embd=32, dff=64, n_layer=1, n_head=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)  # CTRL's head is 'classifier'
    with pytest.raises(HeadError, match="CTRLForSequenceClassification has no 'score' head"):
        check_reward_head(model, [3, 4, 5])


def test_a_head_that_pools_another_token_is_refused():
    model = build_model("llama", vocab_size=64, head="reward").eval()
    model.config.pad_token_id = 0
    check_reward_head(
        model, [3, 4, 5, 0]
    )  # a trailing pad id: transformers reads token 2, and so does the check

    def first_token(self, input_ids=None, **kwargs):  # a classifier that pools the first token instead
        logits = self.score(self.model(input_ids).last_hidden_state)
        return SequenceClassifierOutputWithPast(logits=logits[:, 0])

    model.forward = first_token.__get__(model)
    with pytest.raises(HeadError, match="its reward is not 'score' of the last token"):
        check_reward_head(model, [3, 4, 5])

"""A sequence-classification model directory as a GRPO reward, scored as TRL's ``GRPOTrainer`` scores one.

TRL (1.16, ``_calculate_rewards``) loads a reward named by path with
``AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)`` and its tokenizer from the
same place (the pad token set to EOS where it has none, and the model told which id pads, because it
scores the last token that is not padding); it scores ``prompt + completion`` — the chat template
applied to the messages where the prompt is a conversation — right-padded, without special tokens
added, in inference mode, and takes ``logits[:, 0]``. So does :class:`SequenceClassifierReward`.

A directory whose model is not a sequence classifier is refused by name: ``from_pretrained`` would
give it a freshly initialised score head, a reward of noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def is_reward_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


class SequenceClassifierReward:
    """Called like any reward function (keywords); ``logits[:, 0]`` of prompt + completion."""

    def __init__(self, path: Path, key: str) -> None:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
        if not any(name.endswith("ForSequenceClassification") for name in architectures):
            raise ValueError(
                f"'{key}': {path} is a model directory but not a sequence classifier (architectures: "
                f"{', '.join(architectures) or 'none'}); a reward model scores with a trained head"
            )
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.path = path
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        if torch.cuda.is_available():  # the rank's device (train sets it); a CPU run keeps it on the host
            self.model.to(torch.device("cuda", torch.cuda.current_device()))

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        import torch

        if isinstance(prompts[0], list):  # a conversation: the template over prompt + completion messages
            texts = [
                self.tokenizer.apply_chat_template(p + c, tokenize=False)
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(self.model.device)
        with torch.inference_mode():
            return self.model(**inputs).logits[:, 0].float().tolist()

"""Reward functions for examples/grpo.yaml, in TRL's convention (a TRL reward file works as it is):
``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, one value per completion.
Conversational prompts give completions as ``[{"role": "assistant", "content": text}]``."""

import re

_TAG = re.compile(r"<answer>\s*(-?[\d,]+)\s*</answer>\s*$")


def _text(completion):
    return completion[-1]["content"] if isinstance(completion, list) else completion


def ends_with_answer(prompts, completions, completion_ids, **columns):
    """1.0 when the completion ends with one number inside <answer></answer>, else 0.0."""
    return [1.0 if _TAG.search(_text(c).strip()) else 0.0 for c in completions]

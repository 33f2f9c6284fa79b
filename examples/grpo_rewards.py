"""Reward functions for examples/grpo.yaml, in TRL's convention (a TRL reward file works as it is):
``f(prompts, completions, completion_ids, **columns) -> list[float | None]``, one value per completion.
Conversational prompts give completions as ``[{"role": "assistant", "content": text}]``."""

import re

_TAG = re.compile(r"<answer>\s*(-?[\d,]+)\s*</answer>\s*$")
_ANY_TAG = re.compile(r"<answer>\s*(-?[\d,]+)\s*</answer>")


def _text(completion):
    return completion[-1]["content"] if isinstance(completion, list) else completion


def ends_with_answer(prompts, completions, completion_ids, **columns):
    """1.0 when the completion ends with one number inside <answer></answer>, else 0.0."""
    return [1.0 if _TAG.search(_text(c).strip()) else 0.0 for c in completions]


def mentions_answer(prompts, completions, completion_ids, answer, **columns):
    """Partial credit: 1.0 when the row's answer appears in the completion as a number, else 0.0."""
    return [
        1.0 if expected in re.findall(r"-?\d+", _text(c)) else 0.0 for c, expected in zip(completions, answer, strict=True)
    ]


def has_answer_tag(prompts, completions, completion_ids, **columns):
    """The format alone: 1.0 when the completion holds one number inside <answer></answer>, else 0.0."""
    return [1.0 if _ANY_TAG.search(_text(c)) else 0.0 for c in completions]

"""Chats through the tokenizer's own template, and which tokens are the assistant's.

Response-only labels need the token span of every assistant turn. Rather than rely on
``{% generation %}`` tags (few templates have them), we render the conversation twice per
assistant turn: up to the turn with the generation prompt (what the model sees before it
answers), and through the end of the turn. The tokens between are the answer, end-of-turn
marker included. That is only sound if each rendering is a token prefix of the longer one,
so we check it and name the row when a template breaks it (one that rewrites earlier turns,
say). Whitespace the template puts after the end-of-turn special token is formatting, not
something the model must learn to say, so it stays unlabelled.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from ..packing.batch import IGNORE_INDEX  # the label cross-entropy ignores
from .errors import DataError


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def tokenize_chat(
    messages: list[dict[str, str]], tokenizer: Any, response_only: bool, location: str
) -> dict[str, list[int]]:
    """``input_ids`` of the rendered chat; ``labels`` all of them, or only the assistant turns."""
    input_ids = _render_ids(tokenizer, messages, add_generation_prompt=False, location=location)
    if not response_only:
        return {"input_ids": input_ids, "labels": list(input_ids)}
    labels = [IGNORE_INDEX] * len(input_ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_ids(tokenizer, messages[:turn], add_generation_prompt=True, location=location)
        last_turn = turn == len(messages) - 1
        through = input_ids if last_turn else _render_ids(tokenizer, messages[: turn + 1], False, location)
        if through[: len(before)] != before or input_ids[: len(through)] != through:
            raise DataError(
                location,
                f"the chat template breaks the prefix property at messages[{turn}]: rendering the "
                "conversation up to a turn does not start the rendering of the longer conversation, "
                "so the assistant's tokens cannot be found",
            )
        start, stop = len(before), _end_of_turn(tokenizer, through, len(before), len(through))
        labels[start:stop] = input_ids[start:stop]
    return {"input_ids": input_ids, "labels": labels}


def _render_ids(
    tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool, location: str
) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as error:  # e.g. a template that insists on alternating roles
        raise DataError(location, f"the chat template rejected this conversation ({error})") from None
    # The template writes any BOS itself; apply_chat_template(tokenize=True) does the same.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _end_of_turn(tokenizer: Any, ids: list[int], start: int, stop: int) -> int:
    """Where the turn's last special token ends, if only whitespace follows it; else ``stop``."""
    special_ids = _special_ids(tokenizer)
    for index in range(stop - 1, start - 1, -1):
        if ids[index] in special_ids:
            trailing = ids[index + 1 : stop]
            return index + 1 if not tokenizer.decode(trailing).strip() else stop
    return stop


def _special_ids(tokenizer: Any) -> frozenset[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(token_id for token_id, token in tokenizer.added_tokens_decoder.items() if token.special)
    return frozenset(ids)

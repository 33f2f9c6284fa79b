"""Chats through the tokenizer's own template, and which tokens are the assistant's.

Response-only labels need the token span of every assistant turn *as the full conversation
renders it*. Rendering a conversation prefix per turn does not work for templates that
rewrite earlier turns (Qwen3 drops the reasoning of turns before the last user query and
renders only the last one with ``<think>``; DeepSeek-R1-style templates strip history
reasoning; GPT-OSS keeps the analysis channel of the final turn only), so the spans are found
in one rendering of the whole conversation:

- a template with ``{% generation %}`` markers says so itself
  (``return_assistant_tokens_mask``);
- otherwise the conversation is rendered a second time with every assistant-written string
  (content, reasoning, tool-call names and arguments) *rotated*: each letter or digit shifted
  by a per-turn amount, whitespace and ``<tags>`` kept, so lengths, emptiness and every
  branch a template takes stay the same. The characters that differ between the two
  renderings are exactly the assistant-written ones, and the shift tells which turn wrote
  each. A turn's labelled span starts after the generation prompt that opens it (what the
  template emits for ``add_generation_prompt``: the model generates everything after it) and
  ends with the first special token after its last written character (its end-of-turn
  marker: ``<|im_end|>``, ``<|end|>``, ``<|return|>``, ``<|eot_id|>``...). Whitespace the
  template puts after that marker is formatting, not something the model says.

So every assistant turn is trained on what the template renders for it: in Qwen3 the
reasoning of turns before the last user query is not rendered, hence not labelled; the
turns after it carry their ``<think>`` block (empty when the row has no reasoning). A row
whose template rewrites assistant text in a length-changing way, or whose turn has no
letter or digit to locate it by, is refused with its location: it cannot be labelled
exactly.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from jinja2 import TemplateError

from ..packing.batch import IGNORE_INDEX  # the label cross-entropy ignores
from .errors import DataError

_TAG = re.compile(r"<[^<>\s]{1,64}>")  # <think>, </think>, <tool_call>, <|im_end|>: templates test for these
_MAX_SHIFT = 25


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    location: str,
    add_generation_prompt: bool = False,
    tools: list | None = None,
) -> str:
    """The conversation as the template renders it (BOS included where the template writes it)."""
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as error:  # e.g. a template that insists on alternating roles
        raise DataError(location, f"the chat template rejected this conversation ({error})") from None
    except (TypeError, KeyError, AttributeError) as error:  # a field of a shape this template cannot read
        raise DataError(location, f"the chat template cannot render this conversation ({error})") from None


def chat_char_spans(
    tokenizer: Any, messages: list[dict[str, Any]], text: str, location: str, tools: list | None = None
) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the characters of ``text`` (the rendered chat) each assistant turn writes."""
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    rotated = render_chat(tokenizer, _rotated(messages, turns), location, tools=tools)
    if len(rotated) != len(text):
        raise DataError(
            location,
            "the chat template rewrites assistant text in a way that changes its length, so the "
            "assistant's tokens cannot be located exactly",
        )
    written = _written_by_turn(text, rotated, len(turns))
    for number, (first, _) in enumerate(written):
        if first is None:
            raise DataError(
                location,
                f"messages[{turns[number]}]: an assistant turn without a letter or digit cannot be "
                "located in the rendered chat",
            )
    prompt = generation_prompt(tokenizer)
    specials = _special_pattern(tokenizer)
    spans, previous_end = [], 0
    in_text_order = sorted(range(len(turns)), key=lambda number: written[number][0])
    for order, number in enumerate(in_text_order):
        first, last = written[number]
        start = text.rfind(prompt, previous_end, first) if prompt else -1
        if start < 0:
            raise DataError(
                location,
                f"messages[{turns[number]}]: the template does not open this assistant turn with its "
                f"generation prompt {prompt!r}, so where the answer starts is ambiguous",
            )
        start += len(prompt)
        following = in_text_order[order + 1 :]
        next_first = written[following[0]][0] if following else len(text)
        marker = specials.search(text, last + 1, next_first) if specials else None
        end = marker.end() if marker else last + 1
        spans.append((start, end))
        previous_end = end
    return spans


def labels_from_spans(
    input_ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """Each token's label: itself where it starts inside a span, else ignored."""
    labels = [IGNORE_INDEX] * len(input_ids)
    span_iter = iter(sorted(spans))
    span = next(span_iter, None)
    for index, (token_start, _) in enumerate(offsets):
        while span is not None and token_start >= span[1]:
            span = next(span_iter, None)
        if span is None:
            break
        if token_start >= span[0]:
            labels[index] = input_ids[index]
    return labels


def generation_marked_labels(tokenizer: Any, messages, location: str, tools=None) -> dict[str, list[int]]:
    """Labels from a template's own ``{% generation %}`` markers."""
    try:
        out = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except TemplateError as error:
        raise DataError(location, f"the chat template rejected this conversation ({error})") from None
    input_ids = list(out["input_ids"])
    mask = out["assistant_masks"]
    return {
        "input_ids": input_ids,
        "labels": [t if m else IGNORE_INDEX for t, m in zip(input_ids, mask, strict=True)],
    }


def has_generation_markers(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None


def generation_prompt(tokenizer: Any) -> str:
    """What the template adds for ``add_generation_prompt`` (the text the model continues from)."""
    return _generation_prompt(id(tokenizer), tokenizer.chat_template, tokenizer)


@lru_cache(maxsize=32)
def _generation_prompt(_id: int, _template: str, tokenizer: Any) -> str:
    probe = [{"role": "user", "content": "hello"}]
    without = render_chat(tokenizer, probe, "the chat template")
    with_prompt = render_chat(tokenizer, probe, "the chat template", add_generation_prompt=True)
    return with_prompt[len(without) :] if with_prompt.startswith(without) else ""


def _special_pattern(tokenizer: Any) -> re.Pattern | None:
    return _special_regex(id(tokenizer), tokenizer)


@lru_cache(maxsize=32)
def _special_regex(_id: int, tokenizer: Any) -> re.Pattern | None:
    strings = set(tokenizer.all_special_tokens)
    strings.update(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)
    strings.discard("")
    if not strings:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True)))


# ---- rotation: the same text, every letter and digit shifted by the turn's amount ----


def _shift(number: int) -> int:
    return number % _MAX_SHIFT + 1


def _rotated(messages: list[dict[str, Any]], turns: list[int]) -> list[dict[str, Any]]:
    out = list(messages)
    for number, index in enumerate(turns):
        out[index] = _rotate_value(messages[index], _shift(number), key=None)
    return out


def _rotate_value(value: Any, shift: int, key: str | None) -> Any:
    if key == "role" or key == "type" or key == "id" or key == "tool_call_id":
        return value  # structure the template branches on, not text the assistant writes
    if isinstance(value, str):
        return _rotate_text(value, shift)
    if isinstance(value, dict):
        return {k: _rotate_value(v, shift, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_rotate_value(v, shift, key) for v in value]
    return value


def _rotate_text(text: str, shift: int) -> str:
    pieces, position = [], 0
    for tag in _TAG.finditer(text):
        pieces.append("".join(_rotate_char(c, shift) for c in text[position : tag.start()]))
        pieces.append(tag.group())
        position = tag.end()
    pieces.append("".join(_rotate_char(c, shift) for c in text[position:]))
    return "".join(pieces)


def _rotate_char(c: str, shift: int) -> str:
    if "a" <= c <= "z":
        return chr((ord(c) - 97 + shift) % 26 + 97)
    if "A" <= c <= "Z":
        return chr((ord(c) - 65 + shift) % 26 + 65)
    if "0" <= c <= "9":
        return chr((ord(c) - 48 + shift) % 10 + 48)
    if ord(c) > 127 and c.isalnum():  # CJK, accented letters...: same escape width, still a letter
        code = ord(c) + shift
        same_plane = (code > 0xFFFF) == (ord(c) > 0xFFFF) and not 0xD800 <= code <= 0xDFFF
        if same_plane and chr(code).isalnum():
            return chr(code)
    return c


def _shift_of(real: str, rotated: str) -> tuple[int, int]:
    """(residue, modulus) of the shift that turned ``real`` into ``rotated``."""
    if real.isascii() and real.isalpha():
        return (ord(rotated) - ord(real)) % 26, 26
    if "0" <= real <= "9":
        return (ord(rotated) - ord(real)) % 10, 10
    return ord(rotated) - ord(real), 0  # exact


def _written_by_turn(text: str, rotated: str, count: int) -> list[tuple[int | None, int | None]]:
    """(first, last) character each assistant turn wrote, from where the two renderings differ.

    The shift identifies the turn (exactly for letters among up to 25 turns; a digit's or a
    26th turn's shift is shared, and then the turn being read, or the next one, is taken).
    """
    written: list[list[int | None]] = [[None, None] for _ in range(count)]
    current = 0
    for position, (a, b) in enumerate(zip(text, rotated, strict=True)):
        if a == b:
            continue
        residue, modulus = _shift_of(a, b)
        matching = [
            n for n in range(count) if (_shift(n) % modulus == residue if modulus else _shift(n) == residue)
        ]
        if not matching:
            continue  # not a character our rotation produced
        number = current if current in matching else next((n for n in matching if n > current), matching[0])
        current = number
        if written[number][0] is None:
            written[number][0] = position
        written[number][1] = position
    return [(first, last) for first, last in written]


def tokenize_chat(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    response_only: bool,
    location: str,
    tools: list | None = None,
) -> dict[str, list[int]]:
    """``input_ids`` of the rendered chat; ``labels`` all of them, or only the assistant turns."""
    if response_only and has_generation_markers(tokenizer):
        return generation_marked_labels(tokenizer, messages, location, tools)
    text = render_chat(tokenizer, messages, location, tools=tools)
    if not response_only:
        input_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": input_ids, "labels": list(input_ids)}
    spans = chat_char_spans(tokenizer, messages, text, location, tools)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = encoded["input_ids"]
    return {"input_ids": input_ids, "labels": labels_from_spans(input_ids, encoded["offset_mapping"], spans)}

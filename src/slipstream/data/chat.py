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

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import TemplateError

from .errors import DataError
from .labels import IGNORE_INDEX

_TAG = re.compile(r"<[^<>\s]{1,64}>")  # <think>, </think>, <tool_call>, <|im_end|>: templates test for these
_MAX_SHIFT = 25


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def read_chat_template(source: str | Path) -> str:
    """The chat template ``source`` holds: a text file of Jinja (``.jinja``), or a model or
    tokenizer directory (its ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template``, the ``default`` one of a list). ValueError saying why it cannot be used."""
    path = Path(source)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    try:
        template = _directory_template(path) if path.is_dir() else path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (a chat template is Jinja text)") from None
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error.strerror or error})") from None
    if "messages" not in template:  # every chat template loops over the conversation's messages
        raise ValueError(f"{path}: not a chat template (it never reads 'messages')")
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)  # the environment apply_chat_template renders in
    except TemplateError as error:
        raise ValueError(f"{path}: not a valid Jinja template ({error})") from None
    return template


def _directory_template(path: Path) -> str:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    config = path / "tokenizer_config.json"
    try:
        template = (
            json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
        )
    except (json.JSONDecodeError, AttributeError):
        template = None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ValueError(
            f"{path}: a directory without a chat template (no chat_template.jinja, no 'chat_template' "
            "in tokenizer_config.json)"
        )
    return template


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
    prompt = _generation_prompt(id(tokenizer), tokenizer.chat_template, tokenizer)
    specials = _special_regex(id(tokenizer), tokenizer)
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


@lru_cache(maxsize=32)
def _generation_prompt(_id: int, _template: str, tokenizer: Any) -> str:
    """What the template adds for ``add_generation_prompt`` (the text the model continues from)."""
    probe = [{"role": "user", "content": "hello"}]
    without = render_chat(tokenizer, probe, "the chat template")
    with_prompt = render_chat(tokenizer, probe, "the chat template", add_generation_prompt=True)
    return with_prompt[len(without) :] if with_prompt.startswith(without) else ""


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
    pieces = _TAG_SPLIT.split(text)  # text, tag, text, tag, ..., text
    for index in range(0, len(pieces), 2):
        piece = pieces[index].translate(_ascii_rotation(shift))
        if not piece.isascii():
            piece = _NON_ASCII_ALNUM.sub(lambda m: "".join(_rotate_char(c, shift) for c in m.group()), piece)
        pieces[index] = piece
    return "".join(pieces)


_TAG_SPLIT = re.compile(f"({_TAG.pattern})")
_NON_ASCII_ALNUM = re.compile(r"[^\x00-\x7f]+")


@lru_cache(maxsize=_MAX_SHIFT + 1)
def _ascii_rotation(shift: int) -> dict[int, int]:
    """``str.translate`` table shifting ASCII letters and digits by ``shift`` within their class."""
    table = {}
    for first, size in ((97, 26), (65, 26), (48, 10)):
        for offset in range(size):
            table[first + offset] = first + (offset + shift) % size
    return table


def _rotate_char(c: str, shift: int) -> str:
    """A non-ASCII letter or digit (CJK, accented...) shifted within its plane; anything else kept."""
    if c.isalnum():
        code = ord(c) + shift
        same_plane = (code > 0xFFFF) == (ord(c) > 0xFFFF) and not 0xD800 <= code <= 0xDFFF
        if same_plane and chr(code).isalnum():
            return chr(code)
    return c


def _written_by_turn(text: str, rotated: str, count: int) -> list[tuple[int | None, int | None]]:
    """(first, last) character each assistant turn wrote, from where the two renderings differ.

    The shift tells the turn: a letter's shift (mod 26), a digit's (mod 10) or another
    character's code-point difference. Up to 9 turns every shift is unambiguous and this is
    all numpy; beyond, a digit's or a 26th turn's shift is shared, and the turn being read
    (or the next one that matches) is taken.
    """
    real = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    other = np.frombuffer(rotated.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    positions = np.flatnonzero(real != other)
    a, b = real[positions], other[positions]
    letter = ((a >= 97) & (a <= 122)) | ((a >= 65) & (a <= 90))
    digit = (a >= 48) & (a <= 57)
    residue = np.where(letter, (b - a) % 26, np.where(digit, (b - a) % 10, b - a))
    modulus = np.where(letter, 26, np.where(digit, 10, 0))
    if count <= 9:
        number = np.where(digit & (residue == 0), -1, residue - 1)  # shift(n) = n + 1 for n < 9
        valid = (number >= 0) & (number < count)
        return _first_last(positions[valid], number[valid], count)
    numbers, current = [], 0
    shifts = [_shift(n) for n in range(count)]
    for r, m in zip(residue.tolist(), modulus.tolist(), strict=True):
        matching = [n for n in range(count) if (shifts[n] % m == r if m else shifts[n] == r)]
        if not matching:
            numbers.append(-1)
            continue
        current = current if current in matching else next((n for n in matching if n > current), matching[0])
        numbers.append(current)
    number = np.asarray(numbers, dtype=np.int64)
    valid = number >= 0
    return _first_last(positions[valid], number[valid], count)


def _first_last(positions: np.ndarray, number: np.ndarray, count: int) -> list[tuple[int | None, int | None]]:
    out: list[tuple[int | None, int | None]] = []
    for n in range(count):
        mine = positions[number == n]
        out.append((int(mine[0]), int(mine[-1])) if mine.size else (None, None))
    return out


def plan_chat(
    messages: list[dict[str, Any]],
    tokenizer: Any,
    response_only: bool,
    location: str,
    tools: list | None = None,
) -> tuple[str, list[tuple[int, int]] | None] | dict[str, list[int]]:
    """The rendered chat and its assistant character spans (``None``: label everything), to be
    tokenized (in batches) by the caller; or, for a template with ``{% generation %}`` markers,
    the finished sample."""
    if response_only and has_generation_markers(tokenizer):
        return generation_marked_labels(tokenizer, messages, location, tools)
    text = render_chat(tokenizer, messages, location, tools=tools)
    return text, (chat_char_spans(tokenizer, messages, text, location, tools) if response_only else None)

"""The three row shapes, detected per row, turned into ``input_ids`` and ``labels``.

- chat: ``{"messages": [{"role": "user", "content": "..."}, ...], "tools": [...] (optional)}``,
  rendered with the tokenizer's chat template. Besides ``role`` and ``content``, a message's
  ``reasoning_content`` / ``thinking`` (the fields Qwen3 / GPT-OSS templates read),
  ``tool_calls``, ``name`` and ``tool_call_id`` pass through to the template, as do ``tool``
  messages and the row's ``tools``;
- Alpaca: ``{"instruction": ..., "input": ... (optional), "output": ...}``, made a two-turn
  chat when the tokenizer has a template, else plain ``instruction\\n\\ninput\\n\\noutput``;
- plain ``{"text": ...}``: its tokens and EOS, all trained on (there is no prompt to leave out).

Every malformed row raises a ``DataError`` naming its location, so skip mode can count it.
Columnar files give ``None`` for a field a row lacks, so ``None`` counts as missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .chat import has_chat_template, plan_chat
from .errors import DataError, json_type
from .labels import IGNORE_INDEX

ROLES = ("system", "developer", "user", "assistant", "tool")
# Message fields handed to the template besides role and content, with the JSON type each must have.
PASSED_FIELDS = {
    "reasoning_content": str,
    "thinking": str,
    "name": str,
    "tool_call_id": str,
    "tool_calls": list,
}
SHAPE_FIELDS = ("messages", "instruction", "text")  # the field that tells a row's shape


@dataclass
class RowPlan:
    """A row rendered to text, waiting to be tokenized (rows are tokenized in batches).

    ``spans``: the characters to label (``None``: every token); ``special``: let the tokenizer
    add its special tokens (plain text); ``eos``: make sure the ids end with EOS. A row that
    was tokenized on its own already (a template with generation markers, a plain
    prompt/response pair) carries its ``sample`` instead.
    """

    location: str
    text: str = ""
    spans: list[tuple[int, int]] | None = None
    special: bool = False
    eos: bool = False
    sample: dict[str, list[int]] | None = None


def plan_row(
    record: dict[str, Any], tokenizer: Any, response_only: bool = False, location: str = "?"
) -> RowPlan:
    """Check and render one row (everything but tokenizing); ``DataError`` naming ``location`` if it is bad."""
    shape = _shape_of(record, location)
    if shape == "messages":
        messages = _chat_messages(record["messages"], location)
        if response_only and not any(message["role"] == "assistant" for message in messages):
            raise DataError(location, "response_only needs an assistant message; this chat has none")
        tools = record.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise DataError(location, f"'tools' must be a list of tool schemas, got {json_type(tools)}")
        _require_chat_template(tokenizer)
        return _chat_plan(
            plan_chat(messages, tokenizer, response_only, location, tools=tools or None), location
        )
    if shape == "instruction":
        prompt, response = _alpaca_prompt_and_response(record, location)
        if has_chat_template(tokenizer):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return _chat_plan(plan_chat(messages, tokenizer, response_only, location), location)
        sample = _tokenize_plain_prompt(prompt + "\n\n", response, tokenizer, response_only)
        return RowPlan(location, sample=_checked(sample, location))
    return RowPlan(location, text=_nonempty_string(record, "text", location), special=True, eos=True)


def _chat_plan(planned, location: str) -> RowPlan:
    if isinstance(planned, dict):
        return RowPlan(location, sample=_checked(planned, location))
    text, spans = planned
    return RowPlan(location, text=text, spans=spans)


def tokenize_planned(plans: Sequence[RowPlan], tokenizer: Any) -> list[dict[str, list[int]] | DataError]:
    """Tokenize every plan, one batch call per kind (a fast tokenizer's batch encoding runs on
    every core); each result a sample, or the ``DataError`` of a row that turned out empty."""
    results: list[dict[str, list[int]] | DataError | None] = [plan.sample for plan in plans]
    for special in (False, True):
        todo = [i for i, plan in enumerate(plans) if plan.sample is None and plan.special == special]
        if not todo:
            continue
        encodings = _encode_batch(tokenizer, [plans[i].text for i in todo], special)
        for i, encoding in zip(todo, encodings, strict=True):
            plan = plans[i]
            ids = list(encoding.ids) if hasattr(encoding, "ids") else encoding
            if plan.eos:
                ids = _with_eos(ids, tokenizer)
            labels = list(ids) if plan.spans is None else _span_labels(ids, encoding, plan.spans)
            try:
                results[i] = _checked({"input_ids": ids, "labels": labels}, plan.location)
            except DataError as error:
                results[i] = error
    return results


def _encode_batch(tokenizer: Any, texts: list[str], special: bool) -> list:
    """``tokenizers.Encoding`` objects from the fast tokenizer's Rust backend (ids and character
    positions without building Python offset lists), else plain id lists."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        return backend.encode_batch(texts, add_special_tokens=special)
    return tokenizer(texts, add_special_tokens=special)["input_ids"]


def _span_labels(ids: list[int], encoding: Any, spans: list[tuple[int, int]]) -> list[int]:
    """Label the tokens that start inside a span (the characters a turn writes) with themselves."""
    if not hasattr(encoding, "char_to_token"):  # a setup problem: never skipped
        raise ValueError(
            "response-only chat labels need a fast tokenizer (one that reports character offsets)"
        )
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        first = _token_at(encoding, start, end, step=1)
        last = _token_at(encoding, end - 1, start - 1, step=-1)
        if first is None or last is None:
            continue
        if encoding.token_to_chars(first)[0] < start:  # straddles the span's start: the prompt's
            first += 1
        labels[first : last + 1] = ids[first : last + 1]
    return labels


def _token_at(encoding: Any, position: int, stop: int, step: int) -> int | None:
    """The token covering ``position``, or the nearest one towards ``stop``."""
    for char in range(position, stop, step):
        token = encoding.char_to_token(char)
        if token is not None:
            return token
    return None


def tokenize_row(
    record: dict[str, Any], tokenizer: Any, response_only: bool = False, location: str = "?"
) -> dict[str, list[int]]:
    """``{"input_ids", "labels"}`` of one row; with ``response_only`` only the answer is labelled."""
    (result,) = tokenize_planned([plan_row(record, tokenizer, response_only, location)], tokenizer)
    if isinstance(result, DataError):
        raise result
    return result


def _checked(sample: dict[str, list[int]], location: str) -> dict[str, list[int]]:
    if not sample["input_ids"]:
        raise DataError(location, "the row tokenized to zero tokens")
    if sample["labels"].count(IGNORE_INDEX) == len(sample["labels"]):
        raise DataError(location, "the row has no response tokens to train on")
    return sample


def _shape_of(record: dict[str, Any], location: str) -> str:
    present = [name for name in SHAPE_FIELDS if record.get(name) is not None]
    if present:
        return present[0]
    named = [name for name in SHAPE_FIELDS if name in record]  # a column with a null in this row
    if named:
        raise DataError(location, f"missing field {named[0]!r}")
    keys = ", ".join(map(repr, record)) or "none"
    raise DataError(
        location,
        "missing field: expected 'messages' (chat), 'instruction' and 'output' (Alpaca) or 'text'; "
        f"the row has {keys}",
    )


def _chat_messages(messages: Any, location: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise DataError(
            location, f"'messages' must be a list of {{role, content}} objects, got {json_type(messages)}"
        )
    if not messages:
        raise DataError(location, "'messages' is empty")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise DataError(location, f"{where} must be a {{role, content}} object, got {json_type(message)}")
        role = message.get("role")
        if role is None:
            raise DataError(location, f"{where}: missing field 'role'")
        if role not in ROLES:
            raise DataError(location, f"{where}: unknown role {role!r} (expected {', '.join(ROLES)})")
        kept = {"role": role}
        for name, kind in PASSED_FIELDS.items():
            value = message.get(name)
            if value is None:
                continue
            if not isinstance(value, kind):
                raise DataError(
                    location,
                    f"{where}: {name!r} must be {'a string' if kind is str else 'a list'}, got {json_type(value)}",
                )
            kept[name] = value
        if (role == "tool" or (role == "assistant" and "tool_calls" in kept)) and not message.get("content"):
            # a turn that only calls tools (or a tool result without text) may have no content
            content = message.get("content") or ""
            if not isinstance(content, str):
                raise DataError(location, f"{where}: 'content' must be a string, got {json_type(content)}")
        else:
            content = _nonempty_string(message, "content", location, where=f"{where}: ")
        kept["content"] = content
        checked.append(kept)
    return checked


def _alpaca_prompt_and_response(record: dict[str, Any], location: str) -> tuple[str, str]:
    instruction = _nonempty_string(record, "instruction", location)
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise DataError(location, f"'input' must be a string, got {json_type(extra)}")
    response = _nonempty_string(record, "output", location)
    prompt = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
    return prompt, response


def _nonempty_string(record: dict[str, Any], name: str, location: str, where: str = "") -> str:
    value = record.get(name)
    if value is None:
        raise DataError(location, f"{where}missing field {name!r}")
    if not isinstance(value, str):
        raise DataError(location, f"{where}{name!r} must be a string, got {json_type(value)}")
    if not value.strip():
        raise DataError(location, f"{where}{name!r} is empty")
    return value


def _require_chat_template(tokenizer: Any) -> None:
    if not has_chat_template(tokenizer):  # a setup problem, not a row problem: never skipped
        raise ValueError("chat rows need a tokenizer with a chat template; this tokenizer has none")


def _tokenize_plain_prompt(
    prompt: str, response: str, tokenizer: Any, response_only: bool
) -> dict[str, list[int]]:
    """Prompt and response tokenized apart, as at inference, where the model continues the prompt's tokens."""
    eos = tokenizer.eos_token_id
    prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if eos is not None and prompt_ids[-1:] == [eos]:  # a post-processor that appends EOS to everything
        prompt_ids = prompt_ids[:-1]
    response_ids = _with_eos(tokenizer(response, add_special_tokens=False)["input_ids"], tokenizer)
    prompt_labels = [IGNORE_INDEX] * len(prompt_ids) if response_only else list(prompt_ids)
    return {"input_ids": prompt_ids + response_ids, "labels": prompt_labels + response_ids}


def _with_eos(ids: list[int], tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and ids[-1:] != [eos] else list(ids)

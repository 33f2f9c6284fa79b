"""Prompt rows for online RL (``training.objective: grpo``): a prompt to complete, and the columns its
reward functions read.

A row is ``{"prompt": ..., <any other columns>}`` (TRL's GRPO format). ``prompt`` is a string,
used as the model's text as it is (the tokenizer's special tokens added, as TRL does), or a
message list, rendered with the chat template and its generation prompt; an optional ``system``
string turns a string prompt into a conversation with that system message. Every other column
goes to the reward functions, one value per completion (``answer`` for a built-in
``answer_tag``, say). A prompt that leaves no room for ``grpo.max_new_tokens`` within
``data.max_seq_len`` is a bad row (named, or skipped with ``data.skip_bad_rows``), never cut:
a cut prompt asks another question.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from .chat import has_chat_template, render_chat
from .errors import BadRowPolicy, DataError, DataReport, json_type
from .readers import read_rows

# Names a reward function takes positionally: a column may not reuse them.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids")


def _messages(value: Any, location: str) -> list[dict[str, Any]]:
    if not value:
        raise DataError(location, "'prompt' is an empty message list")
    for number, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(location, f"'prompt'[{number}] must be a message with 'role' and 'content'")
    return list(value)


def tokenize_prompt(
    record: dict[str, Any], tokenizer: Any, *, room: int, location: str = "?", tools: list | None = None
) -> dict[str, Any]:
    """One row to ``{"prompt", "prompt_ids", "columns", "location"}``; ``room``: the most prompt tokens;
    ``tools``: what the chat template renders as the tools a rollout may call (``grpo.tools``)."""
    if "prompt" not in record:
        raise DataError(
            location, f"missing field 'prompt' (the row has {', '.join(map(repr, record)) or 'nothing'})"
        )
    prompt, system = record["prompt"], record.get("system")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise DataError(location, f"'system' must be a non-empty string, got {json_type(system)}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(location, "'prompt' is empty")
        if system is not None:
            prompt = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        prompt = _messages(prompt, location)
        if system is not None:
            prompt = [{"role": "system", "content": system}, *prompt]
    else:
        raise DataError(location, f"'prompt' must be a string or a message list, got {json_type(prompt)}")
    if tools and not isinstance(prompt, list):
        raise DataError(
            location,
            "grpo.tools renders the tools with the chat template: the prompt must be a message list "
            "(or have a 'system' beside it)",
        )
    if isinstance(prompt, list):
        if not has_chat_template(tokenizer):  # a setup problem, not a row problem: never skipped
            raise ValueError(
                "conversational prompts need a tokenizer with a chat template; this one has none"
            )
        text = render_chat(tokenizer, prompt, location, add_generation_prompt=True, tools=tools or None)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    else:
        ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        eos = tokenizer.eos_token_id
        if eos is not None and len(ids) > 1 and ids[-1] == eos:  # a post-processor that appends EOS
            ids = ids[:-1]
    if not ids:
        raise DataError(location, "'prompt' tokenized to zero tokens")
    if len(ids) > room:
        raise DataError(
            location,
            f"the prompt is {len(ids)} tokens, more than the {room} that data.max_seq_len leaves beside "
            "grpo.max_new_tokens (raise data.max_seq_len, or shorten the prompt)",
        )
    columns = {key: value for key, value in record.items() if key not in ("prompt", "system")}
    for name in RESERVED_COLUMNS:
        if name in columns:
            raise DataError(location, f"column {name!r} would clash with the reward functions' own argument")
    return {"prompt": prompt, "prompt_ids": ids, "columns": columns, "location": location}


def load_prompts(
    path: str | Path,
    tokenizer: Any,
    *,
    room: int,
    on_bad_row: BadRowPolicy = "error",
    tools: list | None = None,
) -> tuple[list[dict[str, Any]], DataReport]:
    """Every prompt row of ``path``, tokenized (``tools``: rendered into each); bad rows raise (or are
    skipped and reported)."""
    report = DataReport()
    rows = []
    for record, location in read_rows(path, on_bad_row, report):
        try:
            rows.append(tokenize_prompt(record, tokenizer, room=room, location=location, tools=tools))
        except DataError as error:
            report.reject(error, on_bad_row)
    report.count_used(len(rows), path, "prompt rows")
    return rows, report


def split_prompts(
    rows: list[dict], fraction: float, seed: int, source: str, noun: str = "prompts"
) -> tuple[list[dict], list[dict]]:
    """``(train, eval)``: a seeded ``fraction`` of the rows held out (never trained on)."""
    count = len(rows)
    if count < 2:
        raise DataError(
            source, f"data.eval_fraction {fraction:g} needs at least 2 usable {noun}, got {count}"
        )
    share = min(count - 1, max(1, round(fraction * count)))
    order = list(range(count))
    random.Random(f"slipstream eval split {seed}").shuffle(order)
    held = set(order[:share])
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]

"""Preference rows to tokenized pairs: ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (packed into
bins by :func:`slipstream.packing.pairs.pack_pairs`).

The formats users have (TRL's, and what Anthropic HH / UltraFeedback-style sets use):

- strings: ``{"prompt": "...", "chosen": "...", "rejected": "..."}``;
- conversational: ``"prompt"`` a message list (a shared system prompt, several turns), ``"chosen"`` /
  ``"rejected"`` a message list (the assistant's answer) or a string;
- implicit prompt: ``{"chosen": [messages], "rejected": [messages]}``, the prompt being the messages
  the two conversations share;
- an optional ``"system"`` string, put first as a system message of the prompt.

With a chat template the prompt is rendered with its generation prompt and each answer is what the
template writes after it (so the model is trained on exactly what it generates at inference);
without one (strings only) the prompt is tokenized with the tokenizer's special tokens and each
answer after it, ending with EOS. A row whose answers are identical or empty, or whose prompt alone
leaves no room for an answer within ``max_seq_len``, is a ``DataError`` naming the row (or skipped
and counted with ``on_bad_row="skip"``). A pair longer than ``max_seq_len`` (prompt once, both
answers) keeps its prompt whole and cuts its longer answer first; it is counted. With ``cut=False`` (a
reward model, which scores each answer's last token: a cut answer would be scored at another token)
such a pair is a ``DataError`` instead, as TRL's ``RewardTrainer`` drops pairs past its ``max_length``.

An optional ``"margin"`` (a finite number, TRL's ``RewardTrainer`` column) is kept on the pair as
``"margin"``; the reward model's loss subtracts it (a pair objective that has no margin ignores it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chat import has_chat_template, render_chat
from .errors import BadRowPolicy, DataError, DataReport, json_type
from .readers import read_rows
from .shapes import _chat_messages, _with_eos

Pair = dict[str, Any]  # the three token-id lists, and "margin" where the row gives one
PAIR_FIELDS = ("prompt", "chosen", "rejected", "system", "margin")


@dataclass
class PairReport:
    """What became of the rows: the ``DataReport`` counts plus the pairs whose answers were cut."""

    data: DataReport = field(default_factory=DataReport)
    truncated: int = 0
    prompt_tokens: int = 0
    answer_tokens: int = 0  # chosen + rejected

    def summary(self) -> str:
        used = max(self.data.rows_used, 1)
        line = self.data.summary()
        line += (
            f"; pairs: prompt {self.prompt_tokens / used:.0f} tokens on average, each answer "
            f"{self.answer_tokens / (2 * used):.0f}"
        )
        if self.truncated:
            line += f"; {self.truncated} pair(s) cut to max_seq_len (their longer answer first)"
        return line

    def to_dict(self) -> dict:
        return {
            "rows_read": self.data.rows_read,
            "pairs": self.data.rows_used,
            "skipped": len(self.data.skipped),
            "truncated": self.truncated,
            "mean_prompt_tokens": self.prompt_tokens / max(self.data.rows_used, 1),
            "mean_answer_tokens": self.answer_tokens / max(2 * self.data.rows_used, 1),
        }


def load_pairs(
    path: str | Path,
    tokenizer: Any,
    *,
    max_seq_len: int,
    on_bad_row: BadRowPolicy = "error",
    cut: bool = True,
) -> tuple[list[Pair], PairReport]:
    """Read and tokenize every preference row of ``path``; see the module docstring."""
    report = PairReport()
    pairs: list[Pair] = []
    for record, location in read_rows(path, on_bad_row, report.data):
        try:
            pair, was_cut = tokenize_pair(
                record, tokenizer, max_seq_len=max_seq_len, location=location, cut=cut
            )
        except DataError as error:
            report.data.reject(error, on_bad_row)
            continue
        pairs.append(pair)
        report.truncated += was_cut
        report.prompt_tokens += len(pair["prompt_ids"])
        report.answer_tokens += len(pair["chosen_ids"]) + len(pair["rejected_ids"])
    report.data.count_used(len(pairs), path, "preference rows")
    return pairs, report


def tokenize_pair(
    record: dict[str, Any], tokenizer: Any, *, max_seq_len: int, location: str = "?", cut: bool = True
) -> tuple[Pair, bool]:
    """One row to a pair, and whether its answers were cut to fit ``max_seq_len`` (``cut=False``: a
    pair that does not fit is a DataError)."""
    unknown = [key for key in record if key not in PAIR_FIELDS]
    if unknown and not any(key in record for key in ("chosen", "rejected")):
        raise DataError(
            location,
            f"not a preference row: expected 'prompt', 'chosen' and 'rejected', got {', '.join(map(repr, record))}",
        )
    for name in ("chosen", "rejected"):
        if record.get(name) is None:
            raise DataError(location, f"missing field {name!r}")
    prompt, chosen, rejected = _prompt_and_answers(record, location)
    if isinstance(prompt, str):
        prompt_ids, chosen_ids, rejected_ids = _plain(prompt, chosen, rejected, tokenizer, location)
    else:
        if not has_chat_template(tokenizer):  # a setup problem, not a row problem: never skipped
            raise ValueError(
                "conversational preference rows need a tokenizer with a chat template; this one has none"
            )
        prompt_ids, chosen_ids, rejected_ids = _chat(prompt, chosen, rejected, tokenizer, location)
    if chosen_ids == rejected_ids:
        raise DataError(location, "'chosen' and 'rejected' are the same answer: the pair prefers nothing")
    room = max_seq_len - len(prompt_ids)
    if room < 2:
        raise DataError(
            location,
            f"the prompt alone is {len(prompt_ids)} tokens, leaving no room for the answers within "
            f"data.max_seq_len {max_seq_len}",
        )
    too_long = len(chosen_ids) + len(rejected_ids) > room
    if too_long and not cut:
        raise DataError(
            location,
            f"the pair is {len(prompt_ids) + len(chosen_ids) + len(rejected_ids)} tokens (prompt once, both "
            f"answers), past data.max_seq_len {max_seq_len}; a reward model scores each answer's last "
            "token, so the pair is not cut: raise data.max_seq_len or drop the row (data.skip_bad_rows)",
        )
    while len(chosen_ids) + len(rejected_ids) > room:
        if len(chosen_ids) >= len(rejected_ids):
            chosen_ids = chosen_ids[: max(1, room - len(rejected_ids))]
        else:
            rejected_ids = rejected_ids[: max(1, room - len(chosen_ids))]
    if chosen_ids == rejected_ids:
        raise DataError(
            location, f"cut to data.max_seq_len {max_seq_len}, 'chosen' and 'rejected' are the same"
        )
    pair: dict[str, Any] = {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
    if "margin" in record:
        pair["margin"] = _margin(record["margin"], location)
    return pair, too_long


def _margin(value: Any, location: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise DataError(location, f"'margin' must be a finite number, got {json_type(value)} {value!r}")
    return float(value)


def _prompt_and_answers(record, location):
    """(prompt, chosen, rejected): a string prompt with string answers, or messages throughout."""
    system = record.get("system")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise DataError(location, f"'system' must be a non-empty string, got {json_type(system)}")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if prompt is None:
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise DataError(location, "missing field 'prompt' (only conversations can leave it implicit)")
        chosen = _chat_messages(chosen, f"{location}: 'chosen'")
        rejected = _chat_messages(rejected, f"{location}: 'rejected'")
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise DataError(location, "'chosen' and 'rejected' share no prompt message (give 'prompt')")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not chosen or not rejected:
            raise DataError(
                location, "'chosen' and 'rejected' are the same conversation: the pair prefers nothing"
            )
    elif isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(location, "'prompt' is empty")
        if isinstance(chosen, list) or isinstance(rejected, list) or system is not None:
            prompt = [{"role": "user", "content": prompt}]
    else:
        if not isinstance(prompt, list):
            raise DataError(location, f"'prompt' must be a string or a message list, got {json_type(prompt)}")
        prompt = _chat_messages(prompt, f"{location}: 'prompt'")
    if isinstance(prompt, list):
        if system is not None:
            prompt = [{"role": "system", "content": system}, *prompt]
        chosen, rejected = (
            _answer_messages(a, name, location) for a, name in ((chosen, "chosen"), (rejected, "rejected"))
        )
        return prompt, chosen, rejected
    for value, name in ((chosen, "chosen"), (rejected, "rejected")):
        if not isinstance(value, str):
            raise DataError(
                location, f"{name!r} must be a string (the prompt is one), got {json_type(value)}"
            )
        if not value.strip():
            raise DataError(location, f"{name!r} is empty")
    return prompt, chosen, rejected


def _answer_messages(answer, name: str, location: str) -> list[dict[str, Any]]:
    if isinstance(answer, str):
        if not answer.strip():
            raise DataError(location, f"{name!r} is empty")
        return [{"role": "assistant", "content": answer}]
    if not isinstance(answer, list):
        raise DataError(location, f"{name!r} must be a string or a message list, got {json_type(answer)}")
    messages = _chat_messages(answer, f"{location}: {name!r}")
    if messages[-1]["role"] != "assistant":
        raise DataError(
            location, f"{name!r} must end with an assistant message, not {messages[-1]['role']!r}"
        )
    return messages


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _plain(prompt: str, chosen: str, rejected: str, tokenizer, location: str):
    eos = tokenizer.eos_token_id
    prompt_ids = _encode(tokenizer, prompt, True)
    if eos is not None and prompt_ids[-1:] == [eos]:  # a post-processor that appends EOS to everything
        prompt_ids = prompt_ids[:-1]
    if not prompt_ids:
        raise DataError(location, "'prompt' tokenized to zero tokens")
    answers = [_with_eos(_encode(tokenizer, answer, False), tokenizer) for answer in (chosen, rejected)]
    return prompt_ids, *answers


def _chat(prompt, chosen, rejected, tokenizer, location: str):
    prompt_text = render_chat(tokenizer, prompt, location, add_generation_prompt=True)
    answers = []
    for messages, name in ((chosen, "chosen"), (rejected, "rejected")):
        full = render_chat(tokenizer, [*prompt, *messages], location)
        if not full.startswith(prompt_text):
            raise DataError(
                location,
                f"the chat template does not write {name!r} after the prompt's generation prompt, so where the "
                "answer starts is ambiguous",
            )
        ids = _encode(tokenizer, full[len(prompt_text) :], False)
        if not ids:
            raise DataError(location, f"{name!r} rendered to zero tokens")
        answers.append(ids)
    prompt_ids = _encode(tokenizer, prompt_text, False)
    return prompt_ids, *answers

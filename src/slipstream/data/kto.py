"""KTO rows (TRL's unpaired format) to tokenized rows ``{"prompt_ids", "completion_ids", "label"}``
(binned, with their KL completions, by :func:`slipstream.packing.kto.pack_kto`).

TRL's format: ``{"prompt": ..., "completion": ..., "label": true|false}``, the prompt a string or a
message list, the completion a string or a message list (the assistant's answer), ``label`` whether
the completion is desirable; an optional ``"system"`` string is put first as a system message (as
for preference pairs). Tokenized as the DPO pairs are (:mod:`.pairs`): with a chat template the
prompt is rendered with its generation prompt and the completion is what the template writes after
it; without one (strings only) the prompt takes the tokenizer's special tokens and the completion
ends with EOS. ``label`` must be a JSON boolean (``1`` or ``"true"`` is refused: a mislabelled set
trains the wrong way silently). A bad row is a ``DataError`` naming file:line and the key (or
skipped and counted with ``on_bad_row="skip"``). A row longer than ``max_seq_len`` (prompt, then
the completion ``copies`` times: its own and the KL baseline's, which has the same length on
average within a bin) keeps its prompt whole and cuts its completion; it is counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .chat import has_chat_template, render_chat
from .errors import BadRowPolicy, DataError, json_type
from .pairs import PairReport, _answer_messages, _encode
from .readers import read_rows
from .shapes import _chat_messages, _with_eos

KTO_FIELDS = ("prompt", "completion", "label", "system")


def load_kto_rows(
    path: str | Path,
    tokenizer: Any,
    *,
    max_seq_len: int,
    copies: int = 2,
    on_bad_row: BadRowPolicy = "error",
) -> tuple[list[dict], PairReport]:
    """Read and tokenize every KTO row of ``path``; see the module docstring. The report counts
    each row's completion as its answer (``PairReport``: prompt and answer tokens, rows cut)."""
    report = PairReport()
    rows: list[dict] = []
    for record, location in read_rows(path, on_bad_row, report.data):
        try:
            row, cut = tokenize_kto_row(
                record, tokenizer, max_seq_len=max_seq_len, copies=copies, location=location
            )
        except DataError as error:
            report.data.reject(error, on_bad_row)
            continue
        rows.append(row)
        report.truncated += cut
        report.prompt_tokens += len(row["prompt_ids"])
        report.answer_tokens += 2 * len(row["completion_ids"])  # PairReport halves it per answer
    report.data.count_used(len(rows), path, "KTO rows")
    return rows, report


def tokenize_kto_row(
    record: dict[str, Any], tokenizer: Any, *, max_seq_len: int, copies: int = 2, location: str = "?"
) -> tuple[dict, bool]:
    """One row to ``{"prompt_ids", "completion_ids", "label"}``, and whether its completion was cut."""
    if "chosen" in record or "rejected" in record:
        raise DataError(
            location,
            "a paired row ('chosen' / 'rejected'): training.objective kto reads TRL's unpaired rows "
            "{'prompt', 'completion', 'label'} (TRL's unpair_preference_dataset turns pairs into them)",
        )
    unknown = [key for key in record if key not in KTO_FIELDS]
    if unknown:
        raise DataError(
            location,
            f"not a KTO row: expected 'prompt', 'completion' and 'label', got {', '.join(map(repr, record))}",
        )
    for name in ("prompt", "completion", "label"):
        if record.get(name) is None:
            raise DataError(location, f"missing field {name!r}")
    label = record["label"]
    if not isinstance(label, bool):
        raise DataError(
            location,
            f"'label' must be true or false (is the completion desirable), got {json_type(label)} {label!r}",
        )
    prompt, completion = _prompt_and_completion(record, location)
    if isinstance(prompt, str):
        prompt_ids = _encode(tokenizer, prompt, True)
        eos = tokenizer.eos_token_id
        if eos is not None and prompt_ids[-1:] == [eos]:  # a post-processor that appends EOS to everything
            prompt_ids = prompt_ids[:-1]
        if not prompt_ids:
            raise DataError(location, "'prompt' tokenized to zero tokens")
        completion_ids = _with_eos(_encode(tokenizer, completion, False), tokenizer)
    else:
        if not has_chat_template(tokenizer):  # a setup problem, not a row problem: never skipped
            raise ValueError(
                "conversational KTO rows need a tokenizer with a chat template; this one has none"
            )
        prompt_text = render_chat(tokenizer, prompt, location, add_generation_prompt=True)
        full = render_chat(tokenizer, [*prompt, *completion], location)
        if not full.startswith(prompt_text):
            raise DataError(
                location,
                "the chat template does not write 'completion' after the prompt's generation prompt, so where "
                "the completion starts is ambiguous",
            )
        completion_ids = _encode(tokenizer, full[len(prompt_text) :], False)
        if not completion_ids:
            raise DataError(location, "'completion' rendered to zero tokens")
        prompt_ids = _encode(tokenizer, prompt_text, False)
    room = (max_seq_len - len(prompt_ids)) // copies
    if room < 1:
        raise DataError(
            location,
            f"the prompt alone is {len(prompt_ids)} tokens, leaving no room for the completion within "
            f"data.max_seq_len {max_seq_len}",
        )
    cut = len(completion_ids) > room
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids[:room], "label": label}, cut


def _prompt_and_completion(record: dict[str, Any], location: str):
    """(prompt, completion): two strings, or messages throughout (a string completion after a
    conversational prompt is the assistant's message)."""
    system, prompt, completion = record.get("system"), record["prompt"], record["completion"]
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise DataError(location, f"'system' must be a non-empty string, got {json_type(system)}")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(location, "'prompt' is empty")
        if isinstance(completion, list) or system is not None:
            prompt = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        prompt = _chat_messages(prompt, f"{location}: 'prompt'")
    else:
        raise DataError(location, f"'prompt' must be a string or a message list, got {json_type(prompt)}")
    if isinstance(prompt, list):
        if system is not None:
            prompt = [{"role": "system", "content": system}, *prompt]
        return prompt, _answer_messages(completion, "completion", location)
    if not isinstance(completion, str):
        raise DataError(
            location, f"'completion' must be a string (the prompt is one), got {json_type(completion)}"
        )
    if not completion.strip():
        raise DataError(location, "'completion' is empty")
    return prompt, completion

"""A turn's tool calls, read in the chat template's own format; a tool result's tokens, rendered as the
template renders it.

Formats (chosen from the chat template's text, at start):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call, text
  before them the turn's content (Qwen2.5, Qwen3, Hermes and the ChatML templates built on them). A
  ``<think>...</think>`` block is the turn's ``reasoning_content``, as TRL's Qwen3 parser reads it.
- ``llama3``: the whole turn one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1 / 3.2's
  ``ipython`` tool calls; one call per turn, no content beside it).

Any other template is refused at start, by name. A call that does not parse (bad JSON, no name) makes the
turn plain text, as TRL's ``parse_response`` falls back, so the trajectory ends there; it is counted.

The result's tokens (:meth:`ToolFormat.result_ids`) are what TRL appends: the template's rendering of a
conversation with the tool messages and the next assistant header, after the calling turn's end-of-turn
token; the model's own turn (its tokens, end-of-turn included) is kept exactly as sampled.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .tools import ToolError

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
THINK = re.compile(r"<think>(.*?)</think>\s*", re.DOTALL)


@dataclass
class Turn:
    """One assistant turn as the reward functions and the tools see it (TRL's message shape)."""

    content: str
    # [{"type": "function", "function": {"name", "arguments"}}]
    calls: list[dict] = field(default_factory=list)
    malformed: bool = False  # it tried to call a tool and the call did not parse
    reasoning: str | None = None

    def message(self) -> dict:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.calls:
            out["tool_calls"] = self.calls
        return out


def _function(data: Any, key: str) -> dict | None:
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get(key)
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "function", "function": {"name": data["name"], "arguments": arguments}}


@dataclass
class ToolFormat:
    """The template's tool-call format and how its tool results render, for one tokenizer."""

    name: str  # hermes | llama3
    tokenizer: Any
    end_of_turn: int  # the token that ends an assistant turn (the tokenizer's EOS)
    chat_template: str | None = None
    _suffixes: dict = field(default_factory=dict)

    @classmethod
    def of(cls, tokenizer, chat_template: str | None = None) -> ToolFormat:
        template = chat_template or tokenizer.chat_template
        if not isinstance(template, str) or not template:
            raise ToolError("grpo.tools: the tokenizer has no chat template to render the tools with")
        if "<tool_call>" in template:
            name = "hermes"
        elif "<|python_tag|>" in template or "Environment: ipython" in template:
            name = "llama3"
        else:
            raise ToolError(
                "grpo.tools: the chat template renders no tool-call format slipstream reads (Qwen/Hermes "
                "<tool_call> JSON, Llama 3.x JSON); give a template that does with data.chat_template"
            )
        if tokenizer.eos_token_id is None:
            raise ToolError("grpo.tools: the tokenizer has no EOS token to end an assistant turn with")
        return cls(name, tokenizer, int(tokenizer.eos_token_id), chat_template)

    # ------------------------------------------------------------------ parsing
    def parse(self, ids: list[int]) -> Turn:
        """One sampled turn's text and tool calls (its end-of-turn token, where sampled, dropped)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        eos = self.tokenizer.eos_token
        if eos and text.endswith(eos):
            text = text[: -len(eos)]
        return self._hermes(text) if self.name == "hermes" else self._llama3(text)

    def _hermes(self, text: str) -> Turn:
        reasoning = None
        think = THINK.search(text)
        if think and text[: think.start()].strip() == "":
            reasoning = think.group(1).strip()
            text = text[think.end() :]
        if "<tool_call>" not in text:
            return Turn(self._plain(text), reasoning=reasoning)
        calls = []
        for block in HERMES_CALL.findall(text):
            try:
                call = _function(json.loads(block.strip()), "arguments")
            except ValueError:
                call = None
            if call is None:
                return Turn(self._plain(text), malformed=True, reasoning=reasoning)
            calls.append(call)
        if not calls:  # an opened call never closed
            return Turn(self._plain(text), malformed=True, reasoning=reasoning)
        content = text[: text.index("<tool_call>")].strip()
        return Turn(content, calls, reasoning=reasoning)

    def _llama3(self, text: str) -> Turn:
        body = text.removeprefix("<|python_tag|>").strip()
        if not body.startswith('{"name"'):
            return Turn(self._plain(text))
        try:
            call = _function(json.loads(body), "parameters")
        except ValueError:
            call = None
        if call is None:
            return Turn(self._plain(text), malformed=True)
        return Turn("", [call])

    def _plain(self, text: str) -> str:
        """The turn's text as TRL's fallback decodes it: special tokens removed."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()

    # ------------------------------------------------------------------ rendering
    def result_ids(self, calls: list[dict], results: list[tuple[str, str | list]]) -> list[int]:
        """The tokens after a turn that called ``calls``: each result as the template's ``tool`` message,
        then the next assistant turn's header."""
        key = json.dumps([calls, results], sort_keys=True, default=str)
        if key in self._suffixes:
            return self._suffixes[key]
        dummy = [
            {"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": calls},
        ]
        tools = [{"role": "tool", "name": name, "content": content} for name, content in results]
        render = dict(tokenize=True, return_dict=False, chat_template=self.chat_template)
        prefix = list(self.tokenizer.apply_chat_template(dummy, add_generation_prompt=False, **render))
        full = list(self.tokenizer.apply_chat_template(dummy + tools, add_generation_prompt=True, **render))
        # the results start after the assistant turn's end-of-turn token: the k-th in the rendering with
        # them, k counted in the rendering without (a template may render that turn differently once it
        # is not the last, as Qwen3's drops an empty think block: the model's turn stays as it sampled it)
        k = sum(1 for token in prefix if token == self.end_of_turn)
        ends = [i for i, token in enumerate(full) if token == self.end_of_turn]
        if k == 0 or len(ends) < k:
            raise ToolError(
                "grpo.tools: the chat template does not end an assistant turn with the tokenizer's EOS "
                f"{self.tokenizer.eos_token!r}; slipstream cannot tell where a tool's result starts"
            )
        suffix = full[ends[k - 1] + 1 :]
        if len(self._suffixes) < 4096:
            self._suffixes[key] = suffix
        return suffix

    def check(self, tools: list) -> None:
        """At start: the template renders the tools and a whole tool round trip (else one line naming why)."""
        call = [{"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}]
        try:
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}],
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=False,
                chat_template=self.chat_template,
            )
            self.result_ids(call, [("probe", "1")])
        except ToolError:
            raise
        except Exception as error:
            raise ToolError(
                f"grpo.tools: the chat template cannot render tools and their results "
                f"({type(error).__name__}: {' '.join(str(error).split())})"
            ) from None

"""Tool calls read in the chat template's format, and a tool result's tokens exactly as the template
renders the conversation: prompt + the model's turn + the result = the rendered conversation with the
next assistant header (Qwen3's real template)."""

from __future__ import annotations

import pytest

from slipstream.agents.calls import ToolFormat
from slipstream.agents.tools import ToolError


def lookup(key: str) -> str:
    """Look a key up in the almanac.

    Args:
        key: the entry to look up
    """
    return key


CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "velmora"}}\n</tool_call>'


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_hermes_call_parses_as_trls_message(qwen3_tokenizer):
    fmt = ToolFormat.of(qwen3_tokenizer)
    assert fmt.name == "hermes" and fmt.end_of_turn == qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    turn = fmt.parse(ids(qwen3_tokenizer, "Let me look.\n" + CALL + "<|im_end|>"))
    assert turn.message() == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"key": "velmora"}}}],
    }
    two = fmt.parse(ids(qwen3_tokenizer, CALL + "\n" + CALL.replace("velmora", "kaldun") + "<|im_end|>"))
    assert [c["function"]["arguments"]["key"] for c in two.calls] == ["velmora", "kaldun"]
    thought = fmt.parse(ids(qwen3_tokenizer, "<think>\nI should look.\n</think>\n\n" + CALL + "<|im_end|>"))
    assert thought.reasoning == "I should look." and thought.calls and not thought.malformed


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "lookup", "arguments": {"key": }\n</tool_call>',  # bad JSON
        '<tool_call>\n{"arguments": {"key": "x"}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}',  # never closed
    ],
)
def test_a_malformed_call_is_plain_text_and_counted(qwen3_tokenizer, text):
    turn = ToolFormat.of(qwen3_tokenizer).parse(ids(qwen3_tokenizer, text + "<|im_end|>"))
    assert turn.malformed and not turn.calls and "tool_calls" not in turn.message()


def test_an_answer_without_a_call_is_the_turns_content(qwen3_tokenizer):
    turn = ToolFormat.of(qwen3_tokenizer).parse(ids(qwen3_tokenizer, "It is a bridge town.<|im_end|>"))
    assert turn.message() == {"role": "assistant", "content": "It is a bridge town."} and not turn.malformed


def test_the_trajectory_is_the_conversation_the_template_renders(qwen3_tokenizer):
    tok = qwen3_tokenizer
    fmt = ToolFormat.of(tok)
    messages = [{"role": "user", "content": "Where is Velmora?"}]
    prompt = tok.apply_chat_template(
        messages, tools=[lookup], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    turn = ids(tok, CALL + "<|im_end|>")  # what the model sampled, its end-of-turn token included
    parsed = fmt.parse(turn)
    suffix = fmt.result_ids(parsed.calls, [("lookup", "a bridge town")])
    conversation = messages + [
        parsed.message(),
        {"role": "tool", "name": "lookup", "content": "a bridge town"},
    ]
    rendered = tok.apply_chat_template(
        conversation, tools=[lookup], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(prompt) + turn + suffix == list(rendered)
    assert "<tool_response>" in tok.decode(suffix) and tok.decode(suffix).endswith("<|im_start|>assistant\n")


def test_llama3_calls_are_one_json_object_with_parameters(qwen3_tokenizer):
    fmt = ToolFormat.of(qwen3_tokenizer, chat_template="{{ '<|python_tag|>' }}{{ messages }}")
    assert fmt.name == "llama3"
    turn = fmt.parse(ids(qwen3_tokenizer, '{"name": "lookup", "parameters": {"key": "velmora"}}<|im_end|>'))
    assert turn.calls == [
        {"type": "function", "function": {"name": "lookup", "arguments": {"key": "velmora"}}}
    ]
    assert fmt.parse(ids(qwen3_tokenizer, '{"name": "lookup", "parameters": {"key": }')).malformed
    assert fmt.parse(ids(qwen3_tokenizer, "Velmora is a town.")).message()["content"] == "Velmora is a town."


def test_a_template_without_a_tool_format_is_refused_by_name(qwen3_tokenizer):
    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ToolError, match=r"renders no tool-call format .*Qwen/Hermes.*Llama 3"):
        ToolFormat.of(qwen3_tokenizer, chat_template=plain)

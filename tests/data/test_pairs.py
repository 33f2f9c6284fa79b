"""Preference rows to tokenized pairs: every row format, and every bad row named by file:line."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from slipstream.data.errors import DataError
from slipstream.data.pairs import load_pairs, tokenize_pair
from slipstream.data.prompts import split_prompts
from slipstream.packing.pairs import pack_pairs, pair_tokens


@pytest.fixture(scope="module")
def tokenizer(_session_demo_tokenizer):
    """The demo tokenizer (it has a chat template: ``<|im_start|>role\\n...<|im_end|>\\n``)."""
    loaded = PreTrainedTokenizerFast.from_pretrained(str(_session_demo_tokenizer), local_files_only=True)
    assert loaded.chat_template and loaded.eos_token_id is not None
    return loaded


@pytest.fixture
def plain_tokenizer(_session_demo_tokenizer):
    loaded = PreTrainedTokenizerFast.from_pretrained(str(_session_demo_tokenizer), local_files_only=True)
    loaded.chat_template = None
    return loaded


def write_rows(tmp_path: Path, rows: list, name="pairs.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def encode(tokenizer, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


GOOD = {"prompt": "What is two plus two?", "chosen": "It is four.", "rejected": "It is five."}


# ----------------------------------------------------------------------------- formats


def test_string_rows_tokenize_the_prompt_with_specials_and_each_answer_with_eos(tokenizer):
    pair, cut = tokenize_pair(GOOD, tokenizer, max_seq_len=256)
    assert not cut
    eos = tokenizer.eos_token_id
    assert pair["prompt_ids"] == encode(tokenizer, GOOD["prompt"], special=True)
    assert pair["chosen_ids"] == encode(tokenizer, GOOD["chosen"]) + [eos]
    assert pair["rejected_ids"] == encode(tokenizer, GOOD["rejected"]) + [eos]


def chat_expected(tokenizer, prompt, answer):
    """(prompt ids, answer ids) as the chat template writes them: the answer is what follows the generation prompt."""
    prompt_text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*prompt, *answer], tokenize=False)
    assert full.startswith(prompt_text)
    return encode(tokenizer, prompt_text), encode(tokenizer, full[len(prompt_text) :])


def test_message_rows_with_a_system_prompt_and_several_turns(tokenizer):
    prompt = [system("You are terse."), user("Hi."), assistant("Hello."), user("Name a colour.")]
    row = {"prompt": prompt, "chosen": [assistant("Blue.")], "rejected": "Seven."}  # a string answer too
    pair, cut = tokenize_pair(row, tokenizer, max_seq_len=256)
    assert not cut
    prompt_ids, chosen_ids = chat_expected(tokenizer, prompt, [assistant("Blue.")])
    _, rejected_ids = chat_expected(tokenizer, prompt, [assistant("Seven.")])
    assert pair == {"prompt_ids": prompt_ids, "chosen_ids": chosen_ids, "rejected_ids": rejected_ids}
    # prompt + answer is the whole conversation as the template renders it, and the answer opens
    # right after the generation prompt the model sees at inference
    full = tokenizer.apply_chat_template([*prompt, assistant("Blue.")], tokenize=False)
    assert tokenizer.decode(pair["prompt_ids"] + pair["chosen_ids"]) == full
    assert tokenizer.decode(pair["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(pair["chosen_ids"]).startswith("Blue.")


def test_an_implicit_prompt_is_the_messages_the_two_conversations_share(tokenizer):
    shared = [system("Be kind."), user("Tell me a fact.")]
    implicit = {"chosen": [*shared, assistant("Water is wet.")], "rejected": [*shared, assistant("No.")]}
    explicit = {"prompt": shared, "chosen": [assistant("Water is wet.")], "rejected": [assistant("No.")]}
    assert tokenize_pair(implicit, tokenizer, max_seq_len=256) == tokenize_pair(
        explicit, tokenizer, max_seq_len=256
    )


def test_a_system_key_is_the_prompts_first_message(tokenizer):
    with_key = {"system": "Answer in one word.", **GOOD}
    as_messages = {
        "prompt": [system("Answer in one word."), user(GOOD["prompt"])],
        "chosen": [assistant(GOOD["chosen"])],
        "rejected": [assistant(GOOD["rejected"])],
    }
    pair, _ = tokenize_pair(with_key, tokenizer, max_seq_len=256)
    assert pair == tokenize_pair(as_messages, tokenizer, max_seq_len=256)[0]
    assert tokenizer.decode(pair["prompt_ids"]).startswith("<|im_start|>system\nAnswer in one word.")
    # and before an implicit prompt's shared messages
    implicit = {
        "system": "S.",
        "chosen": [user("Q?"), assistant("A.")],
        "rejected": [user("Q?"), assistant("B.")],
    }
    explicit = {
        "prompt": [system("S."), user("Q?")],
        "chosen": [assistant("A.")],
        "rejected": [assistant("B.")],
    }
    assert tokenize_pair(implicit, tokenizer, max_seq_len=256) == tokenize_pair(
        explicit, tokenizer, max_seq_len=256
    )


def test_message_rows_without_a_chat_template_are_a_setup_error_not_a_row_error(tmp_path, plain_tokenizer):
    path = write_rows(tmp_path, [{"prompt": [user("Q?")], "chosen": "A.", "rejected": "B."}])
    with pytest.raises(ValueError, match="need a tokenizer with a chat template") as caught:
        load_pairs(path, plain_tokenizer, max_seq_len=64, on_bad_row="skip")  # never skipped
    assert not isinstance(caught.value, DataError)
    # string rows need none
    pairs, _ = load_pairs(write_rows(tmp_path, [GOOD], "plain.jsonl"), plain_tokenizer, max_seq_len=64)
    assert len(pairs) == 1


def test_load_pairs_reads_every_format_from_one_file(tmp_path, tokenizer):
    rows = [
        GOOD,
        {"prompt": [user("Q?")], "chosen": [assistant("A.")], "rejected": [assistant("B.")]},
        {"chosen": [user("Q?"), assistant("A.")], "rejected": [user("Q?"), assistant("B.")]},
        {"system": "S.", **GOOD},
    ]
    pairs, report = load_pairs(write_rows(tmp_path, rows), tokenizer, max_seq_len=256)
    assert len(pairs) == 4 and pairs[1] == pairs[2]
    assert report.data.rows_read == 4 and report.data.rows_used == 4 and not report.data.skipped
    assert report.truncated == 0
    assert report.prompt_tokens == sum(len(p["prompt_ids"]) for p in pairs)
    assert report.answer_tokens == sum(len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in pairs)
    summary = report.to_dict()
    assert summary["pairs"] == 4 and summary["skipped"] == 0 and summary["rows_read"] == 4


# ----------------------------------------------------------------------------- bad rows


BAD_ROWS = [
    ({"prompt": "Q?", "chosen": "Same.", "rejected": "Same."}, "are the same answer"),
    (
        {"prompt": [user("Q?")], "chosen": [assistant("Same.")], "rejected": "Same."},
        "are the same answer",
    ),
    (
        {"chosen": [user("Q?"), assistant("A.")], "rejected": [user("Q?"), assistant("A.")]},
        "are the same conversation",
    ),
    ({"prompt": "Q?", "chosen": "   ", "rejected": "B."}, "'chosen' is empty"),
    ({"prompt": "Q?", "chosen": "A.", "rejected": ""}, "'rejected' is empty"),
    ({"prompt": "", "chosen": "A.", "rejected": "B."}, "'prompt' is empty"),
    ({"prompt": "Q?", "chosen": "A."}, "missing field 'rejected'"),
    ({"prompt": "Q?", "rejected": "B."}, "missing field 'chosen'"),
    ({"chosen": "A.", "rejected": "B."}, "missing field 'prompt'"),
    ({"messages": [user("Q?"), assistant("A.")]}, "not a preference row"),
    ({"prompt": "Q?", "chosen": 3, "rejected": "B."}, "'chosen' must be a string"),
    (
        {"prompt": [user("Q?")], "chosen": [user("A.")], "rejected": "B."},
        "must end with an assistant message",
    ),
    (
        {"chosen": [user("Q?"), assistant("A.")], "rejected": [user("R?"), assistant("B.")]},
        "share no prompt message",
    ),
    ({"system": "", **GOOD}, "'system' must be a non-empty string"),
]


@pytest.mark.parametrize("row, reason", BAD_ROWS, ids=[reason for _, reason in BAD_ROWS])
def test_a_bad_row_is_a_data_error_naming_its_file_and_line(tmp_path, tokenizer, row, reason):
    path = write_rows(tmp_path, [GOOD, row, GOOD])
    with pytest.raises(DataError) as caught:
        load_pairs(path, tokenizer, max_seq_len=256)
    message = str(caught.value)
    assert message.startswith(f"{path}:2: "), message
    assert reason in message, message
    assert "\n" not in message


def test_a_prompt_that_leaves_no_room_for_the_answers_names_its_line(tmp_path, tokenizer):
    long_prompt = " ".join(["a long prompt"] * 30)
    assert len(encode(tokenizer, long_prompt, special=True)) > 40
    path = write_rows(tmp_path, [GOOD, GOOD, {"prompt": long_prompt, "chosen": "A.", "rejected": "B."}])
    with pytest.raises(DataError, match=rf"^{path}:3: the prompt alone is \d+ tokens.*max_seq_len 40"):
        load_pairs(path, tokenizer, max_seq_len=40)


def test_skip_mode_counts_and_names_every_bad_row(tmp_path, tokenizer):
    long_prompt = " ".join(["a long prompt"] * 30)
    rows = [
        GOOD,
        {"prompt": "Q?", "chosen": "Same.", "rejected": "Same."},  # line 2
        {"prompt": "Q?", "chosen": "", "rejected": "B."},  # line 3
        {"prompt": "Q?", "chosen": "A."},  # line 4
        {"prompt": long_prompt, "chosen": "A.", "rejected": "B."},  # line 5
        GOOD,
    ]
    path = write_rows(tmp_path, rows)
    (tmp_path / "pairs.jsonl").write_text(path.read_text() + "{not json\n")  # line 7
    pairs, report = load_pairs(path, tokenizer, max_seq_len=40, on_bad_row="skip")
    assert len(pairs) == 2
    assert report.data.rows_read == 7 and report.data.rows_used == 2
    assert [location for location, _ in report.data.skipped] == [f"{path}:{n}" for n in (2, 3, 4, 5, 7)]
    reasons = [reason for _, reason in report.data.skipped]
    assert "same answer" in reasons[0] and "'chosen' is empty" in reasons[1]
    assert "missing field 'rejected'" in reasons[2] and "the prompt alone" in reasons[3]
    assert "invalid JSON" in reasons[4]
    assert report.to_dict()["skipped"] == 5
    assert "5 skipped" in report.summary()


def test_a_file_with_no_usable_pair_is_an_error_even_in_skip_mode(tmp_path, tokenizer):
    path = write_rows(tmp_path, [{"prompt": "Q?", "chosen": "A.", "rejected": "A."}])
    with pytest.raises(DataError, match=r"no usable preference rows \(1 read, 1 skipped\)"):
        load_pairs(path, tokenizer, max_seq_len=64, on_bad_row="skip")


def test_an_unknown_bad_row_policy_is_refused_at_once(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="on_bad_row='drop'"):
        load_pairs(write_rows(tmp_path, [GOOD]), tokenizer, max_seq_len=64, on_bad_row="drop")


# ----------------------------------------------------------------------------- cutting long pairs


def test_a_long_pair_keeps_its_prompt_whole_and_cuts_its_longer_answer_first(tmp_path, tokenizer):
    prompt = "Tell me about the river."
    long_answer = " ".join(["the river runs to the sea"] * 12)
    row = {"prompt": prompt, "chosen": long_answer, "rejected": "It is wet."}
    full, _ = tokenize_pair(row, tokenizer, max_seq_len=10_000)
    P, C, R = (len(full[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
    max_seq_len = P + R + 10
    assert C > 10
    pairs, report = load_pairs(write_rows(tmp_path, [row, GOOD]), tokenizer, max_seq_len=max_seq_len)
    cut = pairs[0]
    assert report.truncated == 1
    assert cut["prompt_ids"] == full["prompt_ids"]  # whole
    assert cut["rejected_ids"] == full["rejected_ids"]  # the shorter answer is untouched
    assert cut["chosen_ids"] == full["chosen_ids"][:10]  # the longer one cut to what is left
    assert pair_tokens(cut) == max_seq_len
    assert "1 pair(s) cut to max_seq_len" in report.summary()
    assert report.to_dict()["truncated"] == 1


def test_when_both_answers_are_long_both_are_cut_to_fit(tokenizer):
    row = {
        "prompt": "Q?",
        "chosen": " ".join(["one two three"] * 20),
        "rejected": " ".join(["four five six"] * 20),
    }
    full, _ = tokenize_pair(row, tokenizer, max_seq_len=10_000)
    P = len(full["prompt_ids"])
    pair, cut = tokenize_pair(row, tokenizer, max_seq_len=P + 12)
    assert cut and pair["prompt_ids"] == full["prompt_ids"]
    assert pair_tokens(pair) <= P + 12
    assert pair["chosen_ids"] == full["chosen_ids"][: len(pair["chosen_ids"])]
    assert pair["rejected_ids"] == full["rejected_ids"][: len(pair["rejected_ids"])]
    assert pair["chosen_ids"] and pair["rejected_ids"]


def test_answers_that_become_the_same_once_cut_are_refused(tokenizer):
    row = {"prompt": "Q?", "chosen": "same start then A", "rejected": "same start then B"}
    full, _ = tokenize_pair(row, tokenizer, max_seq_len=10_000)
    shared = 0
    while full["chosen_ids"][shared] == full["rejected_ids"][shared]:
        shared += 1
    assert shared >= 1
    P = len(full["prompt_ids"])
    # room for one token of each: both cut to their first token, which they share
    with pytest.raises(
        DataError, match=r"^rows.jsonl:9: cut to data.max_seq_len \d+, 'chosen' and 'rejected' are the same"
    ):
        tokenize_pair(row, tokenizer, max_seq_len=P + 2, location="rows.jsonl:9")


# ----------------------------------------------------------------------------- split and pack


def test_split_pairs_is_seeded_disjoint_and_holds_out_the_fraction():
    split_pairs = functools.partial(split_prompts, noun="pairs")  # the split the pair objectives take
    pairs = [{"prompt_ids": [i], "chosen_ids": [1], "rejected_ids": [2]} for i in range(20)]
    train, held = split_pairs(pairs, 0.25, seed=0, source="x.jsonl")
    assert len(held) == 5 and len(train) == 15
    assert sorted(p["prompt_ids"][0] for p in train + held) == list(range(20))
    assert split_pairs(pairs, 0.25, seed=0, source="x.jsonl") == (train, held)
    assert split_pairs(pairs, 0.25, seed=1, source="x.jsonl")[1] != held
    # at least one each way
    assert [len(part) for part in split_pairs(pairs[:2], 0.01, 0, "x")] == [1, 1]
    assert [len(part) for part in split_pairs(pairs[:2], 0.99, 0, "x")] == [1, 1]
    with pytest.raises(DataError, match="needs at least 2 usable pairs"):
        split_pairs(pairs[:1], 0.5, 0, "x.jsonl")


def test_pack_pairs_fits_every_pair_once_into_bins_of_max_seq_len():
    import random

    rng = random.Random(0)
    pairs = [
        {
            "prompt_ids": [i] * rng.randint(1, 30),
            "chosen_ids": [1] * rng.randint(1, 20),
            "rejected_ids": [2] * rng.randint(1, 20),
        }
        for i in range(40)
    ]
    bins = pack_pairs(pairs, max_seq_len=96, seed=0)
    assert all(sum(pair_tokens(p) for p in b) <= 96 for b in bins)
    assert sorted(p["prompt_ids"][0] for b in bins for p in b) == list(range(40))
    assert len(bins) <= sum(pair_tokens(p) for p in pairs) // 96 + 3  # best fit: nearly full bins
    assert pack_pairs(pairs, max_seq_len=96, seed=0) == bins

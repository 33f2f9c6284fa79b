"""KTO rows (TRL's unpaired ``prompt`` / ``completion`` / ``label``) to tokenized rows: tokenized as the DPO
pairs are, and every bad row named by file:line and key."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from slipstream.data.errors import DataError
from slipstream.data.kto import load_kto_rows, tokenize_kto_row
from slipstream.data.pairs import tokenize_pair
from tests.data.test_pairs import assistant, system, user, write_rows


@pytest.fixture(scope="module")
def tokenizer(_session_demo_tokenizer):
    """The demo tokenizer (it has a chat template), as the pair tests load it."""
    return PreTrainedTokenizerFast.from_pretrained(str(_session_demo_tokenizer), local_files_only=True)


@pytest.fixture
def plain_tokenizer(_session_demo_tokenizer):
    loaded = PreTrainedTokenizerFast.from_pretrained(str(_session_demo_tokenizer), local_files_only=True)
    loaded.chat_template = None
    return loaded


GOOD = {"prompt": "What is two plus two?", "completion": "It is four.", "label": True}


def test_a_string_row_is_tokenized_as_a_pairs_chosen_answer(tokenizer):
    row, cut = tokenize_kto_row(GOOD, tokenizer, max_seq_len=512)
    pair, _ = tokenize_pair(
        {"prompt": GOOD["prompt"], "chosen": GOOD["completion"], "rejected": "no."},
        tokenizer,
        max_seq_len=512,
    )
    assert row == {"prompt_ids": pair["prompt_ids"], "completion_ids": pair["chosen_ids"], "label": True}
    assert row["completion_ids"][-1] == tokenizer.eos_token_id and not cut


def test_a_conversational_row_with_a_system_prompt_is_tokenized_as_a_pair(tokenizer):
    record = {
        "system": "Be brief.",
        "prompt": [user("Hi?")],
        "completion": [assistant("Hello.")],
        "label": False,
    }
    row, _ = tokenize_kto_row(record, tokenizer, max_seq_len=512)
    pair, _ = tokenize_pair(
        {"prompt": [system("Be brief."), user("Hi?")], "chosen": [assistant("Hello.")], "rejected": "Bye."},
        tokenizer,
        max_seq_len=512,
    )
    assert row["prompt_ids"] == pair["prompt_ids"] and row["completion_ids"] == pair["chosen_ids"]
    assert row["label"] is False


BAD = [
    ({**GOOD, "label": "true"}, r"'label' must be true or false.*got string 'true'"),
    ({**GOOD, "label": 1}, r"'label' must be true or false.*got (integer|number) 1"),
    ({"prompt": "q", "completion": "a"}, "missing field 'label'"),
    ({"prompt": "q", "label": True}, "missing field 'completion'"),
    ({**GOOD, "completion": "  "}, "'completion' is empty"),
    ({**GOOD, "prompt": 3}, "'prompt' must be a string or a message list"),
    ({"prompt": "q", "chosen": "a", "rejected": "b"}, "a paired row.*unpair_preference_dataset"),
    ({**GOOD, "score": 1}, "not a KTO row: expected 'prompt', 'completion' and 'label'"),
]


@pytest.mark.parametrize("row, reason", BAD, ids=[reason.split(" ")[0] for _, reason in BAD])
def test_a_bad_row_is_a_data_error_naming_its_file_line_and_key(tmp_path, tokenizer, row, reason):
    path = write_rows(tmp_path, [GOOD, GOOD, row], name="kto.jsonl")
    with pytest.raises(DataError, match=rf"^{path}:3: {reason}"):
        load_kto_rows(path, tokenizer, max_seq_len=512)


def test_skip_mode_counts_bad_rows_and_keeps_the_rest(tmp_path, tokenizer):
    path = write_rows(tmp_path, [GOOD, {**GOOD, "label": "yes"}, {**GOOD, "label": False}], name="kto.jsonl")
    rows, report = load_kto_rows(path, tokenizer, max_seq_len=512, on_bad_row="skip")
    assert [row["label"] for row in rows] == [True, False]
    assert report.data.rows_read == 3 and [where for where, _ in report.data.skipped] == [f"{path}:2"]


def test_messages_without_a_chat_template_are_a_setup_error(tmp_path, plain_tokenizer):
    path = write_rows(
        tmp_path, [{"prompt": [user("Hi?")], "completion": "Hello.", "label": True}], name="kto.jsonl"
    )
    with pytest.raises(ValueError, match="need a tokenizer with a chat template") as caught:
        load_kto_rows(path, plain_tokenizer, max_seq_len=512, on_bad_row="skip")
    assert not isinstance(caught.value, DataError)


def test_a_long_completion_is_cut_to_leave_room_for_its_kl_copy(tokenizer):
    record = {**GOOD, "completion": "four " * 80}
    row, cut = tokenize_kto_row(record, tokenizer, max_seq_len=64, copies=2)
    assert cut and len(row["prompt_ids"]) + 2 * len(row["completion_ids"]) <= 64
    alone, _ = tokenize_kto_row(record, tokenizer, max_seq_len=64, copies=1)
    assert len(row["prompt_ids"]) + len(alone["completion_ids"]) in (63, 64)
    with pytest.raises(DataError, match="leaving no room for the completion within data.max_seq_len 4"):
        tokenize_kto_row(GOOD, tokenizer, max_seq_len=4, location="kto.jsonl:7")

import pytest
import torch

import slipstream
from slipstream.packing import IGNORE_INDEX, collate_padded
from tests.conftest import random_docs


def test_metadata_is_built_from_python_lengths():
    docs = random_docs([3, 5, 2])
    batch = slipstream.collate_packed(docs)
    assert batch.input_ids.shape == (1, 10)
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert batch.cu_seqlens.tolist() == [0, 3, 8, 10]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.seq_lens == (3, 5, 2)
    assert batch.max_seqlen == 5
    assert batch.doc_bounds() == [(0, 3), (3, 8), (8, 10)]


def test_first_label_of_every_document_is_masked():
    docs = random_docs([3, 5, 2])
    batch = slipstream.collate_packed(docs)
    labels = batch.labels[0].tolist()
    for start in (0, 3, 8):
        assert labels[start] == IGNORE_INDEX
    assert labels[1:3] == docs[0]["input_ids"][1:]
    # 10 tokens, 3 document starts masked
    assert batch.num_label_tokens == 7


def test_explicit_labels_are_kept_and_counted():
    docs = [{"input_ids": [5, 6, 7, 8], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8]}, {"input_ids": [9, 10]}]
    batch = slipstream.collate_packed(docs)
    assert batch.labels[0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 7, 8, IGNORE_INDEX, 10]
    assert batch.num_label_tokens == 3


def test_pad_to_multiple_adds_one_unlabelled_document():
    batch = slipstream.collate_packed(random_docs([3, 4]), pad_to_multiple_of=8)
    assert batch.input_ids.shape == (1, 8)
    assert batch.seq_lens == (3, 4, 1)
    assert batch.labels[0, 7].item() == IGNORE_INDEX
    assert batch.num_label_tokens == 5


def test_model_inputs_carry_the_batch_and_varlen_kwargs():
    batch = slipstream.collate_packed(random_docs([3, 4]))
    inputs = batch.model_inputs(num_items_in_batch=11)
    assert inputs["slipstream_packed_batch"] is batch
    assert inputs["cu_seq_lens_q"] is batch.cu_seqlens
    assert inputs["max_length_q"] == 4
    assert inputs["use_cache"] is False
    assert inputs["num_items_in_batch"] == 11


def test_memo_builds_once_per_batch():
    batch = slipstream.collate_packed(random_docs([3, 4]))
    calls = []
    assert batch.memo("k", lambda: calls.append(1) or "v") == "v"
    assert batch.memo("k", lambda: calls.append(1) or "w") == "v"
    assert calls == [1]
    other = slipstream.collate_packed(random_docs([3, 4]))
    assert other.memo("k", lambda: "w") == "w"  # nothing shared between batches


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([], "at least one sample"),
        ([{"labels": [1]}], "no 'input_ids'"),
        ([{"input_ids": []}], "sample 0 is empty"),
        ([{"input_ids": [1, 2], "labels": [1]}], "1 labels for 2 input_ids"),
        ([{"input_ids": "abc"}], "must be a list of ints"),
        ([{"input_ids": [1, 2.5]}], "only ints"),
    ],
)
def test_bad_samples_are_refused_with_a_clear_error(samples, message):
    with pytest.raises((ValueError, KeyError, TypeError), match=message):
        slipstream.collate_packed(samples)


def test_padded_collator_is_the_stock_layout():
    padded = collate_padded(random_docs([3, 5]))
    assert padded["input_ids"].shape == (2, 5)
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert padded["labels"][0, 3:].tolist() == [IGNORE_INDEX, IGNORE_INDEX]

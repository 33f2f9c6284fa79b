"""Prefix groups (collate_groups): one prefix and N continuations in one row, the prefix run once.

Every continuation's logits must be what the stock model gives prefix + continuation run alone,
and the SFT loss and its LoRA gradients what the unshared rows give (collate_packed of every
prefix + continuation), labelled prefix tokens included.
"""

from __future__ import annotations

import copy

import pytest
import torch

import slipstream
from slipstream.loss import packed_loss_from_logits
from slipstream.models import build_model
from slipstream.packing.batch import IGNORE_INDEX, collate_packed
from slipstream.packing.groups import (
    collate_groups,
    counted_tokens,
    group_documents,
    group_tokens,
    unshared_documents,
)

from .test_pairs import tiny_mistral

VOCAB = 512
x = IGNORE_INDEX


def random_groups(shapes, seed=3, vocab=VOCAB, labelled_prefix=True):
    """Groups of random ids, one per (prefix length, [continuation lengths]); the prefix's second
    half labelled (so shared labels are counted), each continuation's first token not."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, vocab, (n,), generator=generator).tolist()

    groups = []
    for prefix_len, lengths in shapes:
        prefix = ids(prefix_len)
        prefix_labels = [t if labelled_prefix and i >= prefix_len // 2 else x for i, t in enumerate(prefix)]
        continuations = []
        for length in lengths:
            tokens = ids(length)
            continuations.append({"input_ids": tokens, "labels": [x, *tokens[1:]] if length > 2 else tokens})
        groups.append({"prefix_ids": prefix, "prefix_labels": prefix_labels, "continuations": continuations})
    return groups


def shapes_of(n: int):
    """A group of n continuations (prefix longer than the window 4 below), a plain document (an empty
    prefix, one continuation) and a group with nothing shared."""
    return [(9, [(3 * j) % 7 + 1 for j in range(n)]), (0, [5]), (0, [4, 3]), (6, [2, 5])]


# ----------------------------------------------------------------------------- layout


def test_layout_shares_the_prefix_and_counts_shared_labels_once_per_row():
    groups = [
        {
            "prefix_ids": [1, 2, 3],
            "prefix_labels": [x, 5, 6],
            "continuations": [
                {"input_ids": [7, 8]},
                {"input_ids": [9]},
                {"input_ids": [10, 11, 12], "labels": [x, 11, 12]},
            ],
        },
        {"prefix_ids": [], "continuations": [{"input_ids": [4, 4]}, {"input_ids": [5, 5]}]},
    ]
    batch = collate_groups(groups)
    assert batch.input_ids.tolist() == [[1, 2, 3, 7, 8, 9, 10, 11, 12, 4, 4, 5, 5]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1, 0, 1]]
    assert batch.seq_lens == (5, 1, 3, 2, 2)
    assert batch.prefix_lens == (0, 3, 3, 0, 0)
    assert batch.prefix_sources == (0, 0, 0, 3, 4)
    assert batch.prefix_spans() == (None, (0, 3), (0, 3), None, None)
    assert batch.alone_lengths == (5, 4, 6, 2, 2)
    assert batch.labels.tolist() == [[x, 5, 6, 7, 8, 9, x, 11, 12, x, 4, x, 5]]
    # row 0 predicts 5 and row 1 predicts 6 three times (once per unshared row); the continuations'
    # first tokens (8 / 9 / -) from the prefix's last row position 2
    assert batch.loss_positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 6, 7, 9, 11]
    assert batch.loss_targets.tolist() == [5, 6, 7, 8, 5, 6, 9, 5, 6, 11, 12, 4, 5]
    unshared = collate_packed(unshared_documents(groups))
    assert batch.num_label_tokens == unshared.num_label_tokens == 13
    assert counted_tokens(groups) == unshared.num_tokens == sum(batch.alone_lengths) == 19
    assert batch.num_tokens == sum(group_tokens(g) for g in groups) == 13
    assert [len(d["input_ids"]) for d in group_documents(groups)] == list(batch.seq_lens)
    assert collate_groups(groups, prefix_sharing=False).input_ids.tolist() == unshared.input_ids.tolist()
    moved = batch.to("meta")
    assert moved.prefix_sources == batch.prefix_sources and moved.loss_targets.device.type == "meta"


def test_groups_that_share_nothing_are_collate_packeds_batch():
    groups = random_groups([(0, [5]), (4, [3]), (0, [2, 6])])
    batch, plain = collate_groups(groups), collate_packed(unshared_documents(groups))
    assert batch.prefix_lens is None and batch.loss_targets is None
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "loss_positions"):
        assert torch.equal(getattr(batch, name), getattr(plain, name)), name
    assert batch.seq_lens == plain.seq_lens and batch.num_label_tokens == plain.num_label_tokens


def test_pairs_keep_the_previous_document_as_their_source():
    from slipstream.packing.pairs import collate_pairs

    batch = collate_pairs([{"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]}])
    assert batch.prefix_sources is None and batch.loss_targets is None
    assert batch.prefix_spans() == (None, (0, 2))


def test_bad_groups_are_refused_by_name():
    with pytest.raises(ValueError, match="at least one group"):
        collate_groups([])
    with pytest.raises(ValueError, match="group 0 has no continuations"):
        collate_groups([{"prefix_ids": [1], "continuations": []}])
    with pytest.raises(ValueError, match="group 0, continuation 1 is empty"):
        collate_groups([{"prefix_ids": [1], "continuations": [{"input_ids": [2]}, {"input_ids": []}]}])
    with pytest.raises(ValueError, match="2 prefix_labels for 1 prefix_ids"):
        collate_groups([{"prefix_ids": [1], "prefix_labels": [x, x], "continuations": [{"input_ids": [2]}]}])
    with pytest.raises(TypeError, match="only ints"):
        collate_groups([{"prefix_ids": [1.5], "continuations": [{"input_ids": [2]}]}])


def test_split_every_refuses_shared_prefixes():
    batch = collate_groups(random_groups(shapes_of(2)))
    with pytest.raises(NotImplementedError, match="chunked attention"):
        batch.split_every(4)


# ----------------------------------------------------------------------------- exactness


def alone_rows(batch) -> list[list[int]]:
    """Per document, the row positions of the sequence it stands for: its prefix's, then its own."""
    rows = []
    for (start, end), span in zip(batch.doc_bounds(), batch.prefix_spans(), strict=True):
        rows.append(([] if span is None else list(range(*span))) + list(range(start, end)))
    return rows


def assert_logits_exact(stock, packed, groups, atol=1e-5):
    """Every position of every prefix + continuation: packed log-probs == stock run alone."""
    batch = collate_groups(groups, device=next(packed.parameters()).device)
    inputs = batch.model_inputs()
    inputs["labels"] = None  # the logits only (the loss of a group is the chunked loss's)
    with torch.no_grad():
        logits = packed(**inputs).logits[0].float().log_softmax(-1)
        for number, rows in enumerate(alone_rows(batch)):
            ids = batch.input_ids[0, rows]
            expected = stock(input_ids=ids.unsqueeze(0), use_cache=False).logits[0].float().log_softmax(-1)
            error = (logits[rows] - expected).abs().max().item()
            assert error <= atol, f"document {number}: {error}"


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", vocab_size=VOCAB).eval()


def tiny(model_type: str):
    if model_type == "llama":
        return build_model("llama", vocab_size=VOCAB).eval()
    if model_type == "qwen3":
        return build_model("qwen3", vocab_size=VOCAB).eval()
    if model_type == "mistral-window-4":
        return tiny_mistral(4).eval()
    from slipstream.models.tiny_any import tiny_model

    return tiny_model(model_type).eval()


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral-window-4", "lfm2"])
def test_every_continuation_matches_prefix_plus_continuation_run_alone(model_type, n):
    stock = tiny(model_type)
    packed = slipstream.optimize(copy.deepcopy(stock), chunked_loss=False)
    assert_logits_exact(stock, packed, random_groups(shapes_of(n), vocab=stock.config.vocab_size))


def test_without_the_prefix_a_continuation_would_differ(llama):
    """The check sees a continuation that lost its prefix (the test can fail)."""
    import dataclasses

    packed = slipstream.optimize(copy.deepcopy(llama), chunked_loss=False)
    groups = random_groups(shapes_of(4))
    batch = collate_groups(groups)
    broken = dataclasses.replace(batch, prefix_lens=None, prefix_sources=None, _memo={})
    inputs = broken.model_inputs()
    inputs["labels"] = None
    with torch.no_grad():
        ours = packed(**inputs).logits[0]
        rows = alone_rows(batch)[1]
        theirs = llama(input_ids=batch.input_ids[0, rows].unsqueeze(0), use_cache=False).logits[0]
    assert (ours[rows][-1] - theirs[-1]).abs().max().item() > 1e-3


def _flex_runs_here() -> str | None:
    from .test_pairs import _flex_runs_here as probe

    return probe()


@pytest.mark.parametrize("model_type", ["llama", "mistral-window-4"])
def test_flex_backend_shares_the_prefix_exactly(model_type):
    why = _flex_runs_here()
    if why is not None:
        pytest.skip(f"flex_attention does not run on this CPU ({why})")
    stock = tiny(model_type)
    packed = slipstream.optimize(copy.deepcopy(stock), chunked_loss=False, attention_backend="flex")
    assert_logits_exact(stock, packed, random_groups(shapes_of(4)))


# ----------------------------------------------------------------------------- the SFT loss


def lora_pair(model):
    """(stock, packed): the same LoRA weights (B random, so every adapter has a gradient)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    stock = copy.deepcopy(model)
    packed = slipstream.optimize(copy.deepcopy(model))  # the chunked loss on (the default)
    models = []
    for m in (stock, packed):
        torch.manual_seed(0)
        models.append(get_peft_model(m, copy.deepcopy(lora)).train())
    return models


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def stock_alone_loss(model, groups) -> torch.Tensor:
    """The unshared rows, each run alone by the stock model: summed CE over their labels / count."""
    total, count = 0.0, 0
    for doc in unshared_documents(groups):
        logits = model(input_ids=torch.tensor([doc["input_ids"]]), use_cache=False).logits[0, :-1]
        targets = torch.tensor(doc["labels"][1:])
        keep = targets != IGNORE_INDEX
        total = total + torch.nn.functional.cross_entropy(
            logits[keep].float(), targets[keep], reduction="sum"
        )
        count += int(keep.sum())
    return total / count


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral-window-4", "lfm2"])
def test_group_loss_and_lora_grads_match_the_unshared_rows(model_type, n):
    stock, packed = lora_pair(tiny(model_type))
    groups = random_groups(shapes_of(n), seed=n, vocab=stock.config.vocab_size)
    expected = stock_alone_loss(stock, groups)
    expected.backward()
    expected_grads = grads_of(stock)
    batch = collate_groups(groups)
    loss = packed(**batch.model_inputs()).loss
    assert abs(loss.item() - expected.item()) <= 1e-5
    loss.backward()
    grads = grads_of(packed)
    assert grads.keys() == expected_grads.keys() and len(grads) >= 8
    for name, grad in grads.items():
        assert rel(grad, expected_grads[name]) <= 1e-5, name
    # and the same as collate_packed of the unshared rows through the same packed model
    packed.zero_grad(set_to_none=True)
    unshared = collate_packed(unshared_documents(groups))
    assert unshared.num_label_tokens == batch.num_label_tokens
    unshared_loss = packed(**unshared.model_inputs()).loss
    unshared_loss.backward()
    assert abs(unshared_loss.item() - loss.item()) <= 1e-5
    for name, grad in grads_of(packed).items():
        assert rel(grads[name], grad) <= 1e-5, name


def test_an_evaluation_forward_reads_the_groups_targets_from_the_logits(llama):
    packed = slipstream.optimize(copy.deepcopy(llama)).eval()
    groups = random_groups(shapes_of(4))
    batch = collate_groups(groups)
    with torch.no_grad():
        out = packed(**batch.model_inputs())  # chunked loss installed, not armed: stock path
        expected = stock_alone_loss(llama, groups)
        assert abs(out.loss.item() - expected.item()) <= 1e-5
        assert abs(packed_loss_from_logits(out.logits, batch).item() - expected.item()) <= 1e-5


def test_the_stock_loss_refuses_a_groups_batch_by_name(llama):
    packed = slipstream.optimize(copy.deepcopy(llama), chunked_loss=False)
    batch = collate_groups(random_groups(shapes_of(2)))
    with pytest.raises(ValueError, match="chunked_loss=True"):
        packed(**batch.model_inputs())

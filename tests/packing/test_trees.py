"""Prefix trees (collate_trees): every shared history once, each node attending to its ancestors.

Every node's log-probs must be what the stock model gives the row through it run alone, and the SFT
loss and its LoRA gradients what the rows packed whole give (collate_packed of every row), for trees
of depth 2-6 with labelled shared spans, on attention, sliding-window and convolution mixers.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

import slipstream
from slipstream.data.prefix_tree import share_rows_as_trees, tree_items, tree_tokens, trie_report
from slipstream.packing.batch import IGNORE_INDEX, collate_packed
from slipstream.packing.trees import collate_trees, unshared_tree_rows

from .test_groups import grads_of, lora_pair, rel, tiny

VOCAB = 512
x = IGNORE_INDEX


def branching_rows(depth: int, seed: int = 0, vocab: int = VOCAB) -> list[dict]:
    """Rows whose trie is ``depth`` levels deep: a spine of ``depth`` spans, a row leaving it after each
    span (two of them sharing a span of their own before they part: cousins), a row ending inside the
    spine, the spine itself, and a row that shares nothing. Shared spans are half labelled."""
    rng = random.Random(seed)

    def span(n: int, labelled: float = 0.5) -> tuple[list[int], list[int]]:
        ids = [rng.randrange(1, vocab) for _ in range(n)]
        return ids, [t if rng.random() < labelled else x for t in ids]

    spine = [span(rng.randrange(3, 9)) for _ in range(depth)]
    rows = []

    def row(spans):
        return {
            "input_ids": [t for ids, _ in spans for t in ids],
            "labels": [t for _, labs in spans for t in labs],
        }

    for level in range(1, depth):
        fork = span(rng.randrange(2, 6))
        rows.append(row([*spine[:level], fork, span(rng.randrange(2, 7), 1.0)]))
        if level % 2:
            rows.append(row([*spine[:level], fork, span(rng.randrange(2, 7), 1.0)]))  # a cousin's sibling
    rows.append(row(spine))
    rows.append(row(spine[: max(1, depth - 1)]))  # ends where a shared span ends
    rows.append(row([span(rng.randrange(4, 9), 1.0)]))  # shares nothing
    rng.shuffle(rows)
    return rows


# ----------------------------------------------------------------------------- layout


def test_a_hand_built_tree_lays_out_its_nodes_with_their_ancestors():
    a, b, c, d = [1, 2, 3], [4, 5], [6, 7, 8], [9]
    rows = [
        {"input_ids": a + b + c, "labels": [x, x, 3, 4, 5, 6, 7, 8]},
        {"input_ids": a + b + d, "labels": [x, x, 3, 4, 5, 9]},
        {"input_ids": a + [10, 11], "labels": [x, x, 3, 10, 11]},
    ]
    (tree,), report = tree_items(rows, 64, min_shared=1)
    assert [n["input_ids"] for n in tree["tree_nodes"]] == [a, b, c, d, [10, 11]]
    assert [n["parent"] for n in tree["tree_nodes"]] == [-1, 0, 1, 1, 0]
    assert report.trie_tokens == report.shared_tokens == 11 and report.unshared_tokens == 19
    batch = collate_trees([tree])
    assert batch.parents == (-1, 0, 1, 1, 0)
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 3, 4]
    assert batch.context_spans() == ((), ((0, 3),), ((0, 3), (3, 5)), ((0, 3), (3, 5)), ((0, 3),))
    assert batch.alone_lengths == (3, 5, 8, 6, 5)
    assert batch.subtree_ends() == (5, 4, 3, 4, 5)
    # the labels of a, counted once per row (3 rows hold label 3 at a's last position), the whole rows' count
    whole = collate_packed(rows)
    assert batch.num_label_tokens == whole.num_label_tokens == 6 + 4 + 3
    assert sorted(batch.loss_targets.tolist()) == sorted(whole.labels[0][whole.loss_positions + 1].tolist())


def test_a_tree_is_the_rows_it_came_from():
    rng = random.Random(1)
    for depth in range(2, 7):
        rows = branching_rows(depth, seed=depth)
        for max_tokens in (max(len(r["input_ids"]) for r in rows), 40, 400):
            items, report = tree_items(rows, max_tokens, min_shared=1)
            assert all(tree_tokens(tree) <= max_tokens for tree in items)
            key = lambda r: (r["input_ids"], r["labels"])  # noqa: E731
            assert sorted(map(key, unshared_tree_rows(items))) == sorted(map(key, rows))
            assert report.shared_tokens == report.trie_tokens + report.repeated_tokens + report.short_tokens
            assert report.unshared_tokens == sum(len(r["input_ids"]) for r in rows)
        assert trie_report(rows).depth >= depth
        bins, _ = share_rows_as_trees(rows, 400, seed=rng.randrange(9), min_shared=1)
        assert sum(len(b) for b in bins) >= 2  # the tree and the row that shares nothing


def test_a_tree_too_large_for_a_bin_repeats_its_path_and_says_so():
    rows = branching_rows(4, seed=5)
    whole = tree_items(rows, 1000, min_shared=1)[1]
    longest = max(len(r["input_ids"]) for r in rows)
    items, report = tree_items(rows, longest, min_shared=1)
    assert report.parts > 1 and report.repeated_tokens > 0
    assert report.shared_tokens == whole.trie_tokens + report.repeated_tokens
    assert "path tokens repeated to fit" in report.summary()


def test_a_shared_span_shorter_than_the_minimum_runs_in_each_child():
    """Three rows share 20 tokens, then two of them 3 more (a role header): the 3 are not a level of
    their own (an extra document for 3 tokens), each child holds them; the 20 stay shared."""
    start, header = list(range(1, 21)), [30, 31, 32]
    rows = [
        {"input_ids": start + header + [40, 41], "labels": start + header + [40, 41]},
        {"input_ids": start + header + [50], "labels": start + header + [50]},
        {"input_ids": start + [60, 61], "labels": start + [60, 61]},
    ]
    (tree,), report = tree_items(rows, 64)
    assert [n["input_ids"] for n in tree["tree_nodes"]] == [start, header + [40, 41], header + [50], [60, 61]]
    assert report.short_tokens == 3 and report.shared_tokens == report.trie_tokens + 3
    assert sorted(r["input_ids"] for r in unshared_tree_rows([tree])) == sorted(r["input_ids"] for r in rows)
    (alone,) = tree_items(rows[:1], 64)[0]  # one row: one node
    assert len(alone["tree_nodes"]) == 1


def test_bad_trees_are_refused_by_name():
    with pytest.raises(ValueError, match="tree 0 needs"):
        collate_trees([{"tree_nodes": [], "tree_rows": []}])
    node = {"input_ids": [1, 2], "labels": [1, 2]}
    with pytest.raises(ValueError, match="node 1: parent 1"):
        collate_trees([{"tree_nodes": [{**node, "parent": -1}, {**node, "parent": 1}], "tree_rows": [1]}])
    with pytest.raises(ValueError, match="does not have"):
        collate_trees([{"tree_nodes": [{**node, "parent": -1}], "tree_rows": [3]}])
    with pytest.raises(ValueError, match="pack rows whole first"):
        tree_items([{"input_ids": [1] * 9, "labels": [1] * 9}], 8, min_shared=1)


def test_documents_out_of_pre_order_are_refused():
    batch = collate_trees(tree_items(branching_rows(3), 400, min_shared=1)[0])
    shuffled = dataclasses.replace(batch, parents=(-1, 0, -1, 1), seq_lens=(1, 1, 1, 1), _memo={})
    with pytest.raises(ValueError, match="pre-order"):
        shuffled.subtree_ends()


# ----------------------------------------------------------------------------- attention


def node_rows(batch) -> list[list[int]]:
    """Per document, the row positions of the row through it run alone: its ancestors', then its own."""
    return [
        [p for span in spans for p in range(*span)] + list(range(start, end))
        for (start, end), spans in zip(batch.doc_bounds(), batch.context_spans(), strict=True)
    ]


def node_errors(stock, packed, batch, run=None) -> list[float]:
    """Per document of ``batch``, the largest |log-prob| difference between the packed model on ``run``
    (``batch`` itself by default) and the stock model on the row through the document, run alone."""
    inputs = (run or batch).model_inputs()
    inputs["labels"] = None
    errors = []
    with torch.no_grad():
        logits = packed(**inputs).logits[0].float().log_softmax(-1)
        for number, rows in enumerate(node_rows(batch)):
            ids = batch.input_ids[0, rows]
            expected = stock(input_ids=ids.unsqueeze(0), use_cache=False).logits[0].float().log_softmax(-1)
            own = batch.seq_lens[number]
            errors.append((logits[rows[-own:]] - expected[-own:]).abs().max().item())
    return errors


def assert_logits_exact(stock, packed, trees, atol=1e-5):
    errors = node_errors(stock, packed, collate_trees(trees))
    assert max(errors) <= atol, errors


@pytest.mark.parametrize("depth", [2, 4, 6])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral-window-4", "lfm2"])
def test_every_node_matches_its_row_run_alone(model_type, depth):
    stock = tiny(model_type)
    packed = slipstream.optimize(copy.deepcopy(stock), chunked_loss=False)
    trees, _ = tree_items(branching_rows(depth, seed=depth, vocab=stock.config.vocab_size), 400, min_shared=1)
    assert_logits_exact(stock, packed, trees)


def test_without_its_ancestors_a_node_would_differ():
    """The check sees a node that lost its ancestors (the test can fail)."""
    stock = tiny("llama")
    packed = slipstream.optimize(copy.deepcopy(stock), chunked_loss=False)
    trees, _ = tree_items(branching_rows(3), 400, min_shared=1)
    batch = collate_trees(trees)
    broken = dataclasses.replace(batch, parents=None, _memo={})
    assert max(node_errors(stock, packed, batch)) <= 1e-5
    assert max(node_errors(stock, packed, batch, run=broken)) > 1e-3


@pytest.mark.parametrize("model_type", ["llama", "mistral-window-4"])
def test_flex_backend_runs_a_tree_exactly(model_type):
    from .test_pairs import _flex_runs_here

    why = _flex_runs_here()
    if why is not None:
        pytest.skip(f"flex_attention does not run on this CPU ({why})")
    stock = tiny(model_type)
    packed = slipstream.optimize(copy.deepcopy(stock), chunked_loss=False, attention_backend="flex")
    assert_logits_exact(stock, packed, tree_items(branching_rows(5, seed=2), 400, min_shared=1)[0])


# ----------------------------------------------------------------------------- the SFT loss


def alone_loss(model, rows) -> torch.Tensor:
    """Every row run alone by the stock model: summed cross-entropy over its labels / their count."""
    total, count = 0.0, 0
    for row in rows:
        logits = model(input_ids=torch.tensor([row["input_ids"]]), use_cache=False).logits[0, :-1]
        targets = torch.tensor(row["labels"][1:])
        keep = targets != IGNORE_INDEX
        total = total + torch.nn.functional.cross_entropy(
            logits[keep].float(), targets[keep], reduction="sum"
        )
        count += int(keep.sum())
    return total / count


@pytest.mark.parametrize("depth", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral-window-4", "lfm2"])
def test_tree_loss_and_lora_grads_match_the_rows_packed_whole(model_type, depth):
    whole_model, tree_model = lora_pair(tiny(model_type))
    rows = branching_rows(depth, seed=10 + depth, vocab=whole_model.config.vocab_size)
    trees, report = tree_items(rows, 400, min_shared=1)
    assert report.saved_tokens > 0
    whole = collate_packed(rows)
    expected = alone_loss(whole_model, rows)  # the stock model, every row run alone
    expected.backward()
    batch = collate_trees(trees)
    assert batch.num_tokens == report.shared_tokens < whole.num_tokens
    assert batch.num_label_tokens == whole.num_label_tokens
    loss = tree_model(**batch.model_inputs()).loss
    assert abs(loss.item() - expected.item()) <= 1e-5
    loss.backward()
    grads, expected_grads = grads_of(tree_model), grads_of(whole_model)
    assert grads.keys() == expected_grads.keys() and len(grads) >= 8
    for name, grad in grads.items():
        assert rel(grad, expected_grads[name]) <= 1e-5, name


# ----------------------------------------------------------------------------- keys kept once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 6])
def test_context_attention_equals_the_joined_call_and_keeps_no_joined_copy(dtype, window):
    """A node's attention over its ancestors' keys without joining them for the backward
    (``_ContextAttention``): the same output and gradients as SDPA on the joined keys, bit for bit (the
    kernel SDPA dispatches to on a CPU), and fewer bytes kept for the backward."""
    import functools

    from slipstream.packing.attention import sdpa
    from slipstream.packing.attention.documents import _sdpa_one

    batch = collate_trees(tree_items(branching_rows(4, seed=3), 400, min_shared=1)[0])
    T, fn = batch.num_tokens, functools.partial(_sdpa_one, short_kernel="off")
    torch.manual_seed(0)
    tensors = [torch.randn(1, h, T, 16, dtype=dtype) for h in (6, 2, 2)]

    def run(joined: bool):
        q, k, v = (t.clone().requires_grad_(True) for t in tensors)
        kept = {}

        def keep(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        call = sdpa._context_call
        sdpa._context_call = (lambda *a, **kw: None) if joined else call
        try:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                out = sdpa._per_document(fn, batch, q, k, v, scaling=0.25, dropout=0.0, window=window)
        finally:
            sdpa._context_call = call
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return (out.detach(), q.grad, k.grad, v.grad), sum(kept.values())

    (ours, ours_bytes), (joined, joined_bytes) = run(False), run(True)
    for a, b, name in zip(ours, joined, ("out", "dq", "dk", "dv"), strict=True):
        assert torch.equal(a, b), name
    assert ours_bytes < joined_bytes

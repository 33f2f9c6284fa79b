"""Preference pairs whose prompts share history, as prefix trees (collate_pair_trees): every answer's
log-probs, and the gradient of a pair loss, exactly what the pairs packed one by one give."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import slipstream
from slipstream.data.pair_trees import pair_tree_items, share_pairs_as_trees
from slipstream.data.prefix_tree import tree_tokens
from slipstream.loss import answer_logprobs_of
from slipstream.models import build_model
from slipstream.packing.pairs import collate_pair_trees, collate_pairs, pair_tokens

from .test_pairs import VOCAB, packed_token_logprobs, relative_error, stock_token_logprobs, tiny_mistral


def conversation_pairs(turns: int = 5, seed: int = 0, vocab: int = VOCAB) -> list[dict]:
    """A preference pair at every turn of one conversation (turn k's prompt: the history, whose answers
    are the chosen ones, then a question), two pairs on one prompt, a pair whose prompt ends where
    another's history goes on, and a pair that shares nothing."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    pairs, history = [], ids(rng.randrange(6, 10))  # a system prompt
    for _ in range(turns):
        history = history + ids(rng.randrange(3, 7))  # the user's turn
        chosen, rejected = ids(rng.randrange(2, 6)), ids(rng.randrange(2, 6))
        pairs.append({"prompt_ids": list(history), "chosen_ids": chosen, "rejected_ids": rejected})
        history = history + chosen
    pairs.append({"prompt_ids": list(pairs[2]["prompt_ids"]), "chosen_ids": ids(3), "rejected_ids": ids(4)})
    pairs.append({"prompt_ids": ids(7), "chosen_ids": ids(2), "rejected_ids": ids(5)})
    rng.shuffle(pairs)
    return pairs


def answers_of(trees, pairs) -> list[list[int]]:
    """Every answer of the trees as their rows hold it, in batch order."""
    return [list(pairs[number][key]) for tree in trees for number in tree["tree_pairs"]
            for key in ("chosen_ids", "rejected_ids")]  # fmt: skip


# ----------------------------------------------------------------------------- layout


def test_pairs_of_one_conversation_share_every_history_and_keep_their_answers_together():
    pairs = conversation_pairs()
    trees, report = pair_tree_items(pairs, 512, min_shared=1)
    assert sorted(n for tree in trees for n in tree["tree_pairs"]) == list(range(len(pairs)))
    assert len(trees) == 2  # the conversation's pairs in one tree; the lone pair in its own
    today = sum(pair_tokens(p) for p in pairs)
    assert report.unshared_tokens == today
    assert sum(tree_tokens(t) for t in trees) == report.shared_tokens < today * 0.7
    for tree in trees:
        nodes = tree["tree_nodes"]
        assert len(tree["tree_rows"]) == 2 * len(tree["tree_pairs"])
        for j, number in enumerate(tree["tree_pairs"]):
            chosen, rejected = (nodes[end] for end in tree["tree_rows"][2 * j : 2 * j + 2])
            assert chosen["input_ids"] == pairs[number]["chosen_ids"]
            assert rejected["input_ids"] == pairs[number]["rejected_ids"]
            assert chosen["parent"] == rejected["parent"]  # both follow the prompt's last node
            path, at = [], chosen["parent"]
            while at >= 0:
                path = nodes[at]["input_ids"] + path
                at = nodes[at]["parent"]
            assert path == pairs[number]["prompt_ids"]
        assert all(n["input_ids"] and min(n["input_ids"]) > 0 for n in nodes)  # no placeholder left


def test_a_tree_larger_than_a_bin_is_split_never_between_a_pairs_answers():
    pairs = conversation_pairs(turns=8, seed=2)
    bin_size = max(pair_tokens(p) for p in pairs) + 4  # the longest pair fits; the conversation does not
    bins, report = share_pairs_as_trees(pairs, bin_size, min_shared=1)
    assert report.repeated_tokens > 0
    seen = [n for tree_bin in bins for tree in tree_bin for n in tree["tree_pairs"]]
    assert sorted(seen) == list(range(len(pairs)))
    assert all(sum(tree_tokens(t) for t in tree_bin) <= bin_size for tree_bin in bins)


# ----------------------------------------------------------------------------- exactness


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", vocab_size=VOCAB).eval()


@pytest.mark.parametrize("model_name", ["llama", "mistral-window-4"])
def test_every_answer_in_a_pair_tree_matches_the_answer_run_alone(llama, model_name):
    stock = llama if model_name == "llama" else tiny_mistral(4).eval()
    packed = slipstream.optimize(copy.deepcopy(stock), chunked_loss=False)
    pairs = conversation_pairs(seed=4)
    trees, _ = pair_tree_items(pairs, 512, min_shared=1)
    ordered = [pairs[n] for tree in trees for n in tree["tree_pairs"]]
    batch = collate_pair_trees(trees)
    assert batch.answers.num_pairs == len(pairs)
    with torch.no_grad():
        found = packed_token_logprobs(packed, batch)
        expected = stock_token_logprobs(stock, ordered)
    assert [len(t) for t in found] == [len(a) for a in answers_of(trees, pairs)]
    for number, (ours, theirs) in enumerate(zip(found, expected, strict=True)):
        assert (ours - theirs).abs().max().item() <= 1e-5, f"answer {number}"


def test_a_pair_trees_chunked_sums_and_gradients_equal_the_pairs_packed_alone(llama):
    pairs = conversation_pairs(seed=6)
    trees, _ = pair_tree_items(pairs, 512, min_shared=1)
    ordered = [pairs[n] for tree in trees for n in tree["tree_pairs"]]
    results = []
    for batch in (collate_pair_trees(trees), collate_pairs(ordered)):
        model = slipstream.optimize(copy.deepcopy(llama)).train()
        model(**batch.model_inputs())
        sums = answer_logprobs_of(batch)
        (sums[0::2] - sums[1::2]).sigmoid().log().sum().backward()  # a DPO-shaped loss
        results.append(
            (sums.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        )
    (tree_sums, tree_grads), (pair_sums, pair_grads) = results
    assert tree_sums.shape == (2 * len(pairs),)
    assert (tree_sums - pair_sums).abs().max().item() <= 1e-5
    assert tree_grads.keys() == pair_grads.keys() and len(tree_grads) > 10
    for name, grad in tree_grads.items():
        assert relative_error(grad, pair_grads[name]) <= 1e-5, name

"""GRPO's completions as prefix trees (collate_completion_trees): what a micro-batch's prompts share with each
other and what its completions share (a first tool call and its result, identical completions) runs once;
every completion token's log-prob and the gradient of a per-token loss equal each prompt + completion run
alone, listed in the same order as collate_completions lists them."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import slipstream
from slipstream.models import build_model
from slipstream.objectives.answers import answer_sums
from slipstream.packing.completions import (
    collate_completion_trees,
    collate_completions,
    completion_tokens,
    completion_trees,
)

from .test_completions import VOCAB, stock_token_logprobs, weighted_gradient_error
from .test_pairs import tiny_mistral


def agent_groups(seed: int = 0, vocab: int = VOCAB) -> list[dict]:
    """Three prompts under one system prompt (two of them the same conversation a turn apart); their
    completions: two that share a first turn and its tool result, then branch; an identical pair; one
    that is a prefix of another; one that shares nothing."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    system = ids(24)
    history = system + ids(9)
    first_turn = ids(20)  # the same tool call and result in two trajectories
    repeated = ids(5)
    long = ids(18)
    groups = [
        {"prompt_ids": history, "completions": [first_turn + ids(4), first_turn + ids(7), ids(3), repeated]},
        {"prompt_ids": history + ids(6) + ids(17), "completions": [repeated, list(repeated), ids(6), ids(2)]},
        {"prompt_ids": system + ids(5), "completions": [long, long[:11], ids(9), ids(1)]},
    ]
    return groups


def test_trees_run_what_prompts_and_completions_share_once_and_keep_the_completion_order():
    groups = agent_groups()
    trees = completion_trees(groups, min_shared=1)
    numbers = sorted(n for t in trees for n in t["tree_row_numbers"])
    assert numbers == list(range(12))
    shared = sum(len(n["input_ids"]) for t in trees for n in t["tree_nodes"])
    today = sum(completion_tokens(g) for g in groups)
    assert shared < today - 2 * 24  # the system prompt once, not once a group; the shared turn once
    packed = collate_completion_trees(groups, trees)
    expected = collate_completions(groups)
    # the same completion tokens, in the same order, each with its own answer index
    assert packed.batch.answers.targets.tolist() == expected.batch.answers.targets.tolist()
    assert packed.completion_index.tolist() == expected.completion_index.tolist()
    assert packed.lengths == expected.lengths
    assert packed.batch.num_tokens == shared < expected.batch.num_tokens
    assert packed.batch.answers.index.tolist() == list(range(len(packed.completion_index)))
    # a token of the shared first turn is read at one row position by both completions that hold it
    positions = packed.batch.answers.positions.tolist()
    first_two = positions[:24], positions[24 : 24 + 27]
    # (and the first token after it from the turn's last position, in both)
    assert first_two[0][:21] == first_two[1][:21]
    assert first_two[0][21] != first_two[1][21]


def test_without_anything_shared_beyond_a_prompt_the_trees_run_todays_tokens():
    groups = [
        {"prompt_ids": [1, 2, 3], "completions": [[4, 5], [6], [7, 8, 9]]},
        {"prompt_ids": [10, 11], "completions": [[12], [13, 14]]},
    ]
    packed = collate_completion_trees(groups, completion_trees(groups, min_shared=1))
    assert packed.batch.num_tokens == sum(completion_tokens(g) for g in groups)
    assert packed.batch.answers.targets.tolist() == [4, 5, 6, 7, 8, 9, 12, 13, 14]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("model", ["llama", "mistral-window"])
def test_token_logprobs_equal_each_completion_run_alone(model, temperature):
    stock = build_model("llama", vocab_size=VOCAB).eval() if model == "llama" else tiny_mistral(12).eval()
    packed = slipstream.optimize(copy.deepcopy(stock)).eval()
    groups = agent_groups(seed=1)
    batch = collate_completion_trees(
        groups, completion_trees(groups, min_shared=1), temperature=temperature
    ).batch
    assert max(batch.parents) > 0  # a tree deeper than one prompt per group
    with torch.no_grad():
        ours = answer_sums(packed, batch, True)
        theirs = stock_token_logprobs(stock, groups, temperature)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_the_check_sees_completions_out_of_order():
    """Negative control: the trees' log-probs in the trie's own row order are not the completions'."""
    stock = build_model("llama", vocab_size=VOCAB).eval()
    packed = slipstream.optimize(copy.deepcopy(stock)).eval()
    groups = agent_groups(seed=1)
    trees = completion_trees(groups, min_shared=1)
    assert [n for t in trees for n in t["tree_row_numbers"]] != list(range(12))
    for tree in trees:  # claim the trie's order is the completions' order
        tree["tree_row_numbers"] = sorted(tree["tree_row_numbers"])
    with torch.no_grad():
        ours = answer_sums(packed, collate_completion_trees(groups, trees).batch, True)
        theirs = stock_token_logprobs(stock, groups, 1.0)
    assert ours.shape != theirs.shape or (ours - theirs).abs().max().item() > 1e-3


def test_per_token_weighted_gradients_equal_the_stock_models():
    """A loss that weighs every completion token differently (GRPO's advantages): LoRA gradients of the
    trees equal those of every prompt + completion run alone."""
    groups = agent_groups(seed=2)
    worst = weighted_gradient_error(
        groups,
        lambda g, t: collate_completion_trees(g, completion_trees(g, min_shared=1), temperature=t).batch,
    )
    assert worst <= 1e-5, worst


def test_bad_trees_are_refused():
    groups = agent_groups()
    trees = completion_trees(groups, min_shared=1)
    trees[0]["tree_row_numbers"] = trees[0]["tree_row_numbers"][:-1] + [99]
    with pytest.raises(ValueError, match="not one of the groups. completions"):
        collate_completion_trees(groups, trees)
    with pytest.raises(ValueError, match="at least one group"):
        collate_completion_trees([])


@pytest.mark.parametrize("seed", range(5))
def test_trees_never_run_a_prompt_more_often_than_one_prompt_per_group(seed):
    """However short the part of a prompt that is its own (a question after a shared system prompt), the
    trees hold it once for its completions, as collate_completions does; never more tokens than today."""
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 30))]
    groups = []
    for _ in range(rng.randrange(1, 5)):
        prompt = system + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 6))]
        completions = [[rng.randrange(1, 4) for _ in range(rng.randrange(1, 8))] for _ in range(4)]
        groups.append({"prompt_ids": prompt, "completions": completions})
    trees = completion_trees(groups)
    shared = sum(len(n["input_ids"]) for t in trees for n in t["tree_nodes"])
    assert shared <= sum(completion_tokens(g) for g in groups)
    assert collate_completion_trees(groups, trees).batch.answers.targets.tolist() == (
        collate_completions(groups).batch.answers.targets.tolist()
    )

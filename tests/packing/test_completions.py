"""G completions of a prompt packed as a prefix group: every completion token's log-prob (of logits /
temperature) and its gradient equal prompt + completion run alone through the stock model."""

from __future__ import annotations

import copy

import pytest
import torch

import slipstream
from slipstream.models import build_model
from slipstream.objectives.answers import answer_sums
from slipstream.packing.completions import collate_completions, completion_documents, completion_tokens

from .test_groups import grads_of, lora_pair, rel

VOCAB = 512


def random_completion_groups(shapes, seed=5):
    """One group per (prompt length, [completion lengths])."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, VOCAB, (n,), generator=generator).tolist()

    return [{"prompt_ids": ids(p), "completions": [ids(c) for c in lengths]} for p, lengths in shapes]


SHAPES = [(7, [3, 1, 5, 2]), (4, [6, 2, 2, 4]), (9, [1, 3])]


def stock_token_logprobs(model, groups, temperature: float) -> torch.Tensor:
    """Every completion token's log-prob, each prompt + completion run alone (the reference)."""
    out = []
    for group in groups:
        prompt = group["prompt_ids"]
        for completion in group["completions"]:
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
            logp = logits.log_softmax(-1)
            rows = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
            out.append(logp[rows, torch.tensor(completion)])
    return torch.cat(out)


def test_layout_runs_the_prompt_once_and_reads_every_completion_token():
    groups = [{"prompt_ids": [1, 2, 3], "completions": [[4, 5], [6], [7, 8, 9]]}]
    packed = collate_completions(groups)
    batch = packed.batch
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5]]
    # token 4 from the prompt's last position (2), 5 from 3; 6 and 7 from the prompt's last (2)
    assert batch.answers.positions.tolist() == [2, 3, 2, 2, 6, 7]
    assert batch.answers.targets.tolist() == [4, 5, 6, 7, 8, 9]
    assert batch.answers.index.tolist() == list(range(6)) and batch.answers.num_answers == 6
    assert packed.completion_index.tolist() == [0, 0, 1, 2, 2, 2] and packed.lengths == (2, 1, 3)
    assert completion_tokens(groups[0]) == batch.num_tokens == 9
    unshared = collate_completions(groups, prefix_sharing=False)
    assert unshared.batch.num_tokens == completion_tokens(groups[0], prefix_sharing=False) == 15
    assert unshared.batch.answers.targets.tolist() == [4, 5, 6, 7, 8, 9]
    assert [len(d["input_ids"]) for d in completion_documents(groups)] == [5, 1, 3]


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="at least one group"):
        collate_completions([])
    with pytest.raises(ValueError, match="group 0: every completion needs at least one token"):
        collate_completions([{"prompt_ids": [1], "completions": [[2], []]}])
    with pytest.raises(ValueError, match="group 0: the prompt is empty"):
        collate_completions([{"prompt_ids": [], "completions": [[2]]}])


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("sharing", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_each_completion_run_alone(chunked, sharing, temperature):
    stock = build_model("llama", vocab_size=VOCAB).eval()
    packed = slipstream.optimize(copy.deepcopy(stock), chunked_loss=chunked).eval()
    groups = random_completion_groups(SHAPES)
    batch = collate_completions(groups, prefix_sharing=sharing, temperature=temperature).batch
    with torch.no_grad():
        ours = answer_sums(packed, batch, chunked)
        theirs = stock_token_logprobs(stock, groups, temperature)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_temperature_changes_the_logprobs():
    """The check sees a temperature that is not applied (the test can fail)."""
    stock = build_model("llama", vocab_size=VOCAB).eval()
    packed = slipstream.optimize(copy.deepcopy(stock)).eval()
    groups = random_completion_groups(SHAPES[:1])
    with torch.no_grad():
        ours = answer_sums(packed, collate_completions(groups).batch, True)
        theirs = stock_token_logprobs(stock, groups, 0.5)
    assert (ours - theirs).abs().max().item() > 1e-3


def weighted_gradient_error(groups, collate, temperature: float = 0.8) -> float:
    """The worst relative LoRA-gradient error of a loss weighing every completion token differently (as
    GRPO's does), ``collate(groups, temperature)``'s batch against every prompt + completion run alone."""
    stock, packed = lora_pair(build_model("llama", vocab_size=VOCAB))
    total = sum(len(c) for g in groups for c in g["completions"])
    weights = torch.linspace(-1.0, 2.0, total)
    (answer_sums(packed, collate(groups, temperature), True) * weights).sum().backward()
    (stock_token_logprobs(stock, groups, temperature) * weights).sum().backward()
    ours, theirs = grads_of(packed), grads_of(stock)
    assert ours.keys() == theirs.keys() and ours
    return max(rel(ours[name], theirs[name]) for name in theirs)


def test_per_token_weighted_gradients_equal_the_stock_models():
    """LoRA gradients packed and shared equal those of every prompt + completion run alone."""
    groups = random_completion_groups(SHAPES)
    worst = weighted_gradient_error(groups, lambda g, t: collate_completions(g, temperature=t).batch)
    assert worst <= 1e-5, worst

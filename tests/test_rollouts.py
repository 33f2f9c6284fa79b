"""Rollouts (slipstream.rollouts): each prompt prefilled once for its G samples, padded prompts that
never see their padding, rows that stop leaving the batch, and seeded sampling."""

from __future__ import annotations

import copy

import pytest
import torch

import slipstream
from slipstream.models import build_model
from slipstream.rollouts import CachedSampler, Sampling, sample_next

VOCAB = 512
PROMPTS = [[5, 17, 42, 9, 100, 7], [3, 8], [250, 11, 64, 2]]  # different lengths: left padding


@pytest.fixture(scope="module")
def models():
    stock = build_model("llama", vocab_size=VOCAB).eval()
    return stock, slipstream.optimize(copy.deepcopy(stock)).eval()


def greedy_alone(model, prompt, max_new_tokens, stops=()):
    """The stock model's greedy completion of one prompt, no cache, stopped at a stop token."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            device = next(model.parameters()).device
            logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token in stops:
                break
    return out


GREEDY = Sampling(temperature=1.0, top_k=1, max_new_tokens=6)  # top_k 1: the argmax, drawn


def test_top_k_1_is_each_prompts_greedy_completion_run_alone(models):
    stock, packed = models
    rollouts = CachedSampler(stop_ids=()).generate(packed, PROMPTS, 3, GREEDY, seed=0)
    for prompt, completions in zip(PROMPTS, rollouts.completions, strict=True):
        expected = greedy_alone(stock, prompt, 6)
        assert [c.ids for c in completions] == [expected] * 3
        assert not any(c.finished for c in completions)  # cut at max_new_tokens
    stats = rollouts.stats
    assert stats.prefill_tokens == sum(len(p) for p in PROMPTS)  # each prompt once, not 3 times
    assert stats.completions == 9 and stats.generated_tokens == 9 * 6 and stats.decode_steps == 5


def test_a_stop_token_ends_its_row_and_the_others_go_on(models):
    stock, packed = models
    free = greedy_alone(stock, PROMPTS[0], 6)
    stop = free[2]  # prompt 0's third greedy token
    rollouts = CachedSampler(stop_ids=(stop,)).generate(packed, PROMPTS, 2, GREEDY, seed=0)
    for prompt, completions in zip(PROMPTS, rollouts.completions, strict=True):
        expected = greedy_alone(stock, prompt, 6, stops=(stop,))
        for completion in completions:
            assert completion.ids == expected
            assert completion.finished == (expected[-1] == stop)
    cut = free.index(stop) + 1
    assert rollouts.completions[0][0].ids == free[:cut] and rollouts.completions[0][0].finished


def test_sampling_is_seeded():
    stock = build_model("llama", vocab_size=VOCAB).eval()
    sampler, sampling = CachedSampler(stop_ids=()), Sampling(temperature=1.0, max_new_tokens=5)
    first = sampler.generate(stock, PROMPTS, 4, sampling, seed=11).completions
    again = sampler.generate(stock, PROMPTS, 4, sampling, seed=11).completions
    other = sampler.generate(stock, PROMPTS, 4, sampling, seed=12).completions
    ids = [[c.ids for c in group] for group in first]
    assert ids == [[c.ids for c in group] for group in again]
    assert ids != [[c.ids for c in group] for group in other]
    assert len({tuple(c) for c in ids[0]}) > 1  # the G samples of a prompt differ


def test_top_k_and_top_p_cut_the_distribution():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]]).repeat(2000, 1)
    generator = torch.Generator().manual_seed(0)
    top2 = sample_next(logits, Sampling(top_k=2), generator)
    assert set(top2.tolist()) == {1, 2}
    probs = logits[0].softmax(-1)  # 0.64, 0.23, 0.09, ...: top_p 0.7 keeps the first two ranked
    assert probs[1] < 0.7 < probs[1] + probs[2]
    nucleus = sample_next(logits, Sampling(top_p=0.7), generator)
    assert set(nucleus.tolist()) == {1, 2}
    cold = sample_next(logits, Sampling(temperature=0.05), generator)
    assert set(cold.tolist()) == {1}


def test_sampling_draws_each_token_as_often_as_its_probability():
    """Inverse-CDF sampling: over 40,000 draws every token's share is its softmax probability (a
    standard error ~0.0024 at most), a zero-probability token (top-k cut) never drawn."""
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0, 0.5]]).repeat(40_000, 1)
    generator = torch.Generator().manual_seed(3)
    drawn = sample_next(logits, Sampling(), generator)
    shares = torch.bincount(drawn, minlength=6).double() / len(drawn)
    assert torch.allclose(shares, logits[0].double().softmax(-1), atol=0.012), shares
    cut = sample_next(logits, Sampling(top_k=3), generator)
    kept = logits[0, [1, 2, 3]].double().softmax(-1)
    shares = torch.bincount(cut, minlength=6).double() / len(cut)
    assert shares[[0, 4, 5]].sum() == 0 and torch.allclose(shares[[1, 2, 3]], kept, atol=0.012), shares


def test_empty_prompts_are_refused(models):
    _, packed = models
    with pytest.raises(ValueError, match="a prompt is empty"):
        CachedSampler(stop_ids=()).generate(packed, [[1], []], 2, GREEDY, seed=0)


def greedy_turns(model, prompt, budget, stops, results):
    """The reference multi-turn rollout: each turn decoded greedily from the whole sequence so far (no
    cache); at a stop, ``results(k)`` (the k-th tool result, None: done) is appended and decoding goes on."""
    out, k = [], 0
    while len(out) < budget:
        turn = greedy_alone(model, list(prompt) + out, budget - len(out), stops)
        out += turn
        if turn[-1] not in stops or len(out) >= budget:
            break
        more = results(k)
        if more is None or len(out) + len(more) > budget:
            break
        out += more
        k += 1
    return out


def test_a_turn_goes_on_from_its_kept_cache_as_if_run_from_scratch(models):
    """turn_end feeds a tool's result into a row that stopped: rows of different prompts take in results
    of different lengths in one forward; every token is the one the whole sequence decoded alone gives."""
    kept_cache_equals_from_scratch(*models)


@pytest.mark.gpu
def test_a_turn_goes_on_from_its_kept_cache_on_cuda(models):
    """The same on a CUDA device (fp32): the agents' kept-cache turns (gpu_check.sh)."""
    kept_cache_equals_from_scratch(*(copy.deepcopy(model).cuda() for model in models))


def kept_cache_equals_from_scratch(stock, packed):
    stops = tuple(range(0, VOCAB, 5))  # a fifth of the vocabulary ends a turn: rows stop often
    budget = 24

    def results(row, k):
        return None if k >= 2 else [100 + row, 200 + k, 7, 9][: 1 + (row + k) % 4]

    fed = []
    rounds: dict[int, int] = {}

    def turn_end(row, tokens):
        k = rounds.get(row, 0)
        more = results(row, k)
        if more is None or len(tokens) + len(more) > budget:
            return None
        rounds[row] = k + 1
        fed.append(row)
        return more

    G = 2
    sampling = Sampling(temperature=1.0, top_k=1, max_new_tokens=budget)
    rollouts = CachedSampler(stop_ids=stops).generate(packed, PROMPTS, G, sampling, seed=0, turn_end=turn_end)
    assert len(fed) >= 3  # results went in, some in the same step as other rows' plain decoding
    for p, (prompt, completions) in enumerate(zip(PROMPTS, rollouts.completions, strict=True)):
        for g, completion in enumerate(completions):
            row = p * G + g
            expected = greedy_turns(stock, prompt, budget, set(stops), lambda k, row=row: results(row, k))
            assert completion.ids == expected, (p, g)
    assert rollouts.stats.prefill_tokens == sum(map(len, PROMPTS)) + sum(
        len(results(row, k)) for row, n in rounds.items() for k in range(n)
    )


def test_a_result_that_fills_the_budget_ends_its_row(models):
    """turn_end's tokens bring a completion to exactly max_new_tokens: it ends there, cut (not finished),
    and the other rows go on."""
    stock, packed = models
    budget = 10
    stop = greedy_alone(stock, PROMPTS[0], 1)[0]  # prompt 0's first greedy token ends a turn at once

    def turn_end(row, tokens):
        return list(range(300, 300 + budget - len(tokens))) if row == 0 else None

    sampling = Sampling(temperature=1.0, top_k=1, max_new_tokens=budget)
    rollouts = CachedSampler(stop_ids=(stop,)).generate(
        packed, PROMPTS, 2, sampling, seed=0, turn_end=turn_end
    )
    first, second = rollouts.completions[0]
    assert first.ids == [stop, *range(300, 300 + budget - 1)] and not first.finished
    assert second.ids == [stop] and second.finished
    assert [c.ids for c in rollouts.completions[1]] == [greedy_alone(stock, PROMPTS[1], budget, (stop,))] * 2

"""Preference pairs packed ``prompt | chosen | rejected`` (collate_pairs): the layout, and every
answer's log-probs exactly what the stock model gives that answer run alone after its prompt."""

from __future__ import annotations

import copy

import pytest
import torch

import slipstream
from slipstream.bench.counters import HostSyncCounter, LargeTensorWatch
from slipstream.loss import answer_logprobs_of
from slipstream.models import build_model
from slipstream.packing.batch import IGNORE_INDEX
from slipstream.packing.pairs import collate_pairs, pair_tokens

VOCAB = 512


def random_pairs(shapes, seed=3, vocab=VOCAB):
    """Pairs of random ids, one per (prompt, chosen, rejected) length triple."""
    generator = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, vocab, (n,), generator=generator).tolist()

    return [{"prompt_ids": ids(p), "chosen_ids": ids(c), "rejected_ids": ids(r)} for p, c, r in shapes]


# three pairs of different lengths; every prompt longer than the sliding window below (4)
SHAPES = [(9, 5, 4), (6, 7, 8), (12, 3, 6)]


# ----------------------------------------------------------------------------- layout


def test_layout_shares_the_prompt_and_continues_positions_from_it():
    pairs = [
        {"prompt_ids": [11, 12, 13], "chosen_ids": [21, 22], "rejected_ids": [31, 32, 33]},
        {"prompt_ids": [41, 42], "chosen_ids": [51], "rejected_ids": [61, 62]},
    ]
    batch = collate_pairs(pairs)
    assert batch.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 41, 42, 51, 61, 62]]
    # the rejected document's positions continue from its prompt's end (P), not from the chosen answer
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2, 2, 3]]
    assert batch.seq_lens == (5, 3, 3, 2)
    assert batch.prefix_lens == (0, 3, 0, 2)
    assert batch.has_prefixes and batch.alone_lengths == (5, 6, 3, 4)
    assert batch.cu_seqlens.tolist() == [0, 5, 8, 11, 13]
    assert batch.max_seqlen == 5 and batch.num_tokens == 13 == sum(pair_tokens(p) for p in pairs)
    answers = batch.answers
    # the rejected answer's first token is predicted from the prompt's last row position (2, then 9)
    assert answers.positions.tolist() == [2, 3, 2, 5, 6, 9, 9, 11]
    assert answers.targets.tolist() == [21, 22, 31, 32, 33, 51, 61, 62]
    assert answers.index.tolist() == [0, 0, 1, 1, 1, 2, 3, 3]
    assert answers.lengths == (2, 3, 1, 2)
    assert answers.num_answers == 4 and answers.num_pairs == 2
    assert batch.num_label_tokens == 8
    assert torch.equal(batch.loss_positions, answers.positions)
    x = IGNORE_INDEX
    assert batch.labels.tolist() == [[x, x, x, 21, 22, 31, 32, 33, x, x, 51, 61, 62]]


def test_layout_without_prefix_sharing_runs_the_prompt_twice():
    pairs = [
        {"prompt_ids": [11, 12, 13], "chosen_ids": [21, 22], "rejected_ids": [31, 32, 33]},
        {"prompt_ids": [41, 42], "chosen_ids": [51], "rejected_ids": [61, 62]},
    ]
    batch = collate_pairs(pairs, prefix_sharing=False)
    assert batch.input_ids.tolist() == [
        [11, 12, 13, 21, 22, 11, 12, 13, 31, 32, 33, 41, 42, 51, 41, 42, 61, 62]
    ]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3]]
    assert batch.seq_lens == (5, 6, 3, 4)
    assert batch.prefix_lens is None and not batch.has_prefixes
    assert batch.num_tokens == sum(pair_tokens(p, prefix_sharing=False) for p in pairs)
    answers = batch.answers
    assert answers.positions.tolist() == [2, 3, 7, 8, 9, 12, 15, 16]
    assert answers.targets.tolist() == [21, 22, 31, 32, 33, 51, 61, 62]
    assert answers.index.tolist() == [0, 0, 1, 1, 1, 2, 3, 3]
    assert answers.lengths == (2, 3, 1, 2)
    # every answer token's label sits right after the position that predicts it
    labels = batch.labels[0]
    for position, target in zip(answers.positions.tolist(), answers.targets.tolist(), strict=True):
        assert labels[position + 1].item() == target


def test_bad_pairs_are_refused_by_name():
    with pytest.raises(ValueError, match="at least one pair"):
        collate_pairs([])
    with pytest.raises(KeyError, match="pair 0 has no 'rejected_ids'"):
        collate_pairs([{"prompt_ids": [1], "chosen_ids": [2]}])
    with pytest.raises(ValueError, match="pair 1: 'chosen_ids' is empty"):
        collate_pairs(
            random_pairs([(2, 2, 2)]) + [{"prompt_ids": [1], "chosen_ids": [], "rejected_ids": [3]}]
        )
    with pytest.raises(TypeError, match="only ints"):
        collate_pairs([{"prompt_ids": [1.5], "chosen_ids": [2], "rejected_ids": [3]}])


# ----------------------------------------------------------------------------- exactness


def stock_token_logprobs(model, pairs) -> list[torch.Tensor]:
    """Per answer (chosen, rejected of each pair in turn): its per-token log-probs, run alone after its prompt."""
    out = []
    for pair in pairs:
        prompt = pair["prompt_ids"]
        for answer in (pair["chosen_ids"], pair["rejected_ids"]):
            logits = model(input_ids=torch.tensor([prompt + answer]), use_cache=False).logits[0]
            rows = logits[len(prompt) - 1 : len(prompt) + len(answer) - 1].float().log_softmax(-1)
            out.append(rows.gather(1, torch.tensor(answer).unsqueeze(1)).squeeze(1))
    return out


def packed_token_logprobs(model, batch) -> list[torch.Tensor]:
    """The same from one packed forward's logits (the model optimized with chunked_loss=False)."""
    logits = model(**batch.model_inputs()).logits[0]
    answers = batch.answers
    rows = logits.index_select(0, answers.positions).float().log_softmax(-1)
    per_token = rows.gather(1, answers.targets.unsqueeze(1)).squeeze(1)
    return list(per_token.split(list(answers.lengths)))


def tiny_mistral(window: int):
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=window,
        use_cache=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", vocab_size=VOCAB).eval()


def assert_answers_exact(stock, packed, prefix_sharing: bool, pairs=None, atol=1e-5):
    pairs = pairs or random_pairs(SHAPES)
    batch = collate_pairs(pairs, prefix_sharing=prefix_sharing)
    with torch.no_grad():
        expected = stock_token_logprobs(stock, pairs)
        found = packed_token_logprobs(packed, batch)
    assert [len(t) for t in found] == [len(t) for t in expected]
    for number, (ours, theirs) in enumerate(zip(found, expected, strict=True)):
        assert (ours - theirs).abs().max().item() <= atol, f"answer {number}"


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_packed_answers_match_each_answer_run_alone(llama, prefix_sharing):
    packed = slipstream.optimize(copy.deepcopy(llama), chunked_loss=False)
    assert_answers_exact(llama, packed, prefix_sharing)


@pytest.mark.parametrize("prefix_sharing", [True, False])
def test_a_sliding_window_shorter_than_the_prompt_is_honoured(prefix_sharing):
    window = 4
    assert all(p > window for p, _, _ in SHAPES)
    stock = tiny_mistral(window).eval()
    packed = slipstream.optimize(copy.deepcopy(stock), chunked_loss=False)
    assert_answers_exact(stock, packed, prefix_sharing)
    # the window matters here: without it the answers' log-probs differ
    wide = tiny_mistral(window)
    wide.config.sliding_window = None
    wide.load_state_dict(stock.state_dict())
    pairs = random_pairs(SHAPES)
    with torch.no_grad():
        windowed = torch.cat(stock_token_logprobs(stock, pairs))
        unwindowed = torch.cat(stock_token_logprobs(wide.eval(), pairs))
    assert (windowed - unwindowed).abs().max().item() > 1e-3


def _flex_runs_here() -> str | None:
    """None if flex_attention's forward runs on this CPU, else why not."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q = torch.randn(1, 2, 16, 16)
        mask = create_block_mask(
            lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, None, None, 16, 16, device="cpu"
        )
        flex_attention(q, q, q, block_mask=mask)
    except Exception as error:  # noqa: BLE001 - any failure means: not here
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("model_name", ["llama", "mistral-window-4"])
def test_flex_backend_shares_the_prompt_exactly(llama, model_name):
    why = _flex_runs_here()
    if why is not None:
        pytest.skip(f"flex_attention does not run on this CPU ({why})")
    stock = llama if model_name == "llama" else tiny_mistral(4).eval()
    packed = slipstream.optimize(copy.deepcopy(stock), chunked_loss=False, attention_backend="flex")
    assert_answers_exact(stock, packed, prefix_sharing=True)


# ----------------------------------------------------------------------------- gradients


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def test_chunked_answer_gradients_match_the_stock_per_answer_computation(llama):
    pairs = random_pairs(SHAPES, seed=5)
    stock = copy.deepcopy(llama).train()
    packed = slipstream.optimize(copy.deepcopy(llama)).train()  # the chunked loss on (the default)
    batch = collate_pairs(pairs)
    out = packed(**batch.model_inputs())
    sums = answer_logprobs_of(batch)
    assert sums is not None and sums.shape == (6,) and sums.dtype == torch.float32
    assert not isinstance(out.logits, torch.Tensor) or out.logits.numel() == 0  # no logits were built
    (sums[0::2].sum() - sums[1::2].sum()).backward()
    expected = stock_token_logprobs(stock, pairs)
    stock_sums = torch.stack([t.sum() for t in expected])
    (stock_sums[0::2].sum() - stock_sums[1::2].sum()).backward()
    assert (sums.detach() - stock_sums.detach()).abs().max().item() <= 1e-4
    checked = 0
    for (name, ours), (_, theirs) in zip(packed.named_parameters(), stock.named_parameters(), strict=True):
        if theirs.grad is None:
            assert ours.grad is None, name
            continue
        assert relative_error(ours.grad, theirs.grad) <= 1e-4, name
        checked += 1
    assert checked > 10


# ----------------------------------------------------------------------------- no syncs, no [T, T]


def test_a_prefix_shared_forward_does_no_host_sync():
    model = slipstream.optimize(build_model("llama", vocab_size=VOCAB)).train()
    batch = collate_pairs(random_pairs([(40, 20, 30), (25, 35, 10), (60, 12, 18)]))
    assert batch.has_prefixes
    with HostSyncCounter() as syncs:
        model(**batch.model_inputs())
        sums = answer_logprobs_of(batch)
        (sums[0::2] - sums[1::2]).sum().backward()
    assert syncs.total == 0, dict(syncs.by_op)


def test_a_prefix_shared_batch_builds_no_t_by_t_mask():
    pairs = random_pairs([(160, 48, 48)] * 8, seed=7)  # T = 2048
    batch = collate_pairs(pairs)
    T = batch.num_tokens
    assert T == 2048 and T > VOCAB
    model = slipstream.optimize(build_model("llama", vocab_size=VOCAB)).train()
    with LargeTensorWatch(min_numel=T * T) as watch:
        model(**batch.model_inputs())
        sums = answer_logprobs_of(batch)
        (sums[0::2] - sums[1::2]).sum().backward()
    assert watch.seen == []
    # nothing near it: the largest is a chunk of the head's logits, or an activation
    assert watch.largest_numel < T * T // 4


# ----------------------------------------------------------------------------- families with more than attention
#
# Everything a layer computes across tokens must see the shared prompt too, or refuse by name:
# never a rejected answer's log-probs silently computed without its prompt.


def assert_exact_or_refused(model_type: str, shapes) -> None:
    from slipstream.models.tiny_any import tiny_model
    from slipstream.packing.guards import UnsupportedArchitecture

    stock = tiny_model(model_type).eval()
    packed = slipstream.optimize(copy.deepcopy(stock), chunked_loss=False)
    pairs = random_pairs(shapes, vocab=stock.config.vocab_size)
    try:
        assert_answers_exact(stock, packed, prefix_sharing=True, pairs=pairs)
    except (UnsupportedArchitecture, NotImplementedError) as refusal:
        assert "prefix_sharing" in str(refusal), str(refusal)


@pytest.mark.parametrize("model_type", ["lfm3", "granitemoehybrid", "minimax"])
def test_token_mixers_see_the_shared_prompt(model_type):
    assert_exact_or_refused(model_type, SHAPES)


def test_longrope_pairs_on_one_side_of_the_threshold_share_their_prompt_exactly():
    # tiny phi3: longrope switches to its long factors above 16 tokens (tiny_any.POSITION_THRESHOLD)
    shapes = [(9, 5, 4), (10, 8, 9), (4, 3, 2)]  # alone: 14 / 13, 18 / 19, 7 / 6
    assert_exact_or_refused("phi3", shapes)


def test_a_longrope_pair_across_the_threshold_is_exact_or_refused():
    shapes = [(12, 3, 6)]  # prompt + chosen 15 (short factors), prompt + rejected 18 (long)
    assert_exact_or_refused("phi3", shapes)

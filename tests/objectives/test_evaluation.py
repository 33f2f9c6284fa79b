"""The held-out primitives every objective's evaluation uses: SFT's eval loss, each rank's share."""

from __future__ import annotations

import torch

from slipstream.data.labels import IGNORE_INDEX
from slipstream.objectives.evaluation import eval_set, evaluate, rank_share
from slipstream.train.distributed import Distributed


def stock_eval_loss(model, samples, max_seq_len) -> float:
    """Each eval document alone through the model, full logits (no labels: the stock path), token-weighted."""
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for sample in samples:
            ids, labels = sample["input_ids"][:max_seq_len], sample["labels"][:max_seq_len]
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
            targets = torch.tensor(labels[1:])
            total += torch.nn.functional.cross_entropy(
                logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"
            ).item()
            count += int((targets != IGNORE_INDEX).sum())
    return total / count


def test_evaluate_builds_no_tokens_by_vocab_tensor_and_restores_the_modes():
    import slipstream
    from slipstream.bench.counters import LargeTensorWatch
    from slipstream.models import build_model
    from tests.conftest import random_docs

    vocab = 5000  # [100+ tokens, V] logits dwarf every other tensor of the forward (the head: [V, 64])
    model = build_model("qwen3", vocab_size=vocab)
    slipstream.optimize(model, loss_chunk_tokens=16)
    model.train()
    docs = [
        {**doc, "labels": doc["input_ids"]} for doc in random_docs([40, 100, 25, 77, 60], vocab_size=vocab)
    ]
    evals = eval_set(docs, "docs", max_seq_len=128, seed=0, overflow="truncate")
    evaluate(model, evals, Distributed(), torch.device("cpu"))  # the first forward probes the logit transform
    with LargeTensorWatch(min_numel=100 * vocab) as big:  # the bins hold 125, 117 and 60 tokens
        loss = evaluate(model, evals, Distributed(), torch.device("cpu"))
    assert big.seen == [], big.seen
    assert all(module.training for module in model.modules())
    expected = stock_eval_loss(model, docs, 128)
    assert abs(loss - expected) <= 1e-5 * expected
    slipstream.optimize(model, chunked_loss=False)  # the stock loss: the watch does see its logits
    with LargeTensorWatch(min_numel=100 * vocab) as big:
        assert abs(evaluate(model, evals, Distributed(), torch.device("cpu")) - expected) <= 1e-5 * expected
    assert big.seen


def test_rank_shares_cover_every_bin_once_with_equal_forwards():
    for bins, world in [(7, 2), (3, 4), (8, 4), (1, 3)]:
        shares = [rank_share(bins, rank, world) for rank in range(world)]
        assert len({len(share) for share in shares}) == 1  # every rank runs as many forwards
        counted = sorted(index for share in shares for index, counts in share if counts)
        assert counted == list(range(bins))

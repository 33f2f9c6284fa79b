"""No tensor of T x T elements is ever allocated by a packed forward + backward."""

import slipstream
from slipstream.bench.counters import LargeTensorWatch
from slipstream.models import build_model
from tests.conftest import random_docs


def test_watch_catches_the_stock_dense_mask():
    T = 512
    model = build_model("qwen3")
    batch = slipstream.collate_packed(random_docs([128] * (T // 128)))
    with LargeTensorWatch(min_numel=T * T) as watch:
        model(**batch.stock_inputs()).loss.backward()
    assert watch.seen, "stock sdpa with a packed batch builds a [1, 1, T, T] mask"


def test_packed_step_at_16k_tokens_allocates_nothing_t_by_t():
    T = 16384
    model = build_model("qwen3")
    slipstream.optimize(model)
    lengths = [1024] * 12 + [2048, 1536, 512]
    assert sum(lengths) == T
    batch = slipstream.collate_packed(random_docs(lengths))
    with LargeTensorWatch(min_numel=T * T) as watch:
        model(**batch.model_inputs()).loss.backward()
    assert watch.seen == []
    # the largest tensor is the logits, T x vocab
    assert watch.largest_numel <= T * model.config.vocab_size

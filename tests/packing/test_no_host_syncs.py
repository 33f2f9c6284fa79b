"""Zero host syncs in a packed forward + backward; the counter itself is proven able to count."""

import pytest
import torch

import slipstream
from slipstream.bench.counters import HostSyncCounter
from slipstream.models import build_model
from tests.conftest import random_docs


def test_counter_sees_syncs():
    x = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        x.sum().item()
        torch.nonzero(x)
        bool(x.any())
        torch.equal(x, x)
    assert syncs.total >= 4
    assert syncs.by_op["nonzero"] == 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_forward_backward_has_no_host_sync(family):
    model = build_model(family)
    batch = slipstream.collate_packed(random_docs([40, 100, 25, 77]))
    # stock transformers (sdpa) on the same packed batch: it inspects position_ids for packing
    with HostSyncCounter() as stock_syncs:
        model(**batch.stock_inputs()).loss.backward()
    assert stock_syncs.total >= 1
    slipstream.optimize(model)
    with HostSyncCounter() as syncs:
        out = model(**batch.model_inputs())
        out.loss.backward()
    assert syncs.total == 0, dict(syncs.by_op)

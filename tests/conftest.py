"""Shared test set-up: markers that skip cleanly, deterministic threads, small random documents."""

import os

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--runslow") or os.environ.get("SLIPSTREAM_SLOW") == "1"
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: run with --runslow or SLIPSTREAM_SLOW=1"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def random_docs(lengths, vocab_size=512, seed=1):
    """Documents of the given lengths with random token ids (labels default to input_ids)."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, vocab_size, (n,), generator=generator).tolist()} for n in lengths]
